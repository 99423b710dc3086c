"""The `anygpu` command as a user meets it: --help at once (torch not imported), --version, 'did you mean'
for mistyped commands and options, `plan --gpu` on a machine without that GPU, no library warnings in a
tool's output, and a missing model refused once, in one line, under the launchers."""
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


def test_plan_for_a_named_gpu_is_compact_and_quiet(tmp_path):
    proc = anygpu_cmd("plan", "--config_name", "llama-1b", "--block_size", "2048", "--gpu", "h100", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no FutureWarning or other library noise
    out = proc.stdout
    assert "8 GPU(s) × 79.60 GiB NVIDIA H100 80GB HBM3 (--gpu h100; 8 assumed" in out
    assert "recommendation: " in out and " per device × 8 devices × " in out and "GiB of 79.60 GiB per GPU" in out
    assert "runners-up" in out and len(out.splitlines()) <= 12
    assert not any(line.endswith((" yes", " no")) for line in out.splitlines())  # no table's "fits" column
    assert list(tmp_path.iterdir()) == []  # a tool that writes nothing creates no folder
    bad = anygpu_cmd("plan", "--config_name", "tiny", "--gpu", "h10")
    assert bad.returncode == 2 and "--gpu h10 is not in anygpu's table (did you mean h100?)" in bad.stderr


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
