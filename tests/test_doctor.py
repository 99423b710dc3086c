"""`anygpu doctor`: on this CPU machine it runs its checks and exits 0 reporting "no GPU"; with the
fake smi tools it reports their GPUs and the launchers' commands for them; a failing check (an
unwritable output folder) exits non-zero with its fix."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import ROOT

from anygpu.tools import cli

FAKES = ROOT / "tests" / "fakes"


def doctor(capsys, *args: str) -> tuple[int, str]:
    rc = cli.main(["doctor", *args])
    return rc, capsys.readouterr().out


@pytest.mark.slow
def test_cpu_machine_passes_and_says_no_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc, out = doctor(capsys, "--output_dir", str(tmp_path / "out"))
    assert rc == 0, out
    assert "no GPU" in out and "all checks passed" in out
    assert "[pass] all-reduce: gloo, 2 processes, bus bandwidth" in out
    # each check as it runs, with its time; the first line before the slow facts
    assert out.startswith("anygpu doctor: looking at this machine")
    checks = [ln for ln in out.splitlines() if ln.startswith("  [pass]")]
    assert len(checks) == 5 and all(re.search(r"\(\d+\.\d s\)$", ln) for ln in checks)
    assert not (tmp_path / "out").exists()  # the doctor writes nothing, so it creates no folder
    rc, out = doctor(capsys, "--output_dir", str(tmp_path / "out"), "--json", "--skip_collective")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["gpus"] == [] and report["vendor"] is None
    assert {c["name"] for c in report["checks"]} == {"bf16 matmul", "TF32 matmul", "peer access", "output folder"}
    assert report["versions"]["torch"] and report["versions"]["accelerate"]
    assert report["launchers"]["fsdp"]["command"].endswith(" -m anygpu.engines.run_fsdp")


def test_fake_smi_gpus_are_reported_with_the_launchers_commands(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA", "ok")
    monkeypatch.setenv("FAKE_AMD", "absent")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    rc, out = doctor(capsys, "--output_dir", str(tmp_path), "--json", "--skip_collective")
    report = json.loads(out)
    assert rc == 0
    assert report["vendor"] == "nvidia" and report["visibility"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert [g["name"] for g in report["smi_gpus"]] == ["NVIDIA H100 80GB HBM3"] * 4
    # the launcher's own plan for these GPUs (a dry run; torch here is a CPU build, which it warns about)
    hf = report["launchers"]["hf"]
    assert hf["processes"] == 4 and "--num_processes 4" in hf["command"]
    assert any("CPU-only build" in w for w in hf["warnings"])
    rc, text = doctor(capsys, "--output_dir", str(tmp_path), "--skip_collective")
    assert "the smi tools list 4" in text and "NVIDIA H100 80GB HBM3" in text


def test_unwritable_output_dir_fails_with_its_fix(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    rc, out = doctor(capsys, "--output_dir", str(blocker / "out"), "--skip_collective")
    assert rc == 1
    assert "[FAIL] output folder" in out and "fix: choose a writable folder with --output_dir" in out
    assert "some checks failed" in out
