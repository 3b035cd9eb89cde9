"""NaN in, NaN out (issue 28, item 2), on every operator (CPU reference backend; the GPU kernels:
tests/gpu/test_nan_propagation_gpu.py).

A NaN in a query row, or in a key that a row uses, makes that row's out and lse (and max_logits)
NaN, as the formula gives -- not the empty-row values (out 0, lse +inf, max_logits -inf), which
would hide the bug of the layer that produced the NaN. Rows that have no valid key keep the empty
convention whatever their query holds, and every other row is bit-identical to a run without NaN.
"""

import numpy as np
import pytest

import flash_mla
from mla_test_utils import BF16, FP16, gen_dense_case, gen_prefill_case, gen_sparse_decode_case

NAN = np.float32(np.nan)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def _f32(x):
    return np.asarray(x).astype(np.float32)


def _row_is_nan(out_row, lse_val):
    return bool(np.isnan(_f32(out_row)).all()) and bool(np.isnan(lse_val))


def _row_is_empty(out_row, lse_val):
    return bool((_f32(out_row) == 0).all()) and lse_val == np.inf


# ----------------------------------------------------------------------------- dense decode
def _dense(case, q=None, k=None):
    sched, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(q if q is not None else case.q, k if k is not None else case.k_cache,
                                            case.block_table, case.cache_seqlens, 512, sched, causal=case.causal)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("nan_at", ["one_dim", "rope_dim", "whole_row"])
def test_dense_decode_nan_q_row(rng, dtype, nan_at):
    # Request 1 has length 1 with s_q 2, causal: its token 0 sees no key (an empty row).
    case = gen_dense_case(rng, b=3, s_q=2, h_q=16, h_kv=2, d=576, s_k=200, dtype=dtype, causal=True,
                          lens=[150, 1, 0])
    out0, lse0 = _dense(case)
    q = np.array(case.q)
    cols = {"one_dim": [7], "rope_dim": [540], "whole_row": slice(None)}[nan_at]
    q[0, 1, 3, cols] = NAN  # a row with keys
    q[1, 0, 5, cols] = NAN  # the causally empty row
    q[2, 1, 9, cols] = NAN  # a zero-length request
    out, lse = _dense(case, q=q)
    assert _row_is_nan(out[0, 1, 3], lse[0, 3, 1])
    assert _row_is_empty(out[1, 0, 5], lse[1, 5, 0]) and _row_is_empty(out[2, 1, 9], lse[2, 9, 1])
    keep = np.ones(np.shape(lse), bool)
    keep[0, 3, 1] = False
    np.testing.assert_array_equal(_bits(lse)[keep], _bits(lse0)[keep])
    keep_out = np.ones(np.shape(out)[:3], bool)
    keep_out[0, 1, 3] = False
    np.testing.assert_array_equal(_bits(out)[keep_out], _bits(out0)[keep_out])
    assert not np.isnan(_f32(out0)).any() and not np.isnan(lse0).any()


def test_dense_decode_nan_in_used_key(rng):
    case = gen_dense_case(rng, b=2, s_q=2, h_q=8, h_kv=2, d=576, s_k=100, causal=True, lens=[90, 90])
    out0, lse0 = _dense(case)
    k = np.array(case.k_cache)
    pbs = k.shape[1]
    t = 89  # the last key of request 0: seen by its token 1 only (causal), in KV head 1 only
    k[case.block_table[0, t // pbs], t % pbs, 1, 300] = NAN
    out, lse = _dense(case, k=k)
    nan_rows = np.zeros((2, 8, 2), bool)  # (b, h_q, s_q), heads 4..7 read KV head 1
    nan_rows[0, 4:, 1] = True
    assert np.array_equal(np.isnan(lse), nan_rows)
    assert np.array_equal(np.isnan(_f32(out)).all(-1), nan_rows.transpose(0, 2, 1))
    np.testing.assert_array_equal(_bits(lse)[~nan_rows], _bits(lse0)[~nan_rows])


# ----------------------------------------------------------------------------- sparse FP8 decode
def _sparse(case, q=None, packed=None):
    sched, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(q if q is not None else case.q,
                                            packed if packed is not None else case.main.packed, None, None, 512,
                                            sched, **case.kwargs())


@pytest.mark.parametrize("d_qk", [576, 512], ids=["v32", "model1"])
def test_sparse_decode_nan_q_row(rng, d_qk):
    case = gen_sparse_decode_case(rng, b=3, s_q=2, h_q=16, d_qk=d_qk, s_k=200, topk=64, pbs=64, noncontig=False,
                                  topk_length=np.array([64, 0, 30], np.int32))
    out0, lse0 = _sparse(case)
    q = np.array(case.q)
    q[0, 1, 3, 11] = NAN  # a row with valid slots (and a sink: out *= sink factor of a NaN lse)
    q[1, 0, 5, :] = NAN  # topk_length 0: no valid slot
    out, lse = _sparse(case, q=q)
    assert _row_is_nan(out[0, 1, 3], lse[0, 3, 1])
    assert _row_is_empty(out[1, 0, 5], lse[1, 5, 0])
    keep = np.ones(np.shape(lse), bool)
    keep[0, 3, 1] = False
    np.testing.assert_array_equal(_bits(lse)[keep], _bits(lse0)[keep])
    assert np.isnan(_f32(out)).all(-1).sum() == 1


def test_sparse_decode_nan_in_used_key(rng):
    case = gen_sparse_decode_case(rng, b=2, s_q=1, h_q=16, d_qk=576, s_k=150, topk=32, pbs=64, noncontig=False,
                                  sink=False)
    out0, lse0 = _sparse(case)
    idx = np.asarray(case.main.indices)
    token = int(idx[0, 0][idx[0, 0] >= 0][0])  # a token request 0 uses
    packed = case.main.packed  # this test's own data: poisoned in place (keeps the padded block stride)
    pbs = packed.shape[1]
    packed[token // pbs, token % pbs, 0, 5] = 0x7F  # e4m3fn NaN in dim 5 of that token
    used_by_1 = token in set(idx[1, 0].tolist())
    out, lse = _sparse(case, packed=packed)
    assert np.isnan(lse[0]).all() and np.isnan(_f32(out[0])).all()
    assert np.isnan(lse[1]).all() == used_by_1
    if not used_by_1:
        np.testing.assert_array_equal(_bits(lse[1]), _bits(lse0[1]))


# ----------------------------------------------------------------------------- sparse prefill
def _prefill(case, q=None, kv=None):
    return flash_mla.flash_mla_sparse_fwd(q if q is not None else case.q, kv if kv is not None else case.kv,
                                          case.indices, case.sm_scale, attn_sink=case.attn_sink,
                                          topk_length=case.topk_length)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_sparse_prefill_nan_q_row(rng, d_qk):
    case = gen_prefill_case(rng, s_q=4, s_kv=100, topk=64, h_q=16, d_qk=d_qk, sink=True, noncontig=False)
    case.topk_length = np.array([64, 0, 64, 10], np.int32)  # query 1: no valid slot
    out0, ml0, lse0 = _prefill(case)
    q = np.array(case.q)
    q[0, 2, 100] = NAN
    q[1, 4, :] = NAN
    q[3, 15, 520 if d_qk == 576 else 0] = NAN
    out, ml, lse = _prefill(case, q=q)
    for s, h in ((0, 2), (3, 15)):
        assert _row_is_nan(out[s, h], lse[s, h]) and np.isnan(ml[s, h])
    assert _row_is_empty(out[1, 4], lse[1, 4]) and ml[1, 4] == -np.inf
    keep = np.ones(np.shape(lse), bool)
    keep[0, 2] = keep[3, 15] = False
    for a, b in ((lse, lse0), (ml, ml0)):
        np.testing.assert_array_equal(_bits(a)[keep], _bits(b)[keep])
    np.testing.assert_array_equal(_bits(out)[keep], _bits(out0)[keep])


def test_sparse_prefill_nan_in_used_key(rng):
    case = gen_prefill_case(rng, s_q=3, s_kv=100, topk=16, h_q=8, d_qk=512, noncontig=False)
    idx = np.asarray(case.indices)
    row = int(idx[0, 0][(idx[0, 0] >= 0) & (idx[0, 0] < 100)][0])
    kv = np.array(case.kv)
    kv[row, 0, 77] = NAN
    out, ml, lse = _prefill(case, kv=kv)
    for s in range(3):
        uses = row in set(idx[s, 0].tolist())
        assert np.isnan(lse[s]).all() == uses and np.isnan(ml[s]).all() == uses
        assert np.isnan(_f32(out[s])).all() == uses
    assert np.isnan(lse[0]).all()
