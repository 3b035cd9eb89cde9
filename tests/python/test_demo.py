"""`python -m flash_mla demo --quick` runs and reports the reference backend."""

import os
import subprocess
import sys


def test_demo_quick_runs():
    env = dict(os.environ)
    env.setdefault("FLASHMLA_NUM_THREADS", "2")
    env["COLUMNS"] = "200"  # rich wraps/truncates table cells ("referen...") at its 80-column non-tty default
    proc = subprocess.run([sys.executable, "-m", "flash_mla", "demo", "--quick"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "reference" in proc.stdout.lower(), proc.stdout
