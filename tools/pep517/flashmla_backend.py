"""PEP 517 build backend of flash_mla: scikit-build-core's, plus one build requirement chosen per build.

The Hopper (sm_90a) kernels include the CUTLASS / CuTe C++ headers, which come from the PyPI package
``nvidia-cutlass`` (``cutlass_library/source/include``). ``pip install .`` builds in an isolated
environment that holds only the build requirements, so a CUTLASS installed beside it is invisible:
the headers must be a build requirement -- exactly when the CUDA backend will be compiled, so that a
CPU-only build downloads nothing it does not use. That is when

* the CUDA backend is not switched off (``-C cmake.define.FLASHMLA_ENABLE_CUDA=OFF``, or
  ``-DFLASHMLA_ENABLE_CUDA=OFF`` in ``-C cmake.args`` / the environment's ``CMAKE_ARGS``, or
  ``FLASHMLA_ENABLE_CUDA=OFF`` in ``SKBUILD_CMAKE_DEFINE``), and
* it is switched on (``=ON``), or a CUDA compiler is where CMakeLists.txt looks for one
  (``CMAKE_CUDA_COMPILER``, ``CUDACXX``, ``nvcc`` on ``PATH``, ``/usr/local/cuda/bin/nvcc``), and
* no CUTLASS is given: neither ``FLASHMLA_CUTLASS_INCLUDE_DIR`` (define or environment) nor the
  source tree's ``.deps/cutlass_include`` (tools/fetch-cutlass.sh).

pip installs the requirement with its dependencies into the throwaway build environment only.
Everything else is scikit-build-core's backend unchanged.
"""

from __future__ import annotations

import os
import shlex
import shutil
from typing import Dict, List, Mapping, Optional, Union

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401 - the hooks this module passes through unchanged
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

CUTLASS_REQUIREMENT = "nvidia-cutlass>=4.2,<5"

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FALSE = {"OFF", "0", "FALSE", "NO", "N", "IGNORE", "NOTFOUND", ""}

Settings = Optional[Mapping[str, Union[str, List[str]]]]


def _cmake_defines(config_settings: Settings, environ: Mapping[str, str]) -> Dict[str, str]:
    """The -D definitions this build will pass to CMake, as NAME -> value (later ones win)."""
    defs: Dict[str, str] = {}

    def from_args(args: str) -> None:
        for a in shlex.split(args):
            if a.startswith("-D") and "=" in a:
                name, value = a[2:].split("=", 1)
                defs[name.split(":", 1)[0]] = value

    from_args(environ.get("CMAKE_ARGS", ""))
    for item in environ.get("SKBUILD_CMAKE_DEFINE", "").split(";"):
        if "=" in item:
            name, value = item.split("=", 1)
            defs[name.strip()] = value.strip()
    for key, value in (config_settings or {}).items():
        key = key[len("skbuild."):] if key.startswith("skbuild.") else key
        values = value if isinstance(value, list) else [value]
        if key.startswith("cmake.define."):
            defs[key[len("cmake.define."):]] = str(values[-1])
        elif key in ("cmake.args", "cmake.define"):
            for v in values:
                if key == "cmake.args":
                    from_args(str(v))
                elif "=" in str(v):
                    name, val = str(v).split("=", 1)
                    defs[name] = val
    return defs


def needs_cutlass(config_settings: Settings = None, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this build compiles the CUDA backend without a CUTLASS of its own (module docstring)."""
    environ = os.environ if environ is None else environ
    defs = _cmake_defines(config_settings, environ)
    cuda = defs.get("FLASHMLA_ENABLE_CUDA", "AUTO").strip().upper()
    if cuda in _FALSE:
        return False
    if defs.get("FLASHMLA_CUTLASS_INCLUDE_DIR") or environ.get("FLASHMLA_CUTLASS_INCLUDE_DIR"):
        return False
    if os.path.exists(os.path.join(_ROOT, ".deps", "cutlass_include", "cute", "tensor.hpp")):
        return False
    if cuda != "AUTO":  # ON (or any other true value): CMake fails without a CUDA compiler anyway
        return True
    compilers = [defs.get("CMAKE_CUDA_COMPILER"), environ.get("CUDACXX"), shutil.which("nvcc", path=environ.get("PATH")),
                 "/usr/local/cuda/bin/nvcc"]
    return any(c and os.path.exists(c) for c in compilers)


def get_requires_for_build_wheel(config_settings: Settings = None) -> List[str]:
    reqs = list(_skbuild.get_requires_for_build_wheel(config_settings))
    return reqs + [CUTLASS_REQUIREMENT] if needs_cutlass(config_settings) else reqs


def get_requires_for_build_editable(config_settings: Settings = None) -> List[str]:
    reqs = list(_skbuild.get_requires_for_build_editable(config_settings))
    return reqs + [CUTLASS_REQUIREMENT] if needs_cutlass(config_settings) else reqs
