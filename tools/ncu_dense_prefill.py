"""Profiling driver: one dense MHA prefill shape, ours beside cuDNN and FlashAttention-3, for Nsight Compute.

Runs, after two warm-up rounds, exactly one call of each inside a CUDA profiler range:
ours forward (flash_mla.flash_attn_varlen_func), ours backward (autograd), FA3's forward (PyPI `fa3_fwd`, when
importable), torch SDPA's cuDNN forward and backward. Every kernel those calls launch is profiled when ncu runs
with `--profile-from-start off`; torch.cuda.nvtx ranges name the five calls. Shapes and inputs as
bench/bench_dense_prefill.py (b 2, bf16, d_v 128, equal lengths).

Usage (GPU machine, repository root, our package and fa3_fwd importable):
  ncu --set full --profile-from-start off --nvtx -o OUT/dense-prefill python3 tools/ncu_dense_prefill.py \
      --shape s8192_h128-128_d128_causal
  ncu -i OUT/dense-prefill.ncu-rep --page details --csv > OUT/dense-prefill.csv
(`--set full` adds the warp-state, scheduler and source sections that name the stalls; the export of
2026-12-04 in bench/results used `--set detailed`, which has neither. The backward's kernels run on
autograd's thread, outside the NVTX ranges, which are per thread.) tools/ncu_compare.py prints such an
export side by side.
Only the two forwards, with per-instruction stall samples (`--import-source yes`); ncu's `-k` matches a
kernel's base name, which is `device_kernel` for FA3's (not `FlashAttnFwdSm90`):
  ncu --set full --import-source yes --profile-from-start off -k 'regex:dense_prefill_fwd|device_kernel' \
      -o OUT/fwd python3 tools/ncu_dense_prefill.py
  ncu -i OUT/fwd.ncu-rep -k regex:device_kernel --page source --csv --print-source sass > OUT/fa3-source.csv
tools/ncu_source_top.py condenses such a source export (the hottest instructions and their stall reasons).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_dense_prefill import B, DV, fa3_forward  # noqa: E402


def parse_shape(name):
    m = re.fullmatch(r"s(\d+)_h(\d+)-(\d+)_d(\d+)_(causal|full)", name)
    if not m:
        raise SystemExit(f"--shape: expected e.g. s8192_h128-128_d128_causal, got {name!r}")
    s, h, hk, d = (int(x) for x in m.groups()[:4])
    return s, h, hk, d, m.group(5) == "causal"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="s8192_h128-128_d128_causal")
    args = ap.parse_args()
    s, h, hk, d, causal = parse_shape(args.shape)
    import flash_mla  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    torch.manual_seed(0)
    total = B * s
    q = (torch.randn(total, h, d, device="cuda") / 10).to(torch.bfloat16)
    k = (torch.randn(total, hk, d, device="cuda") / 10).to(torch.bfloat16)
    v = (torch.randn(total, hk, DV, device="cuda") / 10).to(torch.bfloat16)
    dout = (torch.randn(total, h, DV, device="cuda") / 10).to(torch.bfloat16)
    cu = torch.arange(0, total + 1, s, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    ours_fwd = lambda: flash_mla.flash_attn_varlen_func(q, k, v, cu, cu, s, s, softmax_scale=scale, causal=causal)
    out, _ = flash_mla.flash_attn_varlen_func(qg, kg, vg, cu, cu, s, s, softmax_scale=scale, causal=causal)
    ours_bwd = lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)
    fa3, _ = fa3_forward()
    qb, kb, vb = q.view(B, s, h, d), k.view(B, s, hk, d), v.view(B, s, hk, DV)
    fa3_fwd = (lambda: fa3(qb, kb, vb, softmax_scale=scale, causal=causal)) if fa3 is not None else None
    rep = h // hk
    qt = q.view(B, s, h, d).transpose(1, 2).detach().requires_grad_(True)
    kt = k.view(B, s, hk, d).transpose(1, 2).repeat_interleave(rep, dim=1).detach().requires_grad_(True)
    vt = v.view(B, s, hk, DV).transpose(1, 2).repeat_interleave(rep, dim=1).detach().requires_grad_(True)
    dot = dout.view(B, s, h, DV).transpose(1, 2)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
        o_c = sdpa()
        cudnn_bwd = lambda: torch.autograd.grad(o_c, (qt, kt, vt), dot, retain_graph=True)
        calls = [("ours_fwd", ours_fwd), ("ours_bwd", ours_bwd), ("fa3_fwd", fa3_fwd), ("cudnn_fwd", sdpa),
                 ("cudnn_bwd", cudnn_bwd)]
        calls = [(n, f) for n, f in calls if f is not None]
        for _ in range(2):
            for _, f in calls:
                f()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for n, f in calls:
            with torch.cuda.nvtx.range(n):
                f()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"profiled {args.shape}: {', '.join(n for n, _ in calls)}")


if __name__ == "__main__":
    main()
