"""Dense MHA prefill (flash_attn_varlen_func, forward and backward) on the Hopper backend.

1. FlashMLA's test plan (tests/test_fmha_sm100.py, spec §5.5): the 32 configurations
   b = 2 x (mean_sq, mean_sk) in {(4096, 4096), (8192, 8192)} x varlen {F, T} x (h, h_k) in
   {(128, 128), (32, 4)} x (d, dv) in {(128, 128), (192, 128)} x causal {F, T}; seed 0, varlen
   lengths max(normalvariate(m, m/2), 1) for q and max(normalvariate(m, m/2), len_q) for k,
   q / k / v / grad randn/10 bf16, softmax_scale (d + 100) ** -0.5. Against a float32 reference
   (inputs upcast, explicit softmax, autograd for the gradients) with §5.5's tolerances: out and
   dq / dk / dv abs 1e-3, rel 8.01/128, cos 7e-6 (dv per element also against a reference that rounds P
   to q's dtype as the kernels do: check_dgrads says why); lse abs 1e-6, rel 2.01/65536. As FlashMLA, the
   8192 configurations with h = 128 skip the correctness check (their determinism is still
   checked). Beyond FlashMLA the backward runs for GQA (h 32, h_k 4) too.
   Determinism (as §5.5): 5 further forwards give out and lse bitwise equal to the first; 5
   further backwards give dk and dv (and dq: our contract, ops.h) bitwise equal.
2. Short, ragged and empty cases: lengths 1, 7, 63, 129, s_q != s_k both ways, empty requests
   (s_q = 0 and s_k = 0), causal rows without a visible key (out 0, lse -inf, zero gradients),
   bf16 and fp16, GQA, both head-dim pairs, packed variants, is_varlen=False, NaN propagation.
3. NaN / inf in keys of the causal diagonal block that the first rows do not see (k, v or both; s_q 7 / 63 /
   129 / 200 / 520, s_k = s_q .. s_q + 70): out, lse, dq, dk, dv as the reference, and the other rows bit-identical
   to a run with finite values there. Likewise NaN / inf in every key of the next request (the rows past a
   request's end that its last key block reads), and in one query row's q or dout (dk / dv of the keys it
   does not see).

Outputs are poisoned the only way the op's own allocations can be: a NaN-filled block is freed
into torch's caching allocator right before each call, so the op's outputs come out of it;
any element the kernels do not write stays NaN and fails the NaN-position check.
FLASHMLA_DENSE_PREFILL_TEST_DEVICE=cpu dry-runs the functions below on the CPU reference backend.
"""

import math
import os
import random
import zlib

import pytest

torch = pytest.importorskip("torch")
import flash_mla  # noqa: E402
from torch_reference import check_close  # noqa: E402  (spec §5.1 comparator)

OUT_TOL = dict(abs_tol=1e-3, rel_tol=8.01 / 128, cos_tol=7e-6)
LSE_TOL = dict(abs_tol=1e-6, rel_tol=2.01 / 65536, cos_tol=1e-7)
REF_SCORES = 1 << 28  # float32 score elements per reference chunk (1 GiB)
# Device of the answers under test; "cpu" only dry-runs this file's logic on the reference backend.
DEV = os.environ.get("FLASHMLA_DENSE_PREFILL_TEST_DEVICE", "cuda")


# ----------------------------------------------------------------------------- reference
def row_segments(k, v, s_q, s_k, causal):
    """[(r0, r1, keys)]: the request's query rows cut where a key holding a NaN or inf (in k or v, any head)
    becomes visible (bottom-right causal), with the indices of the keys rows r0..r1 read: every finite key and
    the non-finite keys visible to all of these rows. The non-finite keys a row does not see thus never enter
    the reference's arithmetic (the masked scores are -inf, their P exactly 0, and 0 * NaN would be NaN), as
    the operator never reads them (spec §2.5). One segment of all keys when every key is finite."""
    bad = ~(torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1))
    everything = torch.arange(s_k, device=k.device)
    if not causal or not bool(bad.any()):
        return [(0, s_q, everything)]
    first_row = everything + (s_q - s_k)  # first query row that sees each key
    cuts = sorted({0, s_q} | {r for r in first_row[bad].tolist() if 0 < r < s_q})
    return [(r0, r1, everything[~bad | (first_row <= r0)]) for r0, r1 in zip(cuts, cuts[1:])]


def seen_keys_only(w, rows, seen, bad):
    """w^T rows over the query axis, (heads, n_k, dim) for w (heads, n_q, n_k) and rows (heads, n_q, dim), with
    the rows holding a NaN or inf (bad, (heads, n_q)) adding to the keys they see (seen, (n_q, n_k)) only:
    a plain matmul would multiply their masked 0 weights by them (0 * NaN = NaN)."""
    out = w.transpose(-1, -2) @ torch.where(bad[..., None], 0.0, rows)
    for hh, i in bad.nonzero().tolist():
        out[hh, seen[i]] += w[hh, i, seen[i], None] * rows[hh, i]
    return out


def reference(q, k, v, cu_q, cu_k, scale, causal, dout):
    """float32 reference, request by request and in chunks of query heads (bounded memory):
    (out float32, lse float32, dq, dk, dv in q's dtype, dv_p in q's dtype); gradients by autograd of
    the explicit softmax attention (bottom-right causal mask; GQA by repeat_interleave), as FlashMLA's
    sdpa. dv_p is dV = P^T dO with P rounded to q's dtype first, as the kernels (and FlashAttention's
    backward) feed P to the tensor cores: the precision the backward's dv is specified to. A NaN / inf in
    a key reaches the rows that see it only (row_segments), one in a query row's q or dout the dk / dv of the
    keys that row sees only (seen_keys_only)."""
    total_q, h_q, _ = q.shape
    h_k = k.shape[1]
    g = h_q // h_k
    out = torch.zeros(total_q, h_q, v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, h_q), -math.inf, dtype=torch.float32, device=q.device)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    dv_p = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        s_q, s_k = q1 - q0, k1 - k0
        if s_q == 0 or s_k == 0:
            continue
        for r0, r1, keys in row_segments(k[k0:k1], v[k0:k1], s_q, s_k, causal):
            n_q, n_k = r1 - r0, keys.numel()
            if n_k == 0:  # every key non-finite and unseen: out 0, lse -inf, no gradient
                continue
            keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
            has_keys = torch.ones(n_q, dtype=torch.bool, device=q.device)
            if causal:
                rows = torch.arange(r0, r1, device=q.device)
                keep = keys[None, :] <= rows[:, None] + (s_k - s_q)
                has_keys = rows + (s_k - s_q) >= 0
            heads = max(1, min(h_q, REF_SCORES // (n_q * n_k)))
            for h0 in range(0, h_q, heads):
                h1 = min(h_q, h0 + heads)
                kh = torch.arange(h0, h1, device=q.device) // g
                qc = q[q0 + r0:q0 + r1, h0:h1].float().transpose(0, 1).contiguous().requires_grad_()
                kc = k[k0:k1][keys].float().transpose(0, 1)[kh].contiguous().requires_grad_()
                vc = v[k0:k1][keys].float().transpose(0, 1)[kh].contiguous().requires_grad_()
                # Masked by selection, not by adding -inf, so that a row's NaN or inf (a visible non-finite key)
                # reaches neither the masked P nor, through the backward, the masked keys. Rows without a
                # visible key are unmasked here (a finite softmax) and zeroed in p.
                sc = qc @ kc.transpose(-1, -2)
                sc.retain_grad()
                x = torch.where(keep | ~has_keys[:, None], sc * scale, -math.inf)
                l = torch.where(has_keys, x.logsumexp(-1), -math.inf)
                p = torch.where(keep & has_keys[:, None], torch.softmax(x, -1), 0.0)
                o = p @ vc
                do = dout[q0 + r0:q0 + r1, h0:h1].float().transpose(0, 1)
                o.backward(do)
                out[q0 + r0:q0 + r1, h0:h1] = o.detach().transpose(0, 1)
                lse[q0 + r0:q0 + r1, h0:h1] = l.detach().transpose(0, 1)
                dq[q0 + r0:q0 + r1, h0:h1] = qc.grad.transpose(0, 1)
                p_q = p.detach().to(q.dtype).float()
                gk, gv, gv_p = kc.grad, vc.grad, p_q.transpose(-1, -2) @ do
                bad_q, bad_do = ~torch.isfinite(qc.detach()).all(-1), ~torch.isfinite(do).all(-1)
                seen = keep & has_keys[:, None]
                if bool(bad_q.any()):
                    gk = seen_keys_only(sc.grad, qc.detach(), seen, bad_q)
                if bool(bad_do.any()):
                    gv = seen_keys_only(p.detach(), do, seen, bad_do)
                    gv_p = seen_keys_only(p_q, do, seen, bad_do)
                for acc, grad in ((dk, gk), (dv, gv), (dv_p, gv_p)):
                    full = torch.zeros(h1 - h0, s_k, grad.shape[-1], device=q.device)
                    full[:, keys] = grad
                    acc[k0:k1].index_add_(1, kh, full.transpose(0, 1))
                del x, p, o, p_q, sc
    return out, lse, dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dv_p.to(q.dtype)


# ----------------------------------------------------------------------------- helpers
def poison_allocator(nbytes):
    """Free a NaN-filled block of `nbytes` into the caching allocator (see the module docstring)."""
    block = torch.full((max(nbytes // 4, 1),), float("nan"), dtype=torch.float32, device=DEV)
    del block


def run_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, **kw):
    poison_allocator((q.shape[0] * q.shape[1] * (v.shape[2] * q.element_size() + 4)) + (1 << 20))
    return flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                            **kw)


def run_bwd(out, dout, q, k, v):
    for t in (q, k, v):
        t.grad = None
    poison_allocator((q.numel() + k.numel() + v.numel()) * q.element_size() + (1 << 20))
    out.backward(dout, retain_graph=True)
    return q.grad.clone(), k.grad.clone(), v.grad.clone()


def make_lengths(b, mean_sq, mean_sk, varlen):
    seqlens_q = [mean_sq] * b
    seqlens_k = [mean_sk] * b
    if varlen:
        for i in range(b):
            seqlens_q[i] = int(max(random.normalvariate(mean_sq, mean_sq / 2), 1))
        for i in range(b):
            seqlens_k[i] = int(max(random.normalvariate(mean_sk, mean_sk / 2), seqlens_q[i]))
    return seqlens_q, seqlens_k


def cumulative(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int32, device=DEV).cumsum(0, dtype=torch.int32)


def check_dgrads(grads, refs, fmha_rule):
    """dq, dk against the float32 reference with §5.5's tolerances. dv: every element against the
    reference whose P is rounded to q's dtype (dv_p), and the cosine against the float32 one. A bf16 P
    is off by up to 2^-9 relative; where dV sums many large P (the first keys of a causal request,
    which the first query rows weight by 1, 1/2, 1/3, ...; GQA's group of query heads; short s_k) that
    reaches 1e-3 on elements of |dv| < 0.016, which §5.5's per-element rule against a float32
    reference cannot hold (it fails the same way on an emulation of the rounding alone). Where
    FlashMLA's test checks the backward (its §5.5 configurations with h == h_k), §5.5's per-element
    rule against float32 holds and is checked too (fmha_rule)."""
    (dq, dk, dv), (ref_dq, ref_dk, ref_dv, ref_dv_p) = grads, refs
    check_close("dq", dq, ref_dq, **OUT_TOL)
    check_close("dk", dk, ref_dk, **OUT_TOL)
    check_close("dv (P rounded as the kernel)", dv, ref_dv_p, **OUT_TOL)
    check_close("dv (cosine vs float32)", dv, ref_dv, abs_tol=math.inf, rel_tol=math.inf, cos_tol=OUT_TOL["cos_tol"])
    if fmha_rule:
        check_close("dv", dv, ref_dv, **OUT_TOL)


def check_case(seqlens_q, seqlens_k, h, h_k, d, dv, causal, dtype=torch.bfloat16, has_bwd=True, correctness=True,
               repeats=5, varlen=True, scale=None, data_scale=0.1, fmha_rule=False):
    cu_q, cu_k = cumulative(seqlens_q), cumulative(seqlens_k)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    max_q, max_k = max(seqlens_q), max(seqlens_k)
    q = (torch.randn(total_q, h, d, device=DEV) * data_scale).to(dtype)
    k = (torch.randn(total_k, h_k, d, device=DEV) * data_scale).to(dtype)
    v = (torch.randn(total_k, h_k, dv, device=DEV) * data_scale).to(dtype)
    dout = (torch.randn(total_q, h, dv, device=DEV) * data_scale).to(dtype)
    scale = (d + 100) ** -0.5 if scale is None else scale
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = run_fwd(q1, k1, v1, cu_q, cu_k, max_q, max_k, scale, causal, is_varlen=varlen)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == (total_q, h) and lse.stride() == (1, total_q)
    grads = run_bwd(out, dout, q1, k1, v1) if has_bwd else None
    if correctness:
        ref_out, ref_lse, ref_dq, ref_dk, ref_dv, ref_dv_p = reference(q, k, v, cu_q, cu_k, scale, causal, dout)
        check_close("out", out.float(), ref_out, **OUT_TOL)
        check_close("lse", lse, ref_lse, **LSE_TOL)
        if has_bwd:
            check_dgrads(grads, (ref_dq, ref_dk, ref_dv, ref_dv_p), fmha_rule)
    for _ in range(repeats):
        out_r, lse_r = run_fwd(q1, k1, v1, cu_q, cu_k, max_q, max_k, scale, causal, is_varlen=varlen)
        assert torch.equal(out_r, out), "out deterministic check failed"
        assert torch.equal(lse_r, lse), "lse deterministic check failed"
        if has_bwd:
            again = run_bwd(out_r, dout, q1, k1, v1)
            for name, a, b in zip(("dq", "dk", "dv"), again, grads):
                assert torch.equal(a, b), f"{name} deterministic check failed"
    return out, lse, grads, (q, k, v, dout, cu_q, cu_k, scale)


# ----------------------------------------------------------------------------- spec §5.5
FMHA_CONFIGS = [
    (mean, varlen, heads, dims, causal)
    for mean in (4096, 8192)
    for varlen in (False, True)
    for heads in ((128, 128), (32, 4))
    for dims in ((128, 128), (192, 128))
    for causal in (False, True)
]


@pytest.mark.parametrize("mean,varlen,heads,dims,causal", FMHA_CONFIGS,
                         ids=[f"s{m}-{'varlen' if vl else 'fixed'}-h{h[0]}_{h[1]}-d{d[0]}_{d[1]}-"
                              f"{'causal' if c else 'full'}" for m, vl, h, d, c in FMHA_CONFIGS])
def test_fmha_sm100_configurations(mean, varlen, heads, dims, causal):
    torch.manual_seed(0)
    random.seed(0)
    seqlens_q, seqlens_k = make_lengths(2, mean, mean, varlen)
    correctness = not (mean == 8192 and heads[0] == 128)
    check_case(seqlens_q, seqlens_k, *heads, *dims, causal, has_bwd=True, correctness=correctness,
               varlen=varlen, fmha_rule=heads[0] == heads[1])


# ----------------------------------------------------------------------------- short / ragged / empty
RAGGED = {
    "ones": ([1, 1, 1], [1, 1, 1]),
    "sevens": ([7, 7], [7, 7]),
    "mixed": ([1, 7, 63, 129], [7, 1, 129, 63]),
    "empty": ([0, 7, 5, 0, 129], [3, 0, 9, 0, 200]),
    "sq_gt_sk": ([129, 63], [7, 1]),
    "sq_lt_sk": ([7, 63], [129, 300]),
}


@pytest.mark.parametrize("lens", list(RAGGED))
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_short_ragged_and_empty(lens, dims, causal, heads, dtype):
    torch.manual_seed(zlib.crc32(repr((lens, dims, causal, heads, str(dtype))).encode()))
    seqlens_q, seqlens_k = RAGGED[lens]
    out, lse, grads, (q, k, v, dout, cu_q, cu_k, scale) = check_case(
        seqlens_q, seqlens_k, *heads, *dims, causal, dtype=dtype, repeats=2)
    # Rows without a visible key: out exactly 0, lse exactly -inf, dq 0.
    empty = torch.isneginf(lse)
    assert torch.all(out[empty] == 0) and torch.all(grads[0][empty] == 0)


def test_packed_and_is_varlen_false():
    torch.manual_seed(5)
    h, d, dv = 8, 192, 128
    s = 100
    qkv = (torch.randn(3 * s, h, 2 * d + dv, device=DEV) * 0.1).bfloat16().requires_grad_()
    cu = cumulative([s, s, s])
    out, lse = flash_mla.flash_attn_varlen_qkvpacked_func(qkv, cu, s, d, causal=True)
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    out2, lse2 = flash_mla.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    garbage = torch.tensor([0, 5, 6, 7], dtype=torch.int32, device=DEV)
    out3, lse3 = flash_mla.flash_attn_varlen_func(q, k, v, garbage, garbage, 1, 1, causal=True, is_varlen=False)
    assert torch.equal(out, out3) and torch.equal(lse, lse3)
    dout = torch.randn_like(out) * 0.1
    out.backward(dout)
    ref = reference(q.detach(), k.detach(), v.detach(), cu, cu, d ** -0.5, True, dout)
    check_dgrads([g.contiguous() for g in (qkv.grad[..., :d], qkv.grad[..., d:2 * d], qkv.grad[..., 2 * d:])],
                 ref[2:], fmha_rule=False)


def test_nan_propagation_and_unread_keys():
    torch.manual_seed(6)
    s_q, s_k, h, d = 200, 260, 4, 128
    q = torch.randn(s_q, h, d, device=DEV).bfloat16()
    k = torch.randn(s_k, 1, d, device=DEV).bfloat16()
    v = torch.randn(s_k, 1, d, device=DEV).bfloat16()
    cu_q, cu_k = cumulative([s_q]), cumulative([s_k])
    q[10, 2, 3] = float("nan")  # row 10 head 2
    k[150, 0, 0] = float("nan")  # key 150: rows r with r + 60 >= 150, i.e. r >= 90 (causal)
    out, lse = flash_mla.flash_attn_varlen_func(q, k, v, cu_q, cu_k, s_q, s_k, causal=True)
    expect = torch.zeros(s_q, h, dtype=torch.bool, device=DEV)
    expect[90:] = True
    expect[10, 2] = True
    assert torch.equal(torch.isnan(lse), expect)
    assert torch.equal(torch.isnan(out).any(-1), expect)
    # A NaN in another request's key or value is never read.
    k3 = torch.randn(160, 1, d, device=DEV).bfloat16()
    v3 = torch.randn(160, 1, d, device=DEV).bfloat16()
    k3[155, 0, 1] = float("nan")
    v3[152, 0, 7] = float("nan")
    q3 = torch.randn(100, h, d, device=DEV).bfloat16()
    out3, lse3 = flash_mla.flash_attn_varlen_func(q3, k3, v3, cumulative([50, 50]), cumulative([150, 10]), 50, 150)
    assert not torch.isnan(out3[:50]).any() and not torch.isnan(lse3[:50]).any()
    assert torch.isnan(lse3[50:]).all() and torch.isnan(out3[50:]).any(-1).all()


# ----------------------------------------------------------------------------- NaN / inf in masked keys
def diagonal_keys(s_q, s_k):
    """Keys of a causal request (bottom-right) in its diagonal block that the first rows do not see: the key
    first seen by row ceil(2 s_q / 3) and the last key (seen by the last row only)."""
    off = s_k - s_q
    return sorted({off + max(1, -(-2 * s_q // 3)), s_k - 1} & set(range(max(off + 1, 0), s_k)))


def nonfinite_checked(name, ans, ref, nan_only):
    """(ans, ref) for check_close once their non-finite positions are checked. A NaN in the inputs gives NaN
    (nan_only: returned as they are; check_close compares the NaN and +-inf positions exactly). An inf gives
    NaN or +-inf depending on the order of the operations (inf - inf in a softmax, 0 * inf in a rescaling),
    so with infs the non-finite positions must agree and are zeroed in both."""
    if nan_only:
        return ans, ref
    bad_a, bad_r = ~torch.isfinite(ans), ~torch.isfinite(ref.to(ans.device))
    if not torch.equal(bad_a, bad_r):
        first = (bad_a != bad_r).nonzero()[0].tolist()
        raise AssertionError(f"{name}: non-finite positions differ: {int(bad_a.sum())} in answer, {int(bad_r.sum())} "
                             f"in reference; first at {first}: ans={ans[tuple(first)].item()} "
                             f"ref={ref[tuple(first)].item()}")
    return ans.masked_fill(bad_a, 0), ref.to(ans.device).masked_fill(bad_r, 0)


def run_fwd_bwd(q, k, v, dout, cu_q, cu_k, lens_q, lens_k, scale, causal):
    """out, lse, dq, dk, dv of one forward and backward on copies of q, k, v."""
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = run_fwd(q1, k1, v1, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal)
    return (out, lse, *run_bwd(out, dout, q1, k1, v1))


def run_poisoned_checked(q, k, v, dout, cu_q, cu_k, lens_q, lens_k, scale, causal, poison):
    """run_fwd_bwd on inputs holding NaN / inf, every result checked against the reference (non-finite positions
    equal, NaN only where poison is "nan"); returns out, lse, dq, dk, dv."""
    out, lse, dq, dk, dv = run_fwd_bwd(q, k, v, dout, cu_q, cu_k, lens_q, lens_k, scale, causal)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv, ref_dv_p = reference(q, k, v, cu_q, cu_k, scale, causal, dout)
    nan_only = poison == "nan"
    check_close("out", *nonfinite_checked("out", out.float(), ref_out, nan_only), **OUT_TOL)
    check_close("lse", *nonfinite_checked("lse", lse, ref_lse, nan_only), **LSE_TOL)
    pairs = [nonfinite_checked(n, a, r, nan_only) for n, a, r in
             (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv), ("dv (P rounded)", dv, ref_dv_p))]
    check_dgrads([a for a, _ in pairs[:3]], [r for _, r in pairs], fmha_rule=False)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("offset", [0, 1, 37, 70])
@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("where", ["k", "v", "kv"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_masked_keys_holding_nan_or_inf(offset, poison, where, dims, heads):
    """Causal (bottom-right), s_k = s_q + offset for s_q 7 / 63 / 129 / 200 / 520: keys of the diagonal block that
    the first rows do not see hold NaN or inf in k and / or v (diagonal_keys; one request has it in the key
    right of the first row's last, one has s_q > s_k, one is clean). out, lse, dq, dk, dv equal the reference,
    which reads no key a row does not see (reference: row_segments), non-finite where it is; and the rows that
    see no poisoned key get the same bits as with finite values in those keys (dv everywhere, and lse, when
    only v is poisoned: neither reads v)."""
    torch.manual_seed(zlib.crc32(repr((offset, poison, where, dims, heads)).encode()))
    # s_q 520: the last key lies in the checked block of a tile with 4 blocks before it, which the persistent forward
    # scans in global memory first (fwd.cu, kPrescanAfter); the tile of rows 384-511 has a clean one.
    reqs = [(s_q, s_q + offset, diagonal_keys(s_q, s_q + offset)) for s_q in (7, 63, 129, 200, 520)]
    reqs += [(129, 129 + offset, [offset + 1]), (40, 25, diagonal_keys(40, 25)), (63, 63 + offset, [])]
    (h, h_k), (d, d_v) = heads, dims
    cu_q, cu_k = cumulative([r[0] for r in reqs]), cumulative([r[1] for r in reqs])
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    max_q, max_k = max(r[0] for r in reqs), max(r[1] for r in reqs)
    q = (torch.randn(total_q, h, d, device=DEV) * 0.1).bfloat16()
    k_fin = (torch.randn(total_k, h_k, d, device=DEV) * 0.1).bfloat16()
    v_fin = (torch.randn(total_k, h_k, d_v, device=DEV) * 0.1).bfloat16()
    dout = (torch.randn(total_q, h, d_v, device=DEV) * 0.1).bfloat16()
    k, v = k_fin.clone(), v_fin.clone()
    clean = torch.ones(total_q, dtype=torch.bool, device=DEV)  # rows that see no poisoned key
    val = float(poison)
    for (s_q, s_k, keys), q0, k0 in zip(reqs, cu_q.tolist(), cu_k.tolist()):
        for j in keys:
            if "k" in where:
                k[k0 + j, :, 3] = val
            if "v" in where:
                v[k0 + j, :, 5] = -val
        if keys:
            clean[q0 + max(min(keys) - (s_k - s_q), 0):q0 + s_q] = False
    assert 0 < int(clean.sum()) < total_q
    scale = (d + 100) ** -0.5

    lens = ([max_q], [max_k])  # (run_fwd_bwd takes the maxima of the length lists)
    out, lse, dq, dk, dv = run_poisoned_checked(q, k, v, dout, cu_q, cu_k, *lens, scale, True, poison)
    out_f, lse_f, dq_f, dk_f, dv_f = run_fwd_bwd(q, k_fin, v_fin, dout, cu_q, cu_k, *lens, scale, True)
    for name, a, b in (("out", out, out_f), ("lse", lse, lse_f), ("dq", dq, dq_f)):
        finite = torch.isfinite(a[clean]) | (torch.isneginf(a[clean]) if name == "lse" else False)  # no keys: -inf
        assert bool(finite.all()), f"{name}: a row that sees no poisoned key is not finite"
        assert torch.equal(a[clean], b[clean]), f"{name}: a row that sees no poisoned key depends on one"
    if where == "v":
        assert torch.equal(lse, lse_f) and torch.equal(dv, dv_f) and bool(torch.isfinite(dv).all())


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "dout"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_query_rows_holding_nan_or_inf(poison, where, dims, heads):
    """Causal: one query row per request (row s_q // 3) holds NaN or inf in q or dout (one element, every head).
    Its own outputs and the dk / dv of the keys it sees are non-finite as the reference's; the dk / dv of the
    keys it does not see, and the other rows' out, lse and dq, get the bits of a run with finite values there
    (the dk / dv kernel multiplies that row's q / dout by the masked 0s of those keys)."""
    torch.manual_seed(zlib.crc32(repr(("rows", poison, where, dims, heads)).encode()))
    lens_q, lens_k = [7, 63, 129, 200, 63], [7, 80, 129, 230, 63]
    (h, h_k), (d, d_v) = heads, dims
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q_fin = (torch.randn(total_q, h, d, device=DEV) * 0.1).bfloat16()
    k = (torch.randn(total_k, h_k, d, device=DEV) * 0.1).bfloat16()
    v = (torch.randn(total_k, h_k, d_v, device=DEV) * 0.1).bfloat16()
    dout_fin = (torch.randn(total_q, h, d_v, device=DEV) * 0.1).bfloat16()
    q, dout = q_fin.clone(), dout_fin.clone()
    other_rows = torch.ones(total_q, dtype=torch.bool, device=DEV)
    unseen_keys = torch.zeros(total_k, dtype=torch.bool, device=DEV)  # keys the poisoned row does not see
    val = float(poison)
    for i in range(len(lens_q) - 1):  # the last request stays clean
        q0, k0, s_q, s_k = int(cu_q[i]), int(cu_k[i]), lens_q[i], lens_k[i]
        r = s_q // 3
        (q if where == "q" else dout)[q0 + r, :, 3] = val
        other_rows[q0 + r] = False
        unseen_keys[k0 + r + s_k - s_q + 1:k0 + s_k] = True
    unseen_keys[int(cu_k[-2]):] = True
    scale = (d + 100) ** -0.5

    out, lse, dq, dk, dv = run_poisoned_checked(q, k, v, dout, cu_q, cu_k, lens_q, lens_k, scale, True, poison)
    out_f, lse_f, dq_f, dk_f, dv_f = run_fwd_bwd(q_fin, k, v, dout_fin, cu_q, cu_k, lens_q, lens_k, scale, True)
    for name, a, b, sel in (("out", out, out_f, other_rows), ("lse", lse, lse_f, other_rows),
                            ("dq", dq, dq_f, other_rows), ("dk", dk, dk_f, unseen_keys), ("dv", dv, dv_f, unseen_keys)):
        assert bool(torch.isfinite(a[sel]).all()), f"{name}: not finite where no poisoned row reaches"
        assert torch.equal(a[sel], b[sel]), f"{name}: depends on a query row it does not see / is not"


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
def test_next_request_keys_holding_nan_or_inf(poison, causal, dims):
    """Varlen: a request's last key block runs past its end into the next request's keys (the TMA forward loads
    those rows; the cp.async producers zero-fill them), and its last query block past its end (zero-filled).
    Every k and v row of requests 1 and 3 holds NaN (or +inf in k, -inf in v): their outputs are non-finite as
    the reference's, and requests 0 and 2 (s_k 9 and 200: blocks of 64 and 128 keys end inside the next
    request) get out, lse, dq, dk and dv finite and bit-identical to a run with finite values there."""
    torch.manual_seed(zlib.crc32(repr(("next", poison, causal, dims)).encode()))
    lens_q, lens_k = [7, 50, 129, 30], [9, 60, 200, 40]
    (d, d_v), h, h_k = dims, 8, 2
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = (torch.randn(total_q, h, d, device=DEV) * 0.1).bfloat16()
    k_fin = (torch.randn(total_k, h_k, d, device=DEV) * 0.1).bfloat16()
    v_fin = (torch.randn(total_k, h_k, d_v, device=DEV) * 0.1).bfloat16()
    dout = (torch.randn(total_q, h, d_v, device=DEV) * 0.1).bfloat16()
    k, v = k_fin.clone(), v_fin.clone()
    val = float(poison)
    clean_q = torch.zeros(total_q, dtype=torch.bool, device=DEV)
    clean_k = torch.zeros(total_k, dtype=torch.bool, device=DEV)
    for i in range(len(lens_q)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if i % 2:
            k[ks], v[ks] = val, -val
        else:
            clean_q[qs], clean_k[ks] = True, True
    scale = (d + 100) ** -0.5

    out, lse, dq, dk, dv = run_poisoned_checked(q, k, v, dout, cu_q, cu_k, lens_q, lens_k, scale, causal, poison)
    out_f, lse_f, dq_f, dk_f, dv_f = run_fwd_bwd(q, k_fin, v_fin, dout, cu_q, cu_k, lens_q, lens_k, scale, causal)
    for name, a, b, rows in (("out", out, out_f, clean_q), ("lse", lse, lse_f, clean_q), ("dq", dq, dq_f, clean_q),
                             ("dk", dk, dk_f, clean_k), ("dv", dv, dv_f, clean_k)):
        finite = torch.isfinite(a[rows]) | (torch.isneginf(a[rows]) if name == "lse" else False)
        assert bool(finite.all()), f"{name}: a request next to one with non-finite keys is not finite"
        assert torch.equal(a[rows], b[rows]), f"{name}: a request depends on the next request's keys"


def test_other_frameworks_agree_with_torch():
    """CuPy (fp16: CuPy has no bfloat16) and JAX on the GPU: the plain forward / backward (CuPy) and the
    custom_vjp (JAX) give the same bits as the torch path."""
    torch.manual_seed(7)
    h, d, dv = 4, 128, 128
    lens_q, lens_k = [7, 63, 1], [9, 63, 129]
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    q = (torch.randn(int(cu_q[-1]), h, d, device=DEV) * 0.1).half()
    k = (torch.randn(int(cu_k[-1]), 2, d, device=DEV) * 0.1).half()
    v = (torch.randn(int(cu_k[-1]), 2, dv, device=DEV) * 0.1).half()
    dout = (torch.randn(int(cu_q[-1]), h, dv, device=DEV) * 0.1).half()
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_mla.flash_attn_varlen_func(qt, kt, vt, cu_q, cu_k, 63, 129, causal=True)
    out.backward(dout)
    ran = []
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        c = [cupy.from_dlpack(t.detach()) for t in (q, k, v, cu_q, cu_k, dout)]
        o_c, l_c = flash_mla.flash_attn_varlen_func(*c[:5], 63, 129, causal=True)
        assert isinstance(o_c, cupy.ndarray)
        assert torch.equal(torch.from_dlpack(o_c), out) and torch.equal(torch.from_dlpack(l_c), lse)
        g_c = flash_mla.flash_attn_varlen_backward(c[5], *c[:3], o_c, l_c, c[3], c[4], 63, 129, causal=True)
        for a, b in zip(g_c, (qt.grad, kt.grad, vt.grad)):
            assert torch.equal(torch.from_dlpack(a), b)
        ran.append("cupy")
    try:
        import jax
        import jax_tvm_ffi  # noqa: F401

        gpus = jax.devices("gpu")
    except (ImportError, RuntimeError):
        gpus = []
    if gpus and DEV == "cuda":
        import numpy as np

        put = lambda t: jax.device_put(t.detach().cpu().numpy(), gpus[0])  # noqa: E731
        jq, jk, jv, jcq, jck, jdo = (put(t) for t in (q, k, v, cu_q, cu_k, dout))

        def loss(a, b, c):
            o, _ = flash_mla.flash_attn_varlen_func(a, b, c, jcq, jck, 63, 129, causal=True)
            return jax.numpy.sum(o.astype(jax.numpy.float32) * jdo.astype(jax.numpy.float32))

        o_j, l_j = flash_mla.flash_attn_varlen_func(jq, jk, jv, jcq, jck, 63, 129, causal=True)
        np.testing.assert_array_equal(np.asarray(o_j), out.detach().cpu().numpy())
        np.testing.assert_array_equal(np.asarray(l_j), lse.cpu().numpy())
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
        for a, b in zip(grads, (qt.grad, kt.grad, vt.grad)):
            np.testing.assert_array_equal(np.asarray(a), b.cpu().numpy())
        ran.append("jax")
    if not ran:
        pytest.skip("neither CuPy nor JAX with a GPU backend and jax-tvm-ffi is installed")
