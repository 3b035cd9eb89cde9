"""Sparse MLA prefill (flash_mla_sparse_fwd) on the Hopper backend vs the CPU reference backend.

Data follow FlashMLA's tests/lib.py::generate_testcase (spec §5.3): q, kv = randn/10 + a
per-tensor offset in [-0.05, 0.05] (bf16), indices = topk distinct random tokens per query row
in random order, the surplus slots (topk > s_kv) drawn from the invalid list
[-2147483648, -123456, -1, s_kv, 114514, 1919810, 2147480000, 2147483647]; all-invalid rows
(randn < -2); topk_length = randint(0, max(topk+1, 64)).clamp_max(topk); sinks randn with +-inf;
sm_scale 0.5; q / kv / indices non-contiguous on the GPU (FlashMLA's non_contiguousify: last
dim +128, other dims +1, padding NaN / INT_MAX — so the row kv[s_kv] exists and is NaN: an
index == s_kv that were read would show up). Comparison with spec §5.1's prefill tolerances
(out.float(): abs 8e-4 / rel 3.01/128 / cos 7e-6; max_logits and lse: abs 1e-6 /
rel 2.01/65536 / cos 1e-7) and exact +-inf / NaN positions.

To keep the CPU reference cheap the GPU computes every row and the reference only a sample of
rows (at most MAX_REF_ROWS, always the first and the last; rows are independent).

Covered: a subset of the §5.3 correctness / feature grid (d_qk 512/576 x h_q 16/32/64/128 x
(s_kv, topk) incl. topk > s_kv and topk not a multiple of 64 x s_q 1/62/213, sink and
topk_length on and off), both kernels (the wgmma seesaw kernel for 64-row head tiles, the mma.sync
kernel for h_q <= 32, and the two against each other on the same heads), the §5.3 corner cases (all-invalid rows, blocks without a
valid index), s_q = 70000 (beyond the 65535 grid limit of y / z), head counts 8..96 without
padding to 64, negative / out-of-range indices, whole rows of -1, topk_length with garbage beyond it
and NaN in every kv row that no valid slot references, duplicates, views with storage offsets and
unaligned q / kv rows, sink +-inf, CUDA graph replay with new topk_length.
"""

import itertools
import math
import os
import zlib

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from torch_reference import check_close  # noqa: E402  (spec §5.1 comparator, shared by the GPU tests)

INT_MAX = 2147483647
MAX_REF_ROWS = 24
# Device of the answers under test; "cpu" only dry-runs this file's logic against itself.
DEV = os.environ.get("FLASHMLA_PREFILL_TEST_DEVICE", "cuda")


# ----------------------------------------------------------------------------- comparator


# ----------------------------------------------------------------------------- data
def non_contiguousify(t):
    """FlashMLA's non_contiguousify on the GPU: last dim +128, other dims +1, padding NaN / INT_MAX."""
    big = [s + 1 for s in t.shape[:-1]] + [t.shape[-1] + 128]
    fill = float("nan") if t.dtype.is_floating_point else INT_MAX
    buf = torch.full(big, fill, dtype=t.dtype, device=DEV)
    view = buf[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view


def invalid_list(s_kv):
    return [-2147483648, -123456, -1, s_kv, 114514, 1919810, 2147480000, 2147483647]


def gen_indices(g, s_q, s_kv, topk, all_invalid, device):
    """(s_q, 1, topk) int32: min(topk, s_kv) distinct tokens per row in random order, surplus slots invalid."""
    n_valid = min(topk, s_kv)
    rows = []
    for r0 in range(0, s_q, 4096):  # chunks bound the memory of the random keys
        r1 = min(s_q, r0 + 4096)
        keys = torch.rand(r1 - r0, s_kv, generator=g, device=device)
        rows.append(keys.topk(n_valid, dim=1).indices if n_valid < s_kv else keys.argsort(dim=1))
    idx = torch.cat(rows)
    inv = torch.tensor(invalid_list(s_kv), dtype=torch.int64, device=device)
    if topk > s_kv:
        extra = inv[torch.randint(0, len(inv), (s_q, topk - s_kv), generator=g, device=device)]
        idx = torch.cat([idx, extra], 1)
        perm = torch.rand(s_q, topk, generator=g, device=device).argsort(dim=1)
        idx = idx.gather(1, perm)
    if all_invalid:
        bad = torch.randn(s_q, generator=g, device=device) < -2
        vals = inv[torch.randint(0, len(inv), (s_q,), generator=g, device=device)]
        idx = torch.where(bad[:, None], vals[:, None].expand(-1, topk), idx)
    return idx.to(torch.int32)[:, None, :]


def gen_sink(g, h_q, device):
    sink = torch.randn(h_q, generator=g, device=device)
    u = torch.randn(h_q, generator=g, device=device)
    sink[u > 0.5] = math.inf
    sink[u < -0.5] = -math.inf
    return sink


class Case:
    def __init__(self, seed, *, s_q, s_kv, topk, h_q, d_qk, sink=False, topk_len=False, all_invalid=False,
                 device=None):
        if device is None:  # large inputs are generated on the device
            device = DEV if s_q * h_q * d_qk > 20_000_000 else "cpu"
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(shape):  # randn/10 + offset, bf16; in chunks of rows (bounded fp32 temporaries)
            off = (torch.rand((), generator=g, device=device).item() - 0.5) / 10
            out = torch.empty(shape, dtype=torch.bfloat16, device=device)
            flat = out.view(shape[0], -1)
            for r0 in range(0, shape[0], 4096):
                r1 = min(shape[0], r0 + 4096)
                x = torch.randn((r1 - r0, flat.shape[1]), generator=g, device=device) / 10 + off
                flat[r0:r1] = x.clamp(-10, 10).to(torch.bfloat16)
            return out

        self.q = rnd((s_q, h_q, d_qk))
        self.kv = rnd((s_kv, 1, d_qk))
        self.indices = gen_indices(g, s_q, s_kv, topk, all_invalid, device)
        self.sink = gen_sink(g, h_q, device) if sink else None
        self.topk_length = None
        if topk_len:
            self.topk_length = torch.randint(0, max(topk + 1, 64), (s_q,), generator=g, device=device).clamp_max(
                topk).to(torch.int32)
        self.scale = 0.5
        self.s_q, self.topk = s_q, topk

    def ref_rows(self, n=MAX_REF_ROWS, extra=()):
        if self.s_q <= n:
            return torch.arange(self.s_q)
        g = torch.Generator().manual_seed(self.s_q * 31 + self.topk)
        pick = set(torch.randperm(self.s_q, generator=g)[: n - 2].tolist()) | {0, self.s_q - 1} | set(extra)
        return torch.tensor(sorted(pick))


def run(case, device, rows=None, noncontig=True):
    q, kv, idx, sink, tl = case.q, case.kv, case.indices, case.sink, case.topk_length
    if rows is not None:
        rows_d = rows.to(q.device)
        q, idx = q[rows_d], idx[rows_d]
        tl = None if tl is None else tl[rows_d]
    to = (lambda t: None if t is None else t.to(device))  # noqa: E731
    q, kv, idx, sink, tl = to(q), to(kv), to(idx), to(sink), to(tl)
    if device == DEV and noncontig:
        q, kv, idx = non_contiguousify(q), non_contiguousify(kv), non_contiguousify(idx)
    return flash_mla.flash_mla_sparse_fwd(q, kv, idx, sm_scale=case.scale, attn_sink=sink, topk_length=tl)


def compare(res, case, rows=None):
    """GPU result `res` (all rows) vs the CPU reference on `rows` (default: case.ref_rows())."""
    out, ml, lse = res
    s_q, h_q = case.q.shape[0], case.q.shape[1]
    assert out.device.type == ml.device.type == lse.device.type == DEV
    assert out.dtype == torch.bfloat16 and ml.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == (s_q, h_q, 512) and ml.shape == (s_q, h_q) and lse.shape == (s_q, h_q)
    assert not out.isnan().any() and not ml.isnan().any() and not lse.isnan().any()
    empty = lse == math.inf
    assert torch.equal(empty, ml == -math.inf), "empty rows: lse +inf iff max_logits -inf"
    assert bool((out[empty] == 0).all()), "empty rows must have out == 0"
    rows = case.ref_rows() if rows is None else rows
    ref_out, ref_ml, ref_lse = run(case, "cpu", rows if len(rows) < s_q else None)
    rd = rows.to(out.device)
    check_close("out", out[rd].float(), ref_out.float(), 8e-4, 3.01 / 128, 7e-6)
    check_close("max_logits", ml[rd], ref_ml, 1e-6, 2.01 / 65536, 1e-7)
    check_close("lse", lse[rd], ref_lse, 1e-6, 2.01 / 65536, 1e-7)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def check_case(case, noncontig=True, rows=None):
    res = run(case, DEV, noncontig=noncontig)
    sync()
    compare(res, case, rows)
    return res


# ----------------------------------------------------------------------------- §5.3 grid subset
SHAPES = [(128, 128), (592, 128), (1840, 256), (1521, 512), (95, 128), (153, 256), (114, 384), (1592, 384),
          (300, 100), (70, 1), (1000, 200), (50, 77)]
GRID = []
for _i, (_d, _h) in enumerate(itertools.product((512, 576), (16, 32, 64, 128))):
    for _j in range(5):
        _skv, _topk = SHAPES[(_i * 5 + _j) % len(SHAPES)]
        _feat = (_i + 2 * _j) % 4
        GRID.append((_d, _h, _skv, _topk, (1, 62, 213)[(_i + _j) % 3], bool(_feat & 1), bool(_feat & 2)))


def _gid(c):
    d, h, s_kv, topk, s_q, sink, tl = c
    return f"d{d}-h{h}-skv{s_kv}-topk{topk}-sq{s_q}" + ("-sink" if sink else "") + ("-tl" if tl else "")


def _case(c):
    d, h, s_kv, topk, s_q, sink, tl = c
    return Case(zlib.crc32(_gid(c).encode()) % 100000, s_q=s_q, s_kv=s_kv, topk=topk, h_q=h, d_qk=d, sink=sink,
                topk_len=tl)


@pytest.mark.parametrize("c", GRID, ids=[_gid(c) for c in GRID])
def test_correctness_grid(c):
    check_case(_case(c))


def test_both_kernels_agree():
    """Heads are independent: the first 32 heads of an h_q = 64 call (the seesaw kernel's 64-row tile)
    equal an h_q = 32 call on those heads (the mma.sync kernel's 32-row tiles)."""
    case = Case(7, s_q=40, s_kv=900, topk=320, h_q=64, d_qk=576, sink=True, topk_len=True)
    a = run(case, DEV)
    half = Case(7, s_q=40, s_kv=900, topk=320, h_q=64, d_qk=576, sink=True, topk_len=True)
    half.q, half.sink = case.q[:, :32].contiguous(), case.sink[:32].contiguous()
    b = run(half, DEV)
    check_close("out", a[0][:, :32].float(), b[0].float(), 8e-4, 3.01 / 128, 7e-6)
    check_close("max_logits", a[1][:, :32], b[1], 1e-6, 2.01 / 65536, 1e-7)
    check_close("lse", a[2][:, :32], b[2], 1e-6, 2.01 / 65536, 1e-7)
    compare(a, case)
    compare(b, half)


# ----------------------------------------------------------------------------- §5.3 corner subset
@pytest.mark.parametrize("d_qk,h_q", [(512, 64), (576, 128), (512, 16)])
@pytest.mark.parametrize("s_q,s_kv,topk", [(1, 128, 128), (1, 256, 256), (1234, 4321, 4096), (4096, 2048, 2048)])
def test_all_invalid_rows(s_q, s_kv, topk, d_qk, h_q):
    case = Case(s_q + s_kv + topk + d_qk + h_q, s_q=s_q, s_kv=s_kv, topk=topk, h_q=h_q, d_qk=d_qk, sink=True,
                topk_len=True, all_invalid=True)
    inv = invalid_list(s_kv)
    case.indices[0, 0, :] = inv[(s_q + h_q) % len(inv)]  # the first row always all-invalid
    bad = [int(r) for r in (case.indices[:, 0, :] < 0).all(dim=1).nonzero()[:4, 0]]
    out, ml, lse = check_case(case, rows=case.ref_rows(n=16, extra=bad))
    assert bool((lse[0] == math.inf).all()) and bool((out[0] == 0).all()) and bool((ml[0] == -math.inf).all())


@pytest.mark.parametrize("s_q", [1, 1024])
@pytest.mark.parametrize("s_kv,topk", [(32, 2048), (64, 8192)])
def test_blocks_without_valid_indices(s_kv, topk, s_q):
    d_qk, h_q = (576, 128) if topk == 2048 else (512, 64)
    case = Case(s_kv * 7 + s_q, s_q=s_q, s_kv=s_kv, topk=topk, h_q=h_q, d_qk=d_qk, sink=True, topk_len=True)
    check_case(case)


# ----------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("d_qk,h_q", [(576, 128), (512, 16)])
def test_huge_s_q(d_qk, h_q):
    """s_q = 70000 (> 65535 grid limit of y/z): no crash; a sample of rows vs the reference."""
    s_q, s_kv, topk = 70000, 256, 256
    case = Case(5 + h_q, s_q=s_q, s_kv=s_kv, topk=topk, h_q=h_q, d_qk=d_qk, sink=True, topk_len=True,
                device=DEV)
    res = flash_mla.flash_mla_sparse_fwd(case.q, case.kv, case.indices, sm_scale=case.scale, attn_sink=case.sink,
                                         topk_length=case.topk_length)
    sync()
    rows = case.ref_rows(n=16, extra=(65534, 65535, 65536, 69998))
    compare(res, case, rows)
    del res, case
    if DEV == "cuda":
        torch.cuda.empty_cache()


@pytest.mark.parametrize("h_q,d_qk", [(8, 512), (24, 576), (48, 512), (96, 576)])
def test_head_counts_not_a_multiple_of_64(h_q, d_qk):
    """Tensor-parallel head counts that are not a multiple of 64 (computed without padding to 64 rows)."""
    check_case(Case(70 + h_q, s_q=9, s_kv=700, topk=192, h_q=h_q, d_qk=d_qk, sink=True, topk_len=True))


@pytest.mark.parametrize("h_q", [16, 64, 128])
@pytest.mark.parametrize("topk", [1, 37, 100, 200])
def test_garbage_indices_and_nan_rows(topk, h_q):
    """Negative / out-of-range indices, whole rows of -1, topk_length with garbage beyond it (INT_MAX,
    sentinel, in-range tokens whose kv row is NaN): NaN is put in every kv row that no valid slot
    (below topk_length) references, so any read of an unused row would leak NaN."""
    s_q, s_kv, d_qk = 20, 150, 512 if h_q != 128 else 576
    case = Case(800 + topk + h_q, s_q=s_q, s_kv=s_kv, topk=topk, h_q=h_q, d_qk=d_qk, sink=True)
    g = torch.Generator().manual_seed(topk)
    idx = case.indices[:, 0, :].long()
    garbage = torch.tensor([-2147483648, -123456, -2, -1, s_kv, s_kv + 1, 2147480000, INT_MAX])
    pick = garbage[torch.randint(0, len(garbage), idx.shape, generator=g)]
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, pick, idx)  # scattered invalid slots
    idx[1] = -1  # a whole row of -1
    tl = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
    tl[2], tl[3] = 0, topk
    beyond = torch.arange(topk)[None, :] >= tl.long()[:, None]
    live = torch.where(beyond, torch.full_like(idx, -1), idx)
    referenced = torch.zeros(s_kv, dtype=torch.bool)
    referenced[live[(live >= 0) & (live < s_kv)]] = True
    case.kv[~referenced] = float("nan")
    # beyond topk_length: INT_MAX, the sentinel, or in-range tokens with NaN rows
    nan_rows = (~referenced).nonzero()[:, 0]
    if len(nan_rows):
        junk = nan_rows[torch.randint(0, len(nan_rows), idx.shape, generator=g)]
        idx = torch.where(beyond & (torch.rand(idx.shape, generator=g) < 0.5), junk, idx)
    idx = torch.where(beyond & (torch.rand(idx.shape, generator=g) < 0.3), torch.full_like(idx, 2147480000), idx)
    case.indices = idx.to(torch.int32)[:, None, :]
    case.topk_length = tl
    check_case(case)


def test_duplicates_count_twice():
    """A duplicated index, and a row of one token 77 times: each slot counts."""
    case = Case(81, s_q=3, s_kv=120, topk=77, h_q=64, d_qk=576)
    case.indices[0, 0, 1] = case.indices[0, 0, 0]
    case.indices[2, 0, :] = case.indices[2, 0, 5]  # one token 77 times
    check_case(case)


@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (16, 512), (128, 512)])
def test_storage_offsets_unaligned(h_q, d_qk):
    """q / kv views with a storage offset of one element (rows not 16-byte aligned: 2-byte load
    paths) and indices with an offset; out of the same kernel as the aligned path."""
    case = Case(9 + h_q, s_q=7, s_kv=300, topk=130, h_q=h_q, d_qk=d_qk, sink=True, topk_len=True)
    q, kv, idx = case.q.to(DEV), case.kv.to(DEV), case.indices.to(DEV)
    bq = torch.zeros(q.numel() + 1, dtype=q.dtype, device=DEV)
    bq[1:] = q.reshape(-1)
    qv = bq[1:].view(q.shape)
    bk = torch.zeros(kv.numel() + 1, dtype=kv.dtype, device=DEV)
    bk[1:] = kv.reshape(-1)
    kvv = bk[1:].view(kv.shape)
    assert qv.data_ptr() % 16 != 0 and kvv.data_ptr() % 16 != 0
    bi = torch.full((idx.numel() + 3,), INT_MAX, dtype=torch.int32, device=DEV)
    bi[3:] = idx.reshape(-1)
    iv = bi[3:].view(idx.shape)
    res = flash_mla.flash_mla_sparse_fwd(qv, kvv, iv, sm_scale=case.scale, attn_sink=case.sink.to(DEV),
                                         topk_length=case.topk_length.to(DEV))
    compare(res, case)
    aligned = run(case, DEV)
    assert torch.equal(res[0], aligned[0]) and torch.equal(res[2], aligned[2])


# The rescaling paths. With randn/10 data a row's logits stay far closer together than the lazy
# rescaling's slack (the running max moves only by more than 8 in base 2), so every other test has
# scale0 / scale1 exactly 0 or 1 and never rescales O. Here two tokens whose keys are all 1.0 / 2.0
# sit at slots 70 (block 1) and 300 (block 4) of every row, and q (its offset removed) leans +0.05 on
# the even heads and -0.05 on the odd ones: the even heads' max jumps by ~20 and ~40 (base 2) mid-row, the odd heads'
# does not, so every warp holds rows that rescale next to rows that keep scale 1 (the case that the seesaw kernel's
# P0 store distinguishes: warpgroup 0 stores P0 unscaled and rewrites it as P0 * scale1 only when
# some row of the warp has scale1 != 1).
@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("d_qk,h_q", [(576, 128), (512, 64), (576, 16)])
def test_rescale_mid_row(d_qk, h_q, sink):
    case = Case(4242 + d_qk + h_q, s_q=8, s_kv=1024, topk=512, h_q=h_q, d_qk=d_qk, sink=sink)
    lean = torch.where(torch.arange(h_q) % 2 == 0, 0.05, -0.05)
    q = case.q.float()
    case.q = (q - q.mean() + lean[None, :, None]).to(torch.bfloat16)  # without the per-tensor offset
    case.kv[10] = 1.0
    case.kv[20] = 2.0
    case.indices[:, 0, 70] = 10
    case.indices[:, 0, 300] = 20
    out, ml, lse = check_case(case)
    even, odd = ml[:, 0::2], ml[:, 1::2]
    assert bool((even > odd + 10).all()), "the large tokens should dominate the even heads only"


@pytest.mark.parametrize("sink_value", [math.inf, -math.inf, 3.0], ids=["+inf", "-inf", "finite"])
@pytest.mark.parametrize("h_q", [32, 128])
def test_sink_values(sink_value, h_q):
    case = Case(11 + h_q, s_q=5, s_kv=400, topk=256, h_q=h_q, d_qk=512, topk_len=True)
    case.sink = torch.full((h_q,), sink_value)
    out, ml, lse = check_case(case)
    if sink_value == math.inf:
        assert bool((out == 0).all())
    if sink_value == -math.inf:
        plain = run(Case(11 + h_q, s_q=5, s_kv=400, topk=256, h_q=h_q, d_qk=512, topk_len=True), DEV)
        check_close("out", out.float(), plain[0].float(), 8e-4, 3.01 / 128, 7e-6)
        assert torch.equal(lse, plain[2])


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs")
def test_cuda_graph_replay_with_new_topk_length():
    case = Case(6, s_q=16, s_kv=600, topk=256, h_q=64, d_qk=512, sink=True, topk_len=True)
    q, kv, idx = case.q.cuda(), case.kv.cuda(), case.indices.cuda()
    sink, tl = case.sink.cuda(), case.topk_length.cuda()
    fn = lambda: flash_mla.flash_mla_sparse_fwd(q, kv, idx, sm_scale=0.5, attn_sink=sink, topk_length=tl)  # noqa
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fn()
    gen = torch.Generator().manual_seed(66)
    for _ in range(2):
        new_tl = torch.randint(0, 257, (16,), generator=gen, dtype=torch.int32)
        tl.copy_(new_tl)
        graph.replay()
        torch.cuda.synchronize()
        case.topk_length = new_tl
        compare(res, case)
