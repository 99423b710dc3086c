"""The `anygpu` command as a user meets it: --help at once (torch not imported), --version, 'did you mean'
for mistyped commands and options, and a missing model refused once, in one line, under the launchers.
(`plan --gpu`'s answer is in test_plan.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, env

import anygpu


def anygpu_cmd(*args: str, flags: tuple[str, ...] = (), cwd=ROOT) -> subprocess.CompletedProcess:
    """The real console command (`anygpu ARGS` is `python -m anygpu.tools.cli ARGS`) in a fresh process."""
    return subprocess.run(
        [sys.executable, *flags, "-m", "anygpu.tools.cli", *args],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def imported(importtime_stderr: str) -> set[str]:
    """Top-level packages a `python -X importtime` run imported."""
    return {line.split("|")[-1].strip().split(".")[0] for line in importtime_stderr.splitlines() if "|" in line}


def test_train_help_answers_without_torch_grouped():
    proc = anygpu_cmd("train", "--help", flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" not in imported(proc.stderr)  # the seconds of `import torch` are what --help must not pay
    out = proc.stdout
    assert out.startswith("usage: anygpu train [config.yaml]")
    for group in (
        "model:",
        "LoRA and QLoRA:",
        "data:",
        "training:",
        "checkpoints and resume:",
        "logging, evaluation and reporting:",
    ):
        assert f"\n{group}\n" in out, group
    assert "(default: None)" not in out and "--no_" not in out
    assert "  --lora_target_modules TEXT[,TEXT...]" in out and "  --learning_rate X " in out


def test_version_and_did_you_mean():
    version = anygpu_cmd("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"anygpu {anygpu.__version__}"
    typo = anygpu_cmd("trian")
    assert typo.returncode == 2 and "unknown command 'trian' (did you mean train?)" in typo.stderr
    assert typo.stderr.count("\n") == 1
    option = anygpu_cmd("doctor", "--outptu_dir", "x")
    assert option.returncode == 2 and "unknown option --outptu_dir (did you mean --output_dir?)" in option.stderr
    assert "Traceback" not in option.stderr and option.stderr.count("\n") == 1
    info = anygpu_cmd("info", "--help")
    assert info.returncode == 0 and info.stdout.startswith("usage: anygpu info")


@pytest.mark.parametrize(
    "cmd, says",
    [
        (
            ["run_hf_standalone.py", "--model_name_or_path", "anygpu-test/not-cached"],
            "--model_name_or_path anygpu-test/not-cached: no such local folder, and not in the Hugging Face cache",
        ),
        (
            ["run_hf_standalone.py", "--config_name", "./no/such/config.json"],
            "--config_name ./no/such/config.json: no such file or folder",
        ),
        (
            ["run_fsdp_standalone.py", "--config_name", "tiny", "--validation_file", "no/such/valid.jsonl"],
            "--validation_file no/such/valid.jsonl: no such file",
        ),
        (
            ["run_fsdp_standalone.py", "--config_name", "tiny", "--dataset_name", "anygpu-test/no-data"],
            "hf download --repo-type dataset anygpu-test/no-data",
        ),
    ],
)
def test_missing_inputs_are_one_line_from_either_engine(tmp_path, cmd, says):
    """The engines' own scripts, as a user runs them: one line, exit 2, no traceback, no folder left."""
    proc = subprocess.run(
        [sys.executable, *cmd, "--output_dir", str(tmp_path / "run")],
        cwd=ROOT,
        env={**env(), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, engine, missing",
    [
        ("run_nvidia_all.sh", "fsdp", ["--model_name_or_path", "anygpu-test/not-cached"]),
        ("run_amd_all.sh", "hf", ["--dataset_name", "anygpu-test/no-data"]),
    ],
)
def test_missing_model_or_data_under_the_launcher_is_one_line(tmp_path, launcher, engine, missing):
    """Under torchrun or accelerate each rank would fail and the launcher add its ChildFailedError wall: the
    vendor launcher runs the engine's checks once first."""
    e = {**env(), "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "PYTHON": sys.executable}
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / launcher),
            "--engine",
            engine,
            "--nproc",
            "2",
            "--",
            *missing,
            "--output_dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and " ".join(missing) in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_doctor_prints_as_it_goes_and_tools_print_no_library_warnings(tmp_path):
    """`anygpu doctor` shows its first line before the slow facts (unbuffered or not); neither doctor nor plan
    lets a library's warnings (FutureWarning, UserWarning and the like) into what the user reads."""
    quiet = {k: v for k, v in env().items() if k != "PYTHONUNBUFFERED"}  # a user's terminal-less default
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "anygpu.tools.cli",
            "doctor",
            "--skip_collective",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=quiet,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stdout.readline()
    seen_first = time.monotonic()
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert first.startswith("anygpu doctor: looking at this machine") and "all checks passed" in rest
    assert time.monotonic() - seen_first > 0.5  # the first line came while torch was still being imported
    plan = anygpu_cmd("plan", "--config_name", "tiny", "--block_size", "64", "--gpu", "h100", cwd=tmp_path)
    assert plan.returncode == 0 and "recommendation: " in plan.stdout, plan.stderr
    for stderr in (err, plan.stderr):
        assert "Warning" not in stderr and "warn(" not in stderr, stderr
