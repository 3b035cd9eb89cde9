"""The installed package ships the C++ core for C++ engines (issue 28, item 8): headers, the static
library and a CMake package that `python -m flash_mla --cmake-dir` names, so that a CMake project's
find_package(flashmla) + target flashmla::core builds and runs (examples/cpp, built here from a copy).
"""

import os
import shutil
import subprocess
import sys

import pytest

import flash_mla

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FROM_SOURCE = os.path.dirname(os.path.abspath(flash_mla.__file__)) == os.path.join(ROOT, "python", "flash_mla")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flash_mla", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def cmake_dir():
    proc = _cli("--cmake-dir")
    if proc.returncode != 0 and FROM_SOURCE:
        pytest.skip("flash_mla is imported from the source tree (PYTHONPATH), not from an installed wheel")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_wheel_ships_headers_library_and_cmake_package(cmake_dir):
    assert os.path.isfile(os.path.join(cmake_dir, "flashmlaConfig.cmake"))
    assert os.path.isfile(os.path.join(cmake_dir, "flashmlaConfigVersion.cmake"))
    inc = _cli("--include-dir").stdout.strip()
    for h in ("ops.h", "tensor.h", "status.h", "kv_format.h", "flashmla.h"):
        assert os.path.isfile(os.path.join(inc, "flashmla", h)), h
    pkg = os.path.dirname(os.path.abspath(flash_mla.__file__))
    assert os.path.isfile(os.path.join(pkg, "lib", "libflashmla_core.a"))


def test_find_package_from_the_wheel_builds_and_runs(cmake_dir, tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    src = tmp_path / "engine"
    shutil.copytree(os.path.join(ROOT, "examples", "cpp"), src)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = tmp_path / "build"
    cfg = subprocess.run([cmake, "-S", str(src), "-B", str(build), *gen, f"-DCMAKE_PREFIX_PATH={cmake_dir}"],
                         capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    bld = subprocess.run([cmake, "--build", str(build), "-j", "2"], capture_output=True, text=True, timeout=600)
    assert bld.returncode == 0, bld.stdout + bld.stderr
    run = subprocess.run([str(build / "dense_decode_cpu")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "request 1 (empty): lse = inf" in run.stdout and "TypeError: block_table" in run.stdout, run.stdout
    assert "request 0 against double precision" in run.stdout, run.stdout
