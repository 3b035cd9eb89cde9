"""+inf, -inf or NaN in one element of a query row on the Hopper kernels, against the CPU reference backend on
the same inputs (the CPU contract: tests/python/test_nonfinite_q.py).

A row whose scores hold +inf or NaN has no defined softmax: that row, and only that row, is NaN in out and lse
(and max_logits for sparse prefill; dq, and dk / dv of the keys it sees in its KV head, for the dense MHA
prefill backward). Each case puts the value into one element of two or three query rows, one of which sees no
key (it keeps out 0 and lse +inf, or -inf for dense MHA prefill), and checks on the GPU and the CPU:
  * the rows that see a key are NaN in every element of out / lse (/ max_logits, dq; dk / dv rows of the keys
    they see) and nothing else is NaN;
  * everything is within the tolerances of the existing GPU tests of that operator (the spec §5.1 comparator,
    which also requires identical NaN / +-inf positions);
  * no output element keeps the poison: each GPU call runs with this thread's allocations served from a private
    memory pool whose free memory was filled with POISON bytes right before (poisoned_call), so an element the
    kernels leave unwritten shows up as 0x7B7B (bf16 / fp16) or 0x7B7B7B7B (float32).
Covered kernels: dense decode seesaw (with split KV + combine), wgmma and mma.sync (page size 48: no K tensor
map), bf16 and fp16; sparse FP8 decode V3.2 and MODEL1 on the wgmma producer, small-heads and mma.sync
(unaligned cache) kernels and the split combine; sparse prefill seesaw and mma.sync; dense MHA prefill forward
and backward, d_qk 128 / 192, GQA, causal or not.
Run: pytest tests/gpu/test_nonfinite_q_gpu.py (skips without a Hopper GPU).
"""

import math

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from flash_mla import quant  # noqa: E402
from torch_reference import check_close  # noqa: E402  (spec §5.1 comparator)
from test_nan_propagation_gpu import _dense_case, _sparse_case, _sparse_prefill_case, _strided_cuda  # noqa: E402
from test_dense_prefill_gpu import LSE_TOL, OUT_TOL, check_dgrads, reference  # noqa: E402

VALUES = {"+inf": math.inf, "-inf": -math.inf, "nan": math.nan}
POISON = 0x7B  # every byte: bf16 0x7B7B = 1.3e36, fp16 0x7B7B = 61280, float32 0x7B7B7B7B = 1.3e36
# Tolerances of the existing GPU tests (test_nan_propagation_gpu.py; dense prefill: test_dense_prefill_gpu.py).
DECODE_LSE_TOL = (1e-6, 8.01 / 65536, 1e-7)
DENSE_DECODE_OUT_TOL = (8e-4, 2.01 / 128, 5e-6)
SPARSE_OUT_TOL = (1e-3, 2.01 / 128, 5e-6)
PREFILL_LSE_TOL = (1e-6, 2.01 / 65536, 1e-7)


def _poison_free_memory():
    """Allocates, fills with POISON and frees 16 blocks of 1 MiB (small-block segments of 2 MiB, filled whole)
    and one of 64 MiB (a large-block segment of exactly that size)."""
    fill = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]
    fill.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    for t in fill:
        t.fill_(POISON)
    del fill, t


def poisoned_call(fn, *args, **kwargs):
    """fn(*args, **kwargs) with this thread's allocations served from a fresh private pool (torch.cuda.MemPool)
    whose only memory, poisoned first, holds POISON bytes; returns copies of its tensor results (outside the
    pool, which goes once they are taken: the ops cache no buffer across calls). Without MemPool the default
    pool's free memory is poisoned instead (weaker: a block cached before may serve an output)."""
    torch.cuda.synchronize()
    try:
        pool = torch.cuda.MemPool()
    except (AttributeError, RuntimeError):  # a torch without MemPool
        pool = None
    if pool is None:
        _poison_free_memory()
        res = fn(*args, **kwargs)
    else:
        with torch.cuda.use_mem_pool(pool):
            _poison_free_memory()
            probe = torch.empty(1 << 12, dtype=torch.uint8, device="cuda")
            assert bool((probe == POISON).all()), "the pool's memory is not poisoned"
            del probe
            res = fn(*args, **kwargs)
    torch.cuda.synchronize()
    single = isinstance(res, torch.Tensor)
    res = tuple(t.clone() for t in ((res,) if single else res))
    del pool
    return res[0] if single else res


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_written(name, t):
    pattern = 0x7B7B if t.element_size() == 2 else 0x7B7B7B7B
    n = int((_bits(t) == pattern).sum())
    assert n == 0, f"{name}: {n} of {t.numel()} elements hold the poison (never written)"


def assert_nan_rows(name, t, rows):
    """t (rows' shape + trailing dims) is NaN in every element of the rows `rows` (bool) and nowhere else."""
    nan = torch.isnan(t.float().cpu()).reshape(*rows.shape, -1)
    full = nan.all(-1)
    assert torch.equal(full, rows), (f"{name}: NaN rows {full.nonzero().tolist()}, expected "
                                     f"{rows.nonzero().tolist()}")
    assert not bool(nan[~rows].any()), f"{name}: a NaN outside the rows of a non-finite query"


# ----------------------------------------------------------------------------- dense decode
def check_decode(out, lse, ref_out, ref_lse, rows, out_tol):
    """A decode call's out (b, s_q, h_q, d_v) and lse (b, h_q, s_q) against the reference's: every element written,
    exactly the `rows` (b, s_q, h_q) NaN on both, the rest within the tolerances."""
    for name, t in (("out", out), ("lse", lse)):
        assert_written(name, t)
    for where, o, l in (("cpu", ref_out, ref_lse), ("gpu", out, lse)):
        assert_nan_rows(f"{where} out", o, rows)
        assert_nan_rows(f"{where} lse", l.transpose(1, 2), rows)
    check_close("lse", lse, ref_lse, *DECODE_LSE_TOL)
    check_close("out", out, ref_out, *out_tol)


def _dense(q, k, bt, lens, causal):
    return flash_mla.flash_mla_with_kvcache(q, k, bt, lens, 512, flash_mla.get_mla_metadata()[0], causal=causal)


DENSE = [  # b, s_q, h_q, h_kv, lens, causal, page size
    (2, 1, 128, 1, [6000, 300], False, 64),  # seesaw kernel; request 0 split over several SM parts + combine
    (3, 2, 16, 1, [150, 1, 0], True, 64),  # request 1 token 0 causally empty, request 2 zero length
    (2, 2, 64, 2, [700, 64], True, 48),  # page 48: no K tensor map; 64 rows per KV head: wgmma kernel
    (2, 1, 16, 1, [500, 90], False, 48),  # page 48, 16 rows per KV head: mma.sync kernel
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("case", DENSE, ids=lambda c: f"b{c[0]}-sq{c[1]}-hq{c[2]}-hkv{c[3]}-page{c[6]}")
def test_dense_decode(case, value, dtype):
    b, s_q, h_q, h_kv, lens, causal, pbs = case
    q, k, bt, ln = _dense_case(b, s_q, h_q, h_kv, lens, dtype, seed=h_q + b + pbs, pbs=pbs)
    val = VALUES[value]
    poisoned = [(0, 0, 3, 7), (b - 1, s_q - 1, h_q - 1, 540)]  # a NoPE and a RoPE dimension
    if causal and lens[1] == 1:
        poisoned.append((1, 0, 2, 100))  # sees no key: stays empty
    rows = torch.zeros(b, s_q, h_q, dtype=torch.bool)
    for i, r, h, d in poisoned:
        q[i, r, h, d] = val
        n_vis = lens[i] - (s_q - 1 - r) if causal else lens[i]
        rows[i, r, h] = n_vis > 0
    ref_out, ref_lse = _dense(q, k, bt, ln, causal)
    out, lse = poisoned_call(_dense, q.cuda(), k.cuda(), bt.cuda(), ln.cuda(), causal)
    check_decode(out, lse, ref_out, ref_lse, rows, DENSE_DECODE_OUT_TOL)
    for i, r, h, _ in poisoned:
        if not rows[i, r, h]:
            assert lse[i, h, r].item() == math.inf and bool((out[i, r, h] == 0).all())


# ----------------------------------------------------------------------------- sparse FP8 decode
def _sparse(q, packed, idx, sink, topk_length):
    return flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512, flash_mla.get_mla_metadata()[0],
                                            is_fp8_kvcache=True, indices=idx, attn_sink=sink,
                                            topk_length=topk_length)


SPARSE = [  # h_q, d_qk (576: V3.2, 512: MODEL1), b, s_q, topk, cache 4 bytes past a 16-byte boundary
    (128, 576, 2, 2, 256, False),  # wgmma producer kernel
    (64, 512, 3, 1, 128, False),
    (16, 576, 2, 2, 192, False),  # small-heads kernel
    (32, 512, 2, 1, 128, True),  # mma.sync kernel, byte-copy gather
    (128, 512, 64, 1, 128, False),  # many requests: split work + combine
    (128, 576, 2, 2, 2048, False),  # V3.2 b 2: request 0 over ~16 parts (combine J = 1, splits past the 8 ahead)
    (64, 576, 2, 1, 4096, False),  # h_q 64, request 1 empty: request 0 over > 32 parts (the combine's chunk loop)
]


@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("case", SPARSE,
                         ids=lambda c: f"hq{c[0]}-d{c[1]}-b{c[2]}-sq{c[3]}-{'unaligned' if c[5] else 'aligned'}")
def test_sparse_decode(case, value):
    h_q, d_qk, b, s_q, topk, unaligned = case
    q, kv, idx, sink = _sparse_case(b, s_q, h_q, d_qk, topk, 4096, seed=h_q * 7 + b + 1)
    topk_length = torch.full((b,), topk, dtype=torch.int32)
    topk_length[1] = 0  # request 1: no valid slot
    val = VALUES[value]
    poisoned = [(0, 0, 3, 11), (0, s_q - 1, h_q - 1, d_qk - 1), (b - 1, s_q - 1, h_q // 2, 200), (1, 0, 5, 40)]
    rows = torch.zeros(b, s_q, h_q, dtype=torch.bool)
    for i, r, h, d in poisoned:
        q[i, r, h, d] = val
        rows[i, r, h] = i != 1
    packed = quant.quantize_k_cache(kv)
    ref_out, ref_lse = _sparse(q, packed, idx, sink, topk_length)
    packed_cuda = _strided_cuda(packed, extra_offset=4 if unaligned else 0)
    assert (packed_cuda.data_ptr() % 16 != 0) == unaligned
    out, lse = poisoned_call(_sparse, q.cuda(), packed_cuda, idx.cuda(), sink.cuda(), topk_length.cuda())
    check_decode(out, lse, ref_out, ref_lse, rows, SPARSE_OUT_TOL)
    assert lse[1, 5, 0].item() == math.inf and bool((out[1, 0, 5] == 0).all())


# ----------------------------------------------------------------------------- sparse prefill
@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("h_q", [128, 64, 16])
@pytest.mark.parametrize("d_qk", [576, 512])
def test_sparse_prefill(d_qk, h_q, value):
    q, kv, idx, topk_length, sink = _sparse_prefill_case(h_q, d_qk, seed=h_q + d_qk + 1)
    s_q = q.shape[0]
    val = VALUES[value]
    q[0, 1, 100] = val
    q[4, h_q - 1, d_qk - 1] = val
    q[2, 3, 0] = val  # no valid slot: stays empty
    rows = torch.zeros(s_q, h_q, dtype=torch.bool)
    rows[0, 1] = rows[4, h_q - 1] = True

    def run(*ts):
        return flash_mla.flash_mla_sparse_fwd(*ts[:3], 0.5, attn_sink=ts[3], topk_length=ts[4])

    ref = run(q, kv, idx, sink, topk_length)
    res = poisoned_call(run, q.cuda(), kv.cuda(), idx.cuda(), sink.cuda(), topk_length.cuda())
    for name, a, r in zip(("out", "max_logits", "lse"), res, ref):
        assert_written(name, a)
        assert_nan_rows(f"cpu {name}", r, rows)
        assert_nan_rows(f"gpu {name}", a, rows)
    check_close("max_logits", res[1], ref[1], *PREFILL_LSE_TOL)
    check_close("lse", res[2], ref[2], *PREFILL_LSE_TOL)
    check_close("out", res[0], ref[0], *SPARSE_OUT_TOL)
    assert res[2][2, 3].item() == math.inf and res[1][2, 3].item() == -math.inf and bool((res[0][2, 3] == 0).all())


# ----------------------------------------------------------------------------- dense MHA prefill
def _masked(t, mask):
    """t with the rows mask (bool over its leading dims) set to 0, on t's device."""
    return t.masked_fill(mask.to(t.device).reshape(*mask.shape, *([1] * (t.dim() - mask.dim()))), 0)


@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 192])
def test_dense_prefill_forward_and_backward(d, causal, value):
    """Requests (s_q, s_k) (10, 15), (130, 140), (6, 4); 8 query heads on 2 KV heads. Request 1's row 70 (two
    query tiles in) head 5 and request 0's row 3 head 0 hold the value; so does request 2's row 0 head 2, which
    sees no key when causal (out 0, lse -inf, dq 0) and all 4 otherwise."""
    g = torch.Generator().manual_seed(d + causal)
    lens_q, lens_k = [10, 130, 6], [15, 140, 4]
    h, h_k = 8, 2
    cu_q = torch.tensor([0, 10, 140, 146], dtype=torch.int32)
    cu_k = torch.tensor([0, 15, 155, 159], dtype=torch.int32)
    q = (torch.randn(146, h, d, generator=g) * 0.1).bfloat16()
    k = (torch.randn(159, h_k, d, generator=g) * 0.1).bfloat16()
    v = (torch.randn(159, h_k, 128, generator=g) * 0.1).bfloat16()
    dout = (torch.randn(146, h, 128, generator=g) * 0.1).bfloat16()
    scale = (d + 100) ** -0.5
    val = VALUES[value]
    rows = torch.zeros(146, h, dtype=torch.bool)
    keys = torch.zeros(159, h_k, dtype=torch.bool)  # the keys a poisoned row sees, in its KV head
    for i, r, hh in ((1, 70, 5), (0, 3, 0), (2, 0, 2)):
        t = int(cu_q[i]) + r
        q[t, hh, 9 if hh != 2 else 0] = val
        n_vis = min(max(r + lens_k[i] - lens_q[i] + 1, 0), lens_k[i]) if causal else lens_k[i]
        rows[t, hh] = n_vis > 0
        keys[int(cu_k[i]):int(cu_k[i]) + n_vis, hh // (h // h_k)] = True
    max_q, max_k = max(lens_q), max(lens_k)

    def fwd_bwd(q, k, v, dout, cu_q, cu_k):
        out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                                    causal=causal)
        return (out, lse, *flash_mla.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                                softmax_scale=scale, causal=causal))

    ref = fwd_bwd(q, k, v, dout, cu_q, cu_k)
    cuda = [t.cuda() for t in (q, k, v, dout, cu_q, cu_k)]
    res = poisoned_call(fwd_bwd, *cuda)
    for name, a, r, m in zip(("out", "lse", "dq", "dk", "dv"), res, ref, (rows, rows, rows, keys, keys)):
        assert_written(name, a)
        assert_nan_rows(f"cpu {name}", r, m)
        assert_nan_rows(f"gpu {name}", a, m)
    out, lse, dq, dk, dv = res
    check_close("out", out, ref[0], **OUT_TOL)
    check_close("lse", lse, ref[1], **LSE_TOL)
    # dv per element against the float32 reference whose P is rounded to bf16 as the kernels' (check_dgrads says
    # why), its NaN rows (the same keys) zeroed with the others'.
    ref_dv_p = reference(*cuda[:3], cuda[4], cuda[5], scale, causal, cuda[3])[5]
    check_dgrads([_masked(dq, rows), _masked(dk, keys), _masked(dv, keys)],
                 [_masked(ref[2], rows), _masked(ref[3], keys), _masked(ref[4], keys), _masked(ref_dv_p, keys)],
                 fmha_rule=False)
    empty = torch.isneginf(ref[1])
    assert torch.equal(torch.isneginf(lse).cpu(), empty) and bool(empty.any()) == causal
    assert bool((out[empty.cuda()] == 0).all()) and bool((dq[empty.cuda()] == 0).all())
    # The autograd route (torch.ops with register_autograd) gives the same bits.
    q1, k1, v1 = (t.clone().requires_grad_() for t in cuda[:3])
    out_a, lse_a = flash_mla.flash_attn_varlen_func(q1, k1, v1, cuda[4], cuda[5], max_q, max_k, softmax_scale=scale,
                                                    causal=causal)
    out_a.backward(cuda[3])
    for name, a, b in (("out", out_a, out), ("lse", lse_a, lse), ("dq", q1.grad, dq), ("dk", k1.grad, dk),
                       ("dv", v1.grad, dv)):
        assert torch.equal(_bits(a.detach()), _bits(b)), f"{name}: autograd differs from flash_attn_varlen_backward"
