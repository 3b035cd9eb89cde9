"""Timeline of one dense-decode call on the GPU: each kernel's start offset and duration.

Where the whole-call time goes (scheduler, split-KV kernel, combine, gaps between them), for
eager calls and for a call captured in a CUDA graph (the anchors' "graph" time). Uses the
torch profiler's Chrome trace. Needs a CUDA GPU.

Usage: python tools/profile_decode_call.py [--cases b:h_q:s_k,...] [--sparse]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))


def kernels_of(prof):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    ev = [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    return sorted(ev, key=lambda e: e["ts"])


def show(label, events):
    if not events:
        print(f"  {label}: no GPU events")
        return
    t0 = events[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in events)
    print(f"  {label}: span {end - t0:8.1f} us, busy {sum(e['dur'] for e in events):8.1f} us")
    prev_end = t0
    for e in events:
        gap = e["ts"] - prev_end
        print(f"    +{e['ts'] - t0:8.1f} us  gap {gap:7.1f}  dur {e['dur']:8.1f}  {e['name'][:90]}")
        prev_end = e["ts"] + e["dur"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1:16:2048,128:16:256,128:16:8192")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import flash_mla
    from bench_dense_decode import make_inputs

    for spec in args.cases.split(","):
        b, h_q, s_k = (int(x) for x in spec.split(":"))
        q, k, bt, lens_t, _ = make_inputs(b, 1, h_q, s_k, False)
        sched = flash_mla.get_mla_metadata()[0]

        def call():
            return flash_mla.flash_mla_with_kvcache(q, k, bt, lens_t, 512, sched)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        print(f"b={b} h_q={h_q} s_k={s_k}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        show("eager", kernels_of(prof))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        show("graph", kernels_of(prof))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(10):
            e0.record()
            graph.replay()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        ts.sort()
        print(f"  graph replay, CUDA events (L2 warm): median {ts[len(ts) // 2]:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
