"""Quick timing of the sparse FP8 decode main kernel on six key cases (no JSON, no ceilings).

Prints the main kernel's time and the call's GPU span (main kernel start to combine end) for V3.2 b128,
b74 (requests split across partitions: the combine has work) and b2 (the latency-bound case: 2-3 blocks
per CTA, where the prologue and epilogue are a third of the CTA's life), MODEL1 config 1 / 2 b128, the
h_q 128 d_qk 576 peak case, MODEL1 config 3 / 4 b2 (an extra cache of page size 2 with random
extra_topk_length: one block per CTA, the latency chain before the first S is the whole kernel) and config 4 b128
(the same with several requests per CTA: their lengths at every request boundary). Meant for comparing source variants in one device call (tools/ab-variants.sh sets
AB_VARIANT); the full benchmark with ceilings and anchors is bench/bench_sparse_decode.py.

Usage: python3 bench/quick_sparse_decode.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sparse_decode as B  # noqa: E402


def main():
    tag = os.environ.get("AB_VARIANT", "tree")
    unused = {"matmul_tflops": 1.0, "copy_gbps": 1.0}  # ratios to ceilings are not printed
    cases = [("v32 b128", B.V32, 128), ("v32 b74", B.V32, 74), ("v32 b2", B.V32, 2),
             ("model1 config1 b128", B.MODEL1["config1"][0], 128),
             ("model1 config2 b128", B.MODEL1["config2"][0], 128),
             ("peak h128 d576", dict(h_q=128, d_qk=576, s_kv=32768, topk=16384, pbs=64), 148),
             ("model1 config3 b2", B.MODEL1["config3"][0], 2),
             ("model1 config4 b2", B.MODEL1["config4"][0], 2),
             ("model1 config4 b128", B.MODEL1["config4"][0], 128)]
    for name, cfg, b in cases:
        c = B.bench_case(name, cfg, b, None, unused)
        print(f"[{tag}] {name:22s} {c['kernel']} {c['kernel_us']:9.1f} us   combine {c['combine_us']:7.1f} us   "
              f"call span {c['time_us']:9.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
