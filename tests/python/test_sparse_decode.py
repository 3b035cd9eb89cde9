"""Sparse (top-k) FP8 MLA decode on the reference backend vs the float64 oracle (spec §2.3, §3.2-§3.5).

The FP8 caches are built by the oracle's own quantizer (not flash_mla.quant) from NaN-poisoned
bf16 caches (poisoned before quantization, like FlashMLA: unused tokens get NaN payloads and
scales), with padded block strides and random bytes in the padding; the oracle decodes the same
bytes independently."""

import numpy as np
import pytest

import flash_mla
import oracle
from mla_test_utils import BF16, INT_MAX, cdiv, check_lse, check_out, gen_sparse_decode_case, non_contiguousify

FMT = {"V32": 576, "MODEL1": 512}


def run_sparse(case, sched=None, **overrides):
    sched = sched if sched is not None else flash_mla.get_mla_metadata()[0]
    kw = {**case.kwargs(), **overrides}
    return flash_mla.flash_mla_with_kvcache(case.q, case.main.packed, None, None, 512, sched, **kw)


def check_sparse(case, out, lse):
    b, s_q, h_q, _ = case.q.shape
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == (b, s_q, h_q, 512)
    assert lse.dtype == np.float32 and lse.shape == (b, h_q, s_q)
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    ref_out, ref_lse = case.reference()
    check_out("out", out, ref_out, BF16)
    check_lse("lse", lse, ref_lse)
    return ref_out, ref_lse


# (b, s_q, h_q, s_k, topk, pbs, options)
CASES = [
    (2, 1, 8, 100, 64, 2, {}),
    (3, 2, 16, 300, 100, 53, {}),
    (2, 3, 64, 200, 128, 64, {"sink": False}),
    (2, 1, 128, 150, 200, 69, {}),  # topk > s_k for most requests: rows padded with -1
    (3, 3, 16, 120, 37, 69, {"have_topk_length": True}),
    (2, 2, 64, 250, 128, 53, {"have_topk_length": True, "invalid_frac": 0.3}),
    (4, 2, 8, 90, 64, 64, {"zero": "random", "varlen": True}),  # zero-length requests: whole rows of -1
    (1, 3, 128, 300, 64, 2, {"varlen": False}),
]


def _case_id(c):
    b, s_q, h_q, s_k, topk, pbs, opt = c
    extra = "".join(f"-{k}" for k in opt)
    return f"b{b}-sq{s_q}-h{h_q}-sk{s_k}-topk{topk}-pbs{pbs}{extra}"


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("fmt", list(FMT))
def test_sparse_decode(rng, fmt, c):
    b, s_q, h_q, s_k, topk, pbs, opt = c
    case = gen_sparse_decode_case(rng, b=b, s_q=s_q, h_q=h_q, d_qk=FMT[fmt], s_k=s_k, topk=topk, pbs=pbs, **opt)
    assert np.isnan(case.main.dequant).any(), "unused cache tokens should be NaN-poisoned"
    check_sparse(case, *run_sparse(case))


# (main s_k, topk, pbs, extra s_k, extra_topk, extra pbs, extra_topk_length, topk_length)
EXTRA = [
    (200, 64, 64, 300, 128, 2, False, False),
    (130, 100, 53, 90, 64, 69, True, False),
    (300, 128, 2, 200, 192, 64, True, True),
    (100, 64, 69, 500, 64, 53, False, True),
]


@pytest.mark.parametrize("e", EXTRA, ids=[f"main{e[1]}x{e[2]}-extra{e[4]}x{e[5]}{'-etl' if e[6] else ''}"
                                          f"{'-tl' if e[7] else ''}" for e in EXTRA])
@pytest.mark.parametrize("fmt", ["MODEL1", "V32"])
def test_sparse_decode_extra_cache(rng, fmt, e):
    s_k, topk, pbs, es_k, etopk, epbs, etl, tl = e
    case = gen_sparse_decode_case(rng, b=3, s_q=2, h_q=64, d_qk=FMT[fmt], s_k=s_k, topk=topk, pbs=pbs,
                                  have_topk_length=tl,
                                  extra=dict(s_k=es_k, topk=etopk, pbs=epbs, have_topk_length=etl))
    assert case.extra.packed.shape[1] == epbs
    out, lse = run_sparse(case)
    check_sparse(case, out, lse)
    # The joint softmax really uses both caches: without the extra cache the answer differs.
    only_main = oracle.sparse_decode(case.q, case.main.dequant, case.main.indices, case.softmax_scale,
                                     case.main.topk_length, case.attn_sink)[1]
    assert not np.allclose(np.where(np.isinf(only_main), 0, only_main), np.where(np.isinf(lse), 0, lse))


@pytest.mark.parametrize("fmt", list(FMT))
def test_all_indices_invalid(rng, fmt):
    case = gen_sparse_decode_case(rng, b=3, s_q=2, h_q=16, d_qk=FMT[fmt], s_k=100, topk=64, pbs=53, all_invalid=True)
    out, lse = run_sparse(case)
    check_sparse(case, out, lse)
    assert np.all(out.astype(np.float32) == 0) and np.all(lse == np.inf)


@pytest.mark.parametrize("fmt", list(FMT))
def test_topk_length_zero_and_garbage(rng, fmt):
    b, s_q, topk = 4, 2, 100
    tl = np.array([0, 1, topk, 37], np.int32)
    case = gen_sparse_decode_case(rng, b=b, s_q=s_q, h_q=16, d_qk=FMT[fmt], s_k=200, topk=topk, pbs=64,
                                  topk_length=tl, varlen=False)
    case.main.indices[0, :, :] = INT_MAX  # request 0: topk_length 0, every slot is garbage
    out, lse = run_sparse(case)
    check_sparse(case, out, lse)
    assert np.all(out[0].astype(np.float32) == 0) and np.all(lse[0] == np.inf)
    assert np.all(np.isfinite(lse[2]))


@pytest.mark.parametrize("sink_value", [np.inf, -np.inf, 0.0, 3.0], ids=["+inf", "-inf", "0", "3"])
def test_attn_sink_values(rng, sink_value):
    case = gen_sparse_decode_case(rng, b=2, s_q=2, h_q=16, d_qk=576, s_k=100, topk=64, pbs=64, sink=False,
                                  zero=[True, False], varlen=True)
    out_plain, lse_plain = run_sparse(case)
    case.attn_sink = np.full(16, sink_value, np.float32)
    out, lse = run_sparse(case)
    check_sparse(case, out, lse)
    np.testing.assert_array_equal(lse, lse_plain)  # the sink never changes lse
    assert np.all(out[0].astype(np.float32) == 0)  # empty request: out 0 whatever the sink
    if sink_value == -np.inf:
        np.testing.assert_array_equal(out.view(np.uint16), out_plain.view(np.uint16))
    if sink_value == np.inf:
        assert np.all(out.astype(np.float32) == 0)


def test_duplicate_indices_count_twice(rng):
    case = gen_sparse_decode_case(rng, b=1, s_q=1, h_q=8, d_qk=512, s_k=64, topk=64, pbs=64, varlen=False,
                                  sink=False, noncontig=False)
    case.main.indices[0, 0, 32:] = case.main.indices[0, 0, :32]
    check_sparse(case, *run_sparse(case))


@pytest.mark.parametrize("fmt", list(FMT))
def test_contiguous_inputs_same_result(rng, fmt):
    case = gen_sparse_decode_case(rng, b=2, s_q=2, h_q=16, d_qk=FMT[fmt], s_k=100, topk=64, pbs=53)
    out_nc, lse_nc = run_sparse(case)
    sched = flash_mla.get_mla_metadata()[0]
    kw = case.kwargs()
    kw["indices"] = np.ascontiguousarray(case.main.indices)
    out_c, lse_c = flash_mla.flash_mla_with_kvcache(np.ascontiguousarray(case.q), case.main.packed, None, None, 512,
                                                    sched, **kw)
    np.testing.assert_array_equal(out_nc.view(np.uint16), out_c.view(np.uint16))
    np.testing.assert_array_equal(lse_nc, lse_c)
    # A cache with a larger (odd) block stride and garbage padding reads the same tokens.
    kv = oracle.dequantize_cache(case.main.packed, FMT[fmt]).astype(np.float32).astype(BF16)
    nb, pbs = case.main.packed.shape[:2]
    bpt = case.main.packed.shape[-1]
    repacked = oracle.quantize_cache(kv.reshape(nb, pbs, 1, -1), block_stride=pbs * bpt + 16 * 7, fill=rng)
    sched = flash_mla.get_mla_metadata()[0]
    out_r, lse_r = flash_mla.flash_mla_with_kvcache(case.q, repacked, None, None, 512, sched, **case.kwargs())
    np.testing.assert_array_equal(out_nc.view(np.uint16), out_r.view(np.uint16))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "float8_e4m3fn"])
def test_cache_byte_dtypes(rng, dtype):
    import ml_dtypes
    case = gen_sparse_decode_case(rng, b=2, s_q=1, h_q=16, d_qk=576, s_k=80, topk=64, pbs=64)
    dt = np.dtype(ml_dtypes.float8_e4m3fn) if dtype == "float8_e4m3fn" else np.dtype(dtype)
    out_u8, lse_u8 = run_sparse(case)
    out, lse = flash_mla.flash_mla_with_kvcache(case.q, case.main.packed.view(dt), None, None, 512,
                                                flash_mla.get_mla_metadata()[0], **case.kwargs())
    np.testing.assert_array_equal(out.view(np.uint16), out_u8.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_u8)


def test_causal_rejected(rng):
    case = gen_sparse_decode_case(rng, b=1, s_q=2, h_q=8, d_qk=576, s_k=64, topk=64, pbs=64)
    with pytest.raises((ValueError, AssertionError), match="causal"):
        run_sparse(case, causal=True)


def test_is_fp8_kvcache_false_rejected(rng):
    case = gen_sparse_decode_case(rng, b=1, s_q=1, h_q=8, d_qk=512, s_k=64, topk=64, pbs=64)
    with pytest.raises((ValueError, AssertionError), match="is_fp8_kvcache"):
        run_sparse(case, is_fp8_kvcache=False)


# ----------------------------------------------------------------------------- scheduler (spec §4.1-§4.2)


def sparse_work(topk, topk_length, extra_topk=0, extra_topk_length=None):
    """Per-request workload s'_i of spec §4.2."""
    b = len(topk_length) if topk_length is not None else None
    work = []
    for i in range(b):
        s = int(topk_length[i]) if topk_length is not None else topk
        s = s or 1
        if extra_topk:
            s = cdiv(s, 64) * 64 + (int(extra_topk_length[i]) if extra_topk_length is not None else extra_topk)
        work.append(s)
    return work


@pytest.mark.parametrize("with_extra", [False, True])
def test_sparse_scheduler_metadata(rng, reference_threads, with_extra):
    reference_threads(12)
    b, s_q, h_q, topk = 5, 2, 128, 192
    tl = np.array([0, 192, 5, 64, 130], np.int32)
    extra = dict(s_k=300, topk=128, pbs=2, topk_length=np.array([3, 0, 128, 70, 64], np.int32)) if with_extra else None
    case = gen_sparse_decode_case(rng, b=b, s_q=s_q, h_q=h_q, d_qk=512, s_k=300, topk=topk, pbs=64, topk_length=tl,
                                  extra=extra)
    sched, _ = flash_mla.get_mla_metadata()
    out, lse = run_sparse(case, sched)
    parts = max(12 // s_q // max(h_q // 64, 1), 1)
    work = sparse_work(topk, tl, 128 if with_extra else 0, extra["topk_length"] if with_extra else None)
    exp_tsm, exp_splits = oracle.tile_schedule(work, parts)
    np.testing.assert_array_equal(sched.tile_scheduler_metadata, exp_tsm)
    np.testing.assert_array_equal(sched.num_splits, exp_splits)
    cfg = sched.config
    assert (cfg.topk, cfg.is_fp8_kvcache, cfg.causal, cfg.h_k) == (topk, True, False, 1)
    assert (cfg.extra_page_block_size, cfg.extra_topk) == ((2, 128) if with_extra else (None, None))
    check_sparse(case, out, lse)
    # Reuse: same inputs -> identical; changed topk_length values -> mismatch error.
    out2, lse2 = run_sparse(case, sched)
    np.testing.assert_array_equal(out.view(np.uint16), out2.view(np.uint16))
    tl2 = tl.copy()
    tl2[0] = 1
    with pytest.raises(flash_mla.SchedMetaMismatchError, match="topk_length"):
        run_sparse(case, sched, topk_length=tl2)
    idx_wider = non_contiguousify(np.full((b, s_q, topk + 64), -1, np.int32))
    with pytest.raises(flash_mla.SchedMetaMismatchError, match="topk"):
        run_sparse(case, sched, indices=idx_wider)


def test_sparse_decode_v32_large_topk(rng):
    """V3.2-like: h_q 128, topk 2048 over s_k 2046 (spec §5.2 correctness triple (2046, 2048, 64))."""
    case = gen_sparse_decode_case(rng, b=2, s_q=2, h_q=128, d_qk=576, s_k=2046, topk=2048, pbs=64)
    check_sparse(case, *run_sparse(case))


def test_sparse_decode_model1_config(rng):
    """MODEL1 CONFIG3-like: h_q 64, topk 128 (page 256) + extra_topk 1024 (page 2) with extra_topk_length."""
    case = gen_sparse_decode_case(rng, b=2, s_q=2, h_q=64, d_qk=512, s_k=1500, topk=128, pbs=256,
                                  extra=dict(s_k=1500, topk=1024, pbs=2, have_topk_length=True))
    check_sparse(case, *run_sparse(case))
