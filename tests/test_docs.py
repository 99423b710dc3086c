"""README.md and docs/: a front page, every page linked, and every command and `--option` they show is real.

Commands are checked against the parsers themselves, built in this process (the engines'
HfArgumentParser over the argument dataclasses, the tools' and the launcher's argparse parsers, torchrun's and
accelerate's own), so an option added to or removed from the code is seen at once.
Only the shell entry points are spawned, at `--help` level.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FIRST_SCREEN = 40  # lines a reader sees before scrolling
PLACEHOLDERS = ("…", "...")  # an elided tail: check the options before it, not the values
PROGRAMS = r"(bash |python |\.venv/bin/python |\.venv/bin/anygpu |torchrun |accelerate launch |anygpu |sbatch )"  # ours, or launching ours
SKIP = "docs-check: skip"  # an HTML comment on a line that shows a mistake on purpose (`anygpu trian`)
# Options of programs that are not ours, named in prose (Slurm, pytest); everything else must be in a parser.
FOREIGN_OPTIONS = {
    "--signal",
    "--nodes",
    "--ntasks-per-node",
    "--kill-on-bad-exit",
    "--no-kill",
    "--cpus-per-task",
    "--gpus-per-node",
    "--durations",
    "--no-loadscope-reorder",
    "--index-url",
    "--target",  # pip's, in the GPU lease (docs/benchmarks.md)
    "--no-deps",
}


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# ----------------------------------------------------------------------------- the parsers


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


@cache
def engine_parser(engine: str) -> argparse.ArgumentParser:
    """The engine's own parser (anygpu.config.args.build_parser), with the HF engine's extra dataclass for `hf`."""
    from anygpu.config import args

    return args.build_parser((args.HFEngineArguments,) if engine == "hf" else (), prog=f"run_{engine}_standalone.py")


@cache
def tool_parser(name: str) -> argparse.ArgumentParser:
    """The launcher's parser, or the interactive launch's."""
    from anygpu.launch import launcher
    from anygpu.tools import interactive

    return launcher.build_parser("nvidia") if name == "launcher" else interactive.build_parser()


@cache
def torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return _options(get_args_parser())


@cache
def accelerate_options() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return _options(launch_command_parser())


@cache
def script_options(path: str) -> set[str]:
    """A benchmark's options, read from its add_argument calls (running it would train)."""
    tree = ast.parse((ROOT / path).read_text())
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")
    }


@cache
def shell_options(path: str) -> set[str]:
    """A shell script's options: the words of its `case` patterns (`--test)`, `-h|--help)`)."""
    text = (ROOT / path).read_text()
    return {w for pat in re.findall(r"^\s*([-\w|]+)\)", text, re.M) for w in pat.split("|") if w.startswith("-")}


@cache
def every_option() -> set[str]:
    """The union, for options named in prose without their command."""
    out = set(FOREIGN_OPTIONS) | torchrun_options() | accelerate_options()
    out |= _options(engine_parser("hf")) | _options(engine_parser("fsdp"))
    for name in ("interactive", "launcher"):
        out |= _options(tool_parser(name))
    for path in sorted((ROOT / "anygpu" / "tools").glob("*.py")):  # every tool with a parser, whatever its name
        module = importlib.import_module(f"anygpu.tools.{path.stem}")
        if hasattr(module, "build_parser"):
            out |= _options(module.build_parser())
    for script in [*ROOT.glob("benchmarks/*.py")]:
        out |= script_options(str(script.relative_to(ROOT)))
    out |= shell_options("scripts/setup.sh")
    return out


# ------------------------------------------------------------------------ reading the pages


@dataclass
class Command:
    where: str  # file:line
    words: list[str]


def _split(line: str, where: str) -> list[Command]:
    """One shell line → its simple commands (split at && || | ;), environment assignments dropped."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:  # an unbalanced quote in an example: nothing to check
        return []
    out, current = [], []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|"):
            while current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", current[0]):
                current.pop(0)
            if current:
                out.append(Command(where, current))
            current = []
        else:
            current.append(word)
    return out


def commands_in(text: str, name: str) -> list[Command]:
    """Commands in fenced bash blocks, `$ ` lines of other blocks, and inline spans that start with a program."""
    out: list[Command] = []
    lines = text.split("\n")
    fence: str | None = None
    pending, start = "", 0
    for i, line in enumerate(lines, 1):
        stripped = line.strip()
        if SKIP in line:
            continue
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "plain")
            continue
        if fence is None:
            for span in re.findall(r"`([^`]+)`", line):
                if re.match(PROGRAMS, span):
                    out += _split(span, f"{name}:{i}")
            continue
        if fence in ("yaml", "yml") and (key := re.match(r"^([A-Za-z_]\w*):", line)):
            out.append(Command(f"{name}:{i}", ["run_hf_standalone.py", f"--{key.group(1)}", "…"]))  # a config file
            continue
        if fence in ("bash", "sh", "shell"):
            body = stripped
        elif stripped.startswith("$ "):
            body = stripped[2:]
        elif pending:
            body = stripped
        else:
            continue
        if not pending:
            start = i
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        out += _split(pending + body, f"{name}:{start}")
        pending = ""
    return out


def prose_options(text: str) -> list[tuple[int, str]]:
    """`--options` named in inline code outside code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.split("\n"), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and SKIP not in line:
            for span in re.findall(r"`([^`]+)`", line):
                if span.startswith("-") or re.match(PROGRAMS, span):
                    # another program's options (`nvidia-smi --query-gpu`, `srun --ntasks-per-node`) are its own business
                    out += [(i, o) for o in _flags(re.split(r"[\s,|()]+", span))]
    return out


# -------------------------------------------------------------------------- checking one


def _flags(words: list[str]) -> list[str]:
    """The `--options` among the words. `[--merge_lora true]` is an optional part, still an option;
    `[--option value ...]` is the generic form, no option."""
    out, group = [], None
    for word in words:
        if word.startswith("[") and group is None:
            group = []
        target = group if group is not None else out
        if word.strip("[]").startswith("--") and len(word.strip("[]")) > 2:
            target.append(word.strip("[]").split("=", 1)[0])
        if group is not None and word.endswith("]"):
            out += [] if word.endswith(("...]", "…]")) else group
            group = None
    return out + (group or [])


def _unknown(words: list[str], known: set[str]) -> list[str]:
    return [f for f in _flags(words) if f not in known]


def _elided(words: list[str]) -> bool:
    return any(p in w for w in words for p in PLACEHOLDERS) or any(w.startswith(("[", "<")) for w in words)


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """argparse's own verdict on the words (types, choices), or None; elided commands are checked by name only."""
    if _elided(words) or "-h" in words or "--help" in words:  # argparse would print its help and exit
        return None
    # A config file given first is read by parse_args; here the options after it are what matter.
    if words and not words[0].startswith("-") and words[0].endswith((".yaml", ".yml", ".json")):
        words = words[1:]
    errors: list[str] = []

    def error(message: str) -> None:
        errors.append(message)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]
    try:
        _, unknown = parser.parse_known_args(words)
    except SystemExit:
        return errors[0] if errors else "exited"
    return f"unrecognized: {unknown}" if unknown else None


def _engine(words: list[str], engine: str) -> list[str]:
    from anygpu.config.args import _auto_micro_batch

    words = _auto_micro_batch(words)  # `--per_device_train_batch_size auto`, as parse_args reads it
    parser = engine_parser(engine)
    bad = _unknown(words, _options(parser))
    if not bad and (err := _parse(parser, words)):
        bad.append(err)
    return bad


def _after(words: list[str], script: str) -> list[str]:
    return words[words.index(script) + 1 :]


def _launcher(words: list[str]) -> list[str]:
    """Launcher options before `--` (the interactive parser with --interactive), the engine's after it."""
    mine, rest = (words[: words.index("--")], words[words.index("--") + 1 :]) if "--" in words else (words, [])
    name = "interactive" if "--interactive" in mine else "launcher"
    parser = tool_parser(name)
    bad = _unknown(mine, _options(parser) | {"--interactive", "--vendor"})
    if not bad and (err := _parse(parser, mine)):
        bad.append(err)
    engine = "fsdp" if "fsdp" in mine else "hf"
    return bad + _engine(rest, engine)


def _cli_answers(argv: list[str]) -> tuple[bool, str]:
    """The `anygpu` command itself, run in this process: did it exit 0, and what it printed."""
    import contextlib
    import io

    from anygpu.tools import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code in (0, None), out.getvalue()


def _tool(sub: str, words: list[str]) -> list[str]:
    """`anygpu <sub> …`: the tool's own parser where it has one (a job's arguments after `--`), else its --help."""
    mine, job = (words[: words.index("--")], words[words.index("--") + 1 :]) if "--" in words else (words, [])
    if importlib.util.find_spec(f"anygpu.tools.{sub}") is not None:
        module = importlib.import_module(f"anygpu.tools.{sub}")
        if hasattr(module, "build_parser"):
            parser = module.build_parser()
            bad = _unknown(mine, _options(parser))
            if not bad and (err := _parse(parser, mine)):
                bad.append(err)
            return bad + _engine(job, "hf")
    answered, text = _cli_answers([sub, "--help"])
    if not answered:
        return [f"anygpu has no command {sub!r}"]
    return [f"{flag} is not in `anygpu {sub} --help`" for flag in _flags(mine) if flag not in text]


def _runnable(module: str) -> bool:
    """`python -m module` works: a module, or a package with a __main__."""
    spec = importlib.util.find_spec(module)
    return spec is not None and (
        spec.submodule_search_locations is None or importlib.util.find_spec(f"{module}.__main__") is not None
    )


ENGINE_SCRIPTS = {"run_fsdp_standalone.py": "fsdp", "run_hf_standalone.py": "hf"}
LAUNCHER_SCRIPTS = ("run_nvidia_all.sh", "run_amd_all.sh", "slurm/train.sbatch")


def check(cmd: Command) -> list[str]:
    """What is wrong with one documented command: unknown options, or values its parser refuses."""
    w = cmd.words
    base = [Path(x).name for x in w]
    for script, engine in ENGINE_SCRIPTS.items():
        if script in base:
            i = base.index(script)
            before = w[:i]
            bad = _engine(w[i + 1 :], engine)
            if any(Path(x).name == "torchrun" for x in before) or "torch.distributed.run" in before:
                bad += _unknown(before, torchrun_options())
            elif "accelerate" in base[:i] or "accelerate.commands.launch" in before:
                bad += _unknown(before, accelerate_options())
            return bad
    if base[0] == "torchrun" or "torch.distributed.run" in w:  # no engine script shown: the launcher's options alone
        return _unknown(w, torchrun_options())
    if w[:2] == ["accelerate", "launch"] or "accelerate.commands.launch" in w:
        return _unknown(w, accelerate_options())
    for script in LAUNCHER_SCRIPTS:
        if any(x.endswith(script) for x in w):
            i = next(k for k, x in enumerate(w) if x.endswith(script))
            return _launcher(w[i + 1 :])
    if "-m" in w[:-1] and w[w.index("-m") + 1].startswith("anygpu"):
        module = w[w.index("-m") + 1]
        if not _runnable(module):
            return [f"python -m {module}: not a runnable module"]
        if module == "anygpu.launch.launcher":
            return _launcher(_after(w, module))
    if base[0] == "anygpu" and len(w) > 1:
        sub, rest = w[1], w[2:]
        if sub.startswith("-"):  # `anygpu --help`: ask the command itself
            return [] if _cli_answers(w[1:])[0] else [f"anygpu {' '.join(w[1:])} exits non-zero"]
        if sub == "train":
            return _engine(rest, "fsdp")
        if sub == "launch":
            return (
                _launcher(rest)
                if "--vendor" in rest and "--interactive" not in rest
                else _launcher(["--interactive", *rest])
            )
        return _tool(sub, rest)
    for x in w:
        if x.startswith("benchmarks/") and x.endswith(".py"):
            if not (ROOT / x).is_file():
                return [f"{x}: no such file"]
            return _unknown(_after(w, x), script_options(x) | {"-h", "--help"})
        if x.endswith(".sh") and (ROOT / x).is_file():
            return _unknown(_after(w, x), shell_options(x) | {"-h", "--help"})
    return []  # pytest, pip, printf, huggingface-cli …: not ours


def problems(text: str, name: str) -> list[str]:
    """Every unknown option or refused command in one page's text."""
    out = [f"{c.where}: {' '.join(c.words)}: {bad}" for c in commands_in(text, name) for bad in check(c)]
    known = every_option()
    out += [f"{name}:{i}: {opt} is no option of any parser" for i, opt in prose_options(text) if opt not in known]
    return out


# ---------------------------------------------------------------------------------- tests


def test_readme_is_a_front_page():
    """≤ 200 lines, with the CI's test command and the demo command, verbatim, in its first screen."""
    lines = README.read_text().split("\n")
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/"
    first = "\n".join(lines[:FIRST_SCREEN])
    ci = (ROOT / ".ci" / "run").read_text().strip().split("\n")[-1]
    assert ci in first, f"the test command .ci/run runs ({ci}) is not in README's first screen"
    assert "bash scripts/setup.sh && .venv/bin/python run_fsdp_standalone.py --max_steps 150" in first
    text = "\n".join(lines)
    recipes = [
        "**Pretrain on your own text**",
        "**Fine-tune a pretrained model on chat data.**",
        "LoRA",
        "**8 NVIDIA GPUs.**",
        "**8 AMD GPUs**",
        "**Several nodes, or Slurm.**",
        "**Resume, also on another number of GPUs.**",
        "**Check a job before launch.**",
        "## Measured figures",
        "## Documentation",
    ]
    assert [r for r in recipes if r not in text] == [], "a recipe or section of the front page is missing"
    figures = text.split("## Measured figures")[1].split("\n## ")[0]
    lines = figures.splitlines()
    headers = {lines[i - 1] for i, ln in enumerate(lines) if ln.startswith("|---") or ln.startswith("| ---")}
    rows = [ln for ln in lines if ln.startswith("| ") and ln not in headers and not ln.startswith("| ---")]
    assert rows and all("`" in ln for ln in rows), "every measured figure names the command that made it"


def test_every_docs_page_is_linked_and_every_link_resolves():
    readme = README.read_text()
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in readme, f"docs/{page.name} is not linked from README.md"
    for doc in doc_files():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            page = (doc.parent / target) if target else doc
            assert page.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and page.suffix == ".md":
                assert anchor in anchors(page), f"{doc.relative_to(ROOT)} links to {target}#{anchor}: no such heading"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (not - and _), spaces as dashes."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_and_option_in_the_docs_exists(doc):
    found = problems(doc.read_text(), str(doc.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_the_check_flags_a_made_up_option_and_a_bad_value():
    """The checker can fail: made-up options, in a block, a launcher's tail, a tool and prose, are each flagged."""
    snippet = "\n".join(
        [
            "```bash",
            "torchrun --standalone --nproc-per-node 8 run_fsdp_standalone.py --config_name tiny --learning_rat 3e-4",
            "bash run_nvidia_all.sh --engine fsdp -- --config_name tiny --max_stepz 10",
            "anygpu plan --config_name tiny --gpu_memory_gigs 80",
            ".venv/bin/python run_hf_standalone.py --bf16 maybe",
            "python -m anygpu.launch --vendor nvidia --dry-run",
            "accelerate launch --config_fil accelerate_configs/ddp.yaml",
            "```",
            "The `--no_such_option` switch.",
            "The form is `anygpu train [--option value ...]`; `--merge_lora` writes final-merged/.",  # generic: not flagged
            "A typo on purpose: `anygpu trian --lerning_rate 1`. <!-- docs-check: skip -->",  # marked: not flagged
        ]
    )
    found = problems(snippet, "snippet")
    for flagged in (
        "--learning_rat",
        "--max_stepz",
        "--gpu_memory_gigs",
        "maybe",
        "--no_such_option",
        "not a runnable module",
        "--config_fil",
    ):
        assert any(flagged in p for p in found), (flagged, found)
    assert len(found) == 7, found
    ok = "```bash\nbash run_amd_all.sh --engine fsdp -- --config_name tiny --max_steps 10\n```\n"
    assert problems(ok, "ok") == []


@pytest.mark.parametrize("script", ["run_nvidia_all.sh", "run_amd_all.sh", "scripts/setup.sh"])
def test_shell_entry_points_answer_help(script):
    """The documented shell entry points run (only --help: the launcher is stdlib-only, setup.sh prints its header)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    done = subprocess.run(["bash", script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--" in done.stdout
