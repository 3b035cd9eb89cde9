"""Dense MLA decode benchmark on an H200 vs the FlashMLA anchors (shared/anchors-h200.md).

Usage: python bench/bench_dense_decode.py [--out bench/results] [--quick] [--filter compute,memory]

Cases: compute-bound anchors (b=128, h_q=128, s_q 1/2, varlen mean s_k 4k-32k,
causal and not), memory-bound anchors (h_q 16/32/64, s_k=8192 fixed), the
whole-call table (uniform lengths, incl. tensor-parallel and short contexts)
and extra TP shapes. FLOP/byte formulas: spec §5.4. Main-kernel time excludes
the scheduler and combine kernels (as FlashMLA's harness reports); call time
is the whole call captured in a CUDA graph and replayed with L2 flushed, as the anchors' "graph µs"
column: for the whole-call table, as the anchors, eight calls over eight layer caches sharing one
FlashMLASchedMeta (the first computes the split schedule inside the graph, the others reuse it),
per call; the eager (plain Python call) time is kept as
eager_call_us (host overhead leaks into it whenever the host is slower than the L2 flush).

Each case records the main kernel the library runs for it (field "kernel": the seesaw kernel whenever a
K tensor map can be made, as for every case here). Kernel variants are compared between builds
(tools/ab-variants.sh builds each variant and runs this script once per build); the C++ GPU test
(tests/gpu/cpp, --kernel) times every main kernel on the same inputs.
--filter S1,S2: only cases whose name contains one of the substrings.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import flash_mla  # noqa: E402

KERNEL = "flash_fwd_splitkv_mla_kernel"
COMBINE = "flash_fwd_mla_combine_kernel"

# anchors: (b, s_q, h_q, s_k, causal, varlen) -> (metric, value)
COMPUTE = {(1, False): [600, 642, 663, 675], (2, False): [681, 711, 726, 727],
           (1, True): [601, 641, 663, 674], (2, True): [679, 711, 725, 718]}
MEMORY = {16: 3869, 32: 3906, 64: 3898}
CALL_GRAPH_US = [  # b, s_q, h_q, s_k, graph us
    (1, 1, 128, 2048, 19.4), (1, 1, 16, 2048, 16.1), (4, 1, 128, 2048, 22.1), (16, 1, 128, 2048, 31.8),
    (16, 1, 16, 2048, 21.2), (128, 1, 8, 256, 17.3), (128, 1, 16, 256, 18.6), (128, 4, 16, 256, 20.1),
    (128, 1, 64, 256, 21.5), (128, 1, 128, 256, 33.5), (128, 1, 16, 1024, 43.0), (128, 4, 32, 1024, 67.5),
    (128, 1, 128, 1024, 68.3), (128, 1, 16, 4096, 145.3), (128, 4, 64, 4096, 476.9), (128, 1, 128, 4096, 242.2),
]


def make_inputs(b, s_q, h_q, s_k, varlen, pbs=64, d=576, seed=0):
    random.seed(seed)
    torch.manual_seed(seed)
    if varlen:
        lens = [max(int(random.normalvariate(s_k, s_k / 2)), s_q) for _ in range(b)]
    else:
        lens = [s_k] * b
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    max_pad = math.ceil(max(lens) / 256) * 256
    nb = b * max_pad // pbs
    q = (torch.randn(b, s_q, h_q, d, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
    k = (torch.randn(nb, pbs, 1, d, device="cuda") / 10).clamp(-1, 1).to(torch.bfloat16)
    bt = torch.randperm(nb, device="cuda").to(torch.int32).reshape(b, -1)
    return q, k, bt, lens_t, lens


def graph_call_us(fn, reps: int = 20):
    """Median GPU time of one call captured in a CUDA graph and replayed, L2 flushed before
    each replay: the anchors' "graph" whole-call time (no host overhead). None if capture fails."""
    import statistics

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up on a side stream before capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed ({e}); call time stays eager", flush=True)
        return None
    ts = []
    for _ in range(reps):
        common.flush_l2()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def time_call(fn, reuse_meta, fn_layers=None, layers=1):
    """Kernel times of one call (profiler); call time = the CUDA-graph time of `fn_layers` (`layers`
    calls, one per layer cache, sharing one FlashMLASchedMeta as a step's layers do) per call."""
    t = common.kernel_times_us(fn, [KERNEL, COMBINE, "get_mla_metadata", "scheduler"])
    t["eager"] = t["call"]
    g = graph_call_us(fn_layers or fn) if reuse_meta else None
    if g is not None:
        g /= layers
        t["call"] = g
    return t, g


def bench_case_impl(name, b, s_q, h_q, s_k, causal, varlen, anchor, ceil, reuse_meta=True, layers=1):
    q, k, bt, lens_t, lens = make_inputs(b, s_q, h_q, s_k, varlen)
    sched, _ = flash_mla.get_mla_metadata()
    fn = lambda: flash_mla.flash_mla_with_kvcache(q, k, bt, lens_t, 512, sched, causal=causal)
    fn_layers = None
    if layers > 1:  # the anchors' whole-call method: one step over `layers` layer caches, one schedule
        others = [make_inputs(b, s_q, h_q, s_k, varlen, seed=i)[:3] for i in range(1, layers)]

        def fn_layers():
            r = fn()
            for qi, ki, bti in others:
                flash_mla.flash_mla_with_kvcache(qi, ki, bti, lens_t, 512, sched, causal=causal)
            return r
    if not reuse_meta:
        fn = lambda: flash_mla.flash_mla_with_kvcache(q, k, bt, lens_t, 512, flash_mla.get_mla_metadata()[0],
                                                      causal=causal)
    out = fn()[0].float()
    torch.cuda.synchronize()
    nonfinite = int((~torch.isfinite(out)).sum())
    t, g = time_call(fn, reuse_meta, fn_layers, layers)
    mean_len = sum(lens) / b
    flop = b * h_q * s_q * (2 * 576 * mean_len + 2 * mean_len * 512)
    nbytes = b * (s_q * h_q * 576 * 2 + mean_len * 576 * 2 + s_q * h_q * 512 * 2)
    kt = t[KERNEL]
    case = {
        "name": name,
        "params": {"b": b, "s_q": s_q, "h_q": h_q, "h_kv": 1, "s_k": s_k, "mean_s_k": mean_len, "causal": causal,
                   "varlen": varlen, "page_block_size": 64, "d_qk": 576, "d_v": 512},
        "time_us": kt, "call_time_us": t["call"], "eager_call_us": t["eager"], "call_is_graph": g is not None,
        "combine_us": t[COMBINE], "nonfinite_outputs": nonfinite, "kernel": "wgmma_seesaw",
        "tflops": flop / kt / 1e6, "gbps": nbytes / kt / 1e3,
        "frac_matmul_ceiling": flop / kt / 1e6 / ceil["matmul_tflops"],
        "frac_copy_ceiling": nbytes / kt / 1e3 / ceil["copy_gbps"],
        "anchor_tflops": None, "anchor_gbps": None, "anchor_call_us": None, "ratio_to_anchor": None,
    }
    if anchor is not None:
        metric, value = anchor
        if metric == "tflops":
            case["anchor_tflops"], case["ratio_to_anchor"] = value, case["tflops"] / value
        elif metric == "gbps":
            case["anchor_gbps"], case["ratio_to_anchor"] = value, case["gbps"] / value
        else:  # whole-call time in µs, lower is better
            case["anchor_call_us"], case["ratio_to_anchor"] = value, value / t["call"]
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--filter", default=None, help="comma-separated substrings of case names to run")
    args = ap.parse_args()
    filters = [f.strip() for f in args.filter.split(",") if f.strip()] if args.filter else None
    gpu = torch.cuda.get_device_name()
    ceil = common.measure_ceilings()
    print(f"{gpu}: ceilings {ceil}", flush=True)
    cases = []

    def bench_case(name, *a, **kw):  # noqa: F811  (the filter for every case below)
        if filters and not any(f in name for f in filters):
            return None
        return bench_case_impl(name, *a, **kw)

    def keep(c):
        if c is not None:
            cases.append(c)

    sks = [4096, 8192, 16384, 32768]
    for (s_q, causal), anchors in COMPUTE.items():
        for s_k, a in zip(sks, anchors):
            if args.quick and s_k > 8192:
                continue
            keep(bench_case(f"compute sq{s_q} sk{s_k}{' causal' if causal else ''}", 128, s_q, 128, s_k,
                            causal, True, ("tflops", a), ceil))
    for h_q, a in MEMORY.items():
        keep(bench_case(f"memory hq{h_q} sk8192", 128, 1, h_q, 8192, False, False, ("gbps", a), ceil))
    for b, s_q, h_q, s_k, us in CALL_GRAPH_US:
        keep(bench_case(f"call b{b} sq{s_q} hq{h_q} sk{s_k}", b, s_q, h_q, s_k, False, False,
                        ("call_us", us), ceil, layers=8))
    for h_q in (8, 16, 32):
        for s_q in (1, 2, 4):
            keep(bench_case(f"tp hq{h_q} sq{s_q} sk8192", 128, s_q, h_q, 8192, False, False, None, ceil))
    for c in cases:
        r = c["ratio_to_anchor"]
        print(f"{c['name']:32s} kernel {c['time_us']:9.1f} us  call {c['call_time_us']:9.1f} us  "
              f"eager {c['eager_call_us']:9.1f} us  "
              f"{c['tflops']:7.1f} TFLOP/s {c['gbps']:7.0f} GB/s  ratio {'-' if r is None else f'{r:.3f}'}",
              flush=True)
    path = common.write_results("dense-decode", gpu, ceil, cases, args.out)
    common.plot_ratios(cases, f"dense decode vs FlashMLA ({gpu})", path.replace(".json", ".png"))
    rs = [c["ratio_to_anchor"] for c in cases if c["ratio_to_anchor"]]
    print(f"wrote {path}; geomean ratio {math.exp(sum(map(math.log, rs)) / len(rs)):.3f} over {len(rs)} anchor cases")


if __name__ == "__main__":
    main()
