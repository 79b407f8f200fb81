import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_code_passes_the_linter():
    # ruff, as configured in pyproject.toml (requirements.txt installs it beside pytest)
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
