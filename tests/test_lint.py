"""The codebase stays lint-clean and type-checked: ruff with the rules in
pyproject.toml (pyflakes, pycodestyle, bugbear) over the package, tests and
benchmarks; mypy with the [tool.mypy] settings over the `pipeline` package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_mypy_is_clean():
    # mypy is in the dev extra (scripts/setup-env.sh installs it): a missing mypy fails here, it does not skip.
    # The files and settings come from pyproject.toml; the cache is the default .mypy_cache/ (git-ignored),
    # so a rerun only re-checks what changed.
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
