#!/usr/bin/env python3
"""Standalone GPU check of the sm90 dense MHA prefill kernels (src/sm90/prefill/dense/), through the ctypes
library that tools/dense-prefill-gpu-check.sh builds. Prints everything and writes a JSON summary.

1. reference self-test: the float32 reference's hand-written backward against torch autograd (small case);
2. correctness (spec §5.5's comparator and tolerances: out / dq / dk / dv abs 1e-3 or rel 8.01/128, cos 7e-6;
   lse abs 1e-6 or rel 2.01/65536; inf / NaN positions equal) on spec §5.5's configurations (b 2, mean s
   4096 and 8192 with h 32/4 at 8192 as the spec, varlen and not, h 128/128 and 32/4, d 128/192, causal and
   not; backward for GQA too), outputs poisoned with NaN before every call, lse in FlashMLA's (1, total_q)
   strides;
3. extra cases: lengths 1, 7, 63, 129, s_q != s_k both ways, empty requests, rows without a visible key,
   fp16, strided (packed qkv) inputs, contiguous lse, NaN in q, in k and in the next request's v;
4. determinism: 5 forwards (out, lse) and 3 backwards (dq, dk, dv) bitwise equal, per schedule;
   every correctness case also checks every forward schedule (serial, overlap, pingpong, pingpong_tma,
   persistent_tma, it with the folded scale, with 176-key blocks, with the tiles by block, and on 2 CTAs) and backward
   schedule (two_kernel, two_kernel_tma, and it with both kernels' CTAs by head and by block on every shape;
   dense_prefill.h), unless --no-variants; the schedules of SAME_BITS (another order of the same tiles) bitwise equal
   to the one they name;
5. performance on the 16 shapes of ../shared/anchors-h200.md's dense MHA table against torch SDPA's cuDNN
   backend in the same process (FLOPs as spec §5.5: fwd = pairs * h * 2 (d + dv), bwd = pairs * h * 2 (3d + 2dv)).
Exit status 1 if any check fails."""
import argparse
import json
import math
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dense_prefill_lib import DensePrefillLib  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

FAILURES = []
OUT_DIR = {"path": "."}
VARIANTS = {"on": True}  # also check / time the non-default schedules (--no-variants turns it off)
FWD_SCHEDULES = ("serial", "overlap", "pingpong", "pingpong_tma", "persistent_tma", "persistent_tma_fold",
                 "persistent_tma_fold_k176", "persistent_tma_fold_by_block", "persistent_tma_2cta",
                 "persistent_tma_k176_2cta", "persistent_tma_fold_by_block_2cta")
# The *_2cta schedules (the persistent grid capped at 2 CTAs: every case walks many tiles per CTA) are checked, not timed.
FWD_PERF_SCHEDULES = tuple(s for s in FWD_SCHEDULES if not s.endswith("_2cta"))
BWD_SCHEDULES = ("two_kernel", "two_kernel_tma", "two_kernel_tma_by_head", "two_kernel_tma_by_block")
# Schedules that compute every tile as another one does, in another order or on fewer CTAs: their outputs must be
# bitwise equal to that one's (schedule -> the schedule it must equal).
SAME_BITS = {"persistent_tma_fold_by_block": "persistent_tma_fold",
             "persistent_tma_fold_by_block_2cta": "persistent_tma_fold",
             "two_kernel_tma_by_block": "two_kernel_tma_by_head"}
RESULTS = {"correctness": [], "determinism": [], "perf": []}


# ------------------------------------------------------------------------------------ comparator (spec §5.1)
def same_bits_check(name, outs, refs):
    """A check entry (check_close's fields): every tensor of outs bitwise equal to its counterpart in refs (NaN
    payloads included); max_abs is the largest finite difference."""
    same = all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                         b.contiguous().view(torch.uint8))
               for a, b in zip(outs, refs))
    diff = max(float((a.float() - b.float()).nan_to_num(0.0, 0.0, 0.0).abs().max()) if a.numel() else 0.0
               for a, b in zip(outs, refs))
    return {"name": name, "ok": same, "max_abs": diff, "cos_diff": 0.0, "max_rel_where_abs_fails": 0.0,
            "msg": "" if same else "not bitwise equal"}


def check_close(name, ans, ref, abs_tol, rel_tol, cos_tol, nan_required=None):
    """nan_required (a boolean mask, or None): NaN must appear at least there and at most where the
    reference has NaN. For a NaN query row under a causal mask the kernels may leave the keys the row does
    not see finite (their dS entries are structural zeros), where the dense reference multiplies those
    zeros by the NaN; without it the NaN positions must be equal."""
    a, r = ans.float(), ref.float()
    msg = []
    checks = [("+inf", a == math.inf, r == math.inf), ("-inf", a == -math.inf, r == -math.inf)]
    if nan_required is None:
        checks.append(("nan", torch.isnan(a), torch.isnan(r)))
    else:
        na, nr = torch.isnan(a), torch.isnan(r)
        if bool((nan_required & ~na).any()) or bool((na & ~nr).any()):
            msg.append(f"nan positions outside [required, reference] ({int(na.sum())}: required "
                       f"{int(nan_required.sum())}, reference {int(nr.sum())})")
    for what, fa, fr in checks:
        if not torch.equal(fa, fr):
            msg.append(f"{what} positions differ ({int(fa.sum())} vs {int(fr.sum())} in ref)")
    bad = torch.isinf(a) | torch.isnan(a) | torch.isinf(r) | torch.isnan(r)
    a = torch.where(bad, torch.zeros_like(a), a)
    r = torch.where(bad, torch.zeros_like(r), r)
    diff = (a - r).abs()
    ok = (diff < abs_tol) | (diff / (r.abs() + 1e-6) < rel_tol)
    n_bad = int((~ok).sum())
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float((diff / (r.abs() + 1e-6)).max()) if diff.numel() else 0.0
    a64, r64 = a.double(), r.double()
    denom = float((a64 * a64 + r64 * r64).sum())
    cos = 0.0 if float((r64 * r64).sum()) < 1e-12 else 1.0 - 2.0 * float((a64 * r64).sum()) / denom
    if n_bad:
        msg.append(f"{n_bad} elements out of tolerance")
    if abs(cos) > cos_tol:
        msg.append(f"cos_diff {cos:.3g} > {cos_tol}")
    return {"name": name, "max_abs": max_abs, "max_rel_where_abs_fails": max_rel, "cos_diff": cos, "ok": not msg,
            "msg": "; ".join(msg)}


TOL = {"out": (1e-3, 8.01 / 128, 7e-6), "lse": (1e-6, 2.01 / 65536, 1e-7), "dq": (1e-3, 8.01 / 128, 7e-6),
       "dk": (1e-3, 8.01 / 128, 7e-6), "dv": (1e-3, 8.01 / 128, 7e-6)}


# --------------------------------------------------------------------------------------- float32 reference
def ref_attention(q, k, v, cu_q, cu_k, scale, causal, dout=None):
    """float32 forward (out, lse natural) and, with dout, the backward (dq, dk, dv, dv_p) by the textbook
    formulas (checked against autograd in ref_selftest). dv_p is dV = P^T dO with P rounded to q's dtype
    first, as the kernels (and FlashAttention) compute it: a bf16 P alone puts ~1e-3 on small dv elements
    of GQA, causal-first-key and short-s_k cases, so dv is checked per element against dv_p and by cosine
    against the float32 dv. Heads processed in chunks to bound memory."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    total_q, h_q, d = q.shape
    h_kv, dv_ = k.shape[1], v.shape[2]
    g = h_q // h_kv
    out = torch.zeros(total_q, h_q, dv_, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, h_q), -math.inf, dtype=torch.float32, device=q.device)
    grads = None
    if dout is not None:
        grads = (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                 torch.zeros(k.shape, dtype=torch.float32, device=q.device),
                 torch.zeros(v.shape, dtype=torch.float32, device=q.device),
                 torch.zeros(v.shape, dtype=torch.float32, device=q.device))
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        sq, sk = q1 - q0, k1 - k0
        if sq == 0:
            continue
        if sk == 0:
            continue  # out 0, lse -inf, grads 0
        chunk = max(1, min(h_q, (1 << 28) // (sq * sk)))
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        vis = (j <= i + sk - sq) if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        row_any = vis.any(dim=1)
        for h0 in range(0, h_q, chunk):
            hs = list(range(h0, min(h_q, h0 + chunk)))
            qh = q[q0:q1, hs].float().transpose(0, 1)                     # (c, sq, d)
            kh = k[k0:k1, [x // g for x in hs]].float().transpose(0, 1)   # (c, sk, d)
            vh = v[k0:k1, [x // g for x in hs]].float().transpose(0, 1)   # (c, sk, dv)
            s = torch.matmul(qh, kh.transpose(1, 2)) * scale
            s = s.masked_fill(~vis, -math.inf)
            l = torch.logsumexp(s, dim=-1)                                # -inf for rows without keys
            p = torch.exp(s - torch.where(row_any[None, :], l, torch.zeros_like(l))[..., None])
            p = p.masked_fill(~vis, 0.0)
            o = torch.matmul(p, vh)
            out[q0:q1, hs] = o.transpose(0, 1)
            lse[q0:q1, hs] = l.transpose(0, 1)
            if dout is not None:
                do = dout[q0:q1, hs].float().transpose(0, 1)
                dvh = torch.matmul(p.transpose(1, 2), do)
                dvh_p = torch.matmul(p.to(q.dtype).float().transpose(1, 2), do)
                dp = torch.matmul(do, vh.transpose(1, 2))
                dd = (do * o).sum(-1, keepdim=True)
                ds = p * (dp - dd)
                dqh = torch.matmul(ds, kh) * scale
                dkh = torch.matmul(ds.transpose(1, 2), qh) * scale
                grads[0][q0:q1, hs] = dqh.transpose(0, 1)
                for c, x in enumerate(hs):  # GQA: sum over the group
                    grads[1][k0:k1, x // g] += dkh[c]
                    grads[2][k0:k1, x // g] += dvh[c]
                    grads[3][k0:k1, x // g] += dvh_p[c]
    return out, lse, grads


def ref_selftest(dev):
    torch.manual_seed(1)
    cu_q = torch.tensor([0, 5, 5, 17, 30], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 9, 12, 12, 40], dtype=torch.int32, device=dev)
    for causal in (False, True):
        q = torch.randn(30, 4, 16, device=dev, dtype=torch.float64, requires_grad=True)
        k = torch.randn(40, 2, 16, device=dev, dtype=torch.float64, requires_grad=True)
        v = torch.randn(40, 2, 8, device=dev, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(30, 4, 8, device=dev, dtype=torch.float64)
        outs = []
        for b in range(4):
            q0, q1, k0, k1 = [int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1])]
            sq, sk = q1 - q0, k1 - k0
            if sq == 0:
                continue
            if sk == 0:
                outs.append(torch.zeros(sq, 4, 8, dtype=torch.float64, device=dev) + 0 * q[q0:q1, :, :8])
                continue
            qh = q[q0:q1].transpose(0, 1)
            kh = k[k0:k1].repeat_interleave(2, dim=1).transpose(0, 1)
            vh = v[k0:k1].repeat_interleave(2, dim=1).transpose(0, 1)
            s = qh @ kh.transpose(1, 2) * 0.3
            i = torch.arange(sq, device=dev)[:, None]
            j = torch.arange(sk, device=dev)[None, :]
            vis = (j <= i + sk - sq) if causal else torch.ones(sq, sk, dtype=torch.bool, device=dev)
            s = s.masked_fill(~vis, -math.inf)
            p = torch.softmax(s, -1).nan_to_num(0.0)
            outs.append((p @ vh).transpose(0, 1))
        o = torch.cat(outs, 0)
        o.backward(dout)
        ro, _, (rdq, rdk, rdv, _) = ref_attention(q.detach().float(), k.detach().float(), v.detach().float(), cu_q, cu_k,
                                               0.3, causal, dout.float())
        for name, a, r in (("out", ro, o.detach()), ("dq", rdq, q.grad), ("dk", rdk, k.grad), ("dv", rdv, v.grad)):
            err = float((a.double() - r).abs().max())
            print(f"  reference self-test causal={causal} {name}: max |float32 formula - float64 autograd| = {err:.2e}")
            if not err < 1e-4:
                FAILURES.append(f"reference self-test {name} causal={causal}: {err}")


# ----------------------------------------------------------------------------------------------- inputs
def make_lengths(b, mean_q, mean_k, varlen, rng):
    if not varlen:
        return [mean_q] * b, [mean_k] * b
    lq = [max(int(rng.normalvariate(mean_q, mean_q / 2)), 1) for _ in range(b)]
    lk = [max(int(rng.normalvariate(mean_k, mean_k / 2)), lq[i]) for i in range(b)]
    return lq, lk


def make_inputs(lq, lk, h_q, h_kv, d, dv, dtype, dev, packed=False):
    total_q, total_k = sum(lq), sum(lk)
    cu_q = torch.tensor([0] + list(_cumsum(lq)), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + list(_cumsum(lk)), dtype=torch.int32, device=dev)
    if packed:  # q, k, v as slices of a (total, h, d + d + dv) buffer (strided rows), total_q == total_k
        assert total_q == total_k and h_q == h_kv
        qkv = (torch.randn(total_q, h_q, 2 * d + dv, device=dev) / 10).to(dtype)
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    else:
        q = (torch.randn(total_q, h_q, d, device=dev) / 10).to(dtype)
        k = (torch.randn(total_k, h_kv, d, device=dev) / 10).to(dtype)
        v = (torch.randn(total_k, h_kv, dv, device=dev) / 10).to(dtype)
    dout = (torch.randn(total_q, h_q, dv, device=dev) / 10).to(dtype)
    return q, k, v, dout, cu_q, cu_k


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def visible_pairs(lq, lk, causal):
    """Number of (query, key) pairs that attend (spec §5.5's total_attn_compute)."""
    n = 0
    for sq, sk in zip(lq, lk):
        n += sq * sk if not causal else sum(min(max(i + sk - sq + 1, 0), sk) for i in range(sq))
    return n


# ------------------------------------------------------------------------------------------- one case
def run_case(lib, name, lq, lk, h_q, h_kv, d, causal, dtype=torch.bfloat16, bwd=True, packed=False,
             lse_contig=False, nan=None, det=False, seed=0, dev="cuda"):
    t0 = time.time()
    torch.manual_seed(seed)
    dv = 128
    q, k, v, dout, cu_q, cu_k = make_inputs(lq, lk, h_q, h_kv, d, dv, dtype, dev, packed)
    nan_keys = None  # with nan == "q": the dk / dv rows that depend on the NaN query row
    if nan == "q" and q.shape[0] > 0:
        r = min(3, q.shape[0] - 1)
        q[r, 0, 5] = float("nan")
        # request 0 holds row r (the NaN cases put >= 4 rows in it); bottom-right causal: row r sees keys
        # j <= r + s_k - s_q
        last = lk[0] - 1 if not causal else min(lk[0] - 1, r + lk[0] - lq[0])
        nan_keys = torch.zeros(k.shape[0], k.shape[1], 1, dtype=torch.bool, device=dev)
        nan_keys[:last + 1, 0] = True  # query head 0 reads kv head 0
    if nan == "k" and k.shape[0] > 0:
        k[min(2, k.shape[0] - 1), 0, 7] = float("nan")
    if nan == "v_next":  # first v row of the second request: must not reach the first request's rows
        v[lk[0], 0, 3] = float("nan")
    scale = (d + 100) ** -0.5
    mq, mk = max(lq + [0]), max(lk + [0])
    lse_buf = None
    if lse_contig:
        lse_buf = torch.empty(q.shape[0], h_q, dtype=torch.float32, device=dev)
    out, lse = lib.fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, lse=lse_buf)
    torch.cuda.synchronize()
    grads = lib.bwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, out, lse, dout) if bwd else None
    torch.cuda.synchronize()
    ro, rl, rg = ref_attention(q, k, v, cu_q, cu_k, scale, causal, dout if bwd else None)
    checks = [check_close("out", out, ro, *TOL["out"]), check_close("lse", lse, rl, *TOL["lse"])]
    def dgrad_checks(tag, g):
        dq, dk, dv = g
        req = None if nan_keys is None else nan_keys.expand(*dk.shape)
        return [check_close(f"dq{tag}", dq, rg[0], *TOL["dq"]),
                check_close(f"dk{tag}", dk, rg[1], *TOL["dk"], nan_required=req),
                check_close(f"dv{tag}", dv, rg[3], *TOL["dv"]),
                check_close(f"dv{tag}(cos vs f32 P)", dv, rg[2], math.inf, math.inf, TOL["dv"][2])]

    if bwd:
        checks += dgrad_checks("", grads)
    # every forward / backward schedule (dense_prefill.h) on the same inputs, against the same reference, and the
    # SAME_BITS pairs against each other
    results = {}  # (only the SAME_BITS schedules' outputs are kept)
    kept = set(SAME_BITS) | set(SAME_BITS.values())
    for sched in (FWD_SCHEDULES if VARIANTS["on"] else ()):
        o_s, l_s = lib.fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, lse=None if lse_buf is None else
                           torch.empty_like(lse_buf), schedule=sched)
        torch.cuda.synchronize()
        checks.append(check_close(f"out[{sched}]", o_s, ro, *TOL["out"]))
        checks.append(check_close(f"lse[{sched}]", l_s, rl, *TOL["lse"]))
        if sched in kept:
            results[sched] = (o_s.clone(), l_s.clone())
    if bwd:
        for sched in (BWD_SCHEDULES if VARIANTS["on"] else ()):
            g_s = lib.bwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, out, lse, dout, schedule=sched)
            torch.cuda.synchronize()
            checks += dgrad_checks(f"[{sched}]", g_s)
            if sched in kept:
                results[sched] = tuple(t.clone() for t in g_s)
    for sched, other in SAME_BITS.items():
        if sched in results and other in results:
            checks.append(same_bits_check(f"bits[{sched}=={other}]", results[sched], results[other]))
    ok = all(c["ok"] for c in checks)
    line = " ".join(f"{c['name']}:{c['max_abs']:.1e}/{c['cos_diff']:.1e}" for c in checks)
    print(f"{'PASS' if ok else 'FAIL'} {name} [{time.time() - t0:.1f}s] max_abs/cos_diff {line}")
    for c in checks:
        if not c["ok"]:
            print(f"      {c['name']}: {c['msg']} (max_abs {c['max_abs']:.3e}, max_rel {c['max_rel_where_abs_fails']:.3e})")
    RESULTS["correctness"].append({"case": name, "ok": ok, "checks": checks})
    save()
    if not ok:
        FAILURES.append(name)
    if det:
        same = True
        for sched in (FWD_SCHEDULES if VARIANTS["on"] else ("default",)):
            o1, l1 = lib.fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, schedule=sched)
            o1, l1 = o1.clone(), l1.clone()
            for _ in range(4):
                o2, l2 = lib.fwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, schedule=sched)
                same &= torch.equal(o2.view(torch.int16), o1.view(torch.int16)) and torch.equal(
                    l2.view(torch.int32), l1.view(torch.int32))
        gsame = True
        if bwd:
            for sched in (BWD_SCHEDULES if VARIANTS["on"] else ("default",)):
                g1 = [t.clone() for t in lib.bwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, out, lse, dout,
                                                  schedule=sched)]
                for _ in range(2):
                    g2 = lib.bwd(q, k, v, cu_q, cu_k, mq, mk, scale, causal, out, lse, dout, schedule=sched)
                    gsame &= all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(g2, g1))
        print(f"{'PASS' if same and gsame else 'FAIL'} determinism {name}: 5 forwards bitwise equal (each schedule): {same}; "
              f"3 backwards (dq, dk, dv) bitwise equal: {gsame if bwd else 'n/a'}")
        RESULTS["determinism"].append({"case": name, "fwd": bool(same), "bwd": bool(gsame)})
        if not (same and gsame):
            FAILURES.append("determinism " + name)


def run_masked_key_case(lib, name, d, dev="cuda"):
    """Causal (bottom-right), one request s_q 96, s_k 128 (offset 32): key 70 holds NaN in k, so query rows
    0 .. 37 do not see it. Per backward schedule (the default only with --no-variants): dq of those rows must be
    finite and equal, within 1e-3 of the largest |dq| and bitwise (every schedule's dq is deterministic), to a run
    with a finite key 70. dk / dv are not checked: rows 38 .. 95 see key 70, so their P is NaN, and every key is seen by
    one of them (row 38 sees keys 0 .. 70). The float reference would read the masked key (0 * NaN), so the run
    with the finite key is the reference here (as tests/gpu/test_dense_prefill_gpu.py's masked-key test)."""
    torch.manual_seed(7)
    lq, lk, h, dv = [96], [128], 2, 128
    q, k, v, dout, cu_q, cu_k = make_inputs(lq, lk, h, h, d, dv, torch.bfloat16, dev)
    k_bad = k.clone()
    k_bad[70, :, 5] = float("nan")
    scale = (d + 100) ** -0.5
    out, lse = lib.fwd(q, k, v, cu_q, cu_k, 96, 128, scale, True)
    clean = torch.zeros(96, dtype=torch.bool, device=dev)
    clean[:70 - 32] = True
    ok = True
    msgs = []
    for sched in (BWD_SCHEDULES if VARIANTS["on"] else ("default",)):
        dq_f, _, _ = [t.clone() for t in lib.bwd(q, k, v, cu_q, cu_k, 96, 128, scale, True, out, lse, dout,
                                                   schedule=sched)]
        out_b, lse_b = lib.fwd(q, k_bad, v, cu_q, cu_k, 96, 128, scale, True)
        dq_b, _, _ = lib.bwd(q, k_bad, v, cu_q, cu_k, 96, 128, scale, True, out_b, lse_b, dout, schedule=sched)
        a, r = dq_b[clean].float(), dq_f[clean].float()
        fin = bool(torch.isfinite(a).all())
        err = float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))
        exact = torch.equal(a, r)
        good = fin and err < 1e-3 and exact
        ok &= good
        msgs.append(f"{sched}: finite {fin}, dq rel {err:.1e}{'' if exact else ' (not bitwise)'}")
    print(f"{'PASS' if ok else 'FAIL'} {name}: " + "; ".join(msgs))
    RESULTS["correctness"].append({"case": name, "ok": ok, "checks": msgs})
    save()
    if not ok:
        FAILURES.append(name)


def run_masked_v_case(lib, name, d, dev="cuda", length=300, keys=(130, 170), dtype=torch.bfloat16, head=0, off=0):
    """Causal, one request s_q = s_k = length (offset 0): +inf in v at `keys` (head 0, dim 3). Query rows
    0 .. keys[0] - 1 see none of them (key j is visible to row i iff j <= i), so for every forward schedule their out must equal,
    bitwise, a run with finite values there; rows keys[0] .. see key keys[0], so their out dim 3 is +inf and their
    other dims equal the finite run's within 1e-2; lse (independent of v) and head 1 are bitwise the finite run's. The
    default keys lie in a causal diagonal ("checked") block of both key-block sizes: rows 2 / 42 of 128-key block 1,
    rows 130 / 170 of 176-key block 0 (the second word group of the row marks). length 700, keys (530, 650): checked
    128-key blocks 4 and 5, which the persistent forward scans in global memory first (three or more blocks before
    them in the tile); dtype float16 tests that scan's fp16 exponent. The float reference would multiply the masked
    keys' P = 0 by inf, so the finite run is the reference (as run_masked_key_case).
    head / off: the inf in v of head `head` (the other one bitwise the finite run's), s_k = length + off (key j visible
    to row i iff j <= i + off: rows 0 .. keys[0] - off - 1 see none of them). With FLASHMLA_DENSE_PREFILL_FWD_DIAG_FIRST
    the persistent forward scans a tile's checked blocks in global memory only when the CTA's tile before it had three
    or more plain blocks, which the *_2cta schedules (many tiles a CTA) reach for head 1's middle tiles: length 700,
    off 64, keys (460, 560), head 1 puts both keys into the two checked blocks (3 and 4) of head 1's query tile 3."""
    torch.manual_seed(11)
    lq, lk, h, dv = [length], [length + off], 2, 128
    q, k, v, dout, cu_q, cu_k = make_inputs(lq, lk, h, h, d, dv, dtype, dev)
    v_bad = v.clone()
    for key in keys:
        v_bad[key, head, 3] = float("inf")
    k0 = keys[0] - off  # the first query row that sees keys[0]
    scale = (d + 100) ** -0.5
    ok = True
    msgs = []
    for sched in (("default",) + FWD_SCHEDULES if VARIANTS["on"] else ("default",)):
        o_f, l_f = [t.clone() for t in lib.fwd(q, k, v, cu_q, cu_k, length, length + off, scale, True, schedule=sched)]
        o_b, l_b = lib.fwd(q, k, v_bad, cu_q, cu_k, length, length + off, scale, True, schedule=sched)
        torch.cuda.synchronize()
        unseen = torch.equal(o_b[:k0], o_f[:k0]) and bool(torch.isfinite(o_b[:k0]).all())
        seen = o_b[k0:, head].float()
        inf_col = bool((seen[:, 3] == math.inf).all())
        rest = torch.cat([seen[:, :3], seen[:, 4:]], dim=1)
        ref_rest = torch.cat([o_f[k0:, head, :3], o_f[k0:, head, 4:]], dim=1).float()
        rest_err = float((rest - ref_rest).abs().max() / ref_rest.abs().max().clamp_min(1e-30))
        other = torch.equal(o_b[:, 1 - head], o_f[:, 1 - head]) and torch.equal(l_b, l_f)
        good = unseen and inf_col and bool(torch.isfinite(rest).all()) and rest_err < 1e-2 and other
        ok &= good
        msgs.append(f"{sched}: unseen rows bitwise {unseen}, +inf col {inf_col}, rest rel {rest_err:.1e}, "
                    f"lse / head 1 bitwise {other}")
    print(f"{'PASS' if ok else 'FAIL'} {name}: " + "; ".join(msgs))
    RESULTS["correctness"].append({"case": name, "ok": ok, "checks": msgs})
    save()
    if not ok:
        FAILURES.append(name)


def safe(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 (report and go on)
        name = a[1] if len(a) > 1 else fn.__name__
        print(f"ERROR {name}: {type(e).__name__}: {e}")
        traceback.print_exc()
        FAILURES.append(f"{name}: {type(e).__name__}: {e}")
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- timing
def cuda_time_ms(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def perf_shape(lib, b, s, h, hk, d, causal, dev="cuda"):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dv = 128
    lq = lk = [s] * b
    q, k, v, dout, cu_q, cu_k = make_inputs(lq, lk, h, hk, d, dv, torch.bfloat16, dev)
    scale = (d + 100) ** -0.5
    pairs = visible_pairs(lq, lk, causal)
    f_fwd = pairs * h * 2 * (d + dv)
    f_bwd = pairs * h * 2 * (3 * d + 2 * dv)
    out, lse = lib.fwd(q, k, v, cu_q, cu_k, s, s, scale, causal)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    t_fwd = cuda_time_ms(lambda: lib.fwd(q, k, v, cu_q, cu_k, s, s, scale, causal, out=out, lse=lse, poison=False))
    t_bwd = cuda_time_ms(lambda: lib.bwd(q, k, v, cu_q, cu_k, s, s, scale, causal, out, lse, dout, grads=grads,
                                         poison=False))
    row = {"b": b, "s": s, "h": h, "h_kv": hk, "d": d, "dv": dv, "causal": causal, "ours_fwd_ms": t_fwd,
           "ours_bwd_ms": t_bwd, "ours_fwd_tflops": f_fwd / 1e9 / t_fwd, "ours_bwd_tflops": f_bwd / 1e9 / t_bwd}
    for sched in (FWD_PERF_SCHEDULES if VARIANTS["on"] else ()):
        t = cuda_time_ms(lambda: lib.fwd(q, k, v, cu_q, cu_k, s, s, scale, causal, out=out, lse=lse, poison=False,
                                         schedule=sched))
        row[f"ours_fwd_{sched}_tflops"] = f_fwd / 1e9 / t
    for sched in (BWD_SCHEDULES if VARIANTS["on"] else ()):
        t = cuda_time_ms(lambda: lib.bwd(q, k, v, cu_q, cu_k, s, s, scale, causal, out, lse, dout, grads=grads,
                                         poison=False, schedule=sched))
        row[f"ours_bwd_{sched}_tflops"] = f_bwd / 1e9 / t
    # torch SDPA, cuDNN backend: (b, h, s, d) layout, top-left causal == bottom-right for s_q == s_k.
    try:
        qt = q.view(b, s, h, d).transpose(1, 2).detach().requires_grad_(True)
        kt = k.view(b, s, hk, d).transpose(1, 2).detach().requires_grad_(True)
        vt = v.view(b, s, hk, dv).transpose(1, 2).detach().requires_grad_(True)
        dot = dout.view(b, s, h, dv).transpose(1, 2)
        gqa = hk != h

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                                                    enable_gqa=gqa)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            try:
                o_ref = sdpa()
            except RuntimeError:  # cuDNN without GQA support here: K / V expanded to h heads
                if not gqa:
                    raise
                kt = kt.detach().repeat_interleave(h // hk, dim=1).requires_grad_(True)
                vt = vt.detach().repeat_interleave(h // hk, dim=1).requires_grad_(True)
                gqa = False
                row["cudnn_gqa"] = "k / v expanded (enable_gqa unsupported)"
                o_ref = sdpa()
            t_cf = cuda_time_ms(sdpa)
            t_cb = cuda_time_ms(lambda: torch.autograd.grad(o_ref, (qt, kt, vt), dot, retain_graph=True))
        row.update({"cudnn_fwd_ms": t_cf, "cudnn_bwd_ms": t_cb, "cudnn_fwd_tflops": f_fwd / 1e9 / t_cf,
                    "cudnn_bwd_tflops": f_bwd / 1e9 / t_cb,
                    "fwd_speedup_vs_cudnn": t_cf / t_fwd, "bwd_speedup_vs_cudnn": t_cb / t_bwd})
        # our out against cuDNN's (both bf16): a cross-check of the perf inputs
        row["max_abs_out_vs_cudnn"] = float((o_ref.detach().transpose(1, 2).reshape_as(out).float() - out.float()).abs().max())
    except Exception as e:  # noqa: BLE001
        row["cudnn_error"] = f"{type(e).__name__}: {e}"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="smoke test only (small cases)")
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--no-big", action="store_true", help="skip the spec §5.5 configurations")
    ap.add_argument("--no-variants", action="store_true", help="only the library's default schedules")
    ap.add_argument("--perf-only", action="store_true",
                    help="only the timing of every schedule on the 16 shapes (correctness checked by an earlier run)")
    args = ap.parse_args()
    VARIANTS["on"] = not args.no_variants
    OUT_DIR["path"] = args.out
    lib = DensePrefillLib(args.lib)
    dev = "cuda"
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)

    if args.perf_only:
        args.no_big = True
    print("== smoke")
    safe(run_case, lib, "smoke d128 s256 h4/4", [256], [256], 4, 4, 128, False, det=True)
    safe(run_case, lib, "smoke d192 s300/333 h4/2 causal", [300], [333], 4, 2, 192, True, det=True)
    for d in (128, 192):  # 0, 1 and 2 key blocks, empty requests, every schedule
        safe(run_case, lib, f"smoke edges d{d} causal", [1, 0, 130, 3], [0, 5, 129, 200], 4, 2, d, True, det=True)
        safe(run_case, lib, f"smoke edges d{d}", [1, 0, 130, 3], [0, 5, 129, 200], 4, 2, d, False, det=True)
    if args.quick:
        return finish(args)
    if args.perf_only:
        return perf_all(lib, args)

    print("== reference self-test")
    safe(ref_selftest, dev)

    print("== extra cases (short / ragged lengths, s_q != s_k, empty requests, fp16, strides, NaN)")
    ragged_q = [1, 7, 63, 129, 0, 200, 5]
    ragged_k = [1, 7, 63, 129, 17, 0, 300]
    for d in (128, 192):
        for causal in (False, True):
            for (hq, hk) in ((8, 8), (8, 2)):
                safe(run_case, lib, f"ragged d{d} h{hq}/{hk} causal={causal}", ragged_q, ragged_k, hq, hk, d, causal)
                safe(run_case, lib, f"s_q>s_k d{d} h{hq}/{hk} causal={causal}", [300, 129, 64], [100, 7, 1], hq, hk, d,
                     causal)
                safe(run_case, lib, f"lengths 1,7,63,129 (s_q=s_k) d{d} h{hq}/{hk} causal={causal}", [1, 7, 63, 129],
                     [1, 7, 63, 129], hq, hk, d, causal)
            safe(run_case, lib, f"fp16 d{d} causal={causal}", [129, 500], [200, 500], 4, 2, d, causal,
                 dtype=torch.float16, det=True)
            safe(run_case, lib, f"packed qkv strides d{d} causal={causal}", [100, 300], [100, 300], 4, 4, d, causal,
                 packed=True)
            safe(run_case, lib, f"contiguous lse d{d} causal={causal}", [77, 190], [77, 250], 4, 4, d, causal,
                 lse_contig=True)
            safe(run_case, lib, f"NaN in q d{d} causal={causal}", [40, 60], [50, 60], 2, 2, d, causal, nan="q")
            safe(run_case, lib, f"NaN in k d{d} causal={causal}", [40, 60], [50, 60], 2, 2, d, causal, nan="k")
            safe(run_case, lib, f"NaN in v of the next request d{d} causal={causal}", [40, 60], [50, 60], 2, 2, d,
                 causal, nan="v_next")
            # the request's last key block (its V tail zeroed by the consumers, zero_v_tail) is a query tile's third:
            # walked last in the ascending order, first (a step's P V, not the tile's last) with the diagonal first
            safe(run_case, lib, f"NaN in v of the next request, 3 key blocks d{d} causal={causal}", [300, 60],
                 [300, 60], 2, 2, d, causal, nan="v_next")
        safe(run_masked_key_case, lib, f"NaN in a key the first rows do not see d{d} causal=True", d)
        safe(run_masked_v_case, lib, f"inf in v of keys the first rows do not see d{d} causal=True", d)
        for dt in (torch.bfloat16, torch.float16):
            safe(run_masked_v_case, lib, f"inf in v of keys the first rows do not see, blocks 4-5, d{d} {dt} causal=True",
                 d, length=700, keys=(530, 650), dtype=dt)
        safe(run_masked_v_case, lib, f"inf in v of keys the first rows do not see, head 1, s_k + 64, blocks 3-4, d{d} "
             "causal=True", d, length=700, keys=(460, 560), head=1, off=64)
    safe(run_case, lib, "all requests empty of keys", [5, 9], [0, 0], 2, 1, 128, False)
    safe(run_case, lib, "no query rows", [0, 0], [5, 9], 2, 1, 128, True)

    if not args.no_big:
        print("== spec §5.5 configurations (b 2; correctness skipped at 8192 with h 128, as the spec)")
        rng = random.Random(0)
        for mean in (4096, 8192):
            for varlen in (False, True):
                for (h, hk) in ((128, 128), (32, 4)):
                    for d in (128, 192):
                        for causal in (False, True):
                            lq, lk = make_lengths(2, mean, mean, varlen, rng)
                            if mean == 8192 and h == 128:
                                continue
                            safe(run_case, lib, f"spec s{mean} varlen={varlen} h{h}/{hk} d{d} causal={causal} "
                                 f"lens q{lq} k{lk}", lq, lk, h, hk, d, causal, det=True)
                            torch.cuda.empty_cache()

    return perf_all(lib, args)


def perf_all(lib, args):
    if not args.no_perf:
        print("== performance (TFLOPS, spec §5.5 FLOPs; torch SDPA cuDNN backend in the same process)")
        for s in (4096, 8192):
            for (h, hk) in ((128, 128), (32, 4)):
                for d in (128, 192):
                    for causal in (False, True):
                        try:
                            r = perf_shape(lib, 2, s, h, hk, d, causal)
                        except Exception as e:  # noqa: BLE001
                            print(f"ERROR perf s{s} h{h}/{hk} d{d} causal={causal}: {e}")
                            FAILURES.append(f"perf s{s} h{h}/{hk} d{d} causal={causal}: {e}")
                            continue
                        RESULTS["perf"].append(r)
                        save()
                        c = (f"cuDNN fwd {r['cudnn_fwd_tflops']:.0f} bwd {r['cudnn_bwd_tflops']:.0f} | ours/cuDNN fwd "
                             f"{r['fwd_speedup_vs_cudnn']:.2f}x bwd {r['bwd_speedup_vs_cudnn']:.2f}x | out vs cuDNN "
                             f"max_abs {r['max_abs_out_vs_cudnn']:.1e}") if "cudnn_fwd_ms" in r else r.get("cudnn_error")
                        var = " ".join(f"{k_[5:-7]} {v_:.0f}" for k_, v_ in r.items()
                                       if k_.startswith("ours_") and k_.endswith("_tflops") and k_.count("_") > 2)
                        print(f"s{s} h{h}/{hk} d{d} causal={int(causal)}: ours fwd {r['ours_fwd_tflops']:.0f} "
                              f"[{var}] "
                              f"({r['ours_fwd_ms']:.2f} ms) bwd {r['ours_bwd_tflops']:.0f} ({r['ours_bwd_ms']:.2f} ms) | {c}")
                        torch.cuda.empty_cache()
    return finish(args)


def save():
    """Writes the results so far (also after every case: a later hang or crash keeps them)."""
    os.makedirs(OUT_DIR["path"], exist_ok=True)
    RESULTS["failures"] = FAILURES
    with open(os.path.join(OUT_DIR["path"], "dense-prefill-check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def finish(args):
    save()
    print(f"== {len(FAILURES)} failure(s)")
    for x in FAILURES:
        print("  ", x)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
