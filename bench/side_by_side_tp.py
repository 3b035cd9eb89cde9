"""Tensor-parallel head counts of sparse FP8 decode, side by side with FlashMLA in one GPU run.

After a tensor-parallel split a rank holds h_q / TP query heads (16 at TP8 for DeepSeek-V3.2's 128).
FlashMLA's sparse decode takes 64 or 128 heads only, so an integration pads each shard's q to 64 heads
(zeros) and drops the padded rows of the output. This tool times, on the same inputs:

* ours, native: `flash_mla_with_kvcache` on q with h_q heads (the library's own kernel choice);
* ours, padded: the same call on q zero-padded to 64 heads (the wgmma producer kernel);
* FlashMLA, padded: FlashMLA (the anchor, built by the anchor kit into /tmp/anchor) on the padded q.

Both packages are named `flash_mla`, so each runs in its own subprocess (`--worker`), with the anchor
first on sys.path for FlashMLA's. Inputs are the V3.2 format (d_qk 576, page block 64, s_kv 32768,
varlen lengths, topk 2048 distinct tokens per row, sink on), built from the same seed in every process
(`bench_sparse_decode.make_scope`). Time = the call's GPU span, from the main kernel's start to the
combine's end (the combine is a programmatic dependent of the main kernel, so the two durations overlap
and their sum would count the combine's wait), each call after an L2 flush, FlashMLA's kineto method
(`common.kernel_times_us`, its 'span'); the scheduler metadata is reused as across layers. ratio = FlashMLA padded time / ours native time (> 1: ours is faster).

Rows: the five of issue 24 (b, s_q, h_q) = (128, 1, 16), (128, 2, 16), (128, 2, 32), (32, 2, 16),
(8, 1, 16); `--sweep` adds ours native against ours padded for h_q 1, 8, 16, 24, 32, 48 at b 4, 8, 16,
32, 64, 128 and s_q 1, 2: the "never slower than our own padded kernel" check, across the query-token
count at which the library moves small head counts onto the 64-row wgmma kernel. `--cases B,S_Q,H_Q ...`
runs only the given (b, s_q, h_q), each with all three columns (e.g. the rows of one kernel in an A/B).
`--d-qk 512` runs the same rows and sweep in the MODEL1 format (d_qk 512, s_kv 16384, topk 512, page block 64), FlashMLA
too (its sm90 kernels take MODEL1 at 64 and 128 heads).

The document also records the ceilings of the same run (`ceilings`: bf16 matmul TFLOP/s and device copy
GB/s, measured before the workers start) and which package ran (`ours`), written by the helpers of
`side_by_side_flashmla.py` (the ceilings: `common.measure_ceilings`), as its documents carry them.

Usage (GPU machine, repository root, ours installed, anchor built by `bash .anchor/build.sh`):
  python3 bench/side_by_side_tp.py OUT_DIR [--anchor /tmp/anchor/flashmla] [--sweep | --cases B,S_Q,H_Q ...]
      [--d-qk 512]
Writes OUT_DIR/<date>-sparse-decode-tp-vs-flashmla.json (MODEL1: <date>-sparse-decode-tp-model1-vs-flashmla.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = [(128, 1, 16), (128, 2, 16), (128, 2, 32), (32, 2, 16), (8, 1, 16)]
SWEEP_H = [1, 8, 16, 24, 32, 48]
SWEEP_B = [4, 8, 16, 32, 64, 128]
CFG = dict(d_qk=576, s_kv=32768, topk=2048, pbs=64)
CFG_MODEL1 = dict(d_qk=512, s_kv=16384, topk=512, pbs=64)
PAD = 64


def worker(label: str, cases: list, modes: list, cfg: dict) -> None:
    """Times each (b, s_q, h_q) in each mode ('native' / 'pad64') with whichever flash_mla is first on
    sys.path; prints one 'TP <json>' line per measurement."""
    import torch

    sys.path.insert(0, HERE)
    import bench_sparse_decode as B  # noqa: PLC0415 (imports flash_mla: the one on sys.path)
    import common  # noqa: PLC0415

    import flash_mla  # noqa: PLC0415

    names = [B.KERNEL, B.COMBINE]
    for b, s_q, h_q in cases:
        gen = random.Random(1000 * b + 10 * s_q + h_q)
        torch.manual_seed(1000 * b + 10 * s_q + h_q)
        d = cfg["d_qk"]
        q = torch.randn(b, s_q, h_q, d, device="cuda").clamp(-1, 1).to(torch.bfloat16)
        sink = torch.randn(h_q, device="cuda")
        cache, indices, _ = B.make_scope(b, s_q, cfg["s_kv"], cfg["topk"], cfg["pbs"], d, gen)
        for mode in modes:
            if mode == "native":
                qm, sm = q, sink
            else:
                qm = torch.zeros(b, s_q, PAD, d, dtype=torch.bfloat16, device="cuda")
                qm[:, :, :h_q] = q
                sm = torch.zeros(PAD, device="cuda")
                sm[:h_q] = sink
            sched, _ = flash_mla.get_mla_metadata()
            kw = dict(softmax_scale=d ** -0.55, is_fp8_kvcache=True, indices=indices, attn_sink=sm)

            def call(qm=qm, sched=sched, kw=kw):
                return flash_mla.flash_mla_with_kvcache(qm, cache, None, None, 512, sched, **kw)

            try:
                out, _ = call()
                t = common.kernel_times_us(call, names, reps=20)
                kt = t[names[0]]
                ct = 0.0 if math.isnan(t[names[1]]) else t[names[1]]
                rec = dict(label=label, b=b, s_q=s_q, h_q=h_q, mode=mode, kernel_us=kt, combine_us=ct,
                           kernel=B.default_kernel(b, s_q, h_q if mode == "native" else PAD),
                           us=t["span"], finite=bool(torch.isfinite(out[:, :, :h_q]).all()))
            except Exception as e:  # FlashMLA refuses h_q it does not support: record why
                rec = dict(label=label, b=b, s_q=s_q, h_q=h_q, mode=mode, error=f"{type(e).__name__}: {e}"[:300])
            print("TP " + json.dumps(rec), flush=True)
        del cache, indices
        torch.cuda.empty_cache()
    print(f"# {label}: flash_mla from {flash_mla.__file__}", flush=True)


def run_worker(label: str, pythonpath: str | None, cases: list, modes: list, cfg: dict) -> list:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    arg = json.dumps(dict(cases=cases, modes=modes, cfg=cfg))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", label, arg], env=env,
                       capture_output=True, text=True, cwd="/tmp")
    if p.returncode:
        sys.exit(f"{label} worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    sys.stdout.write("".join(line + "\n" for line in p.stdout.splitlines() if line.startswith("#")))
    return [json.loads(line[3:]) for line in p.stdout.splitlines() if line.startswith("TP ")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="output folder")
    ap.add_argument("--anchor", default="/tmp/anchor/flashmla", help="FlashMLA built by the anchor kit")
    ap.add_argument("--sweep", action="store_true", help="also ours native vs ours padded over h_q 1..48, b 4..128")
    ap.add_argument("--cases", nargs="+", type=case_arg, metavar="B,S_Q,H_Q",
                    help="only these cases (instead of the five rows), FlashMLA padded on each too")
    ap.add_argument("--d-qk", type=int, default=576, choices=[576, 512], help="576: V3.2 format, 512: MODEL1")
    ap.add_argument("--worker", nargs=2, metavar=("LABEL", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.worker and not args.out:
        ap.error("OUT_DIR is required")
    if args.cases and args.sweep:
        ap.error("--cases replaces the rows and the sweep: give --cases or --sweep, not both")
    return args


def case_arg(text: str) -> tuple:
    """'B,S_Q,H_Q' -> (b, s_q, h_q), each a positive integer, h_q at most the padded width."""
    parts = text.split(",")
    try:
        b, s_q, h_q = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,S_Q,H_Q (three integers), got {text!r}") from None
    if min(b, s_q, h_q) < 1 or h_q > PAD:
        raise argparse.ArgumentTypeError(f"expected b, s_q >= 1 and 1 <= h_q <= {PAD}, got {text!r}")
    return (b, s_q, h_q)


def gpu_and_ceilings() -> tuple:
    """The GPU's name and the ceilings of this run (bf16 matmul TFLOP/s, device copy GB/s), measured by
    side_by_side_flashmla's helper (common.measure_ceilings) before the workers start, as that tool does."""
    import torch  # noqa: PLC0415 (GPU only)

    sys.path.insert(0, HERE)
    import side_by_side_flashmla  # noqa: PLC0415

    return torch.cuda.get_device_name(0), side_by_side_flashmla.ceilings()


def cases_of(sweep: bool) -> list:
    """ROWS, then (with sweep) the sweep's (b, s_q, h_q) that are not rows."""
    extra = [(b, s_q, h) for s_q in (1, 2) for b in SWEEP_B for h in SWEEP_H] if sweep else []
    return ROWS + [c for c in extra if c not in ROWS]


def build_doc(records: list, cases: list, cfg: dict, model1: bool, gpu: str, ceilings: dict,
              anchor_path: str) -> dict:
    """The result document from the workers' records ('TP' lines): one row per case, the ratios, the
    targets, and the ceilings and provenance of the run (the fields side_by_side_flashmla writes)."""
    sys.path.insert(0, HERE)
    import side_by_side_flashmla  # noqa: PLC0415

    get = {(r["label"], r["b"], r["s_q"], r["h_q"], r["mode"]): r for r in records}
    rows = []
    for b, s_q, h_q in cases:
        on, op = get[("ours", b, s_q, h_q, "native")], get[("ours", b, s_q, h_q, "pad64")]
        ap_ = get.get(("anchor", b, s_q, h_q, "pad64"))
        row = dict(b=b, s_q=s_q, h_q=h_q, ours_native_us=on.get("us"), ours_pad64_us=op.get("us"),
                   anchor_pad64_us=None if ap_ is None else ap_.get("us"),
                   kernel=on.get("kernel"),
                   # main kernel / combine durations (the combine's includes its wait for the main kernel)
                   ours_native_kernel_us=on.get("kernel_us"), ours_native_combine_us=on.get("combine_us"),
                   ours_pad64_kernel_us=op.get("kernel_us"),
                   anchor_pad64_kernel_us=None if ap_ is None else ap_.get("kernel_us"),
                   anchor_pad64_combine_us=None if ap_ is None else ap_.get("combine_us"),
                   native_vs_own_padded=(op["us"] / on["us"]) if "us" in on and "us" in op else None)
        if ap_ is not None and "us" in ap_ and "us" in on:
            row["ratio"] = ap_["us"] / on["us"]
        for r in (on, op, ap_):
            if r is not None and "error" in r:
                row.setdefault("errors", []).append(f"{r['label']} {r['mode']}: {r['error']}")
        rows.append(row)
    r = [x["ratio"] for x in rows if "ratio" in x]
    return dict(family="sparse-decode-tp", date=datetime.date.today().isoformat(), gpu=gpu,
                anchor=dict(name="FlashMLA", commit="9241ae3", measured_in_same_run=True, path=anchor_path,
                            input="q zero-padded to 64 heads"),
                timing="per call GPU span from the main kernel start to the combine end, L2 flushed before each call, kineto (common.kernel_times_us span)",
                config=dict(cfg, format="MODEL1" if model1 else "V3.2", sink=True),
                geomean_ratio=math.exp(sum(map(math.log, r)) / len(r)) if r else None,
                min_ratio=min(r) if r else None,
                targets=dict(ratio_ge_1_every_row=bool(r) and min(r) >= 1.0,
                             native_never_slower_than_own_padded=all(
                                 x["native_vs_own_padded"] is not None and x["native_vs_own_padded"] >= 1.0
                                 for x in rows),
                             # the same kernel on both sides differs by timing noise only
                             native_within_1pct_of_own_padded=all(
                                 x["native_vs_own_padded"] is not None and x["native_vs_own_padded"] >= 0.99
                                 for x in rows)),
                rows=rows, ceilings=ceilings, ours=side_by_side_flashmla.ours())


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker[1])
        worker(args.worker[0], [tuple(c) for c in spec["cases"]], spec["modes"], spec["cfg"])
        return ""
    model1 = args.d_qk == 512
    cfg = CFG_MODEL1 if model1 else CFG
    if not os.path.isdir(os.path.join(args.anchor, "flash_mla")):
        sys.exit(f"no FlashMLA anchor at {args.anchor} (build it with: bash .anchor/build.sh)")
    gpu, ceilings = gpu_and_ceilings()
    print(f"{gpu}: ceilings {ceilings}", flush=True)
    cases = list(dict.fromkeys(args.cases)) if args.cases else cases_of(args.sweep)
    ours = run_worker("ours", None, cases, ["native", "pad64"], cfg)
    anchor = run_worker("anchor", args.anchor, cases if args.cases else ROWS, ["pad64"], cfg)
    doc = build_doc(ours + anchor, cases, cfg, model1, gpu, ceilings, args.anchor)
    for row in doc["rows"]:
        us = {key: row[key] or float("nan") for key in ("ours_native_us", "ours_pad64_us", "anchor_pad64_us")}
        print(f"b {row['b']:4d} s_q {row['s_q']} h_q {row['h_q']:3d}: ours native {us['ours_native_us']:8.1f} us, "
              f"ours pad64 {us['ours_pad64_us']:8.1f} us, FlashMLA pad64 {us['anchor_pad64_us']:8.1f} us, "
              f"ratio {row.get('ratio', float('nan')):.3f}, "
              f"native/padded {row['native_vs_own_padded'] or float('nan'):.3f} ({row['kernel']})")
    os.makedirs(args.out, exist_ok=True)
    kind = "sparse-decode-tp-model1" if model1 else "sparse-decode-tp"
    path = os.path.join(args.out, f"{doc['date']}-{kind}-vs-flashmla.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}; geomean ratio {doc['geomean_ratio']}, min {doc['min_ratio']}")
    return path


if __name__ == "__main__":
    main()
