"""Interactive `anygpu launch`: detects the GPUs, offers the plan's recommendation as each default,
reads answers from standard input when it is not a terminal, and prints (with --dry-run) the command
the answers imply. `anygpu launch --vendor V` without --interactive stays the vendor launcher."""
from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT, env

from anygpu.tools import cli, interactive
from anygpu.tools import plan as plan_tool

FAKES = ROOT / "tests" / "fakes"


def command(out: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if not ln.startswith("#") and "run_" in ln and "standalone.py" in ln)
    return shlex.split(line)


def test_cpu_defaults_and_scripted_answers(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no smi tool: no GPU
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"fsdp\n2\n8\n{tmp_path / 'run'}\n"))
    assert cli.main(["launch", "--dry-run", "--config_name", "tiny", "--block_size", "64"]) == 0  # no --vendor: asks
    out = capsys.readouterr().out
    assert "engine (hf: HF Trainer + accelerate; fsdp: native FSDP2) [hf]: fsdp" in out
    assert "CPU processes [1]: 2" in out and "global batch (sequences per optimizer step) [64]: 8" in out
    cmd = command(out)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--global_batch_size") + 1] == "8" and cmd[cmd.index("--output_dir") + 1] == str(tmp_path / "run")


def test_a_bad_answer_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert interactive.main(["--dry-run"], io.StringIO("hf\nddp\n2\n7\n"), io.StringIO()) == 2
    assert "global batch: 7 does not split over 2 processes" in capsys.readouterr().err


def test_vendor_without_interactive_is_the_launcher(capsys):
    with pytest.raises(SystemExit) as exit_:  # the launcher's own parser refuses it
        cli.main(["launch", "--vendor", "nvidia", "--bogus"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.slow
def test_fake_gpus_offer_the_plans_recommendation(tmp_path):
    e = {**env(), "PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "FAKE_NVIDIA": "ok", "FAKE_AMD": "absent"}
    answers = f"\n\n4\n32\n{tmp_path / 'out'}\n"  # keep engine and config, then 4 GPUs, global batch 32
    # the vendor script's --interactive (the same dialogue as `anygpu launch`, which the CPU test drives)
    proc = subprocess.run(["bash", str(ROOT / "run_nvidia_all.sh"), "--interactive", "--dry-run", "--config_name",
                           "llama-1b", "--block_size", "2048"], input=answers, cwd=ROOT,
                          env={**e, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rec = plan_tool.recommend(None, "llama-1b", 2048, 64, num_gpus=8, gpu_memory_gb=81559 / 1024)
    out = proc.stdout
    assert f"accelerate config [{rec.accelerate_config}]: {rec.accelerate_config}" in out
    assert "GPUs to use (1..8) [8]: 4" in out and "[64]: 32" in out
    assert re.search(rf"plan recommends {rec.strategy} .*{rec.per_device_train_batch_size} per device × 8 GPUs", out)
    cmd = command(out)
    assert cmd[cmd.index("--num_processes") + 1] == "4"
    assert cmd[cmd.index("--config_file") + 1].endswith(f"accelerate_configs/{rec.accelerate_config}.yaml")
    assert cmd[cmd.index("--global_batch_size") + 1] == "32"
