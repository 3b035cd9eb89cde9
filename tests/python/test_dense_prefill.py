"""Dense MHA prefill (``flash_attn_varlen_func`` and its packed variants; spec §1.5, §2.5) on the CPU
reference backend: forward and backward against a float64 NumPy oracle on fresh random inputs, through
NumPy (plain forward + ``flash_attn_varlen_backward``), torch (autograd.Function, torch.ops with
register_autograd, fake kernels, torch.compile) and JAX (custom_vjp, jax.jit); the packed variants,
GQA, empty requests, lengths 1 / 7 / 63 / 129, s_q != s_k, causal (bottom-right), is_varlen=False,
NaN propagation, NaN / inf in the keys a causal row does not see, and the errors (each naming the argument)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import flash_mla
from mla_test_utils import BF16, check_allclose, to_jax_cpu
from oracle import FP16

DTYPES = {"bf16": BF16, "fp16": FP16}


# ----------------------------------------------------------------------------- oracle (float64)
def row_segments(k, v, s_q, s_k, causal):
    """[(r0, r1, keys)]: the request's query rows cut where a key holding a NaN or inf (in k or v, any head)
    becomes visible (bottom-right causal), with the indices of the keys rows r0..r1 read: every finite key and
    the non-finite keys visible to all of these rows. A non-finite key a row does not see thus never enters
    the oracle's arithmetic (its P is 0, and 0 * NaN would be NaN), as the operator never reads it (spec §2.5).
    One segment of all keys when every key is finite."""
    bad = ~(np.isfinite(k.reshape(s_k, -1)).all(1) & np.isfinite(v.reshape(s_k, -1)).all(1))
    keys = np.arange(s_k)
    if not causal or not bad.any():
        return [(0, s_q, keys)]
    first_row = keys + (s_q - s_k)  # first query row that sees each key
    cuts = sorted({0, s_q} | {int(r) for r in first_row[bad] if 0 < r < s_q})
    return [(r0, r1, keys[~bad | (first_row <= r0)]) for r0, r1 in zip(cuts, cuts[1:])]


def _segments(q, k, v, cu_q, cu_k, causal):
    """Per request and row segment (row_segments): (q0 + r0, q0 + r1, k0 + keys, mask (n_q, n_keys) of the keys
    each row sees)."""
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        s_q, s_k = q1 - q0, k1 - k0
        if s_q == 0 or s_k == 0:
            continue
        for r0, r1, keys in row_segments(k[k0:k1], v[k0:k1], s_q, s_k, causal):
            if keys.size == 0:
                continue
            mask = np.ones((r1 - r0, keys.size), bool)
            if causal:
                mask = keys[None, :] <= np.arange(r0, r1)[:, None] + s_k - s_q
            yield q0 + r0, q0 + r1, k0 + keys, mask


def _probabilities(x, mask):
    """Softmax over the keys each row sees (mask); 0 elsewhere and on rows that see none. Selected, never
    multiplied, so a row's NaN / inf stays in that row's visible entries."""
    x = np.where(mask[None], x, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)  # rows without keys; a +inf or NaN max makes the row NaN
        p = np.where(mask[None], np.exp(x - m), 0.0)
        s = p.sum(-1, keepdims=True)
        lse = (np.log(s) + m)[..., 0]  # (h, n_q); -inf for rows without keys
        p = np.where(mask[None] & (s != 0), p / np.where(s == 0, 1, s), 0.0)
    return p, lse


def ref_forward(q, k, v, cu_q, cu_k, scale, causal):
    """out (total_q, h_q, d_v), lse (total_q, h_q) in float64; empty rows: out 0, lse -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    total_q, h_q, _ = q.shape
    h_kv, d_v = k.shape[1], v.shape[2]
    g = h_q // h_kv
    out = np.zeros((total_q, h_q, d_v))
    lse = np.full((total_q, h_q), -np.inf)
    for r0, r1, keys, mask in _segments(q, k, v, cu_q, cu_k, causal):
        kk = np.repeat(k[keys], g, axis=1)  # (n_keys, h_q, d)
        vv = np.repeat(v[keys], g, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            p, l = _probabilities(np.einsum("qhd,khd->hqk", q[r0:r1], kk) * scale, mask)
            out[r0:r1] = np.einsum("hqk,khd->qhd", p, vv)
        lse[r0:r1] = l.T
    return out, lse


def ref_backward(q, k, v, cu_q, cu_k, scale, causal, dout, out=None):
    """Exact float64 gradients (dq, dk, dv) of sum(out * dout). With `out` (the operator's own output, in q's
    dtype): D = dout . out from it, as the backward's input, instead of the exact output; this removes the
    rounding of out from the comparison (up to ~1e-2 relative on dk of a causal request's first keys)."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    given = None if out is None else np.asarray(out).astype(np.float64)
    h_q, h_kv = q.shape[1], k.shape[1]
    g = h_q // h_kv
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r0, r1, keys, mask in _segments(q, k, v, cu_q, cu_k, causal):
        kk = np.repeat(k[keys], g, axis=1)
        vv = np.repeat(v[keys], g, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            p, _ = _probabilities(np.einsum("qhd,khd->hqk", q[r0:r1], kk) * scale, mask)  # (h, q, k)
            do = dout[r0:r1]
            o = np.einsum("hqk,khd->qhd", p, vv)
            dvv = np.einsum("hqk,qhd->khd", p, do)
            dp = np.einsum("qhd,khd->hqk", do, vv)
            delta = np.einsum("qhd,qhd->hq", do, o if given is None else given[r0:r1])[..., None]
            ds = np.where(mask[None], p * (dp - delta) * scale, 0.0)
            dq[r0:r1] = np.einsum("hqk,khd->qhd", ds, kk)
            dkk = np.einsum("hqk,qhd->khd", ds, q[r0:r1])
            dk[keys] += dkk.reshape(keys.size, h_kv, g, -1).sum(2)
            dv[keys] += dvv.reshape(keys.size, h_kv, g, -1).sum(2)
    return dq, dk, dv


# ----------------------------------------------------------------------------- data
class Case:
    def __init__(self, rng, seqlens_q, seqlens_k, h_q, h_kv, d_qk, d_v, dtype, causal, scale=None):
        self.cu_q = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
        self.cu_k = np.concatenate([[0], np.cumsum(seqlens_k)]).astype(np.int32)
        self.max_q, self.max_k = int(max(seqlens_q)), int(max(seqlens_k))
        tq, tk = int(self.cu_q[-1]), int(self.cu_k[-1])

        def rnd(*shape):
            return (rng.standard_normal(shape)).astype(np.float32).astype(dtype)

        self.q, self.k, self.v = rnd(tq, h_q, d_qk), rnd(tk, h_kv, d_qk), rnd(tk, h_kv, d_v)
        self.dout = rnd(tq, h_q, d_v)
        self.dtype, self.causal = dtype, causal
        self.scale = d_qk ** -0.5 if scale is None else scale

    def args(self, conv=lambda x: x):
        return (conv(self.q), conv(self.k), conv(self.v), conv(self.cu_q), conv(self.cu_k), self.max_q, self.max_k)

    def ref(self):
        return ref_forward(self.q, self.k, self.v, self.cu_q, self.cu_k, self.scale, self.causal)

    def ref_grads(self, out=None):
        return ref_backward(self.q, self.k, self.v, self.cu_q, self.cu_k, self.scale, self.causal, self.dout, out)


# Tolerances against float64. out / lse as the other operators' reference tests; gradients also
# carry the rounding of out to the input dtype (the backward reads out through D = dout . out), so
# they get a relative bound of a few output ulps plus an absolute one relative to the largest entry.
OUT_TOL = {BF16: dict(abs_tol=2e-5, rel_tol=5e-3, cos_diff_tol=1e-5),
           FP16: dict(abs_tol=5e-6, rel_tol=2e-3, cos_diff_tol=1e-6)}
LSE_TOL = dict(abs_tol=1e-5, rel_tol=1e-5, cos_diff_tol=1e-10)


def check_grad(name, ans, ref, dtype):
    a = np.asarray(ans)
    assert a.dtype == np.dtype(dtype), f"{name}: dtype {a.dtype}"
    scale = float(np.max(np.abs(ref))) if ref.size else 1.0
    rel = 2e-2 if dtype == BF16 else 4e-3
    check_allclose(name, a, ref, abs_tol=rel * 0.25 * scale + 1e-6, rel_tol=rel, cos_diff_tol=1e-4)


def check_fwd(out, lse, case):
    ref_out, ref_lse = case.ref()
    check_allclose("out", np.asarray(out), ref_out, dtype=case.dtype, **OUT_TOL[case.dtype])
    check_allclose("lse", np.asarray(lse), ref_lse, dtype=np.float32, **LSE_TOL)


SEQLENS = {  # (seqlens_q, seqlens_k): empty requests, 1, 7, 63, 129, s_q != s_k both ways
    "ragged": ([1, 7, 0, 63, 5], [7, 7, 4, 40, 0]),
    "long": ([129, 3], [129, 70]),
}


# ----------------------------------------------------------------------------- NumPy
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
@pytest.mark.parametrize("lens", ["ragged", "long"])
def test_numpy_forward_and_backward(rng, dtype, dims, causal, heads, lens):
    dt = DTYPES[dtype]
    case = Case(rng, *SEQLENS[lens], *heads, *dims, dt, causal)
    out, lse = flash_mla.flash_attn_varlen_func(*case.args(), softmax_scale=case.scale, causal=causal)
    assert isinstance(out, np.ndarray) and out.shape == (case.q.shape[0], heads[0], dims[1])
    assert lse.shape == (case.q.shape[0], heads[0]) and lse.strides == (4, 4 * case.q.shape[0])
    check_fwd(out, lse, case)
    dq, dk, dv = flash_mla.flash_attn_varlen_backward(case.dout, case.q, case.k, case.v, out, lse, case.cu_q,
                                                      case.cu_k, case.max_q, case.max_k,
                                                      softmax_scale=case.scale, causal=causal)
    for name, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), case.ref_grads()):
        check_grad(name, a, r, dt)


def test_default_scale_and_empty_rows(rng):
    # Request 1 is causal with s_q > s_k: its first rows see no key (out 0, lse -inf, dq 0).
    case = Case(rng, [3, 6], [3, 2], 2, 2, 128, 128, BF16, True)
    out, lse = flash_mla.flash_attn_varlen_func(*case.args(), causal=True)  # softmax_scale None -> 128 ** -0.5
    check_fwd(out, lse, case)
    empty = np.isneginf(np.asarray(lse))
    assert empty.sum() == 4 * 2  # rows 0..3 of request 1, both heads
    assert np.all(np.asarray(out, np.float32)[empty] == 0)
    dq, _, _ = flash_mla.flash_attn_varlen_backward(case.dout, case.q, case.k, case.v, out, lse, case.cu_q,
                                                    case.cu_k, case.max_q, case.max_k, causal=True)
    assert np.all(np.asarray(dq, np.float32)[empty] == 0)


def test_nan_reaches_only_the_rows_that_see_it(rng):
    case = Case(rng, [6], [6], 2, 1, 128, 128, BF16, True)
    case.k[4, 0, 5] = np.nan  # key 4: rows 4, 5 of both heads
    case.q[1, 1, 0] = np.nan  # row 1 head 1
    out, lse = flash_mla.flash_attn_varlen_func(*case.args(), softmax_scale=case.scale, causal=True)
    expect = np.zeros((6, 2), bool)
    expect[4:] = True
    expect[1, 1] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), expect)
    np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)).any(-1), expect)
    check_fwd(out, lse, case)  # the oracle has the same NaN positions


def _diagonal_keys(s_q, s_k):
    """Keys of a causal request (bottom-right) in its diagonal block that the first rows do not see: the key
    first seen by row ceil(2 s_q / 3) and the last key (seen by the last row only)."""
    off = s_k - s_q
    return sorted({off + max(1, -(-2 * s_q // 3)), s_k - 1} & set(range(max(off + 1, 0), s_k)))


def _nonfinite_checked(name, ans, ref, nan_only):
    """(ans, ref) with their non-finite positions zeroed, once those are checked to agree: NaN for NaN and
    +-inf for +-inf exactly (nan_only: a NaN in the inputs gives NaN); with an inf in the inputs only
    finite / non-finite (inf - inf in a softmax gives NaN or inf depending on the order of the operations)."""
    a, r = np.asarray(ans).copy(), np.asarray(ref, np.float64).copy()
    a64 = a.astype(np.float64)
    if nan_only:
        for label, fa, fr in (("NaN", np.isnan(a64), np.isnan(r)), ("inf", np.isinf(a64), np.isinf(r))):
            np.testing.assert_array_equal(fa, fr, err_msg=f"{name}: {label} positions differ")
    bad = ~np.isfinite(r)
    np.testing.assert_array_equal(~np.isfinite(a64), bad, err_msg=f"{name}: non-finite positions differ")
    a[bad] = 0
    r[bad] = 0
    return a, r


@pytest.mark.parametrize("offset", [0, 1, 70])
@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("where", ["k", "v", "kv"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_masked_keys_holding_nan_or_inf(rng, offset, poison, where, heads):
    """Causal (bottom-right), s_k = s_q + offset for s_q 7 / 63 / 129 / 200: keys of the diagonal block that
    the first rows do not see hold NaN or inf in k and / or v (one request has it in the key right of the
    first row's last, one has s_q > s_k, one is clean). out, lse, dq, dk, dv equal the float64 oracle (which
    reads no key a row does not see: row_segments), non-finite where it is; the rows that see no poisoned key
    get the same bits as with finite values in those keys (and dv and lse everywhere when only v is
    poisoned: neither reads v). As tests/gpu/test_dense_prefill_gpu.py on the Hopper kernels."""
    reqs = [(s_q, s_q + offset, _diagonal_keys(s_q, s_q + offset)) for s_q in (7, 63, 129, 200)]
    reqs += [(129, 129 + offset, [offset + 1]), (40, 25, _diagonal_keys(40, 25)), (63, 63 + offset, [])]
    case = Case(rng, [r[0] for r in reqs], [r[1] for r in reqs], *heads, 192, 128, BF16, True)
    case_finite = copy.copy(case)
    case.k, case.v = case.k.copy(), case.v.copy()  # poisoned below; case_finite keeps the finite values
    clean = np.ones(case.q.shape[0], bool)  # rows that see no poisoned key
    val = float(poison)
    for (s_q, s_k, keys), q0, k0 in zip(reqs, case.cu_q, case.cu_k):
        for j in keys:
            if "k" in where:
                case.k[k0 + j, :, 3] = val
            if "v" in where:
                case.v[k0 + j, :, 5] = -val
        if keys:
            clean[q0 + max(min(keys) - (s_k - s_q), 0):q0 + s_q] = False
    assert 0 < clean.sum() < clean.size

    def run(c):
        out, lse = flash_mla.flash_attn_varlen_func(*c.args(), softmax_scale=c.scale, causal=True)
        grads = flash_mla.flash_attn_varlen_backward(c.dout, c.q, c.k, c.v, out, lse, c.cu_q, c.cu_k, c.max_q,
                                                     c.max_k, softmax_scale=c.scale, causal=True)
        return [np.asarray(x) for x in (out, lse, *grads)]

    got = run(case)
    nan_only = poison == "nan"
    ref_out, ref_lse = case.ref()
    check_allclose("out", *_nonfinite_checked("out", got[0], ref_out, nan_only), dtype=BF16, **OUT_TOL[BF16])
    check_allclose("lse", *_nonfinite_checked("lse", got[1], ref_lse, nan_only), dtype=np.float32, **LSE_TOL)
    for name, a, r in zip(("dq", "dk", "dv"), got[2:], case.ref_grads(out=got[0])):
        check_grad(name, *_nonfinite_checked(name, a, r, nan_only), BF16)

    bits = lambda x: x.view(np.uint16 if x.dtype == BF16 else np.uint32)  # noqa: E731
    fin = run(case_finite)
    for name, a, b in zip(("out", "lse", "dq"), got, fin):
        a64 = a[clean].astype(np.float64)
        finite = np.isfinite(a64) | ((a64 == -np.inf) if name == "lse" else False)  # lse -inf: a row without keys
        assert np.all(finite), f"{name}: a row that sees no poisoned key is not finite"
        np.testing.assert_array_equal(bits(a[clean]), bits(b[clean]),
                                      err_msg=f"{name}: a row that sees no poisoned key depends on one")
    if where == "v":
        np.testing.assert_array_equal(bits(got[1]), bits(fin[1]), err_msg="lse reads v")
        np.testing.assert_array_equal(bits(got[4]), bits(fin[4]), err_msg="dv reads v")
        assert np.all(np.isfinite(got[4].astype(np.float32)))


def test_is_varlen_false(rng):
    case = Case(rng, [5, 5, 5], [9, 9, 9], 4, 2, 192, 128, BF16, True)
    ref = flash_mla.flash_attn_varlen_func(*case.args(), causal=True)
    # cu_seqlens values are not used (only b = len - 1), as in FlashMLA's SM100 kernels.
    garbage = np.array([0, 1, 2, 3], np.int32)
    res = flash_mla.flash_attn_varlen_func(case.q, case.k, case.v, garbage, garbage, 1, 1, causal=True,
                                           is_varlen=False)
    for a, b in zip(res, ref):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16 if a.dtype == BF16 else np.uint32),
                                      np.asarray(b).view(np.uint16 if b.dtype == BF16 else np.uint32))
    with pytest.raises(ValueError, match=r"is_varlen=False: .* multiples of b = 2"):
        flash_mla.flash_attn_varlen_func(case.q, case.k, case.v, garbage[:3], garbage[:3], 1, 1, is_varlen=False)


def test_packed_variants_match(rng):
    case = Case(rng, [7, 1], [7, 1], 2, 2, 192, 128, BF16, False)
    ref_out, ref_lse = flash_mla.flash_attn_varlen_func(*case.args())
    qkv = np.concatenate([case.q, case.k, case.v], -1)
    out, lse = flash_mla.flash_attn_varlen_qkvpacked_func(qkv, case.cu_q, case.max_q, 192)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(ref_out).view(np.uint16))
    np.testing.assert_array_equal(lse, ref_lse)
    case2 = Case(rng, [4, 0, 9], [12, 3, 2], 4, 2, 128, 128, FP16, True)
    kv = np.concatenate([case2.k, case2.v], -1)
    out, lse = flash_mla.flash_attn_varlen_kvpacked_func(case2.q, kv, case2.cu_q, case2.cu_k, case2.max_q,
                                                         case2.max_k, 128, causal=True, softmax_scale=case2.scale)
    check_fwd(out, lse, case2)


@pytest.mark.parametrize("head_dim_qk", [-128, -1, 0, 256, 300])
def test_kvpacked_head_dim_qk_that_does_not_split_kv_is_rejected(rng, head_dim_qk):
    # kv (total_k, h_kv, 256): k and v need 0 < head_dim_qk < 256. A negative one must not count from the end
    # (-128 would split kv as 128 does and run), nor may one at or past the width leave v empty.
    case = Case(rng, [3, 2], [4, 2], 2, 2, 128, 128, BF16, False)
    kv = np.concatenate([case.k, case.v], -1)
    with pytest.raises(ValueError, match=rf"^head_dim_qk: expected 0 < head_dim_qk < kv.shape\[2\] = 256, "
                                         rf"got {head_dim_qk}$"):
        flash_mla.flash_attn_varlen_kvpacked_func(case.q, kv, case.cu_q, case.cu_k, case.max_q, case.max_k,
                                                  head_dim_qk)


@pytest.mark.parametrize("head_dim_qk", [-128, -1, 0, 192, 500])
def test_qkvpacked_head_dim_qk_that_does_not_split_qkv_is_rejected(rng, head_dim_qk):
    case = Case(rng, [3, 2], [3, 2], 2, 2, 128, 128, BF16, False)
    qkv = np.concatenate([case.q, case.k, case.v], -1)  # (total, h, 384): 0 < 2 * head_dim_qk < 384
    with pytest.raises(ValueError, match=rf"^head_dim_qk: expected 0 < 2 \* head_dim_qk < qkv.shape\[2\] = 384, "
                                         rf"got {head_dim_qk}$"):
        flash_mla.flash_attn_varlen_qkvpacked_func(qkv, case.cu_q, case.max_q, head_dim_qk)


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_argument(rng):
    case = Case(rng, [3, 2], [4, 2], 4, 2, 128, 128, BF16, False)
    f = flash_mla.flash_attn_varlen_func
    q, k, v, cu_q, cu_k, mq, mk = case.args()
    with pytest.raises(AssertionError, match="dropout_p"):
        f(q, k, v, cu_q, cu_k, mq, mk, dropout_p=0.1)
    # (the message's reason: every gradient is deterministic here, dq included, as the README says)
    with pytest.raises(AssertionError, match=r"^deterministic: .*dq, dk and dv are bitwise reproducible"):
        f(q, k, v, cu_q, cu_k, mq, mk, deterministic=True)
    with pytest.raises(TypeError, match=r"^k: expected the dtype of q"):
        f(q, k.astype(FP16), v, cu_q, cu_k, mq, mk)
    with pytest.raises(TypeError, match=r"^q: expected dtype bfloat16 or float16, got float32"):
        f(q.astype(np.float32), k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"no kernel for d_qk=128 d_v=64"):
        f(q, k, v[..., :64], cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"no kernel for d_qk=64 d_v=128"):
        f(q[..., :64], k[..., :64], v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"h_q % h_kv != 0"):
        f(q[:, :3], k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^q: expected a 3-D tensor"):
        f(q[0], k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv\[b\] = 6 must equal total_k = k.shape\[0\] = 7"):
        f(q, np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]]), cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^cu_seqlens_qo: request 0 has 3 tokens, more than max_seqlen_qo = 2"):
        f(q, k, v, cu_q, cu_k, 2, mk)
    with pytest.raises(TypeError, match=r"^cu_seqlens_qo: expected dtype int32, got int64"):
        f(q, k, v, cu_q.astype(np.int64), cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^q: the last dimension must be contiguous"):
        f(np.repeat(q, 2, -1)[..., ::2], k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(TypeError, match=r"^v: expected a tensor, got NoneType"):
        f(q, k, None, cu_q, cu_k, mq, mk)
    with pytest.raises(TypeError, match=r"^max_seqlen_qo: expected an int"):
        f(q, k, v, cu_q, cu_k, 3.5, mk)
    with pytest.raises(TypeError, match=r"^max_seqlen_kv: expected an int, got bool True"):
        f(q, k, v, cu_q, cu_k, mq, True)
    with pytest.raises(TypeError, match=r"^head_dim_qk: expected an int"):
        flash_mla.flash_attn_varlen_qkvpacked_func(np.concatenate([q, q, q], -1), cu_q, mq, "128")
    out, lse = f(q, k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(5, 4, 128\)"):
        flash_mla.flash_attn_varlen_backward(case.dout[:, :2], q, k, v, out, lse, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^lse: expected shape \(5, 4\)"):
        flash_mla.flash_attn_varlen_backward(case.dout, q, k, v, out, lse[:, :2], cu_q, cu_k, mq, mk)
    with pytest.raises(TypeError, match=r"^lse: "):
        flash_mla.flash_attn_varlen_backward(case.dout, q, k, v, out, lse.astype(np.float64), cu_q, cu_k, mq, mk)


def test_errors_name_the_packed_sequence_arguments_as_the_function_called_names_them(rng):
    """The core's checks of cu_seqlens / max_seqlen name the arguments of the function the caller called:
    cu_seqlens_qo / cu_seqlens_kv / max_seqlen_qo / max_seqlen_kv (flash_attn_varlen_func, _kvpacked_func,
    _backward), one cu_seqlens / max_seqlen (flash_attn_varlen_qkvpacked_func); never cu_seqlens_q / cu_seqlens_k /
    max_seqlen_q / max_seqlen_k."""
    case = Case(rng, [3, 2], [4, 2], 4, 2, 128, 128, BF16, False)
    q, k, v, cu_q, cu_k, mq, mk = case.args()
    f = flash_mla.flash_attn_varlen_func
    kv = np.concatenate([k, v], -1)
    for call in (lambda cu_q, cu_k, mq, mk: f(q, k, v, cu_q, cu_k, mq, mk),
                 lambda cu_q, cu_k, mq, mk: flash_mla.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, 128)):
        with pytest.raises(ValueError, match=r"^cu_seqlens_qo: request 0 has 3 tokens, more than max_seqlen_qo = 2$"):
            call(cu_q, cu_k, 2, mk)
        with pytest.raises(ValueError, match=r"^cu_seqlens_kv: request 0 has 4 tokens, more than max_seqlen_kv = 3$"):
            call(cu_q, cu_k, mq, 3)
        with pytest.raises(ValueError, match=r"^cu_seqlens_kv: cumulative lengths must not decrease, got "
                                             r"cu_seqlens_kv\[0\] = 0 > cu_seqlens_kv\[1\] = -1$"):
            call(cu_q, np.array([0, -1, 6], np.int32), mq, mk)
        with pytest.raises(ValueError, match=r"^cu_seqlens_kv: expected shape \(3,\) like cu_seqlens_qo "
                                             r"\(b \+ 1 = 3\), got \(2,\)$"):
            call(cu_q, np.array([0, 6], np.int32), mq, 6)
        with pytest.raises(TypeError, match=r"^cu_seqlens_kv: expected dtype int32, got int64"):
            call(cu_q, cu_k.astype(np.int64), mq, mk)
    out, lse = f(q, k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^cu_seqlens_qo: request 0 has 3 tokens, more than max_seqlen_qo = 2$"):
        flash_mla.flash_attn_varlen_backward(case.dout, q, k, v, out, lse, cu_q, cu_k, 2, mk)
    qkv = np.concatenate([q, q, q], -1)  # (d_qk 128, d_v 128; keys = queries: one cu_seqlens)
    packed = flash_mla.flash_attn_varlen_qkvpacked_func
    with pytest.raises(ValueError, match=r"^cu_seqlens: request 0 has 3 tokens, more than max_seqlen = 2$"):
        packed(qkv, cu_q, 2, 128)
    with pytest.raises(ValueError, match=r"^cu_seqlens\[0\] = 1: cumulative lengths must start at 0$"):
        packed(qkv, np.array([1, 3, 5], np.int32), mq, 128)
    with pytest.raises(TypeError, match=r"^max_seqlen: expected an int"):
        packed(qkv, cu_q, 3.5, 128)


@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_packed_variants_errors_name_the_packed_tensor(rng, fw):
    """flash_attn_varlen_qkvpacked_func renamed cu_seqlens / max_seqlen in its errors but still said
    "total_q = q.shape[0]", "q: expected dtype ..." for the q it had sliced from the caller's qkv; the kv-packed
    one "k.shape[0]" for its kv. The packed variants name the tensor the caller passed now; flash_attn_varlen_func's
    messages stay as they were."""
    case = Case(rng, [3, 2], [4, 2], 4, 2, 128, 128, BF16, False)
    q, k, v, cu_q, cu_k, mq, mk = case.args()
    conv = (lambda x: x) if fw == "numpy" else _t
    if fw == "torch":
        _torch()
    qkv, kv = conv(np.concatenate([q, q, q], -1)), conv(np.concatenate([k, v], -1))
    q, k, v, cu_q, cu_k = (conv(x) for x in (q, k, v, cu_q, cu_k))
    packed, kvpacked = flash_mla.flash_attn_varlen_qkvpacked_func, flash_mla.flash_attn_varlen_kvpacked_func
    bad_cu = conv(np.array([0, 3, 4], np.int32))
    with pytest.raises(ValueError, match=r"^cu_seqlens\[b\] = 4 must equal total_q = qkv.shape\[0\] = 5 \("):
        packed(qkv, bad_cu, mq, 128)
    with pytest.raises(TypeError, match=r"^qkv: expected dtype bfloat16 or float16, got float32$"):
        packed(conv(np.asarray(np.concatenate([case.q] * 3, -1), np.float32)), cu_q, mq, 128)
    with pytest.raises(ValueError, match=r"^qkv: no kernel for d_qk=64 d_v=64;"):
        packed(qkv[..., :192], cu_q, mq, 64)
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv\[b\] = 4 must equal total_k = kv.shape\[0\] = 6 \("):
        kvpacked(q, kv, cu_q, bad_cu, mq, mk, 128)
    with pytest.raises(TypeError, match=r"^kv: expected the dtype of q \(bfloat16\), got float16$"):
        kvpacked(q, conv(np.concatenate([case.k, case.v], -1).astype(FP16)), cu_q, cu_k, mq, mk, 128)
    with pytest.raises(ValueError, match=r"^h_q % h_kv != 0: q has h_q = 4 heads, kv has h_kv = 3;"):
        kvpacked(q, conv(np.concatenate([np.concatenate([case.k, case.v], -1)] * 2, 1)[:, :3]), cu_q, cu_k, mq, mk,
                 128)
    with pytest.raises(ValueError, match=r"^head_dim_qk: expected q's head dim d_qk = q.shape\[2\] = 128, got 64$"):
        kvpacked(q, kv, cu_q, cu_k, mq, mk, 64)
    # (flash_attn_varlen_func: unchanged)
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv\[b\] = 4 must equal total_k = k.shape\[0\] = 6 \("):
        flash_mla.flash_attn_varlen_func(q, k, v, cu_q, bad_cu, mq, mk)
    with pytest.raises(ValueError, match=r"^cu_seqlens_qo\[b\] = 4 must equal total_q = q.shape\[0\] = 5 \("):
        flash_mla.flash_attn_varlen_func(q, k, v, bad_cu, cu_k, mq, mk)


def test_packed_variants_errors_name_the_packed_tensor_under_jax_jit(rng):
    """Under jax.jit a value error surfaces when the compiled function runs, after the packed variant's frame that
    renames q / k / v for eager calls: the XLA custom call said "total_q = q.shape[0]" for the caller's qkv and
    "total_k = k.shape[0]" for its kv. It names the packed tensor itself now, in the forward and in the backward
    (jax.grad); flash_attn_varlen_func's messages stay as they were."""
    jax = pytest.importorskip("jax")
    import flash_mla._jax

    jnp = jax.numpy
    case = Case(rng, [3, 2], [4, 2], 4, 2, 128, 128, BF16, False)
    q, k, v, cu_q, cu_k, mq, mk = (to_jax_cpu(x) if hasattr(x, "shape") else x for x in case.args())
    if not flash_mla._jax.use_xla(q):
        pytest.skip("jax-tvm-ffi is not installed (no XLA custom calls)")
    qkv = jnp.concatenate([q, q, q], -1)
    kv = jnp.concatenate([k, v], -1)
    bad_cu = to_jax_cpu(np.array([0, 3, 4], np.int32))
    packed, kvpacked = flash_mla.flash_attn_varlen_qkvpacked_func, flash_mla.flash_attn_varlen_kvpacked_func

    def runs_with(fn, *args, match):
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"\[flash_mla:ValueError\] " + match):
            jax.block_until_ready(jax.jit(fn)(*args))

    runs_with(lambda x, c: packed(x, c, mq, 128)[0], qkv, bad_cu,
              match=r"cu_seqlens\[b\] = 4 must equal total_q = qkv.shape\[0\] = 5 \(")
    runs_with(jax.grad(lambda x, c: packed(x, c, mq, 128)[0].astype(jnp.float32).sum()), qkv, bad_cu,
              match=r"cu_seqlens\[b\] = 4 must equal total_q = qkv.shape\[0\] = 5 \(")
    runs_with(lambda a, b, c: kvpacked(a, b, cu_q, c, mq, mk, 128)[0], q, kv, bad_cu,
              match=r"cu_seqlens_kv\[b\] = 4 must equal total_k = kv.shape\[0\] = 6 \(")
    runs_with(jax.grad(lambda a, b, c: kvpacked(a, b, cu_q, c, mq, mk, 128)[0].astype(jnp.float32).sum(),
                       argnums=(0, 1)), q, kv, bad_cu,
              match=r"cu_seqlens_kv\[b\] = 4 must equal total_k = kv.shape\[0\] = 6 \(")
    runs_with(lambda a, b, c: kvpacked(a, b, c, cu_k, mq, mk, 128)[0], q, kv, bad_cu,
              match=r"cu_seqlens_qo\[b\] = 4 must equal total_q = q.shape\[0\] = 5 \(")
    # (flash_attn_varlen_func: unchanged)
    runs_with(lambda a, b, c, d: flash_mla.flash_attn_varlen_func(a, b, c, cu_q, d, mq, mk)[0], q, k, v, bad_cu,
              match=r"cu_seqlens_kv\[b\] = 4 must equal total_k = k.shape\[0\] = 6 \(")
    # A good run of a side-effecting call (the backward's; the forward's is not one, see flash_mla/_jax.py) replaces
    # JAX's runtime token, which the failed runs left in error.
    jax.block_until_ready(jax.jit(jax.grad(lambda x: packed(x, cu_q, mq, 128)[0].astype(jnp.float32).sum()))(qkv))
    jax.effects_barrier()


@pytest.mark.parametrize("flag", ["causal", "is_varlen", "deterministic"])
@pytest.mark.parametrize("bad", ["False", b"", [False]], ids=repr)
def test_flags_must_not_be_strings_or_containers(rng, flag, bad):
    """causal="False" (truthy) ran a causal prefill and is_varlen="False" a varlen one, silently: a TypeError
    naming the flag now, on the forward and the backward."""
    case = Case(rng, [3, 2], [4, 2], 2, 2, 128, 128, BF16, False)
    q, k, v, cu_q, cu_k, mq, mk = case.args()
    with pytest.raises(TypeError, match=rf"^{flag}: expected a bool, got "):
        flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **{flag: bad})
    if flag != "deterministic":
        out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
        with pytest.raises(TypeError, match=rf"^{flag}: expected a bool, got "):
            flash_mla.flash_attn_varlen_backward(case.dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, **{flag: bad})


# ----------------------------------------------------------------------------- torch


def _torch():
    return pytest.importorskip("torch")


def _t(x, requires_grad=False):
    torch = _torch()
    x = np.asarray(x)
    if x.dtype == BF16:
        t = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(x.copy())
    return t.requires_grad_(requires_grad)


def _np(t):
    torch = _torch()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_torch_autograd(rng, dtype, causal, heads):
    torch = _torch()
    dt = DTYPES[dtype]
    case = Case(rng, [1, 7, 0, 63], [7, 7, 3, 33], *heads, 192, 128, dt, causal)
    q, k, v = (_t(x, True) for x in (case.q, case.k, case.v))
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, _t(case.cu_q), _t(case.cu_k), case.max_q, case.max_k,
                                                softmax_scale=case.scale, causal=causal)
    assert out.requires_grad and not lse.requires_grad
    assert lse.shape == (q.shape[0], heads[0]) and lse.stride() == (1, q.shape[0])
    check_fwd(_np(out), _np(lse), case)
    out.backward(_t(case.dout))
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), case.ref_grads()):
        check_grad(name, _np(t.grad), r, dt)
    # The backward is deterministic: a second run gives the same bits.
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out2, _ = flash_mla.flash_attn_varlen_func(q, k, v, _t(case.cu_q), _t(case.cu_k), case.max_q, case.max_k,
                                               softmax_scale=case.scale, causal=causal)
    assert torch.equal(out2, out)
    out2.backward(_t(case.dout))
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)


def test_torch_double_backward_raises_instead_of_dropping_the_second_order_term(rng):
    """The backward is not differentiable. With create_graph=True (a gradient penalty) the gradients it returns
    must not silently look constant: backpropagating through them raises, through both ways in (the
    autograd.Function of flash_attn_varlen_func and the op's register_autograd), instead of leaving the
    second-order term out of the loss."""
    torch = _torch()
    from flash_mla import _torch_ops

    case = Case(rng, [3, 5], [4, 5], 2, 1, 128, 128, BF16, True)
    cu_q, cu_k = _t(case.cu_q), _t(case.cu_k)
    ways = [lambda q, k, v: flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, case.max_q, case.max_k,
                                                             causal=True)]
    if _torch_ops.available():
        ways.append(lambda q, k, v: torch.ops.flash_mla.dense_prefill_fwd(q, k, v, cu_q, cu_k, case.max_q,
                                                                         case.max_k, case.scale, True))
    # (the loss's gradient into out: one that requires grad itself, and a constant one, as of out.sum())
    for fwd, loss in [(f, l) for f in ways for l in (lambda o: o.float().square().sum(), lambda o: o.sum())]:
        q, k, v = (_t(x, True) for x in (case.q, case.k, case.v))
        out, _ = fwd(q, k, v)
        dq, dk = torch.autograd.grad(loss(out), (q, k), create_graph=True)
        assert dq.requires_grad and dk.requires_grad  # (a penalty on them is part of the graph, not a constant)
        penalty = dq.float().square().sum() + dk.float().sum()
        with pytest.raises(RuntimeError, match="differentiate twice"):
            (penalty + out.float().sum()).backward()
        # The first-order gradients are those of a call without create_graph.
        q2, k2, v2 = (_t(x, True) for x in (case.q, case.k, case.v))
        dq2, dk2 = torch.autograd.grad(loss(fwd(q2, k2, v2)[0]), (q2, k2))
        assert torch.equal(dq.detach(), dq2) and torch.equal(dk.detach(), dk2)


def test_torch_packed_grads_flow_into_the_packed_tensor(rng):
    torch = _torch()
    case = Case(rng, [5, 9], [5, 9], 2, 2, 128, 128, BF16, True)
    qkv = _t(np.concatenate([case.q, case.k, case.v], -1), True)
    out, _ = flash_mla.flash_attn_varlen_qkvpacked_func(qkv, _t(case.cu_q), case.max_q, 128, causal=True,
                                                        softmax_scale=case.scale)
    out.backward(_t(case.dout))
    dq, dk, dv = case.ref_grads()
    g = qkv.grad
    check_grad("dq", _np(g[..., :128]), dq, BF16)
    check_grad("dk", _np(g[..., 128:256]), dk, BF16)
    check_grad("dv", _np(g[..., 256:]), dv, BF16)
    q = _t(case.q, True)
    kv = _t(np.concatenate([case.k, case.v], -1), True)
    out, _ = flash_mla.flash_attn_varlen_kvpacked_func(q, kv, _t(case.cu_q), _t(case.cu_k), case.max_q, case.max_k,
                                                       128, causal=True, softmax_scale=case.scale)
    out.backward(_t(case.dout))
    check_grad("dq", _np(q.grad), dq, BF16)
    check_grad("dk", _np(kv.grad[..., :128]), dk, BF16)
    check_grad("dv", _np(kv.grad[..., 128:]), dv, BF16)


def test_torch_is_varlen_false_and_errors(rng):
    torch = _torch()
    case = Case(rng, [4, 4], [6, 6], 2, 1, 128, 128, BF16, True)
    q, k, v = (_t(x, True) for x in (case.q, case.k, case.v))
    ones = torch.ones(3, dtype=torch.int32)  # values ignored with is_varlen=False
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, ones, ones, 0, 0, causal=True, is_varlen=False)
    check_fwd(_np(out), _np(lse), case)
    out.sum().backward()  # an expanded (stride 0) gradient
    with pytest.raises(TypeError, match=r"^v: expected the dtype of q"):
        flash_mla.flash_attn_varlen_func(q, k, v.half(), _t(case.cu_q), _t(case.cu_k), 4, 6)
    with pytest.raises(ValueError, match=r"no kernel for d_qk=128 d_v=64"):
        flash_mla.flash_attn_varlen_func(q, k, v[..., :64], _t(case.cu_q), _t(case.cu_k), 4, 6)
    # (through torch.ops.flash_mla, whose arguments have the caller's names)
    with pytest.raises(ValueError, match=r"^cu_seqlens_qo: request 0 has 4 tokens, more than max_seqlen_qo = 3$"):
        flash_mla.flash_attn_varlen_func(q, k, v, _t(case.cu_q), _t(case.cu_k), 3, 6)


def test_torch_ops_registered_autograd_fake_and_compile(rng):
    torch = _torch()
    from flash_mla import _torch_ops

    if not _torch_ops.available():
        pytest.skip(f"torch.ops.flash_mla not available: {_torch_ops.load_error()}")
    case = Case(rng, [3, 0, 5], [4, 2, 5], 4, 2, 128, 128, BF16, True)
    q, k, v = (_t(x, True) for x in (case.q, case.k, case.v))
    cu_q, cu_k = _t(case.cu_q), _t(case.cu_k)
    op = torch.ops.flash_mla.dense_prefill_fwd
    out, lse = op(q, k, v, cu_q, cu_k, case.max_q, case.max_k, case.scale, True)
    assert lse.stride() == (1, q.shape[0])
    out.backward(_t(case.dout))  # register_autograd on the op itself
    for name, t, r in zip(("dq", "dk", "dv"), (q, k, v), case.ref_grads()):
        check_grad(name, _np(t.grad), r, BF16)
    # lse carries no gradient, as flash_attn_varlen_func's: a loss of lse alone raises (it gave zero gradients for
    # q, k and v, silently), and lse in a loss beside out adds nothing to theirs.
    out2, lse2 = op(q, k, v, cu_q, cu_k, case.max_q, case.max_k, case.scale, True)
    assert out2.requires_grad and not lse2.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse2[torch.isfinite(lse2)].sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (out2.float() * _t(case.dout).float()).sum().add(lse2[torch.isfinite(lse2)].sum()).backward()
    for t, g in zip((q, k, v), grads):
        assert torch.equal(t.grad, g)
    torch.library.opcheck(op, (q.detach(), k.detach(), v.detach(), cu_q, cu_k, case.max_q, case.max_k,
                               case.scale, True))
    torch.library.opcheck(op, (q, k, v, cu_q, cu_k, case.max_q, case.max_k, case.scale, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    o, l = op(q.detach(), k.detach(), v.detach(), cu_q, cu_k, case.max_q, case.max_k, case.scale, True)
    torch.library.opcheck(torch.ops.flash_mla.dense_prefill_bwd,
                          (_t(case.dout), q.detach(), k.detach(), v.detach(), o, l, cu_q, cu_k, case.max_q,
                           case.max_k, case.scale, True))

    def step(q, k, v, cu_q, cu_k, dout):
        out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, softmax_scale=case.scale,
                                                    causal=True)
        return out, lse

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q2, k2, v2 = (_t(x, True) for x in (case.q, case.k, case.v))
    out_c, lse_c = compiled(q2, k2, v2, cu_q, cu_k, _t(case.dout))
    out_c.backward(_t(case.dout))
    assert torch.equal(out_c, out.detach()) and torch.equal(lse_c, lse.detach())
    for a, b in zip((q2, k2, v2), (q, k, v)):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("call", ["one_cu_seqlens", "q_is_k_is_v", "qkvpacked", "kvpacked_one_cu_seqlens"])
def test_torch_compile_fullgraph_with_one_tensor_in_two_roles(rng, call):
    """Self-attention passes one cu_seqlens for queries and keys (qkvpacked always does), or one tensor as q, k and
    v. Dynamo rejects one tensor given twice to autograd.Function.apply ("duplicate tensor input"), so under
    torch.compile(fullgraph=True) with inputs that require grad these calls failed; forward and gradients must
    be eager's."""
    torch = _torch()
    from flash_mla import _torch_ops

    if not _torch_ops.available():  # (torch.compile traces the op library's ops, not TVM-FFI calls)
        pytest.skip(f"torch.ops.flash_mla not available: {_torch_ops.load_error()}")
    case = Case(rng, [3, 5], [3, 5], 2, 2, 128, 128, BF16, True)
    cu, x = _t(case.cu_q), _t(case.q)
    packed = {"qkvpacked": 384, "kvpacked_one_cu_seqlens": 256}.get(call)
    leaf = torch.cat([x] * (packed // 128), -1) if packed else x

    def step(t):
        if call == "one_cu_seqlens":
            return flash_mla.flash_attn_varlen_func(t, t * 2, t * 3, cu, cu, 5, 5, causal=True)[0]
        if call == "q_is_k_is_v":
            return flash_mla.flash_attn_varlen_func(t, t, t, cu, cu.clone(), 5, 5, causal=True)[0]
        if call == "qkvpacked":
            return flash_mla.flash_attn_varlen_qkvpacked_func(t, cu, 5, 128, causal=True)[0]
        return flash_mla.flash_attn_varlen_kvpacked_func(t[..., :128], t, cu, cu, 5, 5, 128, causal=True)[0]

    ref_in, comp_in = (leaf.detach().clone().requires_grad_() for _ in range(2))
    ref = step(ref_in)
    ref.float().square().sum().backward()
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(comp_in)
    out.float().square().sum().backward()
    assert torch.equal(out, ref) and torch.equal(comp_in.grad, ref_in.grad)


_FIRST_CALL_COMPILED = r"""
import sys, torch, flash_mla
torch.manual_seed(0)
cu = torch.tensor([0, 4, 10], dtype=torch.int32)
q, k, v = (torch.randn(10, 2, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

def step(q, k, v):
    return flash_mla.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)[0]

out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
out.float().square().sum().backward()
q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
ref = step(q2, k2, v2)
ref.float().square().sum().backward()
assert torch.equal(out, ref) and all(torch.equal(a.grad, b.grad) for a, b in ((q, q2), (k, k2), (v, v2)))
print("ok")
"""


def test_torch_compile_fullgraph_as_the_first_call_of_a_process():
    """torch.compile(fullgraph=True) of a function calling flash_attn_varlen_func, before any eager call in the
    process (a fresh interpreter): one graph, forward and backward equal to eager. (The autograd.Function is
    made on first use; made inside the traced region it was a class statement Dynamo cannot trace.)"""
    _torch()
    import subprocess
    import sys

    from flash_mla import _torch_ops

    if not _torch_ops.available():  # (torch.compile traces the op library's ops, not TVM-FFI calls)
        pytest.skip(f"torch.ops.flash_mla not available: {_torch_ops.load_error()}")
    r = subprocess.run([sys.executable, "-c", _FIRST_CALL_COMPILED], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_flash_mla_cuda_raw_functions(rng):
    torch = _torch()
    from flash_mla import _torch_ops

    if not _torch_ops.available():
        pytest.skip(f"torch.ops.flash_mla not available: {_torch_ops.load_error()}")
    import flash_mla.cuda as fc

    case = Case(rng, [6, 2], [3, 8], 4, 2, 192, 128, BF16, True)
    q, k, v = (_t(x) for x in (case.q, case.k, case.v))
    cu_q, cu_k = _t(case.cu_q), _t(case.cu_k)
    out = torch.full((8, 4, 128), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((4, 8), float("nan")).T
    ws = torch.empty(0, dtype=torch.uint8)
    assert fc.dense_prefill_fwd(ws, q, k, v, cu_q, cu_k, out, lse, 1, case.scale, case.max_q, case.max_k,
                                True) is None
    check_fwd(_np(out), _np(lse), case)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    fc.dense_prefill_bwd(ws, _t(case.dout), q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, 1, case.scale, case.max_q,
                         case.max_k, True)
    for name, t, r in zip(("dq", "dk", "dv"), (dq, dk, dv), case.ref_grads()):
        check_grad(name, _np(t), r, BF16)
    with pytest.raises(ValueError, match="mask_mode_code"):
        fc.dense_prefill_fwd(ws, q, k, v, cu_q, cu_k, out, lse, 2, case.scale, case.max_q, case.max_k, True)
    # Errors name FlashMLA's extension's arguments (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv);
    # torch.ops.flash_mla's are its schema's, the public API's (cu_seqlens_kv, max_seqlen_kv).
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv: request 1 has 8 tokens, more than max_seqlen_kv = 7$"):
        fc.dense_prefill_fwd(ws, q, k, v, cu_q, cu_k, out, lse, 1, case.scale, case.max_q, 7, True)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: request 0 has 6 tokens, more than max_seqlen_q = 5$"):
        fc.dense_prefill_bwd(ws, _t(case.dout), q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, 1, case.scale, 5,
                             case.max_k, True)
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv: request 1 has 8 tokens, more than max_seqlen_kv = 7$"):
        _torch_ops.dense_prefill_fwd(q, k, v, cu_q, cu_k, case.max_q, 7, case.scale, True)


def test_preallocated_outputs_are_all_checked_before_any_is_written(rng):
    """FlashMLA's destination-passing forms (flash_mla.cuda.dense_prefill_fwd / _bwd, the private
    _flash_attn_varlen_forward / _backward with out= / dq= ...): a wrong destination raises ValueError naming
    it, and no destination is written then (not the ones before it either); right ones are filled."""
    torch = _torch()
    from flash_mla.flash_mla_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    case = Case(rng, [4, 3], [5, 3], 2, 1, 128, 128, BF16, True)
    q, k, v = (_t(x) for x in (case.q, case.k, case.v))
    cu_q, cu_k = _t(case.cu_q), _t(case.cu_k)
    args = (q, k, v, cu_q, cu_k, case.max_q, case.max_k)
    poison = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    out, lse = _flash_attn_varlen_forward(*args, causal=True, softmax_scale=case.scale)
    check_fwd(_np(out), _np(lse), case)
    o = poison(out)
    with pytest.raises(ValueError, match=r"^lse: expected a torch.float32 tensor of shape \(7, 2\)"):
        _flash_attn_varlen_forward(*args, out=o, lse=torch.zeros(7, 3), causal=True, softmax_scale=case.scale)
    assert o.isnan().all()
    o, l = poison(out), poison(lse)
    assert _flash_attn_varlen_forward(*args, out=o, lse=l, causal=True, softmax_scale=case.scale) == (o, l)
    assert torch.equal(o, out) and torch.equal(l, lse)
    dout = _t(case.dout)
    grads = _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, case.max_q, case.max_k, causal=True,
                                        softmax_scale=case.scale)
    dq, dk = poison(q), poison(k)
    with pytest.raises(ValueError, match=r"^dv: expected a torch.bfloat16 tensor"):
        _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, case.max_q, case.max_k, dq=dq, dk=dk,
                                    dv=torch.zeros(8, 1, 128), causal=True, softmax_scale=case.scale)
    assert dq.isnan().all() and dk.isnan().all()
    from flash_mla import _torch_ops

    if not _torch_ops.available():
        return
    import flash_mla.cuda as fc

    ws = torch.empty(0, dtype=torch.uint8)
    o = poison(out)
    with pytest.raises(ValueError, match=r"^lse: expected"):
        fc.dense_prefill_fwd(ws, q, k, v, cu_q, cu_k, o, torch.zeros(7, 3), 1, case.scale, case.max_q, case.max_k,
                             True)
    assert o.isnan().all()
    dq, dk = poison(q), poison(k)
    with pytest.raises(ValueError, match=r"^dv: expected"):
        fc.dense_prefill_bwd(ws, dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, torch.zeros(8, 1, 64,
                             dtype=torch.bfloat16), 1, case.scale, case.max_q, case.max_k, True)
    assert dq.isnan().all() and dk.isnan().all()
    dq, dk, dv = poison(q), poison(k), poison(v)
    fc.dense_prefill_bwd(ws, dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, 1, case.scale, case.max_q, case.max_k,
                         True)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), grads))


def test_destinations_that_share_memory_are_a_value_error_naming_them(rng):
    """flash_mla.cuda.dense_prefill_fwd / _bwd and the private destination-passing helpers copied the results into
    the given tensors after shape and dtype checks only: one tensor given as dk and dv held dv afterwards (a silent
    wrong answer), an expanded (stride-0) lse gave torch's copy_ RuntimeError, naming no argument. Now a ValueError
    naming the destination(s), before any is written; disjoint views of one buffer (FlashMLA's kvpacked gradient,
    dk = dkv[:, 0] and dv = dkv[:, 1], or the last dim split) still work."""
    torch = _torch()
    from flash_mla.flash_mla_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    case = Case(rng, [4, 3], [5, 3], 2, 2, 128, 128, BF16, True)
    q, k, v = (_t(x) for x in (case.q, case.k, case.v))
    cu_q, cu_k = _t(case.cu_q), _t(case.cu_k)
    args = (q, k, v, cu_q, cu_k, case.max_q, case.max_k)
    out, lse = _flash_attn_varlen_forward(*args, causal=True, softmax_scale=case.scale)
    dout = _t(case.dout)
    grads = _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, case.max_q, case.max_k, causal=True,
                                        softmax_scale=case.scale)
    poison = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    bwd = lambda dq, dk, dv: _flash_attn_varlen_backward(  # noqa: E731
        dout, q, k, v, out, lse, cu_q, cu_k, case.max_q, case.max_k, dq=dq, dk=dk, dv=dv, causal=True,
        softmax_scale=case.scale)
    calls = [bwd]
    from flash_mla import _torch_ops

    if _torch_ops.available():
        import flash_mla.cuda as fc

        ws = torch.empty(0, dtype=torch.uint8)
        calls.append(lambda dq, dk, dv: fc.dense_prefill_bwd(ws, dout, q, k, v, out, lse, cu_q, cu_k, dq, dk, dv, 1,
                                                             case.scale, case.max_q, case.max_k, True))
    for call in calls:
        dq, dkv = poison(q), poison(k)
        with pytest.raises(ValueError, match=r"^dk and dv: the destinations share memory"):
            call(dq, dkv, dkv)
        assert dq.isnan().all() and dkv.isnan().all()  # nothing written
        with pytest.raises(ValueError, match=r"^dq and dv: the destinations share memory"):
            buf = torch.empty(k.numel(), dtype=k.dtype)
            call(buf[:q.numel()].view(q.shape), poison(k), buf.view(k.shape))
        with pytest.raises(ValueError, match=r"^dk and dv: the destinations share memory"):  # partial overlap
            buf = torch.empty(k.numel() + 1, dtype=k.dtype)
            call(dq, buf[:k.numel()].view(k.shape), buf[1:].view(k.shape))
        with pytest.raises(ValueError, match=r"^dv: the destination's elements overlap \(shape \(8, 2, 128\), "
                                             r"strides \(0, 128, 1\)"):
            call(dq, poison(k), torch.empty(1, 2, 128, dtype=v.dtype).expand(8, 2, 128))
        assert dq.isnan().all()
        # FlashMLA's kvpacked gradient: interleaved views of one buffer, no element shared
        dkv = torch.full((8, 2, 2, 128), float("nan"), dtype=k.dtype)
        dq = poison(q)
        call(dq, dkv[:, 0], dkv[:, 1])
        assert torch.equal(dq, grads[0]) and torch.equal(dkv[:, 0], grads[1]) and torch.equal(dkv[:, 1], grads[2])
        dkv = torch.full((8, 2, 256), float("nan"), dtype=k.dtype)
        call(poison(q), dkv[..., :128], dkv[..., 128:])
        assert torch.equal(dkv[..., :128], grads[1]) and torch.equal(dkv[..., 128:], grads[2])
    o = poison(out)
    with pytest.raises(ValueError, match=r"^lse: the destination's elements overlap"):
        _flash_attn_varlen_forward(*args, out=o, lse=torch.empty(1, 2).expand(7, 2), causal=True,
                                   softmax_scale=case.scale)
    assert o.isnan().all()
    if _torch_ops.available():
        with pytest.raises(ValueError, match=r"^lse: the destination's elements overlap"):
            fc.dense_prefill_fwd(ws, q, k, v, cu_q, cu_k, o, torch.empty(1, 2).expand(7, 2), 1, case.scale,
                                 case.max_q, case.max_k, True)
        assert o.isnan().all()
        # out and lse carved from one byte buffer, disjoint (exact, across dtypes) and overlapping
        raw = torch.empty(out.numel() * 2 + lse.numel() * 4, dtype=torch.uint8)
        o = raw[:out.numel() * 2].view(torch.bfloat16).view(out.shape)
        l = raw[out.numel() * 2:].view(torch.float32).view(lse.shape)
        fc.dense_prefill_fwd(ws, q, k, v, cu_q, cu_k, o, l, 1, case.scale, case.max_q, case.max_k, True)
        assert torch.equal(o, out) and torch.equal(l, lse)
        l = raw[out.numel() * 2 - 4:-4].view(torch.float32).view(lse.shape)
        with pytest.raises(ValueError, match=r"^out and lse: the destinations share memory"):
            fc.dense_prefill_fwd(ws, q, k, v, cu_q, cu_k, o, l, 1, case.scale, case.max_q, case.max_k, True)


def test_destination_overlap_checks_are_exact():
    """The overlap checks of the destinations against listing every element's address: random strided views of
    one buffer (strides 0 to 12, interleaved and not), each view alone and pairs of them (with one set of strides
    and with two)."""
    torch = _torch()
    import random

    from flash_mla.flash_mla_interface import _self_overlapping, _share_elements

    rnd = random.Random(0)
    buf = torch.zeros(1024, dtype=torch.bfloat16)
    addrs = torch.arange(buf.numel())

    def view(shape=None, stride=None):
        nd = len(shape) if shape else rnd.randint(1, 3)
        shape = shape or [rnd.randint(1, 5) for _ in range(nd)]
        stride = stride or [rnd.randint(0, 12) for _ in range(nd)]
        off = rnd.randint(0, 40)
        return buf.as_strided(shape, stride, off), addrs.as_strided(shape, stride, off).flatten().tolist()

    pairs = 0
    while pairs < 3000:
        a, ea = view()
        assert _self_overlapping(a) == (len(set(ea)) != len(ea)), (a.shape, a.stride())
        if len(set(ea)) != len(ea):
            continue
        b, eb = view([rnd.randint(1, 5) for _ in a.shape], list(a.stride())) if rnd.random() < 0.6 else view()
        if len(set(eb)) != len(eb):
            continue
        pairs += 1
        want = bool(set(ea) & set(eb))
        assert _share_elements(a, b) == want and _share_elements(b, a) == want, (a.shape, a.stride(),
                                                                                 a.storage_offset(), b.shape,
                                                                                 b.stride(), b.storage_offset())


# ----------------------------------------------------------------------------- JAX
def test_jax_custom_vjp_grad_and_jit(rng):
    jax = pytest.importorskip("jax")
    import flash_mla._jax

    jnp = jax.numpy
    case = Case(rng, [1, 7, 0, 20], [7, 7, 2, 20], 4, 2, 192, 128, BF16, True)
    q, k, v, cu_q, cu_k = (to_jax_cpu(x) for x in (case.q, case.k, case.v, case.cu_q, case.cu_k))
    if not flash_mla._jax.use_xla(q):
        pytest.skip("jax-tvm-ffi is not installed (the custom_vjp needs XLA custom calls)")
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, case.max_q, case.max_k,
                                                softmax_scale=case.scale, causal=True)
    assert isinstance(out, jax.Array) and lse.shape == (q.shape[0], 4)
    check_fwd(np.asarray(out), np.asarray(lse), case)
    dout = to_jax_cpu(case.dout)

    def loss(q, k, v):
        o, _ = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, case.max_q, case.max_k,
                                                softmax_scale=case.scale, causal=True)
        return jnp.sum(o.astype(jnp.float32) * dout.astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, a, r in zip(("dq", "dk", "dv"), grads, case.ref_grads()):
        check_grad(name, np.asarray(a), r, BF16)
    grads_jit = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(grads, grads_jit):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    # The plain backward agrees bit for bit with the NumPy path.
    g_np = flash_mla.flash_attn_varlen_backward(case.dout, case.q, case.k, case.v, np.asarray(out), np.asarray(lse),
                                                case.cu_q, case.cu_k, case.max_q, case.max_k,
                                                softmax_scale=case.scale, causal=True)
    g_jx = flash_mla.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, case.max_q, case.max_k,
                                                softmax_scale=case.scale, causal=True)
    for a, b in zip(g_np, g_jx):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    # Shape errors raise while tracing, naming the argument.
    with pytest.raises(ValueError, match=r"no kernel for d_qk=192 d_v=64"):
        jax.jit(lambda q, k, v: flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20))(q, k, v[..., :64])
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv: expected shape \(5,\) like cu_seqlens_qo \(b \+ 1 = 5\)"):
        jax.jit(lambda q, k, v: flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k[:3], 20, 20))(q, k, v)
    # (values: checked when the CPU custom call runs, named as flash_attn_varlen_func names them)
    # (the message's line exactly; JAX may add its note on filtered frames after it, which pytest matches too)
    with pytest.raises(ValueError, match=r"^cu_seqlens_qo: request 1 has 7 tokens, more than max_seqlen_qo = 6(\n|$)"):
        jax.block_until_ready(flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, case.max_k))
    # Under jax.jit the same value errors surface when the compiled function runs (JaxRuntimeError, after the
    # caller's frame): the custom call names the arguments itself, as the public function the caller called does.
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"\[flash_mla:ValueError\] cu_seqlens_qo: request 1 has 7 tokens, more than max_seqlen_qo = 6"):
        jax.block_until_ready(jax.jit(
            lambda q, k, v: flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, case.max_k)[0])(q, k, v))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"\[flash_mla:ValueError\] cu_seqlens_kv: request 0 has 7 tokens, more than max_seqlen_kv = 6"):
        jax.block_until_ready(jax.jit(
            lambda q, k, v: flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, case.max_q, 6)[0])(q, k, v))
    qkv = jnp.concatenate([q, q, q[..., :128]], axis=-1)  # h_q = h_kv for the packed form
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"\[flash_mla:ValueError\] cu_seqlens: request 1 has 7 tokens, more than max_seqlen = 6"):
        jax.block_until_ready(jax.jit(
            lambda x: flash_mla.flash_attn_varlen_qkvpacked_func(x, cu_q, 6, 192)[0])(qkv))
    # The failed runs leave JAX's runtime token of side-effecting calls in error (jax.effects_barrier would raise
    # it again); a good run replaces it.
    jax.block_until_ready(jax.jit(
        lambda x: flash_mla.flash_attn_varlen_qkvpacked_func(x, cu_q, case.max_q, 192)[0])(qkv))
    jax.effects_barrier()


def test_jax_grad_through_checkpoint(rng):
    """jax.checkpoint (remat), the usual way a training step trades recomputation for memory, works on the CPU
    too: its partial evaluation refuses side-effecting calls, so the forward custom call must not be one (it
    was, for the class of the runtime errors under jax.jit: python/flash_mla/_jax.py). Gradients equal those
    without remat, bit for bit, eagerly, under jax.jit and inside a jax.lax.scan over layers."""
    jax = pytest.importorskip("jax")
    import flash_mla._jax

    jnp = jax.numpy
    case = Case(rng, [3, 0, 9], [5, 2, 9], 4, 2, 128, 128, BF16, True)
    q, k, v, cu_q, cu_k = (to_jax_cpu(x) for x in (case.q, case.k, case.v, case.cu_q, case.cu_k))
    if not flash_mla._jax.use_xla(q):
        pytest.skip("jax-tvm-ffi is not installed (the custom_vjp needs XLA custom calls)")
    dout = to_jax_cpu(case.dout).astype(jnp.float32)

    def loss(q, k, v):
        o, _ = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, case.max_q, case.max_k,
                                                softmax_scale=case.scale, causal=True)
        return jnp.sum(o.astype(jnp.float32) * dout)

    plain = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, a, r in zip(("dq", "dk", "dv"), plain, case.ref_grads()):
        check_grad(name, np.asarray(a), r, BF16)
    for policy in (None, jax.checkpoint_policies.dots_saveable):
        remat = jax.checkpoint(loss, policy=policy)
        for grads in (jax.grad(remat, argnums=(0, 1, 2))(q, k, v), jax.jit(jax.grad(remat, argnums=(0, 1, 2)))(q, k, v)):
            for a, b in zip(plain, grads):
                np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))

    # Two layers in a scan, each rematerialised: the gradient of the first layer's q through both.
    def layer(x, _):
        o, _ = flash_mla.flash_attn_varlen_func(x, k, v, cu_q, cu_k, case.max_q, case.max_k,
                                                softmax_scale=case.scale, causal=True)
        return jnp.concatenate([o, o], axis=1)[:, :4].astype(x.dtype), None

    def two_layers(x, step):
        y, _ = jax.lax.scan(step, x, None, length=2)
        return jnp.sum(y.astype(jnp.float32))

    want = jax.grad(two_layers)(q, layer)
    got = jax.jit(jax.grad(lambda x: two_layers(x, jax.checkpoint(layer))))(q)
    np.testing.assert_array_equal(np.asarray(want).view(np.uint16), np.asarray(got).view(np.uint16))


def test_jax_call_checks_numpy_arguments_with_their_own_dtype(rng):
    """A JAX q with NumPy arrays for the other arguments: each is checked with its own dtype, as the NumPy path
    and the JAX decode check them, not after jax.custom_vjp has converted it (without jax_enable_x64 that narrows
    int64 cu_seqlens to int32, accepted silently, and float64 k to float32, named wrongly in the error)."""
    jax = pytest.importorskip("jax")
    import flash_mla._jax

    case = Case(rng, [3, 4], [5, 4], 2, 2, 128, 128, BF16, False)
    q = to_jax_cpu(case.q)
    if not flash_mla._jax.use_xla(q):
        pytest.skip("jax-tvm-ffi is not installed (the custom_vjp needs XLA custom calls)")
    cu64 = case.cu_q.astype(np.int64)
    for call in (lambda: flash_mla.flash_attn_varlen_func(q, case.k, case.v, cu64, case.cu_k, 4, 5),
                 lambda: jax.jit(lambda q: flash_mla.flash_attn_varlen_func(q, case.k, case.v, cu64, case.cu_k, 4, 5))(q),
                 lambda: flash_mla.flash_attn_varlen_func(case.q, case.k, case.v, cu64, case.cu_k, 4, 5)):
        with pytest.raises(TypeError, match=r"^cu_seqlens_qo: expected dtype int32, got int64"):
            call()
    # float64: the NumPy path's error, word for word (naming float64, not the float32 of a converted array).
    kv = np.concatenate([case.k, case.v], axis=-1).astype(np.float64)
    for call in (lambda q: flash_mla.flash_attn_varlen_func(q, case.k.astype(np.float64), case.v, case.cu_q,
                                                            case.cu_k, 4, 5),
                 lambda q: flash_mla.flash_attn_varlen_kvpacked_func(q, kv, case.cu_q, case.cu_k, 4, 5, 128)):
        with pytest.raises(TypeError) as numpy_error:
            call(case.q)
        assert "float64" in str(numpy_error.value)
        with pytest.raises(TypeError) as jax_error:
            call(q)
        assert str(jax_error.value) == str(numpy_error.value)


def test_cupy_or_paddle_if_installed(rng):
    """Other DLPack frameworks take the plain TVM-FFI path (CPU here: Paddle; CuPy needs a GPU)."""
    paddle = pytest.importorskip("paddle")
    case = Case(rng, [3, 4], [5, 4], 2, 2, 128, 128, FP16, False)
    conv = lambda x: paddle.to_tensor(np.asarray(x))  # noqa: E731
    out, lse = flash_mla.flash_attn_varlen_func(*case.args(conv), softmax_scale=case.scale)
    assert isinstance(out, paddle.Tensor)
    check_fwd(out.numpy(), lse.numpy(), case)
    grads = flash_mla.flash_attn_varlen_backward(conv(case.dout), *case.args(conv)[:3], out, lse,
                                                 *case.args(conv)[3:], softmax_scale=case.scale)
    for name, a, r in zip(("dq", "dk", "dv"), grads, case.ref_grads()):
        check_grad(name, a.numpy(), r, FP16)


def test_paddle_autograd_if_installed(rng):
    """Paddle tensors that want gradients go through a paddle.autograd.PyLayer: loss.backward() fills q / k / v's
    grad with flash_attn_varlen_backward's values (it used to return a detached out, so the attention's gradients
    were silently missing); an input with stop_gradient gets none; qkvpacked's gradient reaches qkv; under
    paddle.no_grad() (or with no input wanting a gradient) out does not record one."""
    paddle = pytest.importorskip("paddle")
    case = Case(rng, [3, 6], [5, 6], 2, 1, 128, 128, FP16, True)
    conv = lambda x: paddle.to_tensor(np.asarray(x))  # noqa: E731
    q, k, v, cu_q, cu_k, max_q, max_k = case.args(conv)
    q.stop_gradient = False
    v.stop_gradient = False
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=case.scale,
                                                causal=True)
    assert not out.stop_gradient and lse.stop_gradient
    (out.astype("float32") * conv(case.dout).astype("float32")).sum().backward()
    assert k.grad is None
    for name, a, r in (("dq", q.grad, case.ref_grads()[0]), ("dv", v.grad, case.ref_grads()[2])):
        check_grad(name, a.numpy(), r, FP16)
    qkv = paddle.to_tensor(rng.standard_normal((9, 1, 384)).astype(np.float16))
    qkv.stop_gradient = False
    cu = conv(np.array([0, 3, 9], np.int32))
    out_p, _ = flash_mla.flash_attn_varlen_qkvpacked_func(qkv, cu, 6, 128, causal=True)
    out_p.astype("float32").sum().backward()
    x = qkv.detach()
    parts = (x[:, :, :128], x[:, :, 128:256], x[:, :, 256:])
    o2, l2 = flash_mla.flash_attn_varlen_func(*parts, cu, cu, 6, 6, causal=True)
    grads = flash_mla.flash_attn_varlen_backward(paddle.ones_like(o2), *parts, o2, l2, cu, cu, 6, 6, causal=True)
    assert np.array_equal(qkv.grad.numpy(), np.concatenate([g.numpy() for g in grads], -1))
    with paddle.no_grad():
        assert flash_mla.flash_attn_varlen_qkvpacked_func(qkv, cu, 6, 128, causal=True)[0].stop_gradient


def test_torch_q_with_other_frameworks_tensors_forward_and_backward():
    """A torch q with NumPy cu_seqlens (or k / v) is a mixed-framework call, which the API takes. The torch path
    used to fail inside the autograd.Function: AttributeError ('numpy.ndarray' object has no attribute
    'view_as') when one NumPy cu_seqlens served queries and keys -- always so for flash_attn_varlen_qkvpacked_func
    -- and TypeError from save_for_backward when q required grad. Same results and gradients as all-torch."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(9, 2, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(9, 2, 128, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    dout = torch.randn(9, 4, 128, generator=gen).to(torch.bfloat16)

    def run(k_, v_, cu_q, cu_k):
        qg = q.clone().requires_grad_()
        out, lse = flash_mla.flash_attn_varlen_func(qg, k_, v_, cu_q, cu_k, 5, 5, causal=True)
        out.backward(dout)
        return out, lse, qg.grad

    ref = run(k, v, cu, cu)
    k_np = k.view(torch.int16).numpy().view(BF16)
    v_np = v.view(torch.int16).numpy().view(BF16)
    for args in ((k, v, cu.numpy(), cu.numpy()), (k, v, cu.numpy(), cu.numpy().copy()), (k_np, v_np, cu, cu),
                 (k_np, k_np, cu.numpy(), cu.numpy())):
        got = run(*args)
        if args[0] is k_np and args[1] is k_np:
            got_ref = run(k, k, cu, cu)
        else:
            got_ref = ref
        for a, b in zip(got, got_ref):
            assert isinstance(a, torch.Tensor)
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    qkv = torch.cat([q[:, :2], k, v], -1).requires_grad_()
    out, _ = flash_mla.flash_attn_varlen_qkvpacked_func(qkv, cu.numpy(), 5, 128, causal=True)
    qkv_ref = qkv.detach().clone().requires_grad_()
    out_ref, _ = flash_mla.flash_attn_varlen_qkvpacked_func(qkv_ref, cu, 5, 128, causal=True)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    out.float().sum().backward()
    out_ref.float().sum().backward()
    torch.testing.assert_close(qkv.grad, qkv_ref.grad, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"^cu_seqlens_qo: "):
        flash_mla.flash_attn_varlen_func(q, k, v, object(), cu, 5, 5)
