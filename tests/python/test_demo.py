"""`python -m flash_mla demo` runs every step, checks each, and reports the backend it used."""

import os
import subprocess
import sys


def _demo(*args):
    env = dict(os.environ)
    env.setdefault("FLASHMLA_NUM_THREADS", "2")
    return subprocess.run([sys.executable, "-m", "flash_mla", "demo", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_demo_quick_runs_and_checks_every_step():
    proc = _demo("--quick")
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    for step in ("dense decode", "sparse FP8 decode", "sparse prefill"):
        assert step in out, out
    assert out.count(" ok ") >= 3 and "FAILED" not in out, out
    # The best backend present: sm90 kernels on a Hopper GPU with a CUDA build, else the CPU reference.
    assert "reference (cpu)" in out or "sm90" in out, out


def test_demo_cpu_backend_is_the_reference():
    proc = _demo("--quick", "--backend", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("reference (cpu)") == 3, proc.stdout
    # The table says what its error is measured against and what "ok" means.
    assert "checked against" in proc.stdout and proc.stdout.count("float64 NumPy") == 3, proc.stdout
    assert "ok: max rel err < 0.02" in proc.stdout, proc.stdout


def test_demo_rejects_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "flash_mla", "bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_help_lists_commands_and_exits_0():
    for flag in ("--help", "-h"):
        proc = subprocess.run([sys.executable, "-m", "flash_mla", flag], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for what in ("demo", "--cmake-dir", "--include-dir", "--info", "--version", "examples:"):
            assert what in proc.stdout, (what, proc.stdout)
    proc = subprocess.run([sys.executable, "-m", "flash_mla"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "demo" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "flash_mla", "demo", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--backend" in proc.stdout, proc.stdout


def test_version_and_info():
    import flash_mla

    proc = subprocess.run([sys.executable, "-m", "flash_mla", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == flash_mla.__version__
    proc = subprocess.run([sys.executable, "-m", "flash_mla", "--info"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "sm_90a CUDA kernels built" in proc.stdout, proc.stdout + proc.stderr


def test_demo_negative_seed_is_a_usage_error_not_a_traceback():
    proc = _demo("--quick", "--seed", "-5")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "--seed: expected a non-negative integer, got '-5'" in proc.stderr, \
        proc.stderr
