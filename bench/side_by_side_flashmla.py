"""Side by side with FlashMLA, in one GPU run: the anchor kit's `side_by_side.py` for each family asked
for, plus the ceilings (bf16 matmul, device copy) of the same run and a bar plot of the ratios.

FlashMLA (deepseek-ai/FlashMLA @9241ae3, built from source by the anchor kit into /tmp/anchor) and our
installed `flash_mla` run FlashMLA's own performance cases through its own harness (kernelkit's
bench_kineto) in consecutive processes; `ratio` = FlashMLA time / our time (> 1: we are faster). The
anchor kit lives in the ignored `.anchor/` (see the kit's README: prepare it on the CPU machine, build it
on the GPU machine with `bash .anchor/build.sh`). Nothing of FlashMLA is part of this repository.

Usage (GPU machine, repository root):
  python3 bench/side_by_side_flashmla.py OUT_DIR sparse [dense prefill]
Writes OUT_DIR/<date>-<family>-decode|prefill-vs-flashmla.json (+ .png) per family:
  sparse -> sparse-decode, dense -> dense-decode, prefill -> sparse-prefill.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KIND = {"sparse": "sparse-decode", "dense": "dense-decode", "prefill": "sparse-prefill"}


def ceilings() -> dict:
    sys.path.insert(0, HERE)
    import common  # noqa: PLC0415 (torch only when run)

    return common.measure_ceilings()


def ours() -> dict:
    """Which flash_mla ran beside the anchor: this repository, at the git revision given in FLASHMLA_GIT_REV
    (empty when not given: the GPU machine's copy of the tree has no .git)."""
    return {"package": "flash_mla (this repository)", "git": os.environ.get("FLASHMLA_GIT_REV", "")}


def plot(doc: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cases = doc["cases"]
    r = [c["ratio"] for c in cases]
    fig, ax = plt.subplots(figsize=(max(8, 0.4 * len(cases)), 5))
    ax.bar(range(len(r)), r, color=["tab:green" if x >= 1 else "tab:red" for x in r])
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(range(len(r)))
    ax.set_xticklabels([c["case"] for c in cases], rotation=75, ha="right", fontsize=6)
    ax.set_ylabel("FlashMLA time / our time (> 1: faster)")
    ax.set_title(f"{doc['family']}: geomean {doc['geomean_ratio']:.3f}, min {doc['min_ratio']:.3f} "
                 f"({doc['date']}, {doc['gpu']}, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) < 3 or any(f not in KIND for f in sys.argv[2:]):
        raise SystemExit(__doc__)
    out, fams = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    kit = os.path.join(ROOT, ".anchor", "side_by_side.py")
    if not os.path.exists(kit):
        raise SystemExit(f"{kit} not found: prepare the anchor kit first (.anchor/, see its README)")
    ceil = ceilings()
    print("ceilings", ceil, flush=True)
    date = datetime.date.today().isoformat()
    for fam in fams:
        path = os.path.join(out, f"{date}-{KIND[fam]}-vs-flashmla.json")
        subprocess.run([sys.executable, kit, fam, path], check=True)
        with open(path) as f:
            doc = json.load(f)
        doc["ceilings"] = ceil
        doc["ours"] = ours()
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        plot(doc, path[:-5] + ".png")


if __name__ == "__main__":
    main()
