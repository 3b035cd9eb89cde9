#!/usr/bin/env python3
"""ABI proof for flash_mla's native libraries (CI: tools/run-tests.sh, stage "torch ABI").

Usage: tools/check-abi.py WHEEL_OR_SO [...]

For every shared object (a wheel is unpacked to a temporary directory):
  * no CPython symbol at all (Py*, _Py*): neither library uses CPython, so the wheel is
    valid for every CPython >= 3.10 (abi3);
  * no libpython / libtorch_python among the needed libraries;
  * libflashmla_torch.so: every undefined symbol is either a C symbol of torch's stable C
    shim (aoti_torch_* / torch_*) or a versioned symbol of the C/C++ runtime (GLIBC_*,
    GLIBCXX_*, CXXABI_*, GCC_*) - in particular no C++-mangled torch / c10 / at symbol,
    which would tie the binary to one torch release; it needs no torch library but
    libtorch_cpu.so (where the shim lives);
  * a wheel must be tagged cp3X-abi3.
Prints the shim symbols used. Exit status 1 on any violation. Needs binutils (nm, readelf).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile

RUNTIME_VERSIONS = re.compile(r"@(GLIBC|GLIBCXX|CXXABI|GCC)_[\d.]+$")
SHIM = re.compile(r"^(aoti_torch_|torch_)[A-Za-z0-9_]+$")
# C++ runtime symbols that may come unversioned (std::, __gnu_cxx::, operator new/delete, RTTI of std types).
STD_MANGLED = re.compile(r"^_Z(N|NK)?(St|Sa|Ss|Si|So|Sd|9__gnu_cxx)|^_ZT[IVS]N?St|^_Z(dl|nw|na|da)[A-Za-z]")
TORCH_MANGLED = re.compile(r"^_Z\w*?(3c10|2at|5torch|6caffe2)")
WEAK_OK = {"_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable", "__gmon_start__", "__cxa_finalize"}
# C++ ABI / unwinder / transactional-memory runtime entry points (libstdc++, libgcc_s, libitm). CUDA builds
# link cudart statically, which brings unversioned references to these (seen on the H200 build machine).
CXX_RUNTIME = re.compile(r"^(_ITM_\w+|_ZGTt\w+|__cxa_\w+|__gxx_personality_v0|_Unwind_\w+)$")
BAD_NEEDED = re.compile(r"libpython|libtorch_python")


def undefined_symbols(path: str) -> list[tuple[str, str]]:
    out = subprocess.run(["nm", "-D", "--undefined-only", path], check=True, capture_output=True, text=True).stdout
    syms = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            syms.append((parts[-2], parts[-1]))  # (type, name[@version])
    return syms


def needed_libs(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def check_so(path: str) -> list[str]:
    errors = []
    name = os.path.basename(path)
    syms = undefined_symbols(path)
    needed = needed_libs(path)
    for lib in needed:
        if BAD_NEEDED.search(lib):
            errors.append(f"{name}: needs {lib}")
    py = [s for _, s in syms if re.match(r"^_?Py", s.split("@")[0])]
    if py:
        errors.append(f"{name}: uses CPython symbols: {', '.join(py[:10])}")
    if name.startswith("libflashmla_torch"):
        shim = []
        for kind, sym in syms:
            base = sym.split("@")[0]
            if SHIM.match(base) and "@" not in sym:
                shim.append(base)
            elif RUNTIME_VERSIONS.search(sym) or STD_MANGLED.match(base):
                continue
            elif (kind.lower() == "w" and base in WEAK_OK) or CXX_RUNTIME.match(base):
                continue
            elif TORCH_MANGLED.match(base):
                errors.append(f"{name}: unstable torch C++ symbol {base}")
            else:
                errors.append(f"{name}: undefined symbol outside the stable C shim and the C/C++ runtime: {sym}")
        torch_libs = [lib for lib in needed if "torch" in lib or "c10" in lib]
        if torch_libs != ["libtorch_cpu.so"]:
            errors.append(f"{name}: expected to need exactly libtorch_cpu.so of torch, needs {torch_libs}")
        print(f"{name}: {len(shim)} stable-shim symbols: {' '.join(sorted(shim))}")
    print(f"{name}: needs {' '.join(needed)}; {len(syms)} undefined symbols, {len(py)} CPython")
    return errors


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    errors: list[str] = []
    for arg in argv:
        if arg.endswith(".whl"):
            tags = os.path.basename(arg)[:-4].split("-")
            if len(tags) < 5 or not re.fullmatch(r"cp3\d+", tags[-3]) or tags[-2] != "abi3":
                errors.append(f"{arg}: not an abi3 wheel (tags {tags[-3:]})")
            with tempfile.TemporaryDirectory() as d:
                with zipfile.ZipFile(arg) as z:
                    sos = [n for n in z.namelist() if n.endswith(".so")]
                    z.extractall(d, sos)
                if not any(os.path.basename(s).startswith("libflashmla_torch") for s in sos):
                    errors.append(f"{arg}: has no libflashmla_torch.so (built without torch?)")
                for so in sos:
                    errors += check_so(os.path.join(d, so))
        else:
            errors += check_so(arg)
    for e in errors:
        print("ABI CHECK FAILED:", e, file=sys.stderr)
    print("ABI check:", "FAILED" if errors else "OK")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
