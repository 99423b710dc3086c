"""The code is kept to one format and one set of lint rules (pyproject.toml's [tool.ruff]): the README's
test command enforces them, so a change that breaks them fails here, not in a reviewer's eye."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command: list[str]) -> None:
    assert RUFF is not None, "ruff is not installed: bash scripts/setup.sh --test installs it"
    proc = subprocess.run([RUFF, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"ruff {' '.join(command)} (fix with `ruff check --fix .` / `ruff format .`):\n"
        + (proc.stdout + proc.stderr)[-4000:]
    )
