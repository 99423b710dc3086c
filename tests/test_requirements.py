"""What the package imports at run time, a default set-up installs: every third-party module anygpu/ imports (at the
top or inside a function) comes from requirements.txt or a package it depends on, or is one of the optional ones a
run asks for by name (vLLM, the trackers beyond TensorBoard) and refuses in one line where missing. A module only the
test requirements bring (TRL, say) would pass every test and fail a user's first run of the feature."""

from __future__ import annotations

import ast
import sys
from importlib import metadata

from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# --use_vllm (refused by name without it), --report_to mlflow|wandb|trackio (pyproject's extras)
OPTIONAL = {"vllm", "mlflow", "wandb", "trackio"}


def imported_modules() -> dict[str, str]:
    """Top-level third-party module → one file of anygpu/ that imports it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "anygpu").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "anygpu":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def installed_by_requirements() -> set[str]:
    """The distributions requirements.txt names, and theirs, transitively (normalised names)."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    todo = [canonicalize_name(Requirement(x).name) for x in lines if x.strip() and not x.startswith("#")]
    seen: set[str] = set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        for req in map(Requirement, metadata.requires(dist) or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):  # not an extra's, and for this Python
                todo.append(canonicalize_name(req.name))
    return seen


def test_every_runtime_import_is_installed_by_the_default_set_up():
    dists = metadata.packages_distributions()
    installed = installed_by_requirements()
    missing = {
        module: (where, dists.get(module))
        for module, where in imported_modules().items()
        if module not in OPTIONAL and not any(canonicalize_name(d) in installed for d in dists.get(module, []))
    }
    assert not missing, (
        f"imported by anygpu/ but not installed by requirements.txt (module: file, distribution): {missing}"
    )
