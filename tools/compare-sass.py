#!/usr/bin/env python3
"""Compare the machine code of two `tools/check-ptxas.py --sass DIR` runs, kernel by kernel.

Kernels are matched by demangled name across all units of each side, so a kernel whose file moved
(another unit) still pairs with itself. Names are normalized first: the hashes nvcc puts into the
names of anonymous namespaces (derived from the file path) are dropped, and `--rename OLD=NEW`
substitutions (substring, applied to the BEFORE side's demangled names) follow renamed namespaces or
kernels. The code compared is the instruction text of each function with the same hashes dropped.

Prints one line per kernel: "same", "DIFFERENT" (with the first differing instruction), "only before"
(a deleted kernel) or "only after" (a new one). Exit status 1 when any kernel present on both sides
differs, 0 otherwise.

Usage: python3 tools/compare-sass.py BEFORE_DIR AFTER_DIR [--rename OLD=NEW ...]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

# nvcc's anonymous-namespace names: _GLOBAL__N__<hash>_<len>_<file>_<hash>
_ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_[A-Za-z0-9_]+?_[0-9a-f]{8}")


def functions(path):
    """{mangled name: [instruction lines]} of one cuobjdump -sass listing."""
    out, cur = {}, None
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                cur = out.setdefault(m.group(1), [])
                continue
            if cur is not None and "/*" in line and line.strip():
                cur.append(_ANON.sub("ANON", line.strip()))
    return out


def demangle(names):
    """Demangled names (c++filt when present) with the anonymous-namespace hashes replaced by ANON."""
    names = list(names)
    out = names
    if names and shutil.which("c++filt"):
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        if len(r.stdout.splitlines()) == len(names):
            out = r.stdout.splitlines()
    return {n: _ANON.sub("ANON", d) for n, d in zip(names, out)}


def load(d, renames=()):
    funcs = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".sass"):
            funcs.update(functions(os.path.join(d, f)))
    pretty = demangle(funcs)
    out = {}
    for mangled, code in funcs.items():
        name = pretty[mangled]
        for old, new in renames:
            name = name.replace(old, new)
        out[name] = code
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rename", action="append", default=[], help="OLD=NEW substring of the before side's names")
    a = ap.parse_args()
    renames = [tuple(r.split("=", 1)) for r in a.rename]
    before, after = load(a.before, renames), load(a.after)
    differ = 0
    for name in sorted(set(before) | set(after)):
        if name not in after:
            print(f"only before  {name}")
        elif name not in before:
            print(f"only after   {name}")
        elif before[name] == after[name]:
            print(f"same         {name} ({len(after[name])} lines)")
        else:
            differ += 1
            b, c = before[name], after[name]
            i = next((k for k in range(min(len(b), len(c))) if b[k] != c[k]), min(len(b), len(c)))
            print(f"DIFFERENT    {name} ({len(b)} -> {len(c)} lines; first difference at line {i}:\n"
                  f"               {b[i] if i < len(b) else '<end>'}\n               {c[i] if i < len(c) else '<end>'})")
    both = len(set(before) & set(after))
    print(f"compare-sass: {both} kernels on both sides, {both - differ} identical, {differ} different; "
          f"{len(set(before) - set(after))} only before, {len(set(after) - set(before))} only after")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
