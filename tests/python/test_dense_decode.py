"""Dense paged MLA decode on the reference backend vs the float64 oracle (spec §2.2, §3.1, §4),
plus the scheduler-object semantics of get_mla_metadata / FlashMLASchedMeta (spec §1.2, §4.3).

Kinds of input that have broken published MLA decode kernels each have their own tests below:
1. requests with cache_seqlens == 0 (alone, first, last, middle, all): out = 0, lse = +inf, no NaN;
2. a partly filled last page, the unused slots and unused pages holding NaN / +-inf: nothing leaks;
3. scattered, non-monotonic block tables whose entries past a request's last page hold a huge sentinel
   that must never be dereferenced;
4. s_q > 1 with bottom-right causal masking (speculative decoding, 2-8 tokens; verify lengths of a few
   hundred), including query rows that see no key (out = 0, lse = +inf);
and inputs that are views starting inside a larger buffer (a storage offset)."""

import dataclasses
import random

import numpy as np
import pytest

import flash_mla
import oracle
from mla_test_utils import BF16, FP16, SENTINEL, cdiv, check_lse, check_out, gen_dense_case

DTYPES = {"bf16": BF16, "fp16": FP16}


def run_dense(case, sched=None):
    sched = sched if sched is not None else flash_mla.get_mla_metadata()[0]
    return flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, sched,
                                            None, case.softmax_scale, case.causal)


def check_dense(case, out, lse):
    ref_out, ref_lse = oracle.dense_decode(case.q, case.k_cache, case.block_table, case.cache_seqlens, case.causal,
                                           case.softmax_scale)
    assert not np.isnan(out.astype(np.float32)).any(), "NaN leaked into out"
    check_out("out", out, ref_out, case.q.dtype)
    check_lse("lse", lse, ref_lse)
    return ref_out, ref_lse


# ----------------------------------------------------------------------------- grid

HEAD_PAIRS = [(1, 1), (3, 1), (3, 3), (16, 1), (16, 2), (128, 1), (128, 8)]


def _grid():
    pick = random.Random(20240601)
    cases = []
    for h_q, h_kv in HEAD_PAIRS:
        for s_q in (1, 2, 4):
            for causal in (False, True):
                b = pick.choice((1, 3))
                d = pick.choice((576, 512))
                dt = pick.choice(("bf16", "fp16"))
                varlen = pick.choice((False, True, "zeros"))
                pbs = pick.choice((64, 64, 16, 61))
                s_k = pick.choice((20, 140))
                scale = pick.choice((None, 0.25))
                cases.append(pytest.param(
                    b, s_q, h_q, h_kv, d, dt, causal, varlen, pbs, s_k, scale,
                    id=f"b{b}-sq{s_q}-h{h_q}x{h_kv}-d{d}-{dt}-{'causal' if causal else 'full'}-"
                       f"{'fixed' if varlen is False else 'varlen' if varlen is True else 'varlen0'}-pbs{pbs}-sk{s_k}"
                       f"-scale{scale or 'default'}"))
    return cases


@pytest.mark.parametrize("b,s_q,h_q,h_kv,d,dt,causal,varlen,pbs,s_k,scale", _grid())
def test_dense_decode_grid(rng, b, s_q, h_q, h_kv, d, dt, causal, varlen, pbs, s_k, scale):
    case = gen_dense_case(rng, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, s_k=s_k, pbs=pbs, dtype=DTYPES[dt],
                          varlen=bool(varlen), zero="random" if varlen == "zeros" else None, causal=causal,
                          softmax_scale=scale, noncontig=(s_q + h_q) % 2 == 1)
    out, lse = run_dense(case)
    assert isinstance(out, np.ndarray) and out.shape == (b, s_q, h_q, 512) and out.dtype == DTYPES[dt]
    assert lse.shape == (b, h_q, s_q) and lse.dtype == np.float32
    check_dense(case, out, lse)


@pytest.mark.parametrize("pbs", [64, 16, 61])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [576, 512])
def test_dense_decode_dims_dtypes_pages(rng, d, dt, pbs):
    case = gen_dense_case(rng, b=2, s_q=2, h_q=16, h_kv=1, d=d, s_k=150, pbs=pbs, dtype=DTYPES[dt], varlen=True,
                          causal=True, softmax_scale=0.3, noncontig=True, poison="mixed")
    check_dense(case, *run_dense(case))


def test_default_softmax_scale_is_d_qk_pow_minus_half(rng):
    case = gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=100)
    out_default, lse_default = run_dense(case)
    case.softmax_scale = 576**-0.5
    out_explicit, lse_explicit = run_dense(case)
    np.testing.assert_array_equal(out_default.view(np.uint16), out_explicit.view(np.uint16))
    np.testing.assert_array_equal(lse_default, lse_explicit)
    case.softmax_scale = None
    check_dense(case, out_default, lse_default)


def test_causal_ignored_for_single_query_token(rng):
    case = gen_dense_case(rng, b=3, s_q=1, h_q=16, h_kv=1, d=576, s_k=70, varlen=True)
    out_full, lse_full = run_dense(case)
    case.causal = True
    out_causal, lse_causal = run_dense(case)
    np.testing.assert_array_equal(out_full.view(np.uint16), out_causal.view(np.uint16))
    np.testing.assert_array_equal(lse_full, lse_causal)


# ----------------------------------------------------------------------------- 1: empty requests

ZERO_PATTERNS = {"alone": [0], "first": [0, 90, 130], "last": [90, 130, 0], "middle": [50, 0, 64],
                 "all": [0, 0, 0], "all_b1_causal_sq4": [0]}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pattern", list(ZERO_PATTERNS))
def test_zero_seqlen_requests(rng, pattern, causal):
    lens = np.array(ZERO_PATTERNS[pattern], np.int32)
    s_q = 4 if pattern.endswith("sq4") else 2
    case = gen_dense_case(rng, b=len(lens), s_q=s_q, h_q=16, h_kv=2, d=576, s_k=0, lens=lens, causal=causal)
    assert np.all(case.block_table[lens == 0] == SENTINEL)  # every entry of an empty request is the sentinel
    out, lse = run_dense(case)
    check_dense(case, out, lse)
    empty = lens == 0
    assert np.all(out[empty].astype(np.float32) == 0.0)
    assert np.all(lse[empty] == np.inf)


# ----------------------------------------------------------------------------- 2: partial pages + poison


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf", "mixed"])
@pytest.mark.parametrize("pbs", [64, 61])
def test_partial_last_page_poisoned(rng, pbs, poison):
    lens = np.array([pbs + 1, 2 * pbs - 1, 1, pbs, pbs - 1], np.int32)
    case = gen_dense_case(rng, b=len(lens), s_q=2, h_q=16, h_kv=1, d=576, s_k=0, lens=lens, pbs=pbs, poison=poison,
                          causal=False, spare_pages=4)
    # The poison really is there: the tail of each partially filled page and the unused pages.
    for i, n in enumerate(lens):
        if n % pbs:
            tail = case.k_cache[case.block_table[i, n // pbs], n % pbs:].astype(np.float32)
            assert not np.isfinite(tail).any()
    out, lse = run_dense(case)
    assert np.isfinite(out.astype(np.float32)).all() and np.isfinite(lse).all()
    check_dense(case, out, lse)


# ----------------------------------------------------------------------------- 3: scattered tables


def test_scattered_block_table_with_sentinels(rng):
    pbs = 64
    lens = np.array([200, 5, 64, 0, 129], np.int32)
    b, max_pages = len(lens), 12  # far more columns than needed: most entries are the sentinel
    n_pages = 40
    perm = rng.permutation(n_pages).astype(np.int32)
    block_table = np.full((b, max_pages), SENTINEL, np.int32)
    used_pages = perm[: sum(cdiv(int(n), pbs) for n in lens)]
    k = 0
    for i, n in enumerate(lens):
        p = cdiv(int(n), pbs)
        block_table[i, :p] = used_pages[k:k + p]
        k += p
    block_table[0, :4] = np.sort(block_table[0, :4])[[2, 0, 3, 1]]  # surely non-monotonic
    assert not np.all(np.diff(block_table[0, :4]) > 0)
    k_cache = np.full((n_pages, pbs, 1, 576), np.nan, np.float32).astype(BF16)
    for i, n in enumerate(lens):
        for j in range(cdiv(int(n), pbs)):
            m = min(pbs, int(n) - j * pbs)
            k_cache[block_table[i, j], :m] = (rng.standard_normal((m, 1, 576)) / 10).astype(np.float32).astype(BF16)
    q = (rng.standard_normal((b, 3, 16, 576))).astype(np.float32).astype(BF16)
    from mla_test_utils import DenseCase
    case = DenseCase(q, k_cache, block_table, lens, 0.2, True)
    check_dense(case, *run_dense(case))


# ----------------------------------------------------------------------------- 4: s_q > 1, causal


@pytest.mark.parametrize("s_q", [2, 3, 5, 8])
def test_speculative_decoding_causal_with_empty_rows(rng, s_q):
    # lens shorter than s_q: the first rows of those requests see no key at all.
    lens = np.array([3, 0, s_q, 20, 1], np.int32)
    case = gen_dense_case(rng, b=len(lens), s_q=s_q, h_q=16, h_kv=1, d=576, s_k=0, lens=lens, causal=True,
                          softmax_scale=0.3)
    out, lse = run_dense(case)
    check_dense(case, out, lse)
    for i, n in enumerate(lens):
        for r in range(s_q):
            visible = n - s_q + r + 1
            if visible <= 0:
                assert np.all(out[i, r].astype(np.float32) == 0) and np.all(lse[i, :, r] == np.inf)
            else:
                assert np.all(np.isfinite(lse[i, :, r]))


@pytest.mark.parametrize("h_q,h_kv", [(2, 1), (16, 2)])
def test_verify_length_causal(rng, h_q, h_kv):
    s_q = 200
    lens = np.array([150, 256], np.int32)  # request 0: the first 50 rows see nothing
    case = gen_dense_case(rng, b=2, s_q=s_q, h_q=h_q, h_kv=h_kv, d=576, s_k=0, lens=lens, causal=True, pbs=64,
                          softmax_scale=0.3)
    out, lse = run_dense(case)
    check_dense(case, out, lse)
    assert np.all(lse[0, :, :50] == np.inf) and np.all(np.isfinite(lse[0, :, 50:]))
    assert np.all(out[0, :50].astype(np.float32) == 0)


# ----------------------------------------------------------------------------- scheduler object (spec §1.2, §4)


def dense_num_sm_parts(num_sms, s_q, h_q, h_kv):
    return max(num_sms // h_kv // cdiv(s_q * (h_q // h_kv), 64), 1)


def test_get_mla_metadata_forms():
    lens = np.array([10, 20], np.int32)
    for res in (flash_mla.get_mla_metadata(), flash_mla.get_mla_metadata(lens, 2 * 128 // 1, 1),
                flash_mla.get_mla_metadata(lens, 128, 1, 128, True, 2048),
                flash_mla.get_mla_metadata(cache_seqlens=lens, num_q_tokens_per_head_k=128, num_heads_k=1)):
        assert isinstance(res, tuple) and len(res) == 2 and res[1] is None
        sched = res[0]
        assert isinstance(sched, flash_mla.FlashMLASchedMeta)
        assert sched.have_initialized is False and sched.config is None
        assert sched.tile_scheduler_metadata is None and sched.num_splits is None
    from flash_mla.flash_mla_interface import FlashMLASchedMeta
    assert FlashMLASchedMeta is flash_mla.FlashMLASchedMeta
    assert [f for f in FlashMLASchedMeta.Config.__dataclass_fields__] == [
        "b", "s_q", "h_q", "page_block_size", "h_k", "causal", "is_fp8_kvcache", "topk", "extra_page_block_size",
        "extra_topk"]


@pytest.mark.parametrize("s_q,h_q,h_kv", [(1, 128, 1), (2, 64, 1), (1, 16, 2), (4, 3, 3)])
def test_first_call_fills_metadata(rng, s_q, h_q, h_kv):
    case = gen_dense_case(rng, b=5, s_q=s_q, h_q=h_q, h_kv=h_kv, d=576, s_k=300, varlen=True, zero="random")
    sched, _ = flash_mla.get_mla_metadata()
    out, lse = run_dense(case, sched)
    assert sched.have_initialized
    cfg = sched.config
    assert (cfg.b, cfg.s_q, cfg.h_q, cfg.page_block_size, cfg.h_k, cfg.causal, cfg.is_fp8_kvcache, cfg.topk,
            cfg.extra_page_block_size, cfg.extra_topk) == (5, s_q, h_q, 64, h_kv, False, False, None, None, None)
    tsm, splits = sched.tile_scheduler_metadata, sched.num_splits
    assert isinstance(tsm, np.ndarray) and tsm.dtype == np.int32 and tsm.ndim == 2 and tsm.shape[1] == 8
    assert isinstance(splits, np.ndarray) and splits.dtype == np.int32 and splits.shape == (6,)
    # CPU convention: "num_sms" is the reference backend's worker count.
    num_parts = dense_num_sm_parts(flash_mla.reference_num_threads(), s_q, h_q, h_kv)
    assert tsm.shape[0] == num_parts
    assert splits[0] == 0 and np.all(np.diff(splits) >= 1) and splits[-1] <= 5 + num_parts
    exp_tsm, exp_splits = oracle.tile_schedule(case.cache_seqlens, num_parts)
    np.testing.assert_array_equal(tsm, exp_tsm)
    np.testing.assert_array_equal(splits, exp_splits)
    check_dense(case, out, lse)


def test_scheduler_worked_example_python():
    """Spec §4.6, derived by hand from the algorithm: the transcription reproduces it."""
    meta, splits = oracle.tile_schedule([1000, 64, 0, 5000], 8)
    assert splits.tolist() == [0, 2, 3, 4, 10]
    assert meta[0, :4].tolist() == [0, 0, 0, 15]
    assert meta[1, :4].tolist() == [0, 2, 15, 0]
    for p, (lo, hi) in enumerate([(0, 15), (15, 30), (30, 45), (45, 60), (60, 75), (75, 79)], start=2):
        assert meta[p, :4].tolist() == [3, 3, lo, hi], p
        assert meta[p, 4] == p - 2  # begin_split_idx
        assert meta[p, 5] == meta[p, 6] == 1  # request 3 is split in every part


@pytest.mark.parametrize("num_threads,lens", [(8, [1000, 64, 0, 5000]), (20, [1, 0, 700, 64, 65, 3000, 0]),
                                              (3, [0, 0, 0])])
def test_scheduler_matches_spec_algorithm(rng, reference_threads, num_threads, lens):
    reference_threads(num_threads)
    assert flash_mla.reference_num_threads() == num_threads
    lens = np.array(lens, np.int32)
    case = gen_dense_case(rng, b=len(lens), s_q=1, h_q=64, h_kv=1, d=576, s_k=0, lens=lens, spare_pages=0)
    sched, _ = flash_mla.get_mla_metadata()
    out, lse = run_dense(case, sched)
    assert sched.tile_scheduler_metadata.shape == (num_threads, 8)
    exp_tsm, exp_splits = oracle.tile_schedule(lens, num_threads)
    np.testing.assert_array_equal(sched.tile_scheduler_metadata, exp_tsm)
    np.testing.assert_array_equal(sched.num_splits, exp_splits)
    if num_threads == 8:
        assert sched.num_splits.tolist() == [0, 2, 3, 4, 10]  # spec §4.6
    check_dense(case, out, lse)


def test_reuse_gives_identical_results(rng):
    case = gen_dense_case(rng, b=3, s_q=2, h_q=16, h_kv=1, d=576, s_k=150, varlen=True, causal=True)
    sched, _ = flash_mla.get_mla_metadata()
    out1, lse1 = run_dense(case, sched)
    tsm, splits = sched.tile_scheduler_metadata.copy(), sched.num_splits.copy()
    out2, lse2 = run_dense(case, sched)
    np.testing.assert_array_equal(out1.view(np.uint16), out2.view(np.uint16))
    np.testing.assert_array_equal(lse1, lse2)
    np.testing.assert_array_equal(sched.tile_scheduler_metadata, tsm)
    np.testing.assert_array_equal(sched.num_splits, splits)
    # A fresh object gives the same answer too.
    out3, lse3 = run_dense(case)
    np.testing.assert_array_equal(out1.view(np.uint16), out3.view(np.uint16))
    # New q values with the same shapes and lengths may reuse the object.
    case.q = (case.q.astype(np.float32) * 0.5).astype(BF16)
    check_dense(case, *run_dense(case, sched))


MISMATCHES = ["b", "s_q", "h_q", "page_block_size", "h_kv", "causal", "cache_seqlens", "is_fp8_kvcache", "sparse"]


@pytest.mark.parametrize("what", MISMATCHES)
def test_reuse_with_changed_call_raises(rng, what):
    kw = dict(b=2, s_q=2, h_q=16, h_kv=1, d=576, s_k=100, pbs=64, varlen=True, causal=False)
    base = gen_dense_case(rng, **kw)
    sched, _ = flash_mla.get_mla_metadata()
    run_dense(base, sched)
    changed = {"b": dict(b=3), "s_q": dict(s_q=3), "h_q": dict(h_q=32), "page_block_size": dict(pbs=16),
               "h_kv": dict(h_kv=2), "causal": dict(causal=True)}.get(what)
    with pytest.raises(flash_mla.SchedMetaMismatchError) as ei:
        if changed is not None:
            run_dense(gen_dense_case(rng, **{**kw, **changed}), sched)
        elif what == "cache_seqlens":
            lens = base.cache_seqlens.copy()
            lens[0] = max(lens[0] - 1, 0) if lens[0] else 1
            flash_mla.flash_mla_with_kvcache(base.q, base.k_cache, base.block_table, lens, 512, sched)
        elif what == "is_fp8_kvcache":
            flash_mla.flash_mla_with_kvcache(base.q, base.k_cache, base.block_table, base.cache_seqlens, 512, sched,
                                             is_fp8_kvcache=True)
        else:  # a dense object reused for a sparse call (topk differs)
            q = base.q
            packed = oracle.quantize_cache(np.zeros((4, 64, 1, 576), np.float32).astype(BF16))
            idx = np.zeros((2, 2, 64), np.int32)
            flash_mla.flash_mla_with_kvcache(q, packed, None, None, 512, sched, indices=idx, is_fp8_kvcache=True)
    err = ei.value
    assert isinstance(err, ValueError) and isinstance(err, AssertionError)
    assert "sched" in str(err) or "cache_seqlens" in str(err)


@pytest.mark.parametrize("config", [None, "not a config"])
def test_hand_made_initialized_sched_meta_raises(rng, config):
    """A FlashMLASchedMeta built by hand with have_initialized=True and no Config (its fields are public) is
    refused with SchedMetaMismatchError naming sched_meta, not an AttributeError from inside the reuse check."""
    case = gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=100)
    sched = flash_mla.FlashMLASchedMeta(have_initialized=True, config=config)
    with pytest.raises(flash_mla.SchedMetaMismatchError, match=r"^sched_meta: have_initialized is True but config"):
        flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, sched)


def test_is_fp8_kvcache_ignored_by_dense_decoding(rng):
    """As FlashMLA (spec §1.3 step 4: the dense path does not pass the flag on): is_fp8_kvcache=True with a
    BF16 cache and no indices decodes as usual; an FP8 (uint8) cache without indices is refused by k_cache's
    dtype check."""
    case = gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=100)
    ref_out, ref_lse = flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens,
                                                        512, flash_mla.get_mla_metadata()[0])
    out, lse = flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 512,
                                                flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True)
    assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(ref_out).view(np.uint16))
    assert np.array_equal(np.asarray(lse), np.asarray(ref_lse))
    packed = oracle.quantize_cache(np.asarray(case.k_cache).astype(np.float32).astype(BF16))
    with pytest.raises(TypeError, match=r"^k_cache: expected the dtype of q \(bfloat16\), got uint8 \(an FP8 cache is "
                                        r"read by the sparse decode only: pass indices\)"):
        flash_mla.flash_mla_with_kvcache(case.q, packed, case.block_table, case.cache_seqlens, 512,
                                         flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True)


def test_num_splits_must_be_none(rng):
    case = gen_dense_case(rng, b=1, s_q=1, h_q=16, h_kv=1, d=576, s_k=64)
    sched, _ = flash_mla.get_mla_metadata()
    with pytest.raises((ValueError, AssertionError), match="num_splits"):
        flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, sched,
                                         np.zeros(2, np.int32))


@pytest.mark.parametrize("bad", [None, (None, None), "meta"], ids=["None", "tuple", "str"])
def test_sched_must_be_flashmla_sched_meta(rng, bad):
    case = gen_dense_case(rng, b=1, s_q=1, h_q=16, h_kv=1, d=576, s_k=64)
    with pytest.raises((TypeError, AssertionError), match="tile_scheduler_metadata"):
        flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, bad)


def test_failed_first_call_leaves_object_uninitialised(rng):
    case = gen_dense_case(rng, b=2, s_q=1, h_q=16, h_kv=1, d=576, s_k=64)
    sched, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError):
        flash_mla.flash_mla_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens, 256, sched)
    assert not sched.have_initialized and sched.tile_scheduler_metadata is None
    check_dense(case, *run_dense(case, sched))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_decode_long_sequences(rng, causal):
    """FlashMLA's s_k = 4096 varlen shape (spec §5.4), with a zero-length request."""
    case = gen_dense_case(rng, b=3, s_q=2, h_q=128, h_kv=1, d=576, s_k=4096, varlen=True, zero=[False, True, False],
                          causal=causal)
    check_dense(case, *run_dense(case))


def test_inputs_that_are_views_with_an_offset(rng):
    """Every input is a view starting inside a larger buffer (a storage offset)."""
    case = gen_dense_case(rng, b=2, s_q=2, h_q=16, h_kv=2, d=576, s_k=130, varlen=True, causal=True)

    def offset_view(x, pad):
        x = np.asarray(x)
        buf = np.empty((x.shape[0] + pad,) + x.shape[1:], x.dtype)
        buf[:pad] = buf.dtype.type(7) if buf.dtype.kind in "iu" else np.float32(np.nan).astype(buf.dtype)
        buf[pad:] = x
        return buf[pad:]

    view_case = dataclasses.replace(case, q=offset_view(case.q, 1), k_cache=offset_view(case.k_cache, 3),
                                    block_table=offset_view(case.block_table, 2),
                                    cache_seqlens=offset_view(case.cache_seqlens, 1))
    assert view_case.k_cache.ctypes.data != view_case.k_cache.base.ctypes.data
    out, lse = run_dense(view_case)
    check_dense(case, out, lse)
