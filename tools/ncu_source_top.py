"""Condense Nsight Compute's per-SASS-instruction CSV into the instructions with the most stall samples.

Input: the output of `ncu --import REPORT.ncu-rep --page source --csv --print-source sass` (or the same
flags on a profiling run) for one kernel, which has one row per SASS instruction with its address,
its text and the warp-stall sampling counters. Output (stdout): the total samples, the share of each
stall reason over all samples, then the N instructions with the most samples, each with its offset
from the kernel start, its share of all samples and its two largest stall reasons.

Usage: python3 tools/ncu_source_top.py SOURCE.csv [N]   (N defaults to 40)

The column names differ between Nsight Compute versions, so they are found by substring: the
address ("Address"), the instruction ("Source"), the total ("Warp Stall Sampling (All Samples)")
and the per-reason sample columns (headers starting with "stall_" or containing "Stall" and
"Samples" other than the totals).
"""

from __future__ import annotations

import csv
import sys


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    path = sys.argv[1]
    top_n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(lines))
    head_i = next(i for i, r in enumerate(rows) if any("Address" in c for c in r) and any("Source" in c for c in r))
    head, body = rows[head_i], rows[head_i + 1:]
    addr = next(i for i, c in enumerate(head) if "Address" in c)
    src = next(i for i, c in enumerate(head) if c.strip() == "Source" or c.startswith("Source"))
    total = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    reasons = [i for i, c in enumerate(head)
               if i != total and "Not-issued" not in c and "Not Issued" not in c and "(All" not in c
               and (c.startswith("stall_") or ("Stall" in c and "Sampl" in c) or c.startswith("smsp__pcsamp"))]
    body = [r for r in body if len(r) > max([addr, src, total] + reasons)]
    if not body:
        raise SystemExit(f"{path}: no instruction rows")
    base = min(int(r[addr], 16) if r[addr].startswith("0x") else int(_num(r[addr])) for r in body)
    all_samples = sum(_num(r[total]) for r in body) or 1.0
    sums = {head[i]: sum(_num(r[i]) for r in body) for i in reasons}
    print(f"samples {all_samples:.0f}; stall reasons: " + ", ".join(
        f"{k} {100 * v / all_samples:.1f}%" for k, v in sorted(sums.items(), key=lambda kv: -kv[1]) if v > 0))
    for r in sorted(body, key=lambda r: -_num(r[total]))[:top_n]:
        a = int(r[addr], 16) if r[addr].startswith("0x") else int(_num(r[addr]))
        rs = sorted(((head[i], _num(r[i])) for i in reasons), key=lambda kv: -kv[1])[:2]
        print(f"  +0x{a - base:05x} {100 * _num(r[total]) / all_samples:5.1f}%  {r[src].strip()[:60]:60s} "
              + ", ".join(f"{k} {v:.0f}" for k, v in rs if v > 0))


if __name__ == "__main__":
    main()
