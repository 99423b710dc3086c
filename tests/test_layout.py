"""The library's layout: one folder per concern, layers that import downwards only, no import circle
(function-level imports included), and launchers that need nothing but the standard library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

PKG = ROOT / "anygpu"
# Lowest first. A module may import its own layer and the layers before it, never a later one.
LAYERS = [
    {"", "errors", "config", "runtime", "launch"},
    {"model", "data"},
    {"train", "planning", "checkpoint"},
    {"reliability"},
    {"engines"},
    {"tools"},
]
MAX_TOP_LEVEL_MODULES = 6


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path) -> list[tuple[str, int]]:
    """Every import in the file, at any depth (functions, branches), as (absolute module, line)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from pkg import mod` names the submodule where one exists
                sub = f"{base}.{a.name}"
                found.append((sub if module_file(sub, root) else base, node.lineno))
    return found


def module_file(name: str, root: Path) -> Path | None:
    if name != root.name and not name.startswith(root.name + "."):
        return None
    rel = Path(*name.split(".")[1:])
    for candidate in (root / rel.with_suffix(".py") if rel.parts else None, root / rel / "__init__.py"):
        if candidate is not None and candidate.exists():
            return candidate
    return None


def layer_of(name: str, root: Path) -> int:
    part = name.split(".")[1] if "." in name else ""
    part = part if (root / part).is_dir() else ""  # a top-level module (errors.py) sits with the package's face
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{name}: folder '{part}' is in no layer; add it to LAYERS in {Path(__file__).name}")


def graph(root: Path) -> dict[str, list[tuple[str, int]]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        out[module_name(path, root)] = [(m, line) for m, line in imports_of(path, root) if module_file(m, root)]
    return out


def upward_imports(root: Path) -> list[str]:
    bad = []
    for mod, edges in graph(root).items():
        for target, line in edges:
            if layer_of(target, root) > layer_of(mod, root):
                bad.append(f"{mod}:{line} imports {target} (a higher layer)")
    return bad


def circles(root: Path) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    g = {m: sorted({t for t, _ in e}) for m, e in graph(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, []):
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in g:
        if v not in index:
            visit(v)
    return found


def non_stdlib_imports(folder: Path, root: Path) -> list[str]:
    own = module_name(folder / "__init__.py", root)
    bad = []
    for path in sorted(folder.rglob("*.py")):
        for name, line in imports_of(path, root):
            top = name.split(".")[0]
            if not (name == own or name.startswith(own + ".") or top in sys.stdlib_module_names or top == "__future__"):
                bad.append(f"{module_name(path, root)}:{line} imports {name}")
    return bad


def test_no_import_circle():
    assert circles(PKG) == []


def test_layers_import_downwards_only():
    assert upward_imports(PKG) == [], "layers import downwards only: " + " → ".join(
        "/".join(sorted(x)) or "top" for x in LAYERS
    )


def test_launch_is_standard_library_only():
    assert non_stdlib_imports(PKG / "launch", PKG) == []


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert all(
        (p / "__init__.py").exists()
        for p in PKG.iterdir()
        if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))
    )


def test_the_checks_catch_a_circle_an_upward_import_and_a_third_party_launch_import(tmp_path):
    """The checks above can fail: a made-up package with each fault is caught, function-level imports included."""
    root = tmp_path / "anygpu"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "config/__init__.py": "",
        "config/args.py": "def f():\n    from anygpu.engines import fsdp\n",  # upward, inside a function
        "model/__init__.py": "",
        "model/a.py": "from anygpu.model import b\n",
        "model/b.py": "def g():\n    from . import a\n",  # a circle through a relative, function-level import
        "engines/__init__.py": "",
        "engines/fsdp.py": "from anygpu.config import args\n",
        "launch/__init__.py": "",
        "launch/detect.py": "import json\nimport yaml\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert upward_imports(root) == ["anygpu.config.args:2 imports anygpu.engines.fsdp (a higher layer)"]
    assert sorted(map(tuple, circles(root))) == [
        ("anygpu.config.args", "anygpu.engines.fsdp"),
        ("anygpu.model.a", "anygpu.model.b"),
    ]
    assert non_stdlib_imports(root / "launch", root) == ["anygpu.launch.detect:2 imports yaml"]


@pytest.mark.parametrize(
    "module", ["anygpu.launch.launcher", "anygpu.launch.detect", "anygpu.launch.vendor_env", "anygpu.tools.cli"]
)
def test_launchers_and_cli_import_without_torch(module):
    """A login node without torch can dry-run: launch/ and the CLI's entry use the standard library only."""
    code = f"import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\nimport {module}\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
