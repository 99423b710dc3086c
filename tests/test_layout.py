"""The library's layout: each layer imports only the layers below it, and the launchers need no torch."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PKG = ROOT / "anygpu"
# A layer may import itself and anything to its right, never to its left.
LAYERS = ["tools", "engines", "core", "data", "launch"]


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("tools", "engines", "data", "launch"):
        return parts[1]
    return "core"


def anygpu_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("anygpu"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if node.module in ("anygpu", "anygpu.data"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("anygpu"))
    return found


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_downwards(path):
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    mine = layer_of(module)
    allowed = {"data": {"data", "core"}, "launch": {"launch"}}.get(mine, set(LAYERS[LAYERS.index(mine):]))
    if mine == "core":
        allowed = {"core", "data"}
    bad = [m for m in anygpu_imports(path) if m != "anygpu" and layer_of(m) not in allowed]
    assert not bad, f"{module} ({mine}) imports {bad}: layers import downwards only ({' → '.join(LAYERS)})"


def test_launchers_and_cli_import_without_torch():
    """A login node without torch can dry-run: launch/ and the CLI's entry use the standard library only."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import anygpu.launch.launcher, anygpu.tools.cli, anygpu.launch.detect, anygpu.launch.vendor_env\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
