"""Shared benchmark plumbing: ceilings measured in the same run, kernel timing, JSON, plots.

Kernel time comes from the PyTorch profiler (CUDA activity, kernels matched by name substring,
the mean over the profiled calls, L2 flushed with an 8 GB memset before each call, as FlashMLA's
kernelkit bench_kineto measures the anchors); whole-call time is the median of CUDA events
around the Python call.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
from typing import Callable, Dict, List

import torch


def measure_ceilings() -> Dict[str, float]:
    """bf16 matmul TFLOP/s (8192^3, mean of 10 after 3 warm-ups, random data) and
    device copy GB/s (2 GiB, bytes read + written), as in shared/anchors-h200.md."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    torch.cuda.synchronize()
    tflops = 2 * n**3 * 10 / (s.elapsed_time(e) * 1e-3) / 1e12
    del a, b
    x = torch.empty(2**30, device="cuda", dtype=torch.int16)  # 2 GiB
    x.random_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    gbps = 2 * x.numel() * 2 * 10 / (s.elapsed_time(e) * 1e-3) / 1e9
    del x, y
    torch.cuda.empty_cache()
    return {"matmul_tflops": round(tflops, 1), "copy_gbps": round(gbps, 1)}


_FLUSH = None
# L2 flush between timed calls: an int memset of FLASHMLA_BENCH_FLUSH_GB gigabytes (default 8, as
# FlashMLA's kernelkit bench_kineto that measured the anchors, spec §5 "bench.py"; the H200's L2 is
# 60 MB, so any size above ~0.1 GB evicts it; the size also sets how long the GPU rests between calls).
FLUSH_GB = float(os.environ.get("FLASHMLA_BENCH_FLUSH_GB", "8"))


def flush_l2():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(int(FLUSH_GB * 1e9) // 4, dtype=torch.int32, device="cuda")
    _FLUSH.zero_()


def kernel_times_us(fn: Callable[[], object], names: List[str], reps: int = 30) -> Dict[str, float]:
    """As FlashMLA's kernelkit bench_kineto(fn, num_tests=reps) (spec §5): two rounds of `reps`
    calls, each call preceded by an L2 flush (flush_l2); the second round runs under the PyTorch
    profiler. Per substring: the summed duration of the kernels whose name contains it, divided by
    `reps` (a mean: one slow call raises it); plus 'call' = the median CUDA-event time of the whole
    call over the first round's calls (flush excluded), and 'span' = the mean over calls of the time
    from the start of the call's first kernel whose name contains names[0] to the end of the last
    kernel of that call matching any name. Microseconds.

    The summed durations double-count when a kernel is launched as a programmatic dependent (PDL):
    the dependent (e.g. the decode combine) starts while the main kernel runs and its duration
    includes its wait at griddepcontrol.wait. 'span' is the whole call's GPU time either way."""
    from torch.profiler import ProfilerActivity, profile

    call = []
    for _ in range(reps):
        flush_l2()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        call.append(s.elapsed_time(e) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    out = {"call": statistics.median(call)}
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    for name in names:
        durs = [ev.device_time for ev in events if name in ev.name]
        out[name] = sum(durs) / reps if durs else float("nan")
    out["span"] = call_span_us(events, names)
    return out


def call_span_us(events, names: List[str]) -> float:
    """Mean per-call GPU span over profiler CUDA events (see kernel_times_us): a call starts at each
    kernel whose name contains names[0] and holds the matching kernels up to the next such start."""
    ks = sorted((ev for ev in events if any(n in ev.name for n in names)), key=lambda ev: ev.time_range.start)
    spans, start, end = [], None, None
    for ev in ks:
        if names[0] in ev.name:
            if start is not None:
                spans.append(end - start)
            start, end = ev.time_range.start, ev.time_range.end
        elif start is not None:
            end = max(end, ev.time_range.end)
    if start is not None:
        spans.append(end - start)
    return sum(spans) / len(spans) if spans else float("nan")


def write_results(kind: str, gpu: str, ceilings: Dict[str, float], cases: List[dict], outdir: str) -> str:
    """Writes <outdir>/<date>-<kind>.json; for the issues' benchmarks (dense-decode, sparse-decode,
    sparse-prefill) with a "targets" block (bench/targets.py: each target, the value reached, met or not)."""
    import targets

    date = _dt.date.today().isoformat()
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, f"{date}-{kind}.json")
    data = {"gpu": gpu, "date": date, "ceilings": ceilings,
            "timing": {"method": "bench_kineto: 2 rounds of reps calls, the second profiled; mean kernel time",
                       "l2_flush_gb": FLUSH_GB},
            "cases": cases}
    if kind in targets.GEOMEAN_TARGET:
        data["targets"] = targets.summarize(kind, cases)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def plot_ratios(cases: List[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = [c for c in cases if c.get("ratio_to_anchor") is not None]
    if not named:
        return
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(named)), 5))
    ratios = [c["ratio_to_anchor"] for c in named]
    ax.bar(range(len(named)), ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(range(len(named)))
    ax.set_xticklabels([c["name"] for c in named], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("ratio to FlashMLA anchor (>1 = faster)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
