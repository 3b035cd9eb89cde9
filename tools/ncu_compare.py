"""Kernels of an Nsight Compute export side by side, as Markdown.

Reads the CSV that `ncu -i REPORT.ncu-rep --page details --csv` writes (plain or gzip-compressed, by the
.gz suffix) with the standard library only, and prints:

* a legend: ID, short kernel name, NVTX range (push/pop range of the launching thread; empty when the
  launch came from another thread, e.g. autograd's backward worker), block and grid;
* one table, one column per kernel, of chosen metrics under the names and units ncu gives them
  ("Section / Metric [unit]"); a chosen metric absent for a kernel prints as "-", and chosen metrics that
  no selected kernel has are listed below the table (they belong to sections the profile did not collect);
* rows read from ncu's rule texts (e.g. HighPipeUtilization names the most-utilised pipeline and its
  percentage), marked as such;
* derived rows (marked "derived", formula given), e.g. pipeline-busy cycles = that percentage x elapsed
  cycles;
* every metric of the sections "Warp State Statistics" and "Scheduler Statistics" that the export holds
  (collected by `--set full` or `--section WarpStateStats --section SchedulerStats`);
* ncu's rules per kernel with their estimated speedups.

Usage:
  python3 tools/ncu_compare.py REPORT.csv[.gz] [--ids 0,6,7] [--names fwd_kernel,FlashAttnFwd] [--full-rules]

--ids takes the export's ID column (comma-separated, ranges as 2-4); --names keeps kernels whose full name,
short name or NVTX range contains any of the comma-separated substrings (case-insensitive). Both given:
a kernel must pass both.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
import sys

NVTX_PREFIX = "thread Domain:Push/Pop_Range"

# (section, metric) as ncu names them in the details page, in print order.
CHOSEN = [
    ("GPU Speed Of Light Throughput", "Duration"),
    ("GPU Speed Of Light Throughput", "SM Frequency"),
    ("GPU Speed Of Light Throughput", "Elapsed Cycles"),
    ("GPU Speed Of Light Throughput", "SM Active Cycles"),
    ("Launch Statistics", "Registers Per Thread"),
    ("Launch Statistics", "Dynamic Shared Memory Per Block"),
    ("Launch Statistics", "Static Shared Memory Per Block"),
    ("Launch Statistics", "Block Size"),
    ("Launch Statistics", "Grid Size"),
    ("Launch Statistics", "Waves Per SM"),
    ("Occupancy", "Theoretical Occupancy"),
    ("Occupancy", "Achieved Occupancy"),
    ("Occupancy", "Achieved Active Warps Per SM"),
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("Compute Workload Analysis", "SM Busy"),
    ("Compute Workload Analysis", "Issue Slots Busy"),
    ("Compute Workload Analysis", "Executed Ipc Active"),
    ("Compute Workload Analysis", "Issued Ipc Active"),
    ("GPU Speed Of Light Throughput", "Memory Throughput"),
    ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"),
    ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("Memory Workload Analysis", "Memory Throughput"),
    ("Memory Workload Analysis", "Mem Pipes Busy"),
    ("Memory Workload Analysis", "L1/TEX Hit Rate"),
    ("Memory Workload Analysis", "L2 Hit Rate"),
    ("Memory Workload Analysis", "L2 Compression Input Sectors"),
    ("Memory Workload Analysis", "Local Memory Spilling Requests"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("Warp State Statistics", "Warp Cycles Per Executed Instruction"),
    ("Scheduler Statistics", "No Eligible"),
    ("Scheduler Statistics", "Eligible Warps Per Scheduler"),
    ("Instruction Statistics", "Executed Instructions"),
    ("Instruction Statistics", "Issued Instructions"),
    ("Source Counters", "Branch Instructions"),
]

# Sections printed in full when present (stall breakdowns, scheduler state).
FULL_SECTIONS = ["Warp State Statistics", "Scheduler Statistics"]

PIPE_BY_CYCLES = re.compile(r"(\w[\w ]*?) is the highest-utilized pipeline \(([\d.]+)%\) based on elapsed cycles")
PIPE_BY_INST = re.compile(
    r"Based on the number of executed instructions, the highest utilized pipeline \(([\d.]+)%\) is (\w+)")


def open_text(path):
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def number(text):
    """Float of an ncu value such as '14,190,512' or '58.61'; None when not numeric."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def short_name(full):
    """Function name without return type, namespaces, template arguments or parameters.

    A `device_kernel<...>` wrapper (CUTLASS) is shown with the first class it instantiates, e.g.
    device_kernel<FlashAttnFwdSm90>; names without templates (cuDNN's generated kernels) stay whole.
    """
    name = full[5:] if full.startswith("void ") else full
    depth, base_end = 0, len(name)
    for i, c in enumerate(name):  # end of the function name: first '<' or '(' at depth 0
        if c in "<(" and depth == 0:
            base_end = i
            break
    base = name[:base_end].split("::")[-1]
    if base == "device_kernel" and base_end < len(name) and name[base_end] == "<":
        inner = [m for m in re.findall(r"::(\w+)<", name[base_end:]) if not m.startswith("enable_")]
        if inner:
            base = f"device_kernel<{inner[0]}>"
    return base


def nvtx_range(text):
    """The innermost range name of the '<domain>:NAME:...' NVTX column, '' when none."""
    m = re.search(r'"<[^>]*>:([^:]*):', text or "")
    return m.group(1) if m else ""


class Kernel:
    def __init__(self, row, nvtx_col):
        self.id = row["ID"]
        self.name = row["Kernel Name"]
        self.short = short_name(self.name)
        self.nvtx = nvtx_range(row.get(nvtx_col, "")) if nvtx_col else ""
        self.block = row["Block Size"]
        self.grid = row["Grid Size"]
        self.metrics = {}  # (section, metric) -> (unit, value)
        self.sections = {}  # section -> [(metric, unit, value)] in file order
        self.rules = []  # (section, rule, type, speedup type, speedup, description)

    def value(self, section, metric):
        uv = self.metrics.get((section, metric))
        return number(uv[1]) if uv else None


def read_kernels(path):
    with open_text(path) as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "ID" not in reader.fieldnames or "Metric Name" not in reader.fieldnames:
            raise SystemExit(f"{path}: not an ncu '--page details --csv' export (no ID / Metric Name columns)")
        nvtx_col = next((c for c in reader.fieldnames if c.startswith(NVTX_PREFIX)), None)
        kernels = {}
        for row in reader:
            k = kernels.get(row["ID"])
            if k is None:
                k = kernels[row["ID"]] = Kernel(row, nvtx_col)
            sec = row["Section Name"]
            if row.get("Metric Name"):
                k.metrics[(sec, row["Metric Name"])] = (row["Metric Unit"], row["Metric Value"])
                k.sections.setdefault(sec, []).append((row["Metric Name"], row["Metric Unit"], row["Metric Value"]))
            if row.get("Rule Name"):
                k.rules.append((sec, row["Rule Name"], row["Rule Type"], row.get("Estimated Speedup Type", ""),
                                row.get("Estimated Speedup", ""), row.get("Rule Description", "")))
    return list(kernels.values())


def parse_ids(text):
    ids = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SystemExit(f"--ids: expected comma-separated IDs or ranges like 0,2-4,6, got {part!r}")
        lo = int(m.group(1))
        hi = int(m.group(2) or lo)
        ids.update(str(i) for i in range(lo, hi + 1))
    return ids


def first_sentence(text):
    m = re.match(r"(.+?\.)(\s|$)", text.strip())
    return m.group(1) if m else text.strip()


def md_cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header, rows):
    out = ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def pipe_rows(kernels):
    """Rows read from the HighPipeUtilization rule text (absent for kernels without that rule)."""
    by_cycles, by_inst = [], []
    for k in kernels:
        text = " ".join(r[5] for r in k.rules if r[1] == "HighPipeUtilization")
        m = PIPE_BY_CYCLES.search(text)
        by_cycles.append(f"{m.group(1)} {m.group(2)}" if m else "-")
        m = PIPE_BY_INST.search(text)
        by_inst.append(f"{m.group(2)} {m.group(1)}" if m else "-")
    return [
        ["rule HighPipeUtilization: highest-utilized pipeline by elapsed cycles [%]"] + by_cycles,
        ["rule HighPipeUtilization: highest-utilized pipeline by executed instructions [%]"] + by_inst,
    ]


def derived_rows(kernels):
    rows = []
    busy = []
    for k in kernels:
        text = " ".join(r[5] for r in k.rules if r[1] == "HighPipeUtilization")
        m = PIPE_BY_CYCLES.search(text)
        cyc = k.value("GPU Speed Of Light Throughput", "Elapsed Cycles")
        busy.append(f"{m.group(1)} {float(m.group(2)) / 100 * cyc / 1e6:.2f} M" if m and cyc else "-")
    rows.append(["derived: top pipeline busy cycles = its % x Elapsed Cycles [cycle per SM]"] + busy)
    inst = []
    for k in kernels:
        ipc = k.value("Compute Workload Analysis", "Executed Ipc Active")
        act = k.value("GPU and Memory Workload Distribution", "Average SM Active Cycles")
        sms = k.value("Launch Statistics", "# SMs")
        inst.append(f"{ipc * act * sms / 1e9:.2f} G" if None not in (ipc, act, sms) else "-")
    rows.append(["derived: instructions executed ~ Executed Ipc Active x Average SM Active Cycles x # SMs [inst]"]
                + inst)
    return rows


def render(kernels, full_rules):
    out = []
    out.append(table(["ID", "kernel (short name)", "NVTX range", "block", "grid"],
                     [[k.id, k.short, k.nvtx or "-", k.block, k.grid] for k in kernels]))
    out.append("")
    header = ["Section / Metric [unit]"] + [f"ID {k.id}" for k in kernels]
    rows, missing = [], []
    for sec, met in CHOSEN:
        present = [k.metrics.get((sec, met)) for k in kernels]
        if not any(present):
            missing.append(f"{sec} / {met}")
            continue
        units = {p[0] for p in present if p}
        if len(units) == 1:  # one unit: in the row label
            unit = units.pop()
            rows.append([f"{sec} / {met}" + (f" [{unit}]" if unit else "")] + [p[1] if p else "-" for p in present])
        else:  # ncu scales units per kernel (ms / us, Gbyte/s / Tbyte/s): in each cell
            rows.append([f"{sec} / {met} [unit per cell]"] + [f"{p[1]} {p[0]}" if p else "-" for p in present])
    rows += pipe_rows(kernels)
    rows += derived_rows(kernels)
    out.append(table(header, rows))
    out.append("")
    if missing:
        out.append("Chosen metrics not in this export (their sections were not collected): " + "; ".join(missing)
                   + ".")
        out.append("")
    for sec in FULL_SECTIONS:
        names = []
        for k in kernels:
            for met, unit, _ in k.sections.get(sec, []):
                if (met, unit) not in names:
                    names.append((met, unit))
        if not names:
            continue
        out.append(f"{sec} (every metric the export holds):")
        out.append("")
        srows = []
        for met, unit in names:
            srows.append([met + (f" [{unit}]" if unit else "")]
                         + [k.metrics.get((sec, met), ("", "-"))[1] for k in kernels])
        out.append(table(["Metric [unit]"] + [f"ID {k.id}" for k in kernels], srows))
        out.append("")
    out.append("ncu rules (type, estimated speedup type and value, " +
               ("full text" if full_rules else "first sentence") + "):")
    out.append("")
    rrows = []
    for k in kernels:
        for sec, rule, typ, sptype, sp, desc in k.rules:
            rrows.append([k.id, rule, typ, f"{sptype} {sp}".strip() or "-",
                          desc.strip() if full_rules else first_sentence(desc)])
    out.append(table(["ID", "rule", "type", "est. speedup [%]", "text"], rrows))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page details --csv export (.csv or .csv.gz)")
    ap.add_argument("--ids", help="IDs to keep, e.g. 0,2-4,6")
    ap.add_argument("--names", help="comma-separated substrings of kernel name / short name / NVTX range")
    ap.add_argument("--full-rules", action="store_true", help="print whole rule texts, not first sentences")
    args = ap.parse_args(argv)
    kernels = read_kernels(args.csv)
    if args.ids:
        keep = parse_ids(args.ids)
        kernels = [k for k in kernels if k.id in keep]
    if args.names:
        subs = [s.strip().lower() for s in args.names.split(",") if s.strip()]
        kernels = [k for k in kernels if any(s in k.name.lower() or s in k.short.lower() or s in k.nvtx.lower()
                                             for s in subs)]
    if not kernels:
        raise SystemExit("no kernel matches --ids / --names")
    print(render(kernels, args.full_rules))


if __name__ == "__main__":
    sys.exit(main())
