"""More processes per node than visible GPUs (e.g. the configs' `num_processes: 8` typed on a
2-GPU node): the HF engine stops before loading anything and says which --num_processes to pass.
The GPU count is faked with the launcher tests' fake nvidia-smi (torch here is a CPU build)."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ROOT, WARM
from conftest import env as clean_env

from anygpu.engines.hf.gpu_count import check_processes_per_node, visible_gpus

FAKES = ROOT / "tests" / "fakes"


def fake_env(**extra: str) -> dict[str, str]:
    e = {**clean_env(), "PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "FAKE_NVIDIA": "ok", "FAKE_AMD": "absent"}
    e.update(extra)
    return e


def test_visible_count_from_the_smi_tools_when_torch_has_no_gpu(monkeypatch):
    e = fake_env(CUDA_VISIBLE_DEVICES="0,1")
    monkeypatch.setenv("PATH", e["PATH"])
    monkeypatch.setenv("FAKE_NVIDIA", "ok")
    monkeypatch.setenv("FAKE_AMD", "absent")
    assert visible_gpus(e) == (2, "nvidia")
    assert visible_gpus({**e, "CUDA_VISIBLE_DEVICES": ""}) == (0, "nvidia")


@pytest.mark.parametrize("local, gpus, ok", [(8, 8, True), (2, 8, True), (8, 2, False), (4, 0, True), (1, 0, True)])
def test_processes_per_node_against_gpus(local, gpus, ok):
    e = {"LOCAL_WORLD_SIZE": str(local), "WORLD_SIZE": str(local)}
    if ok:
        check_processes_per_node(e, (gpus, "nvidia"))
    else:
        with pytest.raises(ValueError, match=f"--num_processes {gpus} .*run_nvidia_all.sh"):
            check_processes_per_node(e, (gpus, "nvidia"))


def test_two_nodes_name_the_total():
    with pytest.raises(ValueError, match=r"--num_processes 4 \(2 per node × 2 nodes\).*run_amd_all.sh"):
        check_processes_per_node({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16"}, (2, "amd"))


@pytest.mark.slow
def test_hf_engine_stops_before_loading_anything(tmp_path):
    out = tmp_path / "out"
    # accelerate launch with ranks forked from a warm launcher: what is tested is the ranks' check, not the launcher's
    cmd = [
        WARM[0],
        str(ROOT / WARM[1]),  # run from tmp_path
        "accelerate",
        "launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "ddp.yaml"),
        "--num_processes",
        "3",
        str(ROOT / "run_hf_standalone.py"),
        "--config_name",
        "tiny",
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=fake_env(CUDA_VISIBLE_DEVICES="0,1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "3 processes on this node but only 2 visible GPU(s)" in lines[0]
    assert "pass --num_processes 2" in lines[0] and "run_nvidia_all.sh" in lines[0]
    assert not out.exists()  # nothing loaded, nothing written
