"""Command line of flash_mla: ``python -m flash_mla --help`` lists what it can do."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))

_EPILOG = """\
examples:
  python -m flash_mla demo --quick              one checked step of each MLA operator, smallest sizes
  python -m flash_mla demo --backend cpu        the CPU reference backend even when a Hopper GPU is present
  python -m flash_mla --info                    version, backends, where the native modules are
  cmake -S my_engine -B build -DCMAKE_PREFIX_PATH="$(python -m flash_mla --cmake-dir)"
                                                a C++ project's find_package(flashmla) -> flashmla::core
"""


def cmake_dir() -> str:
    """Directory of the CMake package shipped in the wheel (flashmlaConfig.cmake: find_package(flashmla),
    target flashmla::core). Raises FileNotFoundError when this installation has none."""
    path = os.path.join(_HERE, "lib", "cmake", "flashmla")
    if not os.path.isfile(os.path.join(path, "flashmlaConfig.cmake")):
        raise FileNotFoundError(
            f"flash_mla: no CMake package at {path}: this installation was not built from a wheel that ships "
            "the C++ core (install it with `pip install .`, or use `cmake --install` of a source build)")
    return path


def include_dir() -> str:
    """Directory holding the C++ headers (``flashmla/ops.h`` ...) shipped in the wheel."""
    path = os.path.join(_HERE, "include")
    if not os.path.isfile(os.path.join(path, "flashmla", "ops.h")):
        raise FileNotFoundError(f"flash_mla: no C++ headers at {path} (see --cmake-dir)")
    return path


def _info() -> str:
    import flash_mla

    lines = [
        f"flash_mla {flash_mla.__version__} at {_HERE}",
        f"sm_90a CUDA kernels built: {flash_mla.has_cuda_backend()}",
        f"CPU reference threads: {flash_mla.reference_num_threads()}",
    ]
    try:
        lines.append(f"CMake package: {cmake_dir()}")
    except FileNotFoundError:
        lines.append("CMake package: not shipped in this installation")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m flash_mla",
        description="flash_mla: DeepSeek Multi-head Latent Attention kernels with FlashMLA's API "
                    "(C++ core, CPU reference backend, Hopper sm_90a kernels).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    ap.add_argument("--info", action="store_true", help="print version, backends and install paths, and exit")
    ap.add_argument("--cmake-dir", action="store_true",
                    help="print the directory of the CMake package (for CMAKE_PREFIX_PATH or flashmla_DIR) and exit")
    ap.add_argument("--include-dir", action="store_true", help="print the C++ include directory and exit")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", add_help=False,
                   help="one checked DeepSeek-sized step of each MLA operator against the float64 oracle "
                        "(GPU if present, else the CPU reference); `demo --help` for its options")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = _parser()
    # Everything after `demo` belongs to the demo's own parser (its --help included).
    if "demo" in argv:
        i = argv.index("demo")
        head, rest = argv[:i], argv[i + 1:]
        if not head:
            from .demo import main as demo_main

            return demo_main(rest)
        ap.error("options go after the command: python -m flash_mla demo [options]")
    args = ap.parse_args(argv)
    try:
        if args.version:
            import flash_mla

            print(flash_mla.__version__)
        elif args.info:
            print(_info())
        elif args.cmake_dir:
            print(cmake_dir())
        elif args.include_dir:
            print(include_dir())
        else:
            ap.print_help()
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
