"""The speed targets of the kernel issues, evaluated on a benchmark result.

`summarize(kind, cases)` returns a `targets` block for bench/results/<date>-<kind>.json: each
target of the issue (issue 3: dense decode, 4: sparse FP8 decode, 6: sparse prefill), the value the
cases reach, whether it is met, and the benchmark's own description of what is measured. The
benchmarks call it when they write their JSON; for a JSON written before (or by another run):

    python3 bench/targets.py bench/results/2026-12-01-dense-decode.json   # adds / replaces "targets"

Only the standard library is used (no torch), so this also runs where no GPU is.

Targets (from the issues):
* dense-decode: ratio to the anchor >= 1.0 on every anchor case and geomean >= 1.05; memory-bound
  cases >= 92% of the copy ceiling; tensor-parallel shapes (h_q 8/16/32, s_q 1-4, s_k 8192) within
  1.2x of the time of the same KV read at h_q 64 (the "memory hq64" case).
* sparse-decode: ratio >= 1.0 on every anchor case, geomean >= 1.15. FlashMLA's anchors time the
  main kernel only; `ratio_to_anchor` adds our combine kernel, `ratio_kernel_only` does not: both
  are evaluated.
* sparse-prefill: ratio >= 1.0 on every anchor case, geomean >= 1.05.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Dict, List, Optional

GEOMEAN_TARGET = {"dense-decode": 1.05, "sparse-decode": 1.15, "sparse-prefill": 1.05}


def _geomean(values: List[float]) -> Optional[float]:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _ratio_targets(cases: List[dict], key: str, geomean_target: float, label: str) -> List[dict]:
    named = [c for c in cases if c.get(key) is not None]
    ratios = [c[key] for c in named]
    if not ratios:
        return []
    worst = min(named, key=lambda c: c[key])
    below = sorted(c["name"] for c in named if c[key] < 1.0)
    g = _geomean(ratios)
    return [
        {"target": f"geomean of {label} >= {geomean_target}", "value": round(g, 4), "met": g >= geomean_target,
         "cases": len(ratios)},
        {"target": f"every {label} >= 1.0", "value": round(worst[key], 4), "worst_case": worst["name"],
         "met": not below, "cases_below": len(below)},
    ]


def summarize(kind: str, cases: List[dict]) -> Dict[str, object]:
    """The `targets` block of a result of `kind` ('dense-decode', 'sparse-decode', 'sparse-prefill')."""
    out: List[dict] = []
    if kind == "sparse-decode":
        out += _ratio_targets(cases, "ratio_kernel_only", GEOMEAN_TARGET[kind],
                              "ratio to the anchor, main kernel only (as FlashMLA's anchors)")
        out += _ratio_targets(cases, "ratio_to_anchor", GEOMEAN_TARGET[kind],
                              "ratio to the anchor, main kernel + our combine")
    else:
        out += _ratio_targets(cases, "ratio_to_anchor", GEOMEAN_TARGET[kind], "ratio to the anchor")
    if kind == "dense-decode":
        mem = [c for c in cases if c["name"].startswith("memory") and c.get("frac_copy_ceiling") is not None]
        if mem:
            worst = min(mem, key=lambda c: c["frac_copy_ceiling"])
            out.append({"target": "memory-bound cases >= 0.92 of the copy ceiling",
                        "value": round(worst["frac_copy_ceiling"], 4), "worst_case": worst["name"],
                        "met": worst["frac_copy_ceiling"] >= 0.92})
        ref = next((c for c in cases if c["name"].startswith("memory hq64")), None)
        tp = [c for c in cases if c["name"].startswith("tp ")]
        if ref is not None and tp:
            rel = {c["name"]: c["time_us"] / ref["time_us"] for c in tp}
            rows = {c["name"]: c["params"].get("s_q", 1) * c["params"].get("h_q", 0) // c["params"].get("h_kv", 1)
                    for c in tp}
            worst = max(rel, key=rel.get)
            small = [v for k, v in rel.items() if rows[k] <= 64]
            out.append({"target": "tensor-parallel shapes within 1.2x of the h_q 64 KV read (memory hq64)",
                        "value": round(rel[worst], 4), "worst_case": worst, "met": rel[worst] <= 1.2,
                        "value_rows_le_64": round(max(small), 4) if small else None,
                        "note": "shapes with s_q * h_q / h_kv > 64 rows (h_q 32, s_q 4) are compute-bound: "
                                "twice the MMA work of h_q 64"})
    return {"all_met": all(t["met"] for t in out), "targets": out,
            "why_not": "bench/NOTES.md, section 'Summary' and each kernel's sections" if not all(
                t["met"] for t in out) else None}


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0])
        print("usage: python3 bench/targets.py RESULT.json")
        return 2
    path = argv[1]
    name = os.path.basename(path)
    kind = next((k for k in GEOMEAN_TARGET if f"-{k}" in name), None)
    if kind is None:
        print(f"{path}: not a dense-decode / sparse-decode / sparse-prefill result")
        return 2
    with open(path) as f:
        data = json.load(f)
    data["targets"] = summarize(kind, data["cases"])
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    for t in data["targets"]["targets"]:
        print(f"{'met    ' if t['met'] else 'NOT met'}  {t['target']}: {t['value']}"
              + (f" ({t['worst_case']})" if "worst_case" in t else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
