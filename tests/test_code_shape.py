"""The code's shape: no function in anygpu/ over 60 lines, no error sentence written twice (each refusal is
said in one place, so two engines cannot drift apart in what they tell a user), and no product function
named like a test (fault injection goes through `anygpu.runtime.faults`)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "anygpu"
MAX_FUNCTION_LINES = 60
MIN_SENTENCE_CHARS = 30  # shorter texts ("--bf16", "unknown") may well repeat


def functions(root: Path):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def message(node: ast.expr) -> str | None:
    """The text of a message argument: a string, an f-string (its fields as {}) or a concatenation of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = message(node.left), message(node.right)
        return left + right if left is not None and right is not None else None
    return None


def raised_messages(root: Path) -> dict[str, list[str]]:
    """Normalised message → the places (file:line) that raise an error with it."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                text = message(node.exc.args[0])
                if text is not None and len(text) >= MIN_SENTENCE_CHARS:
                    found[re.sub(r"\s+", " ", text).strip()].append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_function_is_longer_than_60_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, node in functions(PKG)
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_no_error_sentence_is_written_twice():
    twice = {text: where for text, where in raised_messages(PKG).items() if len(where) > 1}
    assert not twice, "say each in one place and call it from both:\n" + "\n".join(
        f"{where}: {text[:100]}" for text, where in twice.items()
    )


def test_no_product_function_is_named_like_a_test():
    named = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name}" for p, n in functions(PKG) if n.name.startswith("test_")]
    assert not named, named


def test_the_checks_see_what_they_look_for(tmp_path):
    """The three checks above find a long function, a repeated refusal and a test-named function."""
    pkg = tmp_path / "anygpu"
    pkg.mkdir()
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    (pkg / "a.py").write_text(
        f"def long():\n{body}\n\n"
        "def test_hook():\n    pass\n\n"
        "def one(v):\n    raise ValueError(f'--x {v}: not a valid value here; ' 'pass --x 1 instead')\n"
    )
    (pkg / "b.py").write_text(
        "def two(w):\n    raise ValueError(f'--x {w}: not a valid value here; pass --x 1 instead')\n"
    )
    assert [n.name for _, n in functions(pkg) if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES] == ["long"]
    assert [n.name for _, n in functions(pkg) if n.name.startswith("test_")] == ["test_hook"]
    twice = [w for w in raised_messages(pkg).values() if len(w) > 1]
    assert len(twice) == 1 and len(twice[0]) == 2
