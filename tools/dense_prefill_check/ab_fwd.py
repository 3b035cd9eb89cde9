"""A/B of the dense prefill forward between two builds of the standalone check library
(tools/dense-prefill-gpu-check.sh builds one; build the other from an older tree the same way): OLD's default
schedule against NEW's pingpong_tma and persistent_tma, interleaved, on the 16 benchmark shapes (b 2, bf16, d_v 128,
FLOPs as spec 5.5). Prints TFLOP/s per schedule (best of ROUNDS x 10 calls; check.py's timing, no L2 flush) and
whether out / lse of the three are bitwise equal.

Usage (GPU machine, repository root): python3 tools/dense_prefill_check/ab_fwd.py OLD.so NEW.so [ROUNDS]"""
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
    old, new = DensePrefillLib(sys.argv[1]), DensePrefillLib(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    b, dv = 2, 128
    res = {}
    for (s, h, hk, d, c) in SHAPES:
        torch.manual_seed(0)
        q, k, v, _, cu_q, cu_k = make_inputs([s] * b, [s] * b, h, hk, d, dv, torch.bfloat16, "cuda")
        scale = (d + 100) ** -0.5
        flops = visible_pairs([s] * b, [s] * b, c) * h * 2 * (d + dv)
        runs = {"old": (old, "default"), "new_pp": (new, "pingpong_tma"), "new_persist": (new, "persistent_tma")}
        outs = {key: lib.fwd(q, k, v, cu_q, cu_k, s, s, scale, c, schedule=sch) for key, (lib, sch) in runs.items()}
        torch.cuda.synchronize()

        def same(x, y):
            return torch.equal(outs[x][0], outs[y][0]) and torch.equal(outs[x][1].nan_to_num(), outs[y][1].nan_to_num())

        times = {key: [] for key in runs}
        for _ in range(rounds):
            for key, (lib, sch) in runs.items():
                o, lse = outs[key]
                times[key].append(cuda_time_ms(lambda: lib.fwd(q, k, v, cu_q, cu_k, s, s, scale, c, out=o, lse=lse,
                                                               poison=False, schedule=sch)))
        tf = {key: flops / 1e9 / min(t) for key, t in times.items()}
        name = f"s{s}_h{h}-{hk}_d{d}{'_causal' if c else ''}"
        print(f"{name:28s} old {tf['old']:6.1f}  new_pp {tf['new_pp']:6.1f}  persist {tf['new_persist']:6.1f}  "
              f"persist/old {tf['new_persist'] / tf['old']:.3f}  pp/old {tf['new_pp'] / tf['old']:.3f}  "
              f"bitwise persist==pp {same('new_persist', 'new_pp')} pp==old {same('new_pp', 'old')}", flush=True)
        res[name] = tf

    def geomean(key):
        return math.exp(statistics.mean(math.log(r[key] / r["old"]) for r in res.values()))

    print(f"geomean persist/old {geomean('new_persist'):.3f}  new_pp/old {geomean('new_pp'):.3f}")


if __name__ == "__main__":
    main()
