"""`pip install .` just works (issue 28, item 1): the CUTLASS / CuTe headers of the sm_90a kernels
are a build requirement exactly when the CUDA backend will be compiled
(tools/pep517/flashmla_backend.py), so a fresh venv with nvcc on PATH and no CUTLASS builds, and a
CPU-only build downloads nothing it does not use (item 9).

The fresh-venv test builds a copy of the tracked files (no .deps/, no venvs) with pip's build isolation, as a
user's `pip install .` does, up to the CUTLASS step: CMake's configure (which must find the headers
pip installed into the isolated build environment) and one CUDA unit that includes CuTe and
CUTLASS (target flashmla_cutlass_probe), not the whole kernel library (tens of minutes on a small
machine; tools/run-tests.sh builds that itself).
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _backend():
    pytest.importorskip("scikit_build_core")
    spec = importlib.util.spec_from_file_location("flashmla_backend",
                                                  os.path.join(ROOT, "tools", "pep517", "flashmla_backend.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def backend(tmp_path, monkeypatch):
    mod = _backend()
    monkeypatch.setattr(mod, "_ROOT", str(tmp_path))  # a source tree without .deps/cutlass_include
    return mod


@pytest.fixture
def fake_nvcc(tmp_path):
    d = tmp_path / "cuda-bin"
    d.mkdir()
    nvcc = d / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    return str(d)


def _no_cuda_path(tmp_path):
    d = tmp_path / "empty-bin"
    d.mkdir(exist_ok=True)
    return str(d)


def test_cutlass_required_when_nvcc_is_on_path(backend, fake_nvcc):
    env = {"PATH": fake_nvcc}
    assert backend.needs_cutlass({}, env)
    assert backend.needs_cutlass({"cmake.define.FLASHMLA_ENABLE_CUDA": "AUTO"}, env)
    assert backend.needs_cutlass(None, {"PATH": "/nowhere", "CUDACXX": os.path.join(fake_nvcc, "nvcc")})


@pytest.mark.parametrize("settings,env", [
    ({"cmake.define.FLASHMLA_ENABLE_CUDA": "OFF"}, {}),
    ({"skbuild.cmake.define.FLASHMLA_ENABLE_CUDA": "off"}, {}),
    ({"cmake.args": "-DFLASHMLA_BUILD_TESTS=OFF -DFLASHMLA_ENABLE_CUDA=OFF"}, {}),
    ({"cmake.define": ["FLASHMLA_ENABLE_CUDA=0"]}, {}),
    ({}, {"CMAKE_ARGS": "-DFLASHMLA_ENABLE_CUDA:STRING=OFF"}),
    ({}, {"SKBUILD_CMAKE_DEFINE": "FOO=1;FLASHMLA_ENABLE_CUDA=OFF"}),
    ({"cmake.define.FLASHMLA_CUTLASS_INCLUDE_DIR": "/opt/cutlass/include"}, {}),
    ({}, {"FLASHMLA_CUTLASS_INCLUDE_DIR": "/opt/cutlass/include"}),
], ids=["define", "skbuild-prefix", "cmake.args", "define-list", "CMAKE_ARGS", "SKBUILD_CMAKE_DEFINE",
        "include-dir", "include-dir-env"])
def test_cutlass_not_required_when_cuda_is_off_or_given(backend, fake_nvcc, settings, env):
    assert not backend.needs_cutlass(settings, {"PATH": fake_nvcc, **env})


def test_cutlass_requirement_follows_cuda(backend, fake_nvcc, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _no_cuda_path(tmp_path))
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setattr(backend.os.path, "exists",
                        lambda p, _real=os.path.exists: False if p == "/usr/local/cuda/bin/nvcc" else _real(p))
    assert not backend.needs_cutlass({})  # no CUDA compiler anywhere: a CPU build
    assert backend.needs_cutlass({"cmake.define.FLASHMLA_ENABLE_CUDA": "ON"})  # ON without nvcc: CMake says why
    reqs = backend.get_requires_for_build_wheel({})
    assert not any(r.startswith("nvidia-cutlass") for r in reqs), reqs
    monkeypatch.setenv("PATH", fake_nvcc)
    assert backend.CUTLASS_REQUIREMENT in backend.get_requires_for_build_wheel({})
    assert backend.CUTLASS_REQUIREMENT not in backend.get_requires_for_build_wheel(
        {"cmake.define.FLASHMLA_ENABLE_CUDA": "OFF"})
    (tmp_path / ".deps" / "cutlass_include" / "cute").mkdir(parents=True)
    (tmp_path / ".deps" / "cutlass_include" / "cute" / "tensor.hpp").write_text("")
    assert not backend.needs_cutlass({})  # tools/fetch-cutlass.sh's headers in the source tree


def _nvcc():
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    return None


def _copy_worktree(dst):
    """The files a clone has (those in git's index), with the working tree's contents."""
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "-c", "-z"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = os.path.join(ROOT, f)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, f))


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc: the CUDA backend (and CUTLASS) is not built here")
def test_pip_install_in_a_fresh_venv_finds_cutlass(tmp_path):
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")) and \
            not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    src = tmp_path / "src"
    _copy_worktree(src)
    assert not (src / ".deps").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import cutlass_library"], capture_output=True)
    assert probe.returncode != 0  # no CUTLASS in the venv
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "CMAKE_", "SKBUILD_", "FLASHMLA_"))}
    env["PATH"] = os.path.dirname(_nvcc()) + os.pathsep + env.get("PATH", "")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # The user's command, narrowed to the CUTLASS step: build only the probe unit, install no native files.
    cmd = [py, "-m", "pip", "install", "-v", "--no-deps", str(src), "-C", "build.targets=flashmla_cutlass_probe",
           "-C", "install.components=flashmla_none", "-C", "build-dir=" + str(tmp_path / "build")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    lines = [ln for ln in log.splitlines() if "flashmla: CUDA backend ON (sm_90a), CUTLASS at" in ln]
    assert lines, log[-6000:]
    assert "cutlass_library" in lines[0] and str(src) not in lines[0], lines[0]  # from the build requirement
    assert "Building CUDA object CMakeFiles/flashmla_cutlass_probe.dir/tools/pep517/cutlass_probe.cu.o" in log, \
        log[-6000:]
    # The isolated build environment is gone: the user's venv did not get nvidia-cutlass.
    assert subprocess.run([py, "-c", "import cutlass_library"], capture_output=True).returncode != 0
