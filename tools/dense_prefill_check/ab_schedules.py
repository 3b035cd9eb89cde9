"""A/B of dense prefill schedules, forward or backward, in one build of the standalone check library or two
(tools/dense-prefill-gpu-check.sh builds one; tools/dense-prefill-ab.sh builds a tree and an older tree): each schedule
named on the command line, interleaved, on the 16 benchmark shapes (b 2, bf16, d_v 128; FLOPs as spec 5.5: forward
pairs * h * 2 (d + dv), backward pairs * h * 2 (3 d + 2 dv)). Prints TFLOP/s per schedule (best of ROUNDS x 10 calls;
check.py's timing, no L2 flush) and whether the outputs of every schedule (out / lse, or dq / dk / dv) are bitwise
equal to the first one's (True, or per output "=" or "~" and the largest difference relative to the largest value).

Usage (GPU machine, repository root):
  python3 tools/dense_prefill_check/ab_schedules.py fwd|bwd LIB.so [--lib2 OTHER.so] [--rounds N] [--only NAME ...]
      SCHEDULE ...
  (forward: default, serial, overlap, pingpong, pingpong_tma, persistent_tma, persistent_tma_fold,
  persistent_tma_fold_k176, persistent_tma_fold_by_block (and the *_2cta ones, checked, not timed);
  backward: default, two_kernel, two_kernel_tma, two_kernel_tma_by_head, two_kernel_tma_by_block; dense_prefill.h;
  "2:NAME" runs NAME of --lib2)"""
import argparse
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check import cuda_time_ms, make_inputs, visible_pairs  # noqa: E402
from dense_prefill_lib import DensePrefillLib  # noqa: E402

SHAPES = [(s, h, hk, d, c) for s in (4096, 8192) for (h, hk) in ((128, 128), (32, 4)) for d in (128, 192)
          for c in (False, True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("direction", choices=("fwd", "bwd"))
    ap.add_argument("lib")
    ap.add_argument("schedules", nargs="+")
    ap.add_argument("--lib2", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    libs = {"": DensePrefillLib(args.lib)}
    if args.lib2:
        libs["2:"] = DensePrefillLib(args.lib2)

    def lib_of(sch):
        return (libs["2:"], sch[2:]) if sch.startswith("2:") else (libs[""], sch)

    bwd = args.direction == "bwd"
    b, dv = 2, 128
    first = args.schedules[0]
    res = {}
    for (s, h, hk, d, c) in SHAPES:
        name = f"s{s}_h{h}-{hk}_d{d}{'_causal' if c else ''}"
        if args.only and not any(o in name for o in args.only):
            continue
        torch.manual_seed(0)
        q, k, v, dout, cu_q, cu_k = make_inputs([s] * b, [s] * b, h, hk, d, dv, torch.bfloat16, "cuda")
        scale = (d + 100) ** -0.5
        flops = visible_pairs([s] * b, [s] * b, c) * h * 2 * ((3 * d + 2 * dv) if bwd else (d + dv))
        if bwd:
            out, lse = libs[""].fwd(q, k, v, cu_q, cu_k, s, s, scale, c)

        def call(sch, into=None):
            lb, sch_name = lib_of(sch)
            if bwd:
                return lb.bwd(q, k, v, cu_q, cu_k, s, s, scale, c, out, lse, dout, grads=into, poison=into is None,
                              schedule=sch_name)
            o, l2 = into if into is not None else (None, None)
            return lb.fwd(q, k, v, cu_q, cu_k, s, s, scale, c, out=o, lse=l2, poison=into is None, schedule=sch_name)

        results = {sch: call(sch) for sch in args.schedules}
        torch.cuda.synchronize()
        names = ("dq", "dk", "dv") if bwd else ("out", "lse")

        def compare(xs, ys):  # True when all bitwise equal, else per output: "=" or "~" max |x - y| / max |y|
            eq = [torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(xs, ys)]
            if all(eq):
                return True
            def rel(x, y):
                return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
            return ",".join(f"{n}=" if e else f"{n}~{rel(x, y):.1e}" for n, e, x, y in zip(names, eq, xs, ys))

        same = {sch: compare(results[sch], results[first]) for sch in args.schedules}
        times = {sch: [] for sch in args.schedules}
        if not res:  # the call's first shape: one untimed round first (the schedule listed second read low there)
            for sch in args.schedules:
                cuda_time_ms(lambda: call(sch, results[sch]))
        for _ in range(args.rounds):
            for sch in args.schedules:
                times[sch].append(cuda_time_ms(lambda: call(sch, results[sch])))
        tf = {sch: flops / 1e9 / min(t) for sch, t in times.items()}
        cols = "  ".join(f"{sch} {tf[sch]:6.1f}" for sch in args.schedules)
        rel = "  ".join(f"{sch}/{first} {tf[sch] / tf[first]:.3f}" for sch in args.schedules[1:])
        bits = " ".join(f"{sch}=={first} {same[sch]}" for sch in args.schedules[1:])
        print(f"{name:28s} {cols}  {rel}  bitwise {bits}", flush=True)
        res[name] = tf
    for sch in args.schedules[1:]:
        g = math.exp(statistics.mean(math.log(r[sch] / r[first]) for r in res.values()))
        print(f"geomean {sch}/{first} {g:.3f}")


if __name__ == "__main__":
    main()
