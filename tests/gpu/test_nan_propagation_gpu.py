"""NaN in, NaN out on the Hopper kernels (issue 28, item 2; CPU: tests/python/test_nan_propagation.py).

A NaN in a query row or in a key the row uses makes that row's out / lse (/ max_logits) NaN, on
every kernel family and through the split-KV combine; rows without a valid key keep out 0,
lse +inf, max_logits -inf. Each case compares with the CPU reference backend (same inputs) with
the spec §5.1 comparator, which requires identical NaN / +inf / -inf positions.
NaN keys sit where every row of the request sees them (a key masked for one row but visible to
another row of the same tile reaches P.V as 0 * NaN on the GPU, as in FlashMLA).
"""

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from flash_mla import quant  # noqa: E402
from torch_reference import check_close  # noqa: E402

SENTINEL = 2147480000
NAN = float("nan")


def _dense_case(b, s_q, h_q, h_kv, lens, dtype, seed, pbs=64, d=576):
    g = torch.Generator().manual_seed(seed)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    max_pages = max(1, max((int(n) + pbs - 1) // pbs for n in lens))
    nb = b * max_pages + 2
    q = (torch.randn(b, s_q, h_q, d, generator=g) / 10).clamp(-1, 1).to(dtype)
    k = (torch.randn(nb, pbs, h_kv, d, generator=g) / 10).clamp(-1, 1).to(dtype)
    bt = torch.randperm(nb, generator=g)[: b * max_pages].to(torch.int32).reshape(b, max_pages)
    for i in range(b):
        used = (int(lens[i]) + pbs - 1) // pbs
        if int(lens[i]) % pbs:
            k[bt[i, used - 1], int(lens[i]) % pbs:] = NAN
        for blk in bt[i, used:].tolist():
            k[blk] = NAN
        bt[i, used:] = SENTINEL
    return q, k, bt, lens_t


def _dense(q, k, bt, lens, causal):
    return flash_mla.flash_mla_with_kvcache(q, k, bt, lens, 512, flash_mla.get_mla_metadata()[0], causal=causal)


DENSE = [  # b, s_q, h_q, h_kv, lens, causal (page 64, aligned cache: the seesaw kernel, choose_dense_kernel)
    (2, 1, 128, 1, [6000, 300], False),  # long request: split KV + combine
    (3, 2, 16, 1, [150, 1, 0], True),  # request 1 token 0: causally empty; request 2: zero length
    (2, 2, 64, 2, [2000, 64], True),
    (1, 1, 32, 1, [9000], False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: f"b{c[0]}-sq{c[1]}-hq{c[2]}-hkv{c[3]}")
def test_dense_decode_nan_gpu(case, dtype):
    b, s_q, h_q, h_kv, lens, causal = case
    q, k, bt, ln = _dense_case(b, s_q, h_q, h_kv, lens, dtype, seed=h_q + b)
    q[0, 0, 3, 7] = NAN  # a row with keys (in the split request for the first case)
    q[b - 1, s_q - 1, h_q - 1, :] = NAN  # the last request's last row (empty when its length is 0)
    if len(lens) > 1 and lens[1] >= s_q:
        k[bt[1, 0], 0, h_kv - 1, 300] = NAN  # key 0 of request 1: seen by all its rows of KV head h_kv-1
    if causal and len(lens) > 1 and lens[1] == 1:
        q[1, 0, 2, :] = NAN  # causally empty row with a NaN query: stays empty
    ref_out, ref_lse = _dense(q, k, bt, ln, causal)
    assert ref_lse.isnan().any()
    out, lse = _dense(q.cuda(), k.cuda(), bt.cuda(), ln.cuda(), causal)
    torch.cuda.synchronize()
    check_close("lse", lse, ref_lse, 1e-6, 8.01 / 65536, 1e-7)
    check_close("out", out, ref_out, 8e-4, 2.01 / 128, 5e-6)


def _sparse_case(b, s_q, h_q, d_qk, topk, s_k, seed):
    g = torch.Generator().manual_seed(seed)
    pbs = 64
    nb = (s_k + pbs - 1) // pbs  # one cache shared by the batch
    kv = (torch.randn(nb, pbs, 1, d_qk, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(nb * pbs, generator=g)[:topk] for _ in range(b * s_q)]).to(torch.int32)
    idx = idx.reshape(b, s_q, topk)
    idx[:, :, -3:] = -1
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h_q, generator=g).float()
    return q, kv, idx, sink


def _sparse(q, packed, idx, sink, topk_length):
    return flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512, flash_mla.get_mla_metadata()[0],
                                            is_fp8_kvcache=True, indices=idx, attn_sink=sink,
                                            topk_length=topk_length)


def _strided_cuda(t, extra_offset=0):
    """`t` on the GPU with its strides; `extra_offset` elements are added to the storage offset."""
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.zeros(n + extra_offset, dtype=t.dtype, device="cuda")
    flat[extra_offset:] = t.as_strided((n,), (1,), 0).cuda()
    return flat.as_strided(t.shape, t.stride(), t.storage_offset() + extra_offset)


SPARSE = [  # h_q, d_qk, b, s_q, topk, unaligned cache: the kernel is chosen by h_q (small-heads <= 16,
    # mma.sync <= 32, wgmma producer above); a cache 4 bytes past a 16-byte boundary takes the
    # mma.sync kernel's byte-copy path for every h_q
    (128, 576, 2, 2, 256, False),
    (64, 512, 3, 1, 128, False),
    (16, 576, 2, 2, 192, False),
    (64, 576, 2, 1, 128, True),
    (128, 512, 64, 1, 128, False),  # many requests: split work + combine
]


@pytest.mark.parametrize("case", SPARSE,
                         ids=lambda c: f"hq{c[0]}-d{c[1]}-b{c[2]}-sq{c[3]}-{'unaligned' if c[5] else 'aligned'}")
def test_sparse_decode_nan_gpu(case):
    h_q, d_qk, b, s_q, topk, unaligned = case
    q, kv, idx, sink = _sparse_case(b, s_q, h_q, d_qk, topk, 4096, seed=h_q * 7 + b)
    topk_length = torch.full((b,), topk, dtype=torch.int32)
    topk_length[1] = 0  # request 1: no valid slot
    q[0, 0, 3, 11] = NAN
    q[1, 0, 5, :] = NAN  # no valid slot: stays empty
    tok = int(idx[b - 1, 0, 0])
    kv[tok // 64, tok % 64, 0, 20] = NAN  # a key the last request's first token uses (all its heads)
    packed = quant.quantize_k_cache(kv)
    ref_out, ref_lse = _sparse(q, packed, idx, sink, topk_length)
    assert ref_lse.isnan().any()
    packed_cuda = _strided_cuda(packed, extra_offset=4 if unaligned else 0)
    assert (packed_cuda.data_ptr() % 16 != 0) == unaligned
    out, lse = _sparse(q.cuda(), packed_cuda, idx.cuda(), sink.cuda(), topk_length.cuda())
    torch.cuda.synchronize()
    check_close("lse", lse, ref_lse, 1e-6, 8.01 / 65536, 1e-7)
    check_close("out", out, ref_out, 1e-3, 2.01 / 128, 5e-6)


def _sparse_prefill_case(h_q, d_qk, seed, s_q=6, s_kv=600, topk=128):
    """Random sparse prefill inputs (CPU): q, kv, indices (the last two slots -1: invalid), topk_length (query 2: no
    valid slot) and an attention sink."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, h_q, d_qk, generator=g) / 10).to(torch.bfloat16)
    kv = (torch.randn(s_kv, 1, d_qk, generator=g) / 10).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv, generator=g)[:topk] for _ in range(s_q)]).to(torch.int32)[:, None, :]
    idx[:, :, -2:] = -1
    topk_length = torch.full((s_q,), topk, dtype=torch.int32)
    topk_length[2] = 0  # query 2: no valid slot
    sink = torch.randn(h_q, generator=g).float()
    return q, kv, idx, topk_length, sink


@pytest.mark.parametrize("h_q", [128, 64, 16])
@pytest.mark.parametrize("d_qk", [576, 512])
def test_sparse_prefill_nan_gpu(h_q, d_qk):
    q, kv, idx, topk_length, sink = _sparse_prefill_case(h_q, d_qk, seed=h_q + d_qk)
    q[0, 1, 100] = NAN
    q[2, 3, :] = NAN  # no valid slot: stays empty
    q[4, h_q - 1, d_qk - 1] = NAN
    kv[int(idx[5, 0, 0]), 0, 9] = NAN  # a key query 5 uses (every head)

    def run(*ts):
        return flash_mla.flash_mla_sparse_fwd(*ts[:3], 0.5, attn_sink=ts[3], topk_length=ts[4])

    ref = run(q, kv, idx, sink, topk_length)
    assert ref[2].isnan().any() and ref[1].isnan().any()
    res = run(q.cuda(), kv.cuda(), idx.cuda(), sink.cuda(), topk_length.cuda())
    torch.cuda.synchronize()
    check_close("max_logits", res[1], ref[1], 1e-6, 2.01 / 65536, 1e-7)
    check_close("lse", res[2], ref[2], 1e-6, 2.01 / 65536, 1e-7)
    check_close("out", res[0], ref[0], 1e-3, 2.01 / 128, 5e-6)
