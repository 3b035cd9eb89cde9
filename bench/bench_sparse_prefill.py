"""Sparse MLA prefill (flash_mla_sparse_fwd) benchmark on an H200 vs the FlashMLA anchors
(shared/anchors-h200.md).

Usage: python bench/bench_sparse_prefill.py [--out bench/results] [--reps 30] [--filter PREFIXES]

Cases: FlashMLA's sparse-prefill perf cases (spec §5.3: s_q = 4096, attn_sink on, all indices
valid): V3.2 d_qk 576 h_q 128 topk 2048, s_kv 8192..131072; MODEL1 CONFIG1 d_qk 512 h_q 64
topk 512 and CONFIG2 d_qk 512 h_q 128 topk 1024, s_kv 8192..65536; plus tensor-parallel head
counts h_q 16/32 (no anchor; the mma.sync kernel, 16/32-row tiles; the anchor cases run the wgmma
seesaw kernel). --filter S keeps only the cases whose name starts with one of the comma-separated
prefixes S (v32,model1 = the anchor cases only). Kernel variants are compared between builds
(tools/ab-variants.sh builds each variant and runs this script once per build).
FLOP and bytes as tests/lib.py::count_flop_and_mem_vol (spec §5.3):
FLOP = 2 * s_q * topk * h_q * (d_qk + 512); bytes = valid * d_qk * 2 + s_q * h_q * (d_qk + 512) * 2.
Time = the `sparse_attn_fwd` kernel alone (profiler, L2 flushed between calls).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import flash_mla  # noqa: E402

KERNEL = "sparse_attn_fwd"
S_Q = 4096
V32 = (dict(d_qk=576, h_q=128, topk=2048), {8192: 667, 32768: 615, 65536: 580, 98304: 561, 131072: 563})
CONFIG1 = (dict(d_qk=512, h_q=64, topk=512), {8192: 513, 32768: 498, 49152: 476, 65536: 462})
CONFIG2 = (dict(d_qk=512, h_q=128, topk=1024), {8192: 617, 32768: 588, 49152: 571, 65536: 563})


def make_inputs(s_q, s_kv, topk, h_q, d_qk, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(s_q, h_q, d_qk, generator=g, device="cuda") / 10).to(torch.bfloat16)
    kv = (torch.randn(s_kv, 1, d_qk, generator=g, device="cuda") / 10).to(torch.bfloat16)
    rows = []
    for r0 in range(0, s_q, 512):  # topk distinct random tokens per row, random order
        keys = torch.rand(min(512, s_q - r0), s_kv, generator=g, device="cuda")
        rows.append(keys.topk(topk, dim=1, sorted=False).indices)
    idx = torch.cat(rows)
    idx = idx.gather(1, torch.rand(idx.shape, generator=g, device="cuda").argsort(dim=1))
    sink = torch.randn(h_q, generator=g, device="cuda")
    return q, kv, idx.to(torch.int32)[:, None, :].contiguous(), sink


def bench_case(name, cfg, s_kv, anchor, ceil, reps):
    d_qk, h_q, topk = cfg["d_qk"], cfg["h_q"], cfg["topk"]
    q, kv, idx, sink = make_inputs(S_Q, s_kv, topk, h_q, d_qk)
    fn = lambda: flash_mla.flash_mla_sparse_fwd(q, kv, idx, sm_scale=d_qk ** -0.5, attn_sink=sink)  # noqa: E731
    t = common.kernel_times_us(fn, [KERNEL], reps=reps)
    flop = 2 * S_Q * topk * h_q * (d_qk + 512)
    valid = S_Q * topk
    nbytes = valid * d_qk * 2 + S_Q * h_q * (d_qk + 512) * 2
    kt = t[KERNEL]
    tflops = flop / kt / 1e6
    case = {
        "name": name,
        "params": {"s_q": S_Q, "s_kv": s_kv, **cfg, "attn_sink": True,
                   "kernel": "wgmma_seesaw" if h_q > 32 else "mma_sync"},
        # time_us: the field (main-kernel time; prefill is one kernel), kernel_us kept for older readers
        "time_us": kt, "kernel_us": kt, "call_time_us": t["call"], "tflops": tflops, "gbps": nbytes / kt / 1e3,
        "frac_matmul_ceiling": tflops / ceil["matmul_tflops"], "frac_copy_ceiling": nbytes / kt / 1e3 / ceil["copy_gbps"],
        "anchor_tflops": anchor, "ratio_to_anchor": None if anchor is None else tflops / anchor,
    }
    del q, kv, idx, sink
    torch.cuda.empty_cache()
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--reps", type=int, default=30, help="calls per round (bench_kineto num_tests; 30 as FlashMLA's test)")
    ap.add_argument("--filter", default=None, help="comma-separated prefixes of the case names to run")
    args = ap.parse_args()
    filt = None if args.filter is None else [f for f in args.filter.split(",") if f]
    gpu = torch.cuda.get_device_name()
    ceil = common.measure_ceilings()
    print(f"{gpu}: ceilings {ceil}", flush=True)
    cases = []

    def add(*a, **kw):
        if filt is not None and not any(a[0].startswith(f) for f in filt):
            return
        c = bench_case(*a, ceil=ceil, reps=args.reps, **kw)
        r = c["ratio_to_anchor"]
        print(f"{c['name']:34s} kernel {c['kernel_us']:9.1f} us {c['tflops']:6.1f} TFLOP/s {c['gbps']:6.0f} GB/s "
              f"({c['frac_matmul_ceiling']:.2f} of matmul) anchor {c['anchor_tflops'] or '-'} "
              f"ratio {'-' if r is None else f'{r:.3f}'}", flush=True)
        cases.append(c)

    for label, (cfg, anchors) in (("v32", V32), ("model1-c1", CONFIG1), ("model1-c2", CONFIG2)):
        for s_kv, a in anchors.items():
            add(f"{label} skv{s_kv}", cfg, s_kv, a)
    for h_q in (16, 32):
        add(f"tp v32 h{h_q} skv32768", dict(V32[0], h_q=h_q), 32768, None)
        add(f"tp model1-c1 h{h_q} skv32768", dict(CONFIG1[0], h_q=h_q), 32768, None)

    path = common.write_results("sparse-prefill", gpu, ceil, cases, args.out)
    common.plot_ratios(cases, f"sparse prefill vs FlashMLA ({gpu}), sparse_attn_fwd kernel",
                       path.replace(".json", ".png"))
    rs = [c["ratio_to_anchor"] for c in cases if c["ratio_to_anchor"]]
    gm = math.exp(sum(map(math.log, rs)) / len(rs)) if rs else float("nan")
    print(f"wrote {path}; geomean ratio {gm:.3f} over {len(rs)} anchor cases")

if __name__ == "__main__":
    main()
