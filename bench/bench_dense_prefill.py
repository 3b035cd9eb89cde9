"""Dense MHA prefill (flash_attn_varlen_func, spec §1.5) forward and backward on an H200 against torch SDPA's
cuDNN backend (forward and backward) and FlashAttention-3's forward (PyPI `fa3_fwd`, when importable), all
timed in the same run on the 16 shapes of shared/anchors-h200.md's dense MHA table (b 2, s 4096 / 8192,
h / h_kv 128/128 and 32/4, d_qk 128 / 192, d_v 128, causal and not, bf16, equal lengths).

FLOPs as FlashMLA's tests/test_fmha_sm100.py (spec §5.5): pairs = number of attending (query, key) pairs,
forward = pairs * h * 2 (d + dv), backward = pairs * h * 2 (3 d + 2 dv); TFLOP/s = FLOPs / time. (The anchors
table counts the backward as 2.5x the forward; ratios between implementations do not depend on the choice.)
Time: median CUDA-event time of the whole call over --reps calls, each after an L2 flush (bench/common.py).
Ours: the flash_mla package (flash_attn_varlen_func + autograd backward) or, with --lib, the standalone
library that tools/dense-prefill-gpu-check.sh builds (kernels called directly).

Writes <out>/<date>-dense-prefill-vs-cudnn-fa3.json (cases, targets of issue 26: forward >= 1.0x FA3 and
>= 1.1x cuDNN, backward >= 1.0x cuDNN and >= 1.4x on d 192 non-causal) and a plot beside it.

Usage: python3 bench/bench_dense_prefill.py [--out bench/results] [--reps 10] [--lib PATH]
                                          [--fwd-schedule S] [--bwd-schedule S]   (with --lib: dense_prefill.h)
                                          [--only NAME ...]   (shapes whose name contains one of these)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

SHAPES = [(s, h, hk, d, causal) for s in (4096, 8192) for (h, hk) in ((128, 128), (32, 4)) for d in (128, 192)
          for causal in (False, True)]
DV = 128
B = 2


def time_ms(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        common.flush_l2()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def visible_pairs(s, causal):
    return B * (s * (s + 1) // 2 if causal else s * s)


class Ours:
    """fwd(q, k, v, cu, s, scale, causal) -> (out, lse); bwd(...) -> grads, on (total, h, d) tensors."""

    def __init__(self, lib_path, fwd_schedule="default", bwd_schedule="default"):
        self.lib = None
        self.fs, self.bs = fwd_schedule, bwd_schedule
        if lib_path:
            sys.path.insert(0, os.path.join(HERE, "..", "tools", "dense_prefill_check"))
            from dense_prefill_lib import DensePrefillLib  # noqa: PLC0415
            self.lib = DensePrefillLib(lib_path)
            self.name = f"standalone library {lib_path} (fwd schedule {fwd_schedule}, bwd schedule {bwd_schedule})"
        else:
            import flash_mla  # noqa: PLC0415
            self.fa = flash_mla.flash_attn_varlen_func
            self.name = "flash_mla.flash_attn_varlen_func"

    def make(self, q, k, v, dout, cu, s, scale, causal, reps):
        if self.lib is not None:
            out, lse = self.lib.fwd(q, k, v, cu, cu, s, s, scale, causal, schedule=self.fs)
            grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
            fwd = lambda: self.lib.fwd(q, k, v, cu, cu, s, s, scale, causal, out=out, lse=lse, poison=False,
                                       schedule=self.fs)
            bwd = lambda: self.lib.bwd(q, k, v, cu, cu, s, s, scale, causal, out, lse, dout, grads=grads,
                                       poison=False, schedule=self.bs)
            return time_ms(fwd, reps), time_ms(bwd, reps), out
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        fwd = lambda: self.fa(qg, kg, vg, cu, cu, s, s, softmax_scale=scale, causal=causal)
        t_f = time_ms(lambda: self.fa(q, k, v, cu, cu, s, s, softmax_scale=scale, causal=causal), reps)
        out, _ = fwd()
        t_b = time_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True), reps)
        return t_f, t_b, out.detach()


def fa3_forward():
    """FlashAttention-3's forward from the PyPI wheel fa3_fwd, or None (with the reason)."""
    for mod in ("flash_attn_interface", "fa3_fwd", "fa3_fwd_interface"):
        try:
            m = __import__(mod)
        except Exception as e:  # noqa: BLE001
            last = f"{mod}: {type(e).__name__}: {e}"
            continue
        fn = getattr(m, "flash_attn_func", None)
        if fn is not None:
            return fn, mod
        last = f"{mod} has no flash_attn_func"
    return None, last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--lib", default=None, help="standalone library (tools/dense-prefill-gpu-check.sh builds it)")
    ap.add_argument("--fwd-schedule", default="default", help="with --lib: default, serial, overlap, pingpong, pingpong_tma, persistent_tma")
    ap.add_argument("--bwd-schedule", default="default", help="with --lib: default, two_kernel or two_kernel_tma")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="time only the shapes whose name (e.g. s8192_h128-128_d192_causal) contains one of these")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    ours = Ours(args.lib, args.fwd_schedule, args.bwd_schedule)
    fa3, fa3_src = fa3_forward()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; ours: {ours.name}; FA3: {fa3_src if fa3 else 'unavailable (' + fa3_src + ')'}")
    ceil = common.measure_ceilings()
    cases = []
    for (s, h, hk, d, causal) in SHAPES:
        name = f"s{s}_h{h}-{hk}_d{d}_{'causal' if causal else 'full'}"
        if args.only and not any(o in name for o in args.only):
            continue
        torch.manual_seed(0)
        total = B * s
        q = (torch.randn(total, h, d, device="cuda") / 10).to(torch.bfloat16)
        k = (torch.randn(total, hk, d, device="cuda") / 10).to(torch.bfloat16)
        v = (torch.randn(total, hk, DV, device="cuda") / 10).to(torch.bfloat16)
        dout = (torch.randn(total, h, DV, device="cuda") / 10).to(torch.bfloat16)
        cu = torch.arange(0, total + 1, s, dtype=torch.int32, device="cuda")
        scale = d ** -0.5
        pairs = visible_pairs(s, causal)
        f_fwd, f_bwd = pairs * h * 2 * (d + DV), pairs * h * 2 * (3 * d + 2 * DV)
        c = {"name": name, "b": B, "s": s, "h": h, "h_kv": hk,
             "d": d, "dv": DV, "causal": causal, "flop_fwd": f_fwd, "flop_bwd": f_bwd}
        t_f, t_b, out = ours.make(q, k, v, dout, cu, s, scale, causal, args.reps)
        c.update(ours_fwd_ms=t_f, ours_bwd_ms=t_b, ours_fwd_tflops=f_fwd / 1e9 / t_f, ours_bwd_tflops=f_bwd / 1e9 / t_b)
        # cuDNN through torch SDPA, (b, h, s, d); top-left causal == bottom-right for s_q == s_k
        qt = q.view(B, s, h, d).transpose(1, 2).detach().requires_grad_(True)
        kt = k.view(B, s, hk, d).transpose(1, 2).detach().requires_grad_(True)
        vt = v.view(B, s, hk, DV).transpose(1, 2).detach().requires_grad_(True)
        dot = dout.view(B, s, h, DV).transpose(1, 2)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                gqa = hk != h
                try:
                    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                                    scale=scale, enable_gqa=gqa)
                    o_c = sdpa()
                except RuntimeError:
                    if not gqa:
                        raise
                    kt = kt.detach().repeat_interleave(h // hk, dim=1).requires_grad_(True)
                    vt = vt.detach().repeat_interleave(h // hk, dim=1).requires_grad_(True)
                    gqa = False
                    c["cudnn_note"] = "k / v expanded to h heads (enable_gqa unsupported by the cuDNN backend)"
                    o_c = sdpa()
                t_cf = time_ms(sdpa, args.reps)
                t_cb = time_ms(lambda: torch.autograd.grad(o_c, (qt, kt, vt), dot, retain_graph=True), args.reps)
            c.update(cudnn_fwd_ms=t_cf, cudnn_bwd_ms=t_cb, cudnn_fwd_tflops=f_fwd / 1e9 / t_cf,
                     cudnn_bwd_tflops=f_bwd / 1e9 / t_cb, fwd_vs_cudnn=t_cf / t_f, bwd_vs_cudnn=t_cb / t_b,
                     max_abs_out_vs_cudnn=float((o_c.detach().transpose(1, 2).reshape_as(out).float()
                                                 - out.float()).abs().max()))
        except Exception as e:  # noqa: BLE001
            c["cudnn_error"] = f"{type(e).__name__}: {e}"
        if fa3 is not None:
            try:
                qb, kb, vb = q.view(B, s, h, d), k.view(B, s, hk, d), v.view(B, s, hk, DV)
                t_af = time_ms(lambda: fa3(qb, kb, vb, softmax_scale=scale, causal=causal), args.reps)
                c.update(fa3_fwd_ms=t_af, fa3_fwd_tflops=f_fwd / 1e9 / t_af, fwd_vs_fa3=t_af / t_f)
            except Exception as e:  # noqa: BLE001
                c["fa3_error"] = f"{type(e).__name__}: {e}"
        print(f"{c['name']:28s} ours fwd {c['ours_fwd_tflops']:6.0f} bwd {c['ours_bwd_tflops']:6.0f} | cuDNN fwd "
              f"{c.get('cudnn_fwd_tflops', float('nan')):6.0f} bwd {c.get('cudnn_bwd_tflops', float('nan')):6.0f} | "
              f"FA3 fwd {c.get('fa3_fwd_tflops', float('nan')):6.0f} | fwd/cuDNN {c.get('fwd_vs_cudnn', float('nan')):.2f}"
              f" fwd/FA3 {c.get('fwd_vs_fa3', float('nan')):.2f} bwd/cuDNN {c.get('bwd_vs_cudnn', float('nan')):.2f}")
        cases.append(c)
        del q, k, v, dout, qt, kt, vt
        torch.cuda.empty_cache()

    targets = []
    for c in cases:
        def tgt(what, val, need):
            targets.append({"case": c["name"], "target": what, "value": val, "need": need,
                            "met": val is not None and val >= need})
        tgt("fwd >= 1.0x FA3", c.get("fwd_vs_fa3"), 1.0)
        tgt("fwd >= 1.1x cuDNN", c.get("fwd_vs_cudnn"), 1.1)
        tgt("bwd >= 1.0x cuDNN", c.get("bwd_vs_cudnn"), 1.0)
        if c["d"] == 192 and not c["causal"]:
            tgt("bwd >= 1.4x cuDNN (d 192 non-causal)", c.get("bwd_vs_cudnn"), 1.4)
    date = _dt.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{date}-dense-prefill-vs-cudnn-fa3.json")
    data = {"gpu": gpu, "date": date, "ours": ours.name, "fa3": fa3_src if fa3 else None, "ceilings": ceil,
            "timing": {"method": "median CUDA-event time of the call over reps calls, L2 flushed before each",
                       "reps": args.reps, "l2_flush_gb": common.FLUSH_GB},
            "flops": "spec §5.5: fwd = pairs*h*2*(d+dv), bwd = pairs*h*2*(3d+2dv)",
            "cases": cases, "targets": targets,
            "targets_met": sum(t["met"] for t in targets), "targets_total": len(targets)}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}; targets met {data['targets_met']} / {data['targets_total']}")
    for t in targets:
        if not t["met"]:
            print(f"  not met: {t['case']} {t['target']}: {t['value']}")
    plot(cases, path[:-5] + ".png")


def plot(cases, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(16, 5))
    x = range(len(cases))
    w = 0.27
    for ax, kind, series in ((axes[0], "forward", (("ours", "ours_fwd_tflops"), ("cuDNN", "cudnn_fwd_tflops"),
                                                   ("FA3", "fa3_fwd_tflops"))),
                             (axes[1], "backward", (("ours", "ours_bwd_tflops"), ("cuDNN", "cudnn_bwd_tflops")))):
        for i, (label, key) in enumerate(series):
            ax.bar([xi + (i - 1) * w for xi in x], [c.get(key, 0) or 0 for c in cases], w, label=label)
        ax.set_xticks(list(x))
        ax.set_xticklabels([c["name"] for c in cases], rotation=75, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s (spec §5.5 FLOPs)")
        ax.set_title(f"dense MHA prefill {kind}, H200, bf16, b 2")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


if __name__ == "__main__":
    main()
