"""`anygpu doctor`: on this CPU machine it runs its checks and exits 0 reporting "no GPU"; with the
fake smi tools it reports their GPUs and the launchers' commands for them; a failing check (an
unwritable output folder) exits non-zero with its fix."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from conftest import ROOT

from anygpu.tools import cli
from anygpu.tools import doctor as doctor_mod

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
    import importlib.util

    assert bool(report["versions"]["vllm"]) == (importlib.util.find_spec("vllm") is not None)  # --use_vllm's
    assert report["launchers"]["fsdp"]["command"].endswith(" -m anygpu.engines.run_fsdp")


@pytest.mark.slow  # two doctor runs with the launchers' dry runs
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
    # the launcher's own plan for these GPUs (a dry run; a CPU build of torch, as CI's, is warned about)
    hf = report["launchers"]["hf"]
    assert hf["processes"] == 4 and "--num_processes 4" in hf["command"]
    cpu_build = torch.version.cuda is None and torch.version.hip is None
    assert any("CPU-only build" in w for w in hf["warnings"]) == cpu_build, hf["warnings"]
    rc, text = doctor(capsys, "--output_dir", str(tmp_path), "--skip_collective")
    assert "the smi tools list 4" in text and "NVIDIA H100 80GB HBM3" in text


def test_unwritable_output_dir_fails_with_its_fix(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    rc, out = doctor(capsys, "--output_dir", str(blocker / "out"), "--skip_collective")
    assert rc == 1
    assert "[FAIL] output folder" in out and "fix: choose a writable folder with --output_dir" in out
    assert "some checks failed" in out


def amd_host(monkeypatch, arch: str) -> None:
    """The hardware facts of an AMD GPU host of `arch` (gcnArchName), on this CPU machine."""
    import types

    import torch

    from anygpu.runtime import hardware

    monkeypatch.setattr(hardware, "vendor", lambda: "amd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(gcnArchName=arch))


def test_tf32_check_runs_on_an_mi300_class_amd_gpu(monkeypatch):
    """gfx942 (MI300X): TF32 exists through hipBLASLt, so doctor measures it on and off (the matmul itself, a GPU's
    work, stands in here) and fails when the switch has no effect; HIPBLASLT_ALLOW_TF32=0 is reported as the reason
    TF32 is off."""
    from anygpu.runtime import hardware

    amd_host(monkeypatch, "gfx942:sramecc+:xnack-")
    monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "")  # recorded, so that the value the check sets is undone
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32")
    try:
        assert doctor_mod.tf32_off_reason() is None  # measured, not skipped
        monkeypatch.setattr(doctor_mod, "tf32_errors", lambda: (1e-3, 1e-7))
        check = doctor_mod.check_tf32()
        assert check.ok and check.detail.startswith("TF32 on"), check
        monkeypatch.setattr(doctor_mod, "tf32_errors", lambda: (1e-7, 1e-7))  # the switch does nothing
        check = doctor_mod.check_tf32()
        assert not check.ok and "HIPBLASLT_ALLOW_TF32=1" in check.fix, check
        monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "0")
        check = doctor_mod.check_tf32()
        assert check.ok and "TF32 off" in check.detail and "HIPBLASLT_ALLOW_TF32=0" in check.detail, check
    finally:
        hardware.configure_tf32(False)


def test_tf32_check_says_why_an_older_amd_gpu_has_none(monkeypatch):
    amd_host(monkeypatch, "gfx90a:sramecc+:xnack-")  # MI250X: no XF32
    check = doctor_mod.check_tf32()
    assert check.ok and "TF32 off" in check.detail and "gfx90a" in check.detail and "gfx942" in check.detail, check


@pytest.mark.gpu
def test_tf32_check_on_this_gpu():
    """The matmul itself: on a GPU with TF32 the switch really changes fp32 matmuls, and off matches fp64."""
    import torch

    from anygpu.runtime import hardware

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm GPU")
    check = doctor_mod.check_tf32()
    assert check.ok, check
    if doctor_mod.tf32_off_reason() is None:
        on, off = doctor_mod.tf32_errors()
        assert on > 10 * off and off < 1e-5
    hardware.configure_tf32(False)


TORCHRUN_REPORT = """terminate called without an active exception
W1128 12:21:17.321000 19310 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 19315 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
anygpu.tools.collective FAILED
-------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 19315)  (SIGTERM)
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 19314)  (SIGABRT)
=======================================================
"""


def test_a_failed_all_reduce_check_says_what_the_failing_process_said():
    """Found so: CI's failed doctor check read "2 processes failed (exit 1): =====" (torchrun's closing banner)."""
    assert doctor_mod.failure_reason(TORCHRUN_REPORT) == (
        "terminate called without an active exception; root cause exit code -6 (pid: 19314)  (SIGABRT)"
    )
    raised = "Traceback (most recent call last):\n  File x\nRuntimeError: Connection refused\n" + TORCHRUN_REPORT[46:]
    assert doctor_mod.failure_reason(raised).startswith("RuntimeError: Connection refused; root cause exit code -6")
    assert doctor_mod.failure_reason("") == "no output"


@pytest.mark.parametrize(
    "env, multi",
    [
        ({"NNODES": "2:4"}, True),  # an elastic job (docs/launchers.md), MIN:MAX as the launcher reads it
        ({"NNODES": "1:1"}, False),
        ({"NNODES": "2"}, True),
        ({"SLURM_NNODES": "2(x2)"}, False),  # not a whole number: the launcher runs one node, and so does this
        ({"SLURM_JOB_NUM_NODES": "3"}, True),
    ],
)
def test_doctor_reports_on_every_node_count_the_launcher_takes(tmp_path, monkeypatch, env, multi):
    """A node of an elastic job (NNODES=MIN:MAX), or an odd Slurm count, gets a report, not a traceback; the
    output folder must be shared exactly when the job spans several nodes."""
    for name in ("NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen: list[bool] = []
    monkeypatch.setattr(doctor_mod, "check_output_dir", lambda path, multi_node: seen.append(multi_node) or ok())
    for name in ("check_bf16", "check_tf32", "check_peer_access"):
        monkeypatch.setattr(doctor_mod, name, ok)
    args = doctor_mod.build_parser().parse_args(["--output_dir", str(tmp_path), "--skip_collective"])
    report: dict = {"gpus": []}
    doctor_mod.run_checks(args, report)
    assert report["ok"] and seen == [multi]


def ok() -> doctor_mod.Check:
    return doctor_mod.Check("stub", True, "fine")
