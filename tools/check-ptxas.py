#!/usr/bin/env python3
"""Compile every sm_90a translation unit (src/sm90/**/*.cu) with `ptxas -v` and check the kernels.

Prints, per kernel: registers, stack frame and spill bytes, and ptxas's wgmma performance notes.
Fails (exit 1) when ptxas reports C7512 ("wgmma.mma_async instructions are serialized due to
insufficient register resources") for any kernel: that silently costs ~20% of a wgmma kernel's
speed (docs/sparse-prefill.md: the sparse-prefill build with two S accumulator chains). C7519
("warpgroup.arrive is injected") is listed, not failed. Needs nvcc and the CUTLASS headers (the
PyPI package nvidia-cutlass, as CMakeLists.txt finds them, or --cutlass DIR); no GPU.

The nvcc flags mirror CMakeLists.txt's for the flashmla_core CUDA sources.

With --sass DIR it also writes each unit's machine code (cuobjdump -sass, needs cuobjdump and nvdisasm
on PATH or in CUDA's bin; the PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm have them) to
DIR/<unit>.sass, <unit> being the unit's path under src/sm90 with '/' as '.', so that a refactor can be
proven to leave the kernels unchanged: run before and after, then compare per kernel with
tools/compare-sass.py (which also matches kernels whose file moved or whose name changed).

Usage: python3 tools/check-ptxas.py [--cutlass DIR] [--jobs N] [--only NAME ...] [--include DIR] [-D NAME=VALUE]
                                    [--sass DIR]
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FLAGS = ["-std=c++20", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-DFLASHMLA_WITH_CUDA=1",
         "--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo", "-Xptxas=-v,--warn-on-spills",
         "--use_fast_math"]


def find_nvcc():
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    return None


def find_cutlass(explicit):
    if explicit:
        return explicit
    try:
        import cutlass_library  # noqa: PLC0415 (optional dependency)
        return os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    except ImportError:
        local = os.path.join(ROOT, ".deps", "cutlass_include")
        return local if os.path.isdir(local) else None


def find_cuobjdump(nvcc):
    for c in (shutil.which("cuobjdump"), os.path.join(os.path.dirname(nvcc), "cuobjdump")):
        if c and os.path.exists(c):
            return c
    return None


def unit_name(src):
    """A unit's name: its path under src/sm90 without .cu, '/' written as '.' (decode.dense.instantiations_bf16)."""
    return os.path.relpath(src, os.path.join(ROOT, "src", "sm90"))[:-3].replace(os.sep, ".")


def compile_one(nvcc, cutlass, src, outdir, extra=(), sass_dir=None, cuobjdump=None):
    obj = os.path.join(outdir, unit_name(src) + ".o")
    cmd = [nvcc, *FLAGS, *extra, "-I" + os.path.join(ROOT, "include"), "-I" + os.path.join(ROOT, "src"),
           "-isystem", cutlass, "-c", src, "-o", obj]
    r = subprocess.run(cmd, capture_output=True, text=True)
    log = r.stdout + r.stderr
    if r.returncode == 0 and sass_dir:
        d = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True)
        if d.returncode != 0:
            return src, d.returncode, log + d.stderr
        with open(os.path.join(sass_dir, unit_name(src) + ".sass"), "w") as f:
            f.write(d.stdout)
    return src, r.returncode, log


def parse(log):
    """Per mangled kernel name: regs, stack, spill stores / loads, notes (C75xx codes). The stack / spill line
    belongs to the function of the "Function properties for" line before it: an entry function's is followed by
    those of the non-inlined device functions it calls, which are not the kernel's."""
    kernels, cur, props = {}, None, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = kernels.setdefault(m.group(1), {"regs": None, "stack": 0, "spill_st": 0, "spill_ld": 0, "notes": set()})
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur is not None and props in kernels:
            kernels[props]["stack"], kernels[props]["spill_st"], kernels[props]["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m and cur is not None:
            cur["regs"] = int(m.group(1))
        m = re.search(r"\((C75\d\d)\).*function '([^']+)'", line)
        if m:
            kernels.setdefault(m.group(2), {"regs": None, "stack": 0, "spill_st": 0, "spill_ld": 0,
                                            "notes": set()})["notes"].add(m.group(1))
    return kernels


def demangle(names):
    """Readable kernel names (c++filt when present), without namespaces and the parameter list."""
    names = list(names)
    out = names
    if shutil.which("c++filt"):
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        if r.returncode == 0 and len(r.stdout.splitlines()) == len(names):
            out = r.stdout.splitlines()
    pretty = {}
    for n, d in zip(names, out):
        d = re.sub(r"^void |flashmla::sm90::|\(anonymous namespace\)::", "", d)
        pretty[n] = d[: d.find("(")] if "(" in d else d
    return pretty


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cutlass", help="CUTLASS/CuTe include directory")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", nargs="*",
                    help="translation units: file names without .cu (instantiations_d576) or unit names "
                         "(prefill.sparse.instantiations_d576)")
    ap.add_argument("--include", action="append", default=[],
                    help="a folder searched before src/ (a kernel variant: DIR/sm90/<family>/<file>.cuh)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="extra macro definitions (NAME=VALUE)")
    ap.add_argument("--sass", metavar="DIR", help="also write each unit's SASS (cuobjdump -sass) to DIR/<unit>.sass")
    a = ap.parse_args()
    nvcc = find_nvcc()
    if nvcc is None:
        print("check-ptxas: no nvcc; skipped")
        return 0
    cutlass = find_cutlass(a.cutlass)
    if not cutlass or not os.path.exists(os.path.join(cutlass, "cute", "tensor.hpp")):
        print("check-ptxas: CUTLASS headers not found (bash tools/fetch-cutlass.sh, or --cutlass DIR)")
        return 1
    cuobjdump = None
    if a.sass:
        cuobjdump = find_cuobjdump(nvcc)
        if cuobjdump is None:
            print("check-ptxas: --sass needs cuobjdump (pip download nvidia-cuda-cuobjdump; put its bin/ on PATH)")
            return 1
        os.makedirs(a.sass, exist_ok=True)
    srcdir = os.path.join(ROOT, "src", "sm90")
    srcs = sorted(os.path.join(d, f) for d, _, fs in os.walk(srcdir) for f in fs if f.endswith(".cu"))
    if a.only:
        srcs = [s for s in srcs if os.path.basename(s)[:-3] in a.only or unit_name(s) in a.only]
    failed = []
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as ex:
        extra = ["-I" + d for d in a.include] + ["-D" + d for d in a.defines]
        results = list(ex.map(lambda s: compile_one(nvcc, cutlass, s, tmp, extra, a.sass, cuobjdump), srcs))
    rows = {}
    for src, rc, log in results:
        if rc != 0:
            print(f"check-ptxas: {os.path.relpath(src, ROOT)} failed to compile:\n{log[-3000:]}")
            return 1
        for k, v in parse(log).items():
            rows[k] = v  # a kernel instantiated in several units is the same machine code
    pretty = demangle(rows)
    print(f"{'kernel':78s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>12s}  notes")
    for k in sorted(rows, key=lambda n: pretty[n]):
        v = rows[k]
        print(f"{pretty[k][:78]:78s} {v['regs'] if v['regs'] is not None else '-':>4} {v['stack']:5d} "
              f"{v['spill_st']:5d}/{v['spill_ld']:<6d}  {' '.join(sorted(v['notes']))}")
        if "C7512" in v["notes"]:
            failed.append(pretty[k])
    if failed:
        print("check-ptxas: FAILED: wgmma serialized for lack of registers (ptxas C7512) in:\n  " + "\n  ".join(failed))
        return 1
    print(f"check-ptxas: {len(rows)} kernels in {len(srcs)} units, no C7512")
    return 0


if __name__ == "__main__":
    sys.exit(main())
