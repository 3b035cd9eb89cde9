"""An inf or NaN in one element of one query row, on every operator (CPU reference backend; the GPU kernels
against it: tests/gpu/test_nonfinite_q_gpu.py).

The contract: a row whose scores hold +inf or NaN has no defined softmax, so that row -- and only that row --
gets NaN out and NaN lse (and NaN max_logits for sparse prefill). A +inf or -inf element of q gives such a
row as soon as the keys it sees have both signs in that dimension (scores of +inf and -inf; exp(inf - inf) is
NaN) or a 0 there (inf * 0 is NaN), which random keys always do; a NaN element always does. Every other row's
out / lse / max_logits is bit-identical to a run with a finite q. The backward of dense MHA prefill gives the
poisoned row NaN dq and NaN dk / dv for exactly the keys that row sees in its KV head; every other dq, dk, dv
is bit-identical. Rows that see no key keep the empty-row values whatever their query holds.

One corner is not NaN: a row whose every score is -inf (q -inf in a dimension where every key it sees is > 0,
or +inf where every one is < 0) is an empty row for dense / sparse decode and sparse prefill (out 0, lse +inf,
max_logits -inf; their kernels take a row sum of 0 as "no key") but NaN for dense MHA prefill (its kernel
knows whether the row has a key). test_all_scores_minus_inf pins that.
"""

import numpy as np
import pytest

import flash_mla
from mla_test_utils import BF16, FP16, gen_dense_case, gen_prefill_case, gen_sparse_decode_case

VALUES = {"+inf": np.inf, "-inf": -np.inf, "nan": np.nan}


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def _f32(x):
    return np.asarray(x).astype(np.float32)


def _positive(x):
    return (np.abs(_f32(x)) + 0.125).astype(x.dtype)


def _check_rows(name, ans, clean, nan_rows):
    """ans has NaN in every element of the rows nan_rows (bool over ans's leading axes) and nowhere else,
    and the bits of clean elsewhere."""
    a = _f32(ans)
    nan_elems = np.isnan(a).reshape(*nan_rows.shape, -1)
    assert np.array_equal(nan_elems.all(-1), nan_rows), f"{name}: NaN rows {np.argwhere(nan_elems.all(-1))} " \
                                                        f"!= {np.argwhere(nan_rows)}"
    assert not nan_elems[~nan_rows].any(), f"{name}: a NaN outside the poisoned rows"
    np.testing.assert_array_equal(_bits(ans).reshape(*nan_rows.shape, -1)[~nan_rows],
                                  _bits(clean).reshape(*nan_rows.shape, -1)[~nan_rows], err_msg=name)


# ----------------------------------------------------------------------------- dense decode
def _dense(case, q):
    sched, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(q, case.k_cache, case.block_table, case.cache_seqlens, 512, sched,
                                            causal=case.causal)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
def test_dense_decode(rng, value, dtype):
    # Request 1 has length 1 with s_q 2, causal: its token 0 sees no key (an empty row).
    case = gen_dense_case(rng, b=3, s_q=2, h_q=16, h_kv=2, d=576, s_k=200, dtype=dtype, causal=True,
                          lens=[150, 1, 90])
    out0, lse0 = _dense(case, case.q)
    q = np.array(case.q)
    v = VALUES[value]
    q[0, 1, 3, 7] = v  # NoPE dimension
    q[2, 0, 12, 560] = v  # RoPE dimension, KV head 1
    q[1, 0, 5, 100] = v  # the causally empty row: stays empty
    out, lse = _dense(case, q)
    nan_rows = np.zeros((3, 2, 16), bool)  # (b, s_q, h_q)
    nan_rows[0, 1, 3] = nan_rows[2, 0, 12] = True
    _check_rows("out", out, out0, nan_rows)
    _check_rows("lse", np.asarray(lse).transpose(0, 2, 1), np.asarray(lse0).transpose(0, 2, 1), nan_rows)
    assert np.asarray(lse)[1, 5, 0] == np.inf and (_f32(out[1, 0, 5]) == 0).all()


# ----------------------------------------------------------------------------- sparse FP8 decode
def _sparse(case, q):
    sched, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(q, case.main.packed, None, None, 512, sched, **case.kwargs())


@pytest.mark.parametrize("d_qk", [576, 512], ids=["v32", "model1"])
@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
def test_sparse_decode(rng, value, d_qk):
    case = gen_sparse_decode_case(rng, b=3, s_q=2, h_q=16, d_qk=d_qk, s_k=200, topk=64, pbs=64, noncontig=False,
                                  topk_length=np.array([64, 0, 30], np.int32))
    out0, lse0 = _sparse(case, case.q)
    q = np.array(case.q)
    v = VALUES[value]
    q[0, 1, 3, 11] = v  # quantized (NoPE) dimension; the sink then scales a NaN lse
    q[2, 0, 14, d_qk - 1] = v  # RoPE dimension
    q[1, 0, 5, 40] = v  # topk_length 0: no valid slot, stays empty
    out, lse = _sparse(case, q)
    nan_rows = np.zeros((3, 2, 16), bool)
    nan_rows[0, 1, 3] = nan_rows[2, 0, 14] = True
    _check_rows("out", out, out0, nan_rows)
    _check_rows("lse", np.asarray(lse).transpose(0, 2, 1), np.asarray(lse0).transpose(0, 2, 1), nan_rows)
    assert np.asarray(lse)[1, 5, 0] == np.inf and (_f32(out[1, 0, 5]) == 0).all()


# ----------------------------------------------------------------------------- sparse prefill
def _prefill(case, q):
    return flash_mla.flash_mla_sparse_fwd(q, case.kv, case.indices, case.sm_scale, attn_sink=case.attn_sink,
                                          topk_length=case.topk_length)


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
def test_sparse_prefill(rng, value, d_qk):
    case = gen_prefill_case(rng, s_q=4, s_kv=100, topk=64, h_q=16, d_qk=d_qk, sink=True, noncontig=False)
    case.topk_length = np.array([64, 0, 64, 10], np.int32)  # query 1: no valid slot
    out0, ml0, lse0 = _prefill(case, case.q)
    q = np.array(case.q)
    v = VALUES[value]
    q[0, 2, 100] = v
    q[3, 15, d_qk - 1] = v
    q[1, 4, 0] = v  # no valid slot: stays empty
    out, ml, lse = _prefill(case, q)
    nan_rows = np.zeros((4, 16), bool)
    nan_rows[0, 2] = nan_rows[3, 15] = True
    _check_rows("out", out, out0, nan_rows)
    _check_rows("lse", lse, lse0, nan_rows)
    _check_rows("max_logits", ml, ml0, nan_rows)  # NaN, not the +inf row maximum
    assert np.asarray(lse)[1, 4] == np.inf and np.asarray(ml)[1, 4] == -np.inf and (_f32(out[1, 4]) == 0).all()


# ----------------------------------------------------------------------------- dense MHA prefill
def _dense_prefill_data(rng, d, dtype, h_q=8, h_kv=2):
    lens_q, lens_k = [10, 20, 6], [15, 25, 4]  # request 2: s_q > s_k, causal rows 0 and 1 see no key
    cu_q = np.cumsum([0] + lens_q).astype(np.int32)
    cu_k = np.cumsum([0] + lens_k).astype(np.int32)
    q = (rng.standard_normal((cu_q[-1], h_q, d)) * 0.3).astype(np.float32).astype(dtype)
    k = (rng.standard_normal((cu_k[-1], h_kv, d)) * 0.1).astype(np.float32).astype(dtype)
    v = (rng.standard_normal((cu_k[-1], h_kv, 128)) * 0.1).astype(np.float32).astype(dtype)
    dout = (rng.standard_normal((cu_q[-1], h_q, 128)) * 0.1).astype(np.float32).astype(dtype)
    return q, k, v, dout, cu_q, cu_k, max(lens_q), max(lens_k)


def _fwd_bwd(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal):
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    grads = flash_mla.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal)
    return [np.asarray(x) for x in (out, lse, *grads)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 192])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("value", VALUES, ids=list(VALUES))
def test_dense_prefill_forward_and_backward(rng, value, dtype, d, causal):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = _dense_prefill_data(rng, d, dtype)
    clean = _fwd_bwd(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal)
    q = q.copy()
    val = VALUES[value]
    # Request 1 (rows 10..29, keys 15..39), its row 2 (token 12), head 5 (KV head 1): sees keys 15..22 causal
    # (bottom-right: row r sees keys j <= r + s_k - s_q), all 25 otherwise.
    q[12, 5, 9] = val
    q[30, 2, 0] = val  # request 2, row 0: no visible key when causal (out 0, lse -inf, dq 0); else it sees all 4
    out, lse, dq, dk, dv = _fwd_bwd(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal)
    nan_rows = np.zeros(q.shape[:2], bool)
    nan_rows[12, 5] = True
    nan_keys = np.zeros(k.shape[:2], bool)
    nan_keys[15:23 if causal else 40, 1] = True
    if not causal:
        nan_rows[30, 2] = True
        nan_keys[40:44, 0] = True
    _check_rows("out", out, clean[0], nan_rows)
    _check_rows("lse", lse, clean[1], nan_rows)
    _check_rows("dq", dq, clean[2], nan_rows)
    _check_rows("dk", dk, clean[3], nan_keys)
    _check_rows("dv", dv, clean[4], nan_keys)
    if causal:
        assert lse[30, 2] == -np.inf and (_f32(out[30, 2]) == 0).all() and (_f32(dq[30, 2]) == 0).all()


# ----------------------------------------------------------------------------- every score -inf
def test_all_scores_minus_inf(rng):
    """q -inf in a dimension where every key the row sees is > 0: every score is -inf. Dense / sparse decode and
    sparse prefill give the empty row (out 0, lse +inf, max_logits -inf), as their kernels do for a row sum
    of 0; dense MHA prefill gives NaN out and lse (its kernel tells a row with keys from one without). With +inf
    there instead, every score is +inf: NaN on every operator."""
    dim = 3
    # dense decode
    case = gen_dense_case(rng, b=1, s_q=1, h_q=16, h_kv=1, d=576, s_k=100, lens=[100])
    k = np.array(case.k_cache)
    k[..., dim] = _positive(k[..., dim])  # the NaN of unused cache rows stays NaN
    case.k_cache = k
    q = np.array(case.q)
    q[0, 0, 4, dim] = -np.inf
    q[0, 0, 6, dim] = np.inf
    out, lse = _dense(case, q)
    assert np.asarray(lse)[0, 4, 0] == np.inf and (_f32(out[0, 0, 4]) == 0).all()
    assert np.isnan(np.asarray(lse)[0, 6, 0]) and np.isnan(_f32(out[0, 0, 6])).all()
    # sparse prefill (attend_rows, as sparse decode)
    pc = gen_prefill_case(rng, s_q=2, s_kv=50, topk=16, h_q=16, d_qk=512, noncontig=False)
    kv = np.array(pc.kv)
    kv[..., dim] = _positive(kv[..., dim])
    pc.kv = kv
    q = np.array(pc.q)
    q[1, 2, dim] = -np.inf
    q[1, 3, dim] = np.inf
    out, ml, lse = _prefill(pc, q)
    assert lse[1, 2] == np.inf and ml[1, 2] == -np.inf and (_f32(out[1, 2]) == 0).all()
    assert np.isnan(lse[1, 3]) and np.isnan(ml[1, 3]) and np.isnan(_f32(out[1, 3])).all()
    # dense MHA prefill
    q, k, v, dout, cu_q, cu_k, max_q, max_k = _dense_prefill_data(rng, 128, BF16)
    k = k.copy()
    k[..., dim] = _positive(k[..., dim])
    q = q.copy()
    q[12, 5, dim] = -np.inf
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert np.isnan(np.asarray(lse)[12, 5]) and np.isnan(_f32(out[12, 5])).all()
