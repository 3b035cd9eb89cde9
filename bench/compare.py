"""Compare benchmark JSONs of two or more runs case by case (an A/B of source variants).

Usage: python bench/compare.py BASE.json OTHER.json [OTHER2.json ...] [--key time_us]

Each file is a `bench/results/<date>-<family>.json` written by bench_dense_decode.py,
bench_sparse_decode.py, bench_sparse_prefill.py or bench_dense_prefill.py (no default key there: pass
--key ours_fwd_ms or ours_bwd_ms, milliseconds). For every case name present in BASE and in an
OTHER file it prints BASE's and OTHER's value of --key (default: the kernel time, `kernel_us` where
the family reports one, else `time_us`; microseconds) and the speedup BASE/OTHER (> 1: OTHER is
faster), then the geometric mean of the speedups over the common cases.
"""
import argparse
import json
import math


def _time(case, key):
    if key:
        return case.get(key)
    return case.get("kernel_us", case.get("time_us"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("others", nargs="+")
    ap.add_argument("--key", default=None, help="case field to compare (default kernel_us, else time_us)")
    args = ap.parse_args()
    base = {c["name"]: c for c in json.load(open(args.base))["cases"]}
    for path in args.others:
        other = {c["name"]: c for c in json.load(open(path))["cases"]}
        logs = []
        print(f"--- {args.base} -> {path}")
        for name, c in base.items():
            if name not in other:
                continue
            a, b = _time(c, args.key), _time(other[name], args.key)
            if not a or not b:
                continue
            logs.append(math.log(a / b))
            unit = "ms" if (args.key or "").endswith("_ms") else "us"
            print(f"{name:40s} {a:10.3f} -> {b:10.3f} {unit}  x{a / b:.3f}" if unit == "ms"
                  else f"{name:40s} {a:10.1f} -> {b:10.1f} us  x{a / b:.3f}")
        if logs:
            print(f"geomean speedup x{math.exp(sum(logs) / len(logs)):.4f} over {len(logs)} cases")


if __name__ == "__main__":
    main()
