"""Sparse FP8 decode on the Hopper backend vs the CPU reference backend (same API, CPU tensors).

Data follow FlashMLA's tests/lib.py (spec §5.2): q ~ randn clamped to [-1, 1], caches
randn/10 with every token not referenced by a valid slot NaN-poisoned *before*
quantization (flash_mla.quant.quantize_k_cache: NaN payloads and scales), padded block
strides, non-contiguous q / indices (padding NaN / INT_MAX), garbage (INT_MAX, out-of-range,
negative) past topk_length, sinks with random +-inf. Outputs are compared with spec §5.1
tolerances (out abs 1e-3 / rel 2.01/128 / cos 5e-6; lse abs 1e-6 / rel 8.01/65536) and
exact +-inf / NaN positions.

Covered: a subset of the §5.2 correctness and corner grids (V32 and MODEL1, extra cache
with its own page size, topk_length / extra_topk_length, page sizes 2..576, b up to 74,
s_q 1 and 3, all-invalid rows, zero lengths, sinks) and the edge cases: zero-length requests,
b*s_q > 65535, CUDA graph replay with new topk_length, tensor-parallel head counts (h_q 8..128),
topk not a multiple of 64 with garbage past topk_length and whole rows of -1, views with storage
offsets and an unaligned cache.
"""

import math
import random
import zlib

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from torch_reference import check_close  # noqa: E402  (spec §5.1 comparator, shared by the GPU tests)
import flash_mla.quant as fq  # noqa: E402

INT_MAX = 2147483647
SENTINEL = 2147480000


# ----------------------------------------------------------------------------- comparator


def compare(out, lse, ref_out, ref_lse):
    assert out.is_cuda and lse.is_cuda
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    check_close("out", out, ref_out, 1e-3, 2.01 / 128, 5e-6)
    check_close("lse", lse, ref_lse, 1e-6, 8.01 / 65536, 1e-7)


# ----------------------------------------------------------------------------- data
def non_contiguousify(t, device):
    """FlashMLA's non_contiguousify: last dim +128, other dims +1, padding NaN / INT_MAX."""
    big = [s + 1 for s in t.shape[:-1]] + [t.shape[-1] + 128]
    fill = float("nan") if t.dtype.is_floating_point else INT_MAX
    buf = torch.full(big, fill, dtype=t.dtype, device=device)
    view = buf[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view


def strided_to_cuda(t, extra_offset=0):
    """Copy a strided CPU tensor (e.g. a packed cache with padded block stride) to the GPU
    keeping its strides; `extra_offset` elements are added to the storage offset."""
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = t.as_strided((n,), (1,), 0)
    cu = torch.zeros(n + extra_offset, dtype=t.dtype, device="cuda")
    cu[extra_offset:] = flat.cuda()
    return cu.as_strided(t.shape, t.stride(), t.storage_offset() + extra_offset)


class Scope:
    """One FP8 KV cache with its indices (spec §5.2 'KV scope')."""

    def __init__(self, packed, indices, topk_length):
        self.packed, self.indices, self.topk_length = packed, indices, topk_length


def gen_scope(rng, g, *, b, s_q, s_k, topk, pbs, d_qk, varlen=True, zero=False, all_invalid=False,
              have_topk_length=False, topk_length=None, poison_beyond_length=True, spikes=()):
    lens = [max(int(rng.normalvariate(s_k, s_k / 2)), s_q) if varlen else s_k for _ in range(b)]
    if zero:
        lens = [0 if rng.random() < 0.5 else l for l in lens]
    max_pad = max(-(-max(lens) // (4 * pbs)), 1) * 4 * pbs
    nb = b * max_pad // pbs
    block_table = torch.randperm(nb, generator=g).reshape(b, -1)
    cache = (torch.randn(nb, pbs, 1, d_qk, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)

    abs_idx = torch.full((b, s_q, topk), -1, dtype=torch.int64)
    for i in range(b):
        for r in range(s_q):
            k = min(topk, lens[i])
            row = torch.full((topk,), -1, dtype=torch.int64)
            if k:
                row[:k] = torch.randperm(lens[i], generator=g)[:k]
            abs_idx[i, r] = row[torch.randperm(topk, generator=g)]  # -1s scattered through the row
    if all_invalid:
        abs_idx[:] = -1
    valid = abs_idx >= 0
    t = abs_idx.clamp(min=0)
    phys = torch.gather(block_table[:, None, :].expand(b, s_q, -1), 2, t // pbs)
    indices = torch.where(valid, phys * pbs + t % pbs, torch.full_like(t, -1))

    if topk_length is None and have_topk_length:
        topk_length = torch.randint(0, topk + 1, (b,), generator=g)
    beyond = torch.zeros_like(valid)
    if topk_length is not None:
        topk_length = torch.as_tensor(topk_length, dtype=torch.int32)
        beyond = torch.arange(topk)[None, None, :] >= topk_length.long()[:, None, None]
    masked = torch.where(beyond, torch.full_like(indices, -1), indices) if poison_beyond_length else indices

    referenced = torch.zeros(nb * pbs, dtype=torch.bool)
    referenced[masked[masked >= 0]] = True
    cache.view(nb * pbs, d_qk)[~referenced] = float("nan")
    for slot, value in spikes:  # (slot, value): the tokens at that slot of every row get keys of `value`
        tok = masked[:, :, slot]
        cache.view(nb * pbs, d_qk)[tok[tok >= 0]] = value

    if beyond.any() and poison_beyond_length:  # garbage past topk_length: never read
        garbage = torch.tensor([INT_MAX, SENTINEL, -2, -123456, nb * pbs, -1], dtype=torch.int64)
        pick = garbage[torch.randint(0, len(garbage), indices.shape, generator=g)]
        use = beyond & (torch.rand(indices.shape, generator=g) < 0.5)
        indices = torch.where(use, pick, indices)
    packed = fq.quantize_k_cache(cache)  # CPU, padded block stride (V32 (pbs+1)*656, MODEL1 576-multiple)
    return Scope(packed, indices.to(torch.int32), topk_length)


def gen_sink(g, h_q):
    sink = torch.randn(h_q, generator=g)
    u = torch.randn(h_q, generator=g)
    sink[u > 0.5] = math.inf
    sink[u < -0.5] = -math.inf
    return sink


class Case:
    def __init__(self, seed, *, b, s_q, h_q, d_qk, main, extra=None, topk_len=False, extra_topk_len=False,
                 varlen=True, all_invalid=False, zero=False, sink=True, poison_beyond_length=True, spikes=()):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        self.q = (torch.randn(b, s_q, h_q, d_qk, generator=g)).clamp(-1, 1).to(torch.bfloat16)
        self.sink = gen_sink(g, h_q) if sink else None
        s_k, topk, pbs = main
        self.main = gen_scope(rng, g, b=b, s_q=s_q, s_k=s_k, topk=topk, pbs=pbs, d_qk=d_qk, varlen=varlen, zero=zero,
                              all_invalid=all_invalid, have_topk_length=topk_len,
                              poison_beyond_length=poison_beyond_length, spikes=spikes)
        self.extra = None
        if extra is not None:
            s_k, topk, pbs = extra
            self.extra = gen_scope(rng, g, b=b, s_q=s_q, s_k=s_k, topk=topk, pbs=pbs, d_qk=d_qk, varlen=varlen,
                                   zero=zero, all_invalid=all_invalid, have_topk_length=extra_topk_len,
                                   poison_beyond_length=poison_beyond_length)
        self.scale = d_qk ** -0.55

    def args(self, device, noncontig=True, unaligned_cache=False):
        """Positional q, k_cache and keyword arguments for flash_mla_with_kvcache on `device`;
        `unaligned_cache`: both caches start 4 bytes past a 16-byte boundary (the kernels' byte-copy path)."""
        cuda = device == "cuda"
        nc = (lambda t: non_contiguousify(t, "cuda")) if (cuda and noncontig) else (lambda t: t.to(device))
        kv = (lambda t: strided_to_cuda(t, extra_offset=4 if unaligned_cache else 0)) if cuda else (lambda t: t)
        opt = lambda t: None if t is None else t.to(device)  # noqa: E731
        kw = dict(softmax_scale=self.scale, is_fp8_kvcache=True, indices=nc(self.main.indices),
                  attn_sink=opt(self.sink), topk_length=opt(self.main.topk_length))
        if self.extra is not None:
            kw.update(extra_k_cache=kv(self.extra.packed), extra_indices_in_kvcache=nc(self.extra.indices),
                      extra_topk_length=opt(self.extra.topk_length))
        return nc(self.q), kv(self.main.packed), kw


def run_sparse(q, k, kw, sched=None):
    sched = sched if sched is not None else flash_mla.get_mla_metadata()[0]
    return flash_mla.flash_mla_with_kvcache(q, k, None, None, 512, sched, **kw)


def reference(case):
    q, k, kw = case.args("cpu")
    return run_sparse(q, k, kw)


def check_case(case, noncontig=True, unaligned_cache=False):
    q, k, kw = case.args("cuda", noncontig, unaligned_cache)
    if unaligned_cache:
        assert k.data_ptr() % 16 != 0
    out, lse = run_sparse(q, k, kw)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference(case)
    compare(out, lse, ref_out, ref_lse)
    return out, lse, ref_out, ref_lse


# ----------------------------------------------------------------------------- §5.2 correctness subset
# With enough query tokens (b * s_q: 32 for h_q <= 16, 8 for h_q <= 32) the wgmma producer kernel serves
# small h_q, its 64-row head tile masked past h_q (sparse_decode.cu, sparse_decode_main_kernel); fewer
# tokens stay on the mma.sync kernels.
@pytest.mark.parametrize("b,s_q", [(33, 1), (16, 2), (31, 1), (7, 1), (4, 2)])
@pytest.mark.parametrize("h_q", [1, 8, 16, 24, 32, 48])
@pytest.mark.parametrize("d_qk", [576, 512])
def test_small_heads_many_query_tokens(b, s_q, h_q, d_qk):
    extra = (300, 64, 16) if d_qk == 512 else None
    case = Case(h_q * 100 + b * 3 + s_q + d_qk, b=b, s_q=s_q, h_q=h_q, d_qk=d_qk, main=(700, 192, 64),
                extra=extra, topk_len=d_qk == 512, sink=h_q % 16 == 8)
    check_case(case)


@pytest.mark.parametrize("h_q", [8, 24])
def test_small_heads_many_query_tokens_unaligned_cache(h_q):
    case = Case(h_q + 4321, b=33, s_q=1, h_q=h_q, d_qk=576, main=(300, 100, 5))
    check_case(case, unaligned_cache=True)


# (d_qk, h_q, b, s_q, (s_k, topk, pbs), extra triple or None, topk_len, extra_topk_len, varlen)
CORRECTNESS = [
    (576, 64, 4, 1, (512, 64, 2), None, False, False, True),
    (576, 128, 4, 3, (1024, 576, 61), None, False, False, True),
    (576, 128, 74, 1, (2046, 2048, 64), None, False, False, True),
    (576, 64, 74, 3, (512, 64, 69), None, False, False, False),
    (576, 128, 4, 1, (2046, 2048, 576), None, False, False, True),
    (512, 64, 4, 3, (512, 64, 2), None, True, False, True),
    (512, 128, 74, 1, (1024, 576, 61), None, False, False, True),
    (512, 64, 4, 1, (512, 64, 64), (1024, 576, 2), False, False, True),
    (512, 128, 4, 3, (2046, 2048, 2), (512, 64, 69), True, True, True),
    (512, 64, 74, 1, (512, 64, 69), (2046, 2048, 64), False, True, True),
    (512, 128, 74, 1, (1024, 576, 61), (512, 64, 2), True, False, True),
    (512, 64, 4, 1, (2046, 2048, 576), (1024, 576, 61), True, False, True),
    (512, 128, 74, 3, (512, 64, 64), (512, 64, 69), False, False, False),
    # FlashMLA's MODEL1 config 3 / 4 at b 2 (extra cache of page size 2, extra_topk_length only): one block per CTA,
    # most CTAs start in the extra cache (the small-batch form's block-0 index speculation)
    (512, 64, 2, 2, (1024, 128, 256), (2046, 1024, 2), False, True, True),
    (512, 128, 2, 2, (1024, 128, 256), (2046, 1024, 2), False, True, True),
]


def _cid(c):
    d, h, b, s_q, m, e, tl, etl, vl = c
    return (f"d{d}-h{h}-b{b}-sq{s_q}-m{m[0]}_{m[1]}_{m[2]}" + (f"-x{e[0]}_{e[1]}_{e[2]}" if e else "") +
            ("-tl" if tl else "") + ("-etl" if etl else "") + ("" if vl else "-fixed"))


@pytest.mark.parametrize("c", CORRECTNESS, ids=[_cid(c) for c in CORRECTNESS])
def test_correctness_grid(c):
    d, h, b, s_q, m, e, tl, etl, vl = c
    case = Case(zlib.crc32(_cid(c).encode()) % 100000, b=b, s_q=s_q, h_q=h, d_qk=d, main=m, extra=e, topk_len=tl,
                extra_topk_len=etl, varlen=vl)
    check_case(case)


# The kernel choice is by shape (src/sm90/decode/sparse_fp8/sparse_decode.cu): for h_q > 32 the wgmma
# producer kernel over 16-byte aligned caches (its 2-CTA cluster variant for h_q = 128 when the grid fits
# in one wave), the mma.sync kernel over caches that are not 16-byte aligned. These cases run the wide-head
# grid through the mma.sync kernel's 64-row tiles and byte-copy gather.
WIDE = [c for c in CORRECTNESS if c[1] > 32]


@pytest.mark.parametrize("c", WIDE, ids=[_cid(c) for c in WIDE])
def test_wide_heads_unaligned_cache(c):
    d, h, b, s_q, m, e, tl, etl, vl = c
    case = Case(zlib.crc32(_cid(c).encode()) % 100000 + 7, b=b, s_q=s_q, h_q=h, d_qk=d, main=m, extra=e,
                topk_len=tl, extra_topk_len=etl, varlen=vl)
    check_case(case, unaligned_cache=True)


# ----------------------------------------------------------------------------- §5.2 corner subset
CORNER_FLAGS = [(True, False, True), (False, True, True), (True, True, False), (False, True, False),
                (True, False, False)]  # (all_invalid, zero_seqlen, sink)


@pytest.mark.parametrize("flags", CORNER_FLAGS, ids=lambda f: f"inv{int(f[0])}-zero{int(f[1])}-sink{int(f[2])}")
@pytest.mark.parametrize("fmt", ["v32", "model1", "model1-extra"])
def test_corner_cases(fmt, flags):
    all_invalid, zero, sink = flags
    d = 576 if fmt == "v32" else 512
    extra = (650, 576, 53) if fmt == "model1-extra" else None
    case = Case(sum(map(ord, fmt)) * 7 + sum(flags), b=4, s_q=3, h_q=64 if fmt != "model1" else 128, d_qk=d,
                main=(512, 64, 61), extra=extra, all_invalid=all_invalid, zero=zero, sink=sink,
                topk_len=fmt != "v32", extra_topk_len=extra is not None)
    out, lse, _, _ = check_case(case)
    if all_invalid:
        assert bool((out == 0).all()) and bool((lse == math.inf).all())


@pytest.mark.parametrize("sink_value", [math.inf, -math.inf, 0.5], ids=["+inf", "-inf", "finite"])
def test_sink_values(sink_value):
    case = Case(11, b=3, s_q=2, h_q=64, d_qk=512, main=(300, 128, 64), extra=(200, 64, 2))
    case.sink = torch.full((64,), sink_value)
    out, lse, _, _ = check_case(case)
    if sink_value == math.inf:
        assert bool((out == 0).all()) and bool(torch.isfinite(lse).all())


# softmax_scale is any finite number (spec §2.7; FlashMLA does not reject <= 0). A kernel that takes the
# row max of the unscaled S (max(S) * c == max(S * c) only for c > 0) must fall back to its general path
# here; both wgmma producer kernels (64 heads plain, 128 cluster).
@pytest.mark.parametrize("scale", [-0.05, 0.0], ids=["neg", "zero"])
@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (128, 576), (128, 512)])
def test_non_positive_softmax_scale(scale, h_q, d_qk):
    extra = (300, 128, 64) if d_qk == 512 else None
    case = Case(1000 + h_q + d_qk, b=4, s_q=2, h_q=h_q, d_qk=d_qk, main=(700, 256, 64), extra=extra,
                topk_len=True, extra_topk_len=extra is not None)
    case.scale = scale
    check_case(case)


# The rescaling paths. With randn/10 keys every logit of a row stays within the lazy rescaling's slack
# (the running max moves only by more than 8 in base 2), so the other tests never rescale O. Here the
# tokens at slots 70 (block 1) and 300 (block 4) of every row get keys of all 8.0 / 24.0 (before the FP8
# quantization) and q (scaled to randn/10) leans +0.05 on the even heads and -0.05 on the odd ones: the
# even heads' max jumps by ~10 and ~20 (base 2) mid-row, the odd heads' does not. Plain (64 heads) and
# cluster (128) kernels, both formats.
@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (128, 576), (128, 512)])
def test_rescale_mid_row(h_q, d_qk):
    extra = (300, 128, 64) if d_qk == 512 else None
    case = Case(2000 + h_q + d_qk, b=4, s_q=2, h_q=h_q, d_qk=d_qk, main=(2000, 512, 64), extra=extra,
                varlen=False, sink=False, spikes=((70, 8.0), (300, 24.0)))
    lean = torch.where(torch.arange(h_q) % 2 == 0, 0.05, -0.05)
    case.q = (case.q.float() / 10 + lean[None, None, :, None]).to(torch.bfloat16)  # (q here is randn, not /10)
    out, lse, _, _ = check_case(case)
    assert bool((lse[:, 0::2] > lse[:, 1::2] + 5).all()), "the large tokens should dominate the even heads only"


# ----------------------------------------------------------------------------- edge cases
def test_zero_lengths():
    """topk_length = 0 for the first / last / all requests: out 0, lse +inf."""
    for tl in ([0, 100, 0], [0, 0, 0]):
        case = Case(21, b=3, s_q=2, h_q=16, d_qk=512, main=(400, 128, 64), topk_len=False)
        case.main.topk_length = torch.tensor(tl, dtype=torch.int32)
        out, lse, _, _ = check_case(case)
        for i, l in enumerate(tl):
            if l == 0:
                assert bool((out[i] == 0).all()) and bool((lse[i] == math.inf).all())


@pytest.mark.parametrize("h_q,d_qk", [(128, 576), (64, 512)])
def test_zero_lengths_batched_form(h_q, d_qk):
    """From 32 query tokens the wgmma kernel stages an unsplit request's O through shared memory: requests with
    topk_length 0 among the others (first, middle, last; the sink on) still give out 0 and lse +inf, and the rest
    match the reference."""
    b = 20
    tl = [0] + [60 + 37 * i for i in range(1, b - 1)] + [0]
    tl[b // 2] = 0
    case = Case(22 + h_q, b=b, s_q=2, h_q=h_q, d_qk=d_qk, main=(1500, 512, 64), topk_len=False)
    case.main.topk_length = torch.tensor(tl, dtype=torch.int32)
    out, lse, _, _ = check_case(case)
    for i, l in enumerate(tl):
        if l == 0:
            assert bool((out[i] == 0).all()) and bool((lse[i] == math.inf).all())


def test_huge_batch_times_sq():
    """b * s_q > 65535 (grid-y limit): a small shared cache, many requests."""
    g = torch.Generator().manual_seed(5)
    b, s_q, h_q, topk, pbs, nb = 33000, 2, 2, 32, 64, 64
    cache = (torch.randn(nb, pbs, 1, 512, generator=g) / 10).clamp(-1, 1).to(torch.bfloat16)
    packed = fq.quantize_k_cache(cache)
    idx = torch.randint(0, nb * pbs, (b, s_q, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    q = torch.randn(b, s_q, h_q, 512, generator=g).clamp(-1, 1).to(torch.bfloat16)
    tl = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
    kw = dict(is_fp8_kvcache=True, softmax_scale=0.05)
    out, lse = run_sparse(q.cuda(), strided_to_cuda(packed), dict(kw, indices=idx.cuda(), topk_length=tl.cuda()))
    ref_out, ref_lse = run_sparse(q, packed, dict(kw, indices=idx, topk_length=tl))
    compare(out, lse, ref_out, ref_lse)


def test_cuda_graph_replay_with_new_topk_length():
    """A decode captured once in a CUDA graph (the scheduler inside the captured work) and replayed with new
    topk_length / extra_topk_length: each replay equals an eager call and the reference."""
    b = 8
    case = Case(6, b=b, s_q=2, h_q=64, d_qk=512, main=(600, 256, 64), extra=(300, 128, 2), topk_len=True,
                extra_topk_len=True, poison_beyond_length=False)
    q, k, kw = case.args("cuda")
    run_sparse(q, k, kw)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run_sparse(q, k, kw)  # fresh metadata: the scheduler runs inside the captured work
    gen = torch.Generator().manual_seed(66)
    for it in range(3):
        new_tl = torch.randint(0, 257, (b,), generator=gen, dtype=torch.int32)
        new_etl = torch.randint(0, 129, (b,), generator=gen, dtype=torch.int32)
        new_tl[b // 2:] = 0 if it != 1 else new_tl[b // 2:]
        kw["topk_length"].copy_(new_tl)
        kw["extra_topk_length"].copy_(new_etl)
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = run_sparse(q, k, kw)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        case.main.topk_length, case.extra.topk_length = new_tl, new_etl
        ref_out, ref_lse = reference(case)
        compare(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("h_q,s_q", [(8, 1), (16, 1), (32, 1), (8, 2), (16, 3), (32, 2), (64, 1), (128, 2)])
@pytest.mark.parametrize("d_qk", [576, 512])
def test_tensor_parallel_heads(h_q, s_q, d_qk):
    """Head counts of 128 heads split over 16 / 8 / 4 / 2 / 1 GPUs, including h_q * s_q < 64."""
    extra = (300, 64, 16) if d_qk == 512 else None
    case = Case(h_q * 10 + s_q + d_qk, b=5, s_q=s_q, h_q=h_q, d_qk=d_qk, main=(700, 192, 64), extra=extra,
                topk_len=d_qk == 512)
    check_case(case)


@pytest.mark.parametrize("topk", [1, 37, 100, 200])
def test_topk_not_multiple_of_64(topk):
    """topk not a multiple of 64, garbage past topk_length, and a whole row of -1."""
    case = Case(800 + topk, b=4, s_q=2, h_q=32, d_qk=512, main=(150, topk, 53), extra=(90, 45, 7), topk_len=True,
                extra_topk_len=True)
    case.main.indices[1, 0, :] = -1  # a whole row of -1
    check_case(case)


def test_v32_odd_topk_and_duplicates():
    """V32 with an odd topk; a duplicated index counts twice."""
    case = Case(81, b=3, s_q=1, h_q=64, d_qk=576, main=(120, 77, 64))
    case.main.indices[0, 0, 1] = case.main.indices[0, 0, 0]  # duplicate index counts twice
    check_case(case)


def test_views_with_storage_offset():
    """q and indices that are views with a storage offset."""
    case = Case(9, b=3, s_q=2, h_q=64, d_qk=576, main=(300, 128, 64))
    q, k, kw = case.args("cuda", noncontig=False)
    big_q = torch.zeros((4,) + tuple(q.shape[1:]), dtype=q.dtype, device="cuda")
    big_q[1:] = q
    qv = big_q[1:]
    assert qv.storage_offset() > 0
    big_i = torch.full((5,) + tuple(kw["indices"].shape[1:]), INT_MAX, dtype=torch.int32, device="cuda")
    big_i[2:] = kw["indices"]
    kw["indices"] = big_i[2:]
    out, lse = run_sparse(qv, k, kw)
    compare(out, lse, *reference(case))


@pytest.mark.parametrize("d_qk", [576, 512])
def test_unaligned_cache_and_q(d_qk):
    """Cache base / block stride not 16-byte aligned and q rows not 16-byte aligned (slow paths)."""
    case = Case(90 + d_qk, b=3, s_q=2, h_q=16, d_qk=d_qk, main=(200, 100, 5))
    bpt = 656 if d_qk == 576 else 584
    cache_bf16 = fq.dequantize_k_cache(case.main.packed, d_qk)
    case.main.packed = fq.quantize_k_cache(cache_bf16, d_qk, block_stride=5 * bpt + 4)  # odd block stride
    q, k, kw = case.args("cuda", noncontig=False)
    k = strided_to_cuda(case.main.packed, extra_offset=4)
    assert k.data_ptr() % 16 != 0
    big_q = torch.zeros(q.numel() + 1, dtype=q.dtype, device="cuda")
    big_q[1:] = q.reshape(-1)
    qv = big_q[1:].view(q.shape)
    out, lse = run_sparse(qv, k, kw)
    compare(out, lse, *reference(case))


def test_scheduler_reuse():
    case = Case(31, b=6, s_q=2, h_q=128, d_qk=512, main=(500, 128, 64), extra=(400, 192, 2), topk_len=True)
    q, k, kw = case.args("cuda")
    sched, _ = flash_mla.get_mla_metadata()
    out1, lse1 = run_sparse(q, k, kw, sched)
    assert sched.tile_scheduler_metadata.is_cuda and sched.num_splits.shape == (7,)
    out2, lse2 = run_sparse(q, k, kw, sched)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    compare(out1, lse1, *reference(case))
