"""The `anygpu` command as a user meets it: --help at once (torch not imported), --version, 'did you mean'
for mistyped commands and options, and a missing model refused once, in one line, under the launchers.
(`plan --gpu` is in test_plan.py; no library warnings in a tool's output: test_interactive_launch.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, env

import anygpu


def anygpu_cmd(*args: str, flags: tuple[str, ...] = (), cwd=ROOT) -> subprocess.CompletedProcess:
    """The real console command (`anygpu ARGS` is `python -m anygpu.tools.cli ARGS`) in a fresh process."""
    return subprocess.run([sys.executable, *flags, "-m", "anygpu.tools.cli", *args], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=120)


def imported(importtime_stderr: str) -> set[str]:
    """Top-level packages a `python -X importtime` run imported."""
    return {line.split("|")[-1].strip().split(".")[0] for line in importtime_stderr.splitlines() if "|" in line}


def test_train_help_answers_without_torch_grouped():
    proc = anygpu_cmd("train", "--help", flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" not in imported(proc.stderr)  # the seconds of `import torch` are what --help must not pay
    out = proc.stdout
    assert out.startswith("usage: anygpu train [config.yaml]")
    for group in ("model:", "LoRA:", "data:", "training:", "checkpoints and resume:", "logging, evaluation and reporting:"):
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


@pytest.mark.slow
def test_missing_model_under_the_launcher_is_one_line(tmp_path):
    """Under torchrun each rank would fail and torchrun add its ChildFailedError wall: the launcher runs the
    engine's checks once first."""
    e = {**env(), "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "run_nvidia_all.sh"), "--engine", "fsdp", "--nproc", "2", "--",
                           "--model_name_or_path", "anygpu-test/not-cached", "--output_dir", str(tmp_path / "run")],
                          cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--model_name_or_path anygpu-test/not-cached" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert not (tmp_path / "run").exists()
