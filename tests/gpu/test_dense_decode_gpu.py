"""Dense decode on the Hopper backend vs the CPU reference backend (same API, CPU tensors).

The full 2352-case grid of spec §5.4 runs in the C++ GPU test program
(tests/gpu/cpp); this file covers the Python path end to end: empty requests, NaN in unused
slots and pages, s_q > 1 causal with rows that see no key, CUDA graph replay with new lengths,
tensor-parallel head counts, views with storage offsets, mixed devices, page sizes, fp16,
scheduler reuse. Outputs are compared
with spec §5.1 tolerances; unused KV slots and pages hold NaN.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from torch_reference import check_close  # noqa: E402  (spec §5.1 comparator, shared by the GPU tests)

SENTINEL = 2147480000


def make_case(b, s_q, h_q, h_kv, d, lens, pbs=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    max_pages = max(1, max((int(l) + pbs - 1) // pbs for l in lens))
    nb = b * max_pages + 3
    q = (torch.randn(b, s_q, h_q, d, generator=g) / 10).clamp(-1, 1).to(dtype)
    k = (torch.randn(nb, pbs, h_kv, d, generator=g) / 10).clamp(-1, 1).to(dtype)
    bt = torch.randperm(nb, generator=g)[: b * max_pages].to(torch.int32).reshape(b, max_pages)
    used_blocks = set()
    for i in range(b):
        used = (int(lens[i]) + pbs - 1) // pbs
        used_blocks.update(bt[i, :used].tolist())
        if int(lens[i]) % pbs:
            k[bt[i, used - 1], int(lens[i]) % pbs:] = float("nan")
        bt[i, used:] = SENTINEL
    for blk in range(nb):
        if blk not in used_blocks:
            k[blk] = float("nan")
    return q, k, bt, lens


def run(q, k, bt, lens, causal, sched=None, scale=None):
    sched = sched or flash_mla.get_mla_metadata()[0]
    return flash_mla.flash_mla_with_kvcache(q, k, bt, lens, 512, sched, softmax_scale=scale, causal=causal)




def compare(q, k, bt, lens, causal, out, lse):
    ref_out, ref_lse = run(q.cpu(), k.cpu(), bt.cpu(), lens.cpu(), causal)
    assert not out.isnan().any()
    check_close("out", out, ref_out, 8e-4, 2.01 / 128, 5e-6)
    check_close("lse", lse, ref_lse, 1e-6, 8.01 / 65536, 1e-7)


def to_cuda(*ts):
    return [t.cuda() for t in ts]


GRID = [
    # b, s_q, h_q, h_kv, d, lens, causal
    (2, 1, 128, 1, 576, [4096, 2000], False),
    (2, 2, 128, 1, 576, [140, 20], True),
    (6, 4, 64, 2, 576, [20, 140, 4096, 0, 77, 1], True),
    (3, 1, 63, 3, 576, [300, 0, 1000], False),
    (3, 2, 9, 3, 576, [130, 64, 65], True),
    (2, 1, 128, 8, 576, [200, 400], False),
    (2, 2, 126, 2, 512, [1000, 333], True),
    (1, 1, 1, 1, 576, [4096], False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GRID, ids=lambda c: f"b{c[0]}-sq{c[1]}-hq{c[2]}-hkv{c[3]}-d{c[4]}-causal{c[6]}")
def test_grid(case, dtype):
    b, s_q, h_q, h_kv, d, lens, causal = case
    q, k, bt, ln = make_case(b, s_q, h_q, h_kv, d, lens, dtype=dtype, seed=sum(map(ord, str(case))) % 1000)
    out, lse = run(*to_cuda(q, k, bt, ln), causal)
    torch.cuda.synchronize()
    compare(q, k, bt, ln, causal, out, lse)


# The rescaling paths. With randn/10 data every logit of a row stays within the lazy rescaling's slack
# (the running max moves only by more than 8 in base 2), so the other tests never rescale O. Here the
# keys of tokens 100 (block 1) and 300 (block 4) of every request are all 6.0 / 16.0 and q (its mean
# removed) leans +0.05 on the even heads and -0.05 on the odd ones: with the default scale 576^-0.5
# the even heads' max jumps by ~10 and ~17 (base 2) mid-sequence, past the slack, the odd heads' does
# not, so each warp holds rows that rescale (in either block of a pair) next to rows that keep scale 1.
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pbs,h_q,s_q", [(64, 128, 1), (64, 64, 2), (32, 16, 4)])
def test_rescale_mid_sequence(pbs, h_q, s_q, causal):
    lens = [1000, 515, 301]
    q, k, bt, ln = make_case(3, s_q, h_q, 1, 576, lens, pbs=pbs, seed=pbs + h_q + s_q)
    lean = torch.where(torch.arange(h_q) % 2 == 0, 0.05, -0.05)
    qf = q.float()
    q = (qf - qf.mean() + lean[None, None, :, None]).to(q.dtype)
    for i in range(3):
        for tok, val in ((100, 6.0), (300, 16.0)):
            k[bt[i, tok // pbs], tok % pbs] = val
    out, lse = run(*to_cuda(q, k, bt, ln), causal)
    torch.cuda.synchronize()
    compare(q, k, bt, ln, causal, out, lse)
    if not causal:  # (causal: the first query rows of a request may not reach token 300)
        assert bool((lse[:, 0::2] > lse[:, 1::2] + 5).all()), "the large tokens should dominate the even heads only"


@pytest.mark.parametrize("lens", [[0], [0, 300, 500], [300, 500, 0], [0, 0, 0, 0]], ids=str)
def test_empty_requests(lens):
    """Requests with cache_seqlens 0 alone, first, last, or all: out 0, lse +inf, the rest as the reference."""
    q, k, bt, ln = make_case(len(lens), 2, 128, 1, 576, lens)
    out, lse = run(*to_cuda(q, k, bt, ln), True)
    for i, l in enumerate(lens):
        if l == 0:
            assert bool((out[i] == 0).all()) and bool((lse[i] == math.inf).all())
    compare(q, k, bt, ln, True, out, lse)


# 192 and 320: multiples of 64 that are not powers of two (the seesaw kernel's page math by division, not shifts).
@pytest.mark.parametrize("pbs", [16, 32, 64, 128, 192, 256, 320])
def test_page_block_sizes(pbs):
    q, k, bt, ln = make_case(3, 2, 64, 1, 576, [1000, 1, 515], pbs=pbs, seed=pbs)
    out, lse = run(*to_cuda(q, k, bt, ln), True)
    compare(q, k, bt, ln, True, out, lse)


@pytest.mark.parametrize("s_q", [2, 5, 8, 200])
def test_speculative_causal(s_q):
    """s_q > 1 (speculative decoding) with the bottom-right causal mask; a request whose first row sees no key."""
    lens = [s_q + 3, s_q - 1, 700]  # second request: the first row sees no key
    q, k, bt, ln = make_case(3, s_q, 16, 1, 576, lens, seed=s_q)
    out, lse = run(*to_cuda(q, k, bt, ln), True)
    assert bool((lse[1, :, 0] == math.inf).all())
    compare(q, k, bt, ln, True, out, lse)


@pytest.mark.parametrize("h_q,s_q", [(8, 1), (16, 1), (32, 1), (8, 4), (16, 4), (32, 2), (64, 1), (128, 1)])
def test_tensor_parallel_heads(h_q, s_q):
    """Head counts of 128 heads split over 16 / 8 / 4 / 2 / 1 GPUs, including h_q * s_q < 64."""
    q, k, bt, ln = make_case(4, s_q, h_q, 1, 576, [2048, 100, 3000, 64], seed=h_q * 10 + s_q)
    out, lse = run(*to_cuda(q, k, bt, ln), s_q > 1)
    compare(q, k, bt, ln, s_q > 1, out, lse)


def test_scheduler_reuse_and_misuse():
    q, k, bt, ln = make_case(4, 1, 128, 1, 576, [500, 4000, 0, 64])
    qc, kc, btc, lc = to_cuda(q, k, bt, ln)
    sched, _ = flash_mla.get_mla_metadata()
    out1, lse1 = run(qc, kc, btc, lc, False, sched)
    assert sched.tile_scheduler_metadata.shape[1] == 8 and sched.num_splits.shape == (5,)
    assert sched.tile_scheduler_metadata.is_cuda and sched.num_splits.dtype == torch.int32
    out2, lse2 = run(qc, kc, btc, lc, False, sched)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    with pytest.raises(flash_mla.SchedMetaMismatchError):
        run(qc, kc, btc, lc, True, sched)


def test_cuda_graph_replay_with_new_lengths():
    """A decode captured once in a CUDA graph (metadata computed inside the captured work) and replayed with new
    cache_seqlens, half the captured batch empty: each replay equals an eager call and the reference."""
    b_cap = 8
    q, k, bt, ln = make_case(b_cap, 1, 128, 1, 576, [4096] * b_cap)
    qc, kc, btc, lc = to_cuda(q, k, bt, ln)
    run(qc, kc, btc, lc, False)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run(qc, kc, btc, lc, False)  # fresh metadata computed inside the captured work
    rng = np.random.default_rng(1)
    for _ in range(3):
        new_lens = rng.integers(0, 4097, b_cap).astype(np.int32)
        new_lens[b_cap // 2:] = 0  # the real batch is smaller than the captured one
        lc.copy_(torch.from_numpy(new_lens))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_lse = run(qc, kc, btc, lc, False)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        compare(q, k, bt, lc.cpu(), False, out, lse)


def test_views_with_storage_offset():
    """q a view with a storage offset."""
    q, k, bt, ln = make_case(3, 1, 64, 1, 576, [100, 900, 33])
    big_q = torch.randn(4, 1, 64, 576).to(torch.bfloat16)
    big_q[1:] = q
    qv = big_q.cuda()[1:]  # storage offset of one request
    assert qv.storage_offset() > 0
    out, lse = run(qv, *to_cuda(k, bt, ln), False)
    compare(q, k, bt, ln, False, out, lse)


def test_mixed_devices_raise():
    """A CPU block_table with CUDA q: ValueError naming block_table."""
    q, k, bt, ln = make_case(2, 1, 16, 1, 576, [10, 20])
    with pytest.raises(ValueError, match="block_table is on cpu but q is on cuda"):
        run(q.cuda(), k.cuda(), bt, ln.cuda(), False)


def test_reused_sched_with_changed_lengths_is_never_stale():
    """Reusing a FlashMLASchedMeta after cache_seqlens changed in place (FlashMLA's silent
    stale-metadata bug) still gives correct results: the write bumps the tensor's version, so
    the call recomputes the split schedule."""
    q, k, bt, ln = make_case(6, 1, 128, 1, 576, [4000] * 6)  # pages for 4000 tokens each
    qc, kc, btc, lc = to_cuda(q, k, bt, ln)
    sched, _ = flash_mla.get_mla_metadata()
    run(qc, kc, btc, lc, False, sched)
    new_lens = torch.tensor([1, 4000, 0, 2048, 64, 3000], dtype=torch.int32)
    lc.copy_(new_lens)  # same shapes, skewed lengths (each <= 4000): a stale schedule would mis-split
    out, lse = run(qc, kc, btc, lc, False, sched)
    compare(q, k, bt, new_lens, False, out, lse)


def test_sched_shared_by_layers_until_lengths_change():
    """Eager torch calls with one FlashMLASchedMeta share its schedule (as a step's layers do in
    FlashMLA) while cache_seqlens is the same tensor, unmodified; an in-place write or another
    tensor makes the next call recompute it (never a stale schedule)."""
    q, k, bt, ln = make_case(4, 1, 64, 1, 576, [300, 2000, 900, 64])
    qc, kc, btc, lc = to_cuda(q, k, bt, ln)
    sched, _ = flash_mla.get_mla_metadata()
    out1, lse1 = run(qc, kc, btc, lc, False, sched)
    tsm = sched.tile_scheduler_metadata
    out2, lse2 = run(qc, kc, btc, lc, False, sched)  # the next layer: reuses
    assert sched.tile_scheduler_metadata is tsm
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    compare(q, k, bt, ln, False, out2, lse2)
    new_lens = torch.tensor([1, 2000, 0, 33], dtype=torch.int32)  # each within its pages: another split schedule
    lc.copy_(new_lens)  # in place: torch bumps the version counter
    out3, lse3 = run(qc, kc, btc, lc, False, sched)
    assert sched.tile_scheduler_metadata is not tsm
    compare(q, k, bt, new_lens, False, out3, lse3)
    tsm3 = sched.tile_scheduler_metadata
    out4, lse4 = run(qc, kc, btc, lc.clone(), False, sched)  # same values, another tensor: recomputed
    assert sched.tile_scheduler_metadata is not tsm3
    assert torch.equal(out3, out4) and torch.equal(lse3, lse4)


def test_sched_from_outside_a_capture_is_recomputed_inside_it():
    """A schedule computed eagerly is not baked into a CUDA graph: the first captured call
    recomputes it (so every replay does), later calls of the same capture share that one, and
    replays with new lengths stay exact."""
    b = 6
    q, k, bt, ln = make_case(b, 1, 128, 1, 576, [4000] * b)
    qc, kc, btc, lc = to_cuda(q, k, bt, ln)
    sched, _ = flash_mla.get_mla_metadata()
    run(qc, kc, btc, lc, False, sched)  # eager: computes the schedule
    eager_tsm = sched.tile_scheduler_metadata
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_a, lse_a = run(qc, kc, btc, lc, False, sched)  # layer 1: recomputes inside the capture
        captured_tsm = sched.tile_scheduler_metadata
        out_b, lse_b = run(qc, kc, btc, lc, False, sched)  # layer 2: shares layer 1's schedule
    assert captured_tsm is not eager_tsm and sched.tile_scheduler_metadata is captured_tsm
    rng = np.random.default_rng(5)
    for _ in range(2):
        new_lens = torch.from_numpy(rng.integers(0, 4001, b).astype(np.int32))
        lc.copy_(new_lens)
        graph.replay()
        torch.cuda.synchronize()
        compare(q, k, bt, new_lens, False, out_a, lse_a)
        assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    out_e, lse_e = run(qc, kc, btc, lc, False, sched)  # eager again after the capture: recomputed
    assert sched.tile_scheduler_metadata is not captured_tsm
    assert torch.equal(out_e, out_a) and torch.equal(lse_e, lse_a)
