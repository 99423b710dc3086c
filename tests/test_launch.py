"""The vendor launchers (run_nvidia_all.sh, run_amd_all.sh, anygpu/launch/launcher.py).

Detection runs against fake nvidia-smi / rocm-smi / amd-smi (tests/fakes) that print the real
tools' formats for 8 GPUs; the visibility rules are checked against torch's own parser; the
launch commands are checked from --dry-run; and real CPU runs (gloo) check what no dry run can:
training end to end, two "nodes" on one machine matching one node, a failing rank ending the job.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anygpu.launch import detect as gpu_detect
from anygpu.launch import launcher as launch
from anygpu.launch import vendor_env
from anygpu.launch.detect import AMD, NVIDIA, Gpu

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"
sys.path.insert(0, str(FAKES))
from conftest import HIDE_GPUS, outputs  # noqa: E402
import fake_smi  # noqa: E402  (the fakes' own encoders: an independent check of our decoders)

SCRIPT = {NVIDIA: ROOT / "run_nvidia_all.sh", AMD: ROOT / "run_amd_all.sh"}
ENGINE_ENTRIES = [["-m", "anygpu.engines.run_fsdp"], ["-m", "anygpu.engines.run_hf"]]  # what each process runs
TINY = [
    "--config_name",
    "tiny",
    "--max_corpus_mb",
    "1",
    "--block_size",
    "64",
    "--global_batch_size",
    "8",
    "--logging_steps",
    "1",
    "--eval_steps",
    "0",
    "--disable_tqdm",
    "true",
    "--report_to",
    "none",
    "--warmup_steps",
    "2",
    "--learning_rate",
    "3e-3",
    "--export_final",
    "false",
]


def base_env(**extra: str) -> dict[str, str]:
    """A clean environment: the fakes first on PATH, no visibility/Slurm/preset variables."""
    env = {
        "PATH": os.pathsep.join([str(FAKES), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "PYTHON": sys.executable,
        "FAKE_NVIDIA": "ok",
        "FAKE_AMD": "absent",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for name in ("ANYGPU_CACHE", "TMPDIR", "HF_HOME"):
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(extra)
    return env


@dataclass
class DryRun:
    rc: int
    out: str
    err: str

    @property
    def exports(self) -> dict[str, str]:
        pairs = [shlex.split(ln[len("export ") :])[0] for ln in self.out.splitlines() if ln.startswith("export ")]
        return dict(p.split("=", 1) for p in pairs)

    @property
    def kept(self) -> dict[str, str]:
        tag = "# kept (set by the caller): "
        pairs = [shlex.split(ln[len(tag) :])[0] for ln in self.out.splitlines() if ln.startswith(tag)]
        return dict(p.split("=", 1) for p in pairs)

    @property
    def cmd(self) -> list[str]:
        return shlex.split(self.out.strip().splitlines()[-1])

    @property
    def notes(self) -> str:
        return "\n".join(ln for ln in self.out.splitlines() if ln.startswith("# "))

    def opt(self, name: str) -> str:
        cmd = self.cmd
        return cmd[cmd.index(name) + 1]

    @property
    def nproc(self) -> int:
        """Processes this node starts, read from the command itself."""
        cmd = self.cmd
        if "anygpu.reliability.torchrun" in cmd:
            return int(self.opt("--nproc-per-node"))
        if "accelerate.commands.launch" in cmd:
            return int(self.opt("--num_processes")) // int(self.opt("--num_machines"))
        assert cmd[0] == sys.executable and cmd[1:3] in ENGINE_ENTRIES, cmd
        return 1


def dry(vendor: str, *args: str, **env: str) -> DryRun:
    p = subprocess.run(
        ["bash", str(SCRIPT[vendor]), "--dry-run", *args],
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return DryRun(p.returncode, p.stdout, p.stderr)


def launch_real(vendor: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT[vendor]), *args], env=base_env(**env), capture_output=True, text=True, timeout=timeout
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_output(*argv: str, **env: str) -> str:
    return subprocess.run(list(argv), env=base_env(**env), capture_output=True, text=True, check=True).stdout


# ------------------------------------------------------------------- parsing the real formats


def test_nvidia_parsers_read_the_fakes_and_agree():
    query = gpu_detect.parse_nvidia_query(
        tool_output("nvidia-smi", "--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits")
    )
    listed, migs = gpu_detect.parse_nvidia_list(tool_output("nvidia-smi", "-L"))
    assert [g.index for g in query] == list(range(8))
    assert {g.name for g in query} == {"NVIDIA H100 80GB HBM3"} and {g.memory_mib for g in query} == {81559}
    assert [(g.index, g.name, g.uuid) for g in listed] == [(g.index, g.name, g.uuid) for g in query]
    assert [g.uuid for g in query] == [fake_smi.nvidia_uuid(i) for i in range(8)] and not migs


def test_nvidia_list_with_mig_instances():
    text = (
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n"
        "  MIG 1g.5gb      Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)\n"
        "  MIG 1g.5gb      Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)\n"
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-4a2e7c33-2a4f-0fb7-d9d8-3d0d1b3c33a1)\n"
    )
    gpus, migs = gpu_detect.parse_nvidia_list(text)
    assert [g.index for g in gpus] == [0, 1]
    assert [(m.index, m.uuid[:12]) for m in migs] == [(0, "MIG-c6d4f1ef"), (0, "MIG-cba663e8")]
    vis = gpu_detect.visible_gpus(NVIDIA, gpus, {"CUDA_VISIBLE_DEVICES": "MIG-cba663e8"}, migs)
    assert [m.uuid for m in vis.gpus] == [migs[1].uuid]


def test_amd_parsers_read_the_fakes_and_agree():
    csv_ = gpu_detect.parse_rocm_showid_csv(tool_output("rocm-smi", "--showid", "--csv", FAKE_AMD="ok"))
    text = gpu_detect.parse_rocm_showid(tool_output("rocm-smi", "--showid", FAKE_AMD="ok"))
    listed = gpu_detect.parse_amd_smi_list(tool_output("amd-smi", "list", FAKE_AMD="ok"))
    vram = gpu_detect.parse_rocm_vram_csv(tool_output("rocm-smi", "--showmeminfo", "vram", "--csv", FAKE_AMD="ok"))
    assert (
        [(g.index, g.name) for g in csv_]
        == [(g.index, g.name) for g in text]
        == [(i, "AMD Instinct MI300X") for i in range(8)]
    )
    assert [g.index for g in listed] == list(range(8))
    assert vram == {i: fake_smi.AMD_VRAM_B // 2**20 for i in range(8)}
    # amd-smi's UUID encodes the serial ROCr/HIP accept as GPU-<serial>; decoding it gives the
    # fakes' serial back (the fake encodes as amd_smi_uuid.cc does).
    assert [int(g.serial, 16) for g in listed] == [fake_smi.amd_serial(i) for i in range(8)]


def test_amd_serial_from_a_real_amd_smi_uuid():
    # From AMD's amd-smi blog post; layout from amd_smi_uuid.cc: serial byte 7, then fcn (ff) and
    # device id 74a1, …, byte 6 after "80", bytes 0-5 last.
    assert Gpu(0, uuid="afff74a1-0000-1000-8054-e92b0a5d57c8").serial == "af54e92b0a5d57c8"
    assert Gpu(0, uuid="not-a-uuid").serial == ""


def test_rocm_smi_real_layouts_with_other_columns():
    # Older rocm-smi prints only "GPU ID" lines (no name); the CSV may carry more columns.
    old = "==== ROCm System Management Interface ====\nGPU[0]\t\t: GPU ID: 0x738c\nGPU[1]\t\t: GPU ID: 0x738c\n"
    assert [(g.index, g.name) for g in gpu_detect.parse_rocm_showid(old)] == [(0, ""), (1, "")]
    wide = (
        "device,Device Name,Device ID,Device Rev,Subsystem ID,GUID\ncard0,AMD Instinct MI210,0x740f,0x02,0x0c34,36198\n"
    )
    assert [(g.index, g.name) for g in gpu_detect.parse_rocm_showid_csv(wide)] == [(0, "AMD Instinct MI210")]


@pytest.mark.parametrize(
    "mode, count, problem",
    [
        ("ok", 8, ""),
        ("driver-fail", 0, "exit 9: NVIDIA driver not loaded"),
        ("absent", 0, "nvidia-smi not found"),
    ],
)
def test_probe_nvidia_tells_no_driver_from_failure(monkeypatch, mode, count, problem):
    monkeypatch.setenv("PATH", base_env()["PATH"])
    monkeypatch.setenv("FAKE_NVIDIA", mode)
    found = gpu_detect.probe_nvidia()
    assert len(found.gpus) == count and problem in found.problem and bool(found.problem) == bool(problem)


@pytest.mark.parametrize(
    "mode, count, problem",
    [
        ("ok", 8, ""),
        ("driver-fail", 0, "amd-smi failed with exit 255"),
        ("absent", 0, "rocm-smi not found"),
    ],
)
def test_probe_amd_parses_output_not_exit_codes(monkeypatch, mode, count, problem):
    # Without the driver rocm-smi exits 0 and prints nothing: only parsing tells.
    monkeypatch.setenv("PATH", base_env()["PATH"])
    monkeypatch.setenv("FAKE_AMD", mode)
    found = gpu_detect.probe_amd()
    assert len(found.gpus) == count and problem in found.problem
    if mode == "driver-fail":
        assert "rocm-smi lists no GPU" in found.problem
    if mode == "ok":
        assert all(g.name and g.uuid and g.memory_mib for g in found.gpus)


def test_amd_host_without_rocm_smi_gets_names_memory_and_the_mi300x_tuning():
    """rocm-smi is deprecated (ROCm 6.4+): with amd-smi alone the GPUs are named, their memory known, and the
    MI300X-only RCCL setting exported, as with both tools."""
    both = dry(AMD, "--count-from", "smi", FAKE_NVIDIA="absent", FAKE_AMD="ok")
    alone = dry(AMD, "--count-from", "smi", FAKE_NVIDIA="absent", FAKE_AMD="ok", FAKE_ROCM_SMI="absent")
    assert both.rc == alone.rc == 0, alone.err
    assert "8 AMD GPUs present (amd-smi): 0-7: AMD Instinct MI300X, 192 GiB" in alone.notes, alone.notes
    assert alone.exports == both.exports and alone.exports["NCCL_MIN_NCHANNELS"] == "112"


@pytest.mark.parametrize(
    "text",
    [
        '[{"gpu": 1, "asic": {"market_name": "AMD Instinct MI300X"}, "vram": {"size": {"value": 196592, "unit": "MB"}}}]',
        '{"gpu_data": [{"gpu": 1, "asic": {"market_name": "AMD Instinct MI300X"}, '
        '"vram": {"vram_size": {"value": 196592, "unit": "MB"}}}]}',
        '[{"gpu": 1, "asic": {"market_name": "AMD Instinct MI300X"}, "vram": {"size": "196592 MB"}}]',
    ],
)
def test_amd_smi_static_layouts(text):
    """`amd-smi static --asic --vram --json` as ROCm 6.x (a list) and 7.x (gpu_data, vram_size) print it."""
    assert gpu_detect.parse_amd_smi_static(text) == [Gpu(1, "AMD Instinct MI300X", memory_mib=196592)]
    assert gpu_detect.parse_amd_smi_static("not json") == []


# ------------------------------------------------------------------------ visibility rules

NV8 = [Gpu(i, "NVIDIA H100 80GB HBM3", fake_smi.nvidia_uuid(i)) for i in range(8)]
AMD8 = [Gpu(i, "AMD Instinct MI300X", fake_smi.amd_uuid(i)) for i in range(8)]


def _ids(gpus) -> list[int]:
    return [g.index for g in gpus]


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, list(range(8))),
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        ({"CUDA_VISIBLE_DEVICES": "0,2"}, [0, 2]),
        ({"CUDA_VISIBLE_DEVICES": "0,2,-1,1"}, [0, 2]),  # an invalid entry ends the list
        ({"CUDA_VISIBLE_DEVICES": "3,1"}, [3, 1]),  # order is the runtime's numbering
        ({"CUDA_VISIBLE_DEVICES": "0,9,1"}, [0]),  # out of range ends it too
        ({"CUDA_VISIBLE_DEVICES": "1,1"}, []),  # a repeat hides everything
        ({"CUDA_VISIBLE_DEVICES": fake_smi.nvidia_uuid(5)[:12] + "," + fake_smi.nvidia_uuid(2)}, [5, 2]),
        ({"CUDA_VISIBLE_DEVICES": fake_smi.nvidia_uuid(5) + ",1"}, [5]),  # a UUID list stops at an index
        ({"HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}, list(range(8))),  # not read by CUDA
    ],
)
def test_nvidia_visibility(env, expected):
    assert _ids(gpu_detect.visible_gpus(NVIDIA, NV8, env).gpus) == expected


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, list(range(8))),
        ({"HIP_VISIBLE_DEVICES": ""}, list(range(8))),  # HIP treats an empty value as unset
        ({"HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}, []),  # ROCr's empty list hides them
        ({"ROCR_VISIBLE_DEVICES": ""}, []),
        ({"HIP_VISIBLE_DEVICES": "0,2"}, [0, 2]),
        ({"CUDA_VISIBLE_DEVICES": "0,2,-1,1"}, [0, 2]),
        ({"ROCR_VISIBLE_DEVICES": "1,3,5", "HIP_VISIBLE_DEVICES": "0,2"}, [1, 5]),  # HIP indexes ROCR's rest
        ({"ROCR_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}, []),
        ({"ROCR_VISIBLE_DEVICES": "1,3,5,7", "HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, [7]),
        ({"HIP_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": ""}, [2]),  # HIP overrides CUDA
        ({"ROCR_VISIBLE_DEVICES": f"GPU-{fake_smi.amd_serial(6):016x},GPU-{fake_smi.amd_serial(3):016x}"}, [6, 3]),
        ({"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": f"GPU-{fake_smi.amd_serial(6):016x}"}, [6]),
    ],
)
def test_amd_visibility(env, expected):
    assert _ids(gpu_detect.visible_gpus(AMD, AMD8, env).gpus) == expected


def test_amd_uuid_visibility_without_amd_smi_is_unresolved():
    no_uuid = [Gpu(i, "AMD Instinct MI300X") for i in range(8)]
    vis = gpu_detect.visible_gpus(AMD, no_uuid, {"HIP_VISIBLE_DEVICES": "GPU-abcd"})
    assert vis.unresolved and "amd-smi" in vis.unresolved


ENTRY = st.one_of(st.integers(-2, 7).map(str), st.sampled_from(["", " 3", "+1", "2gpu", "x", "1x1"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(ENTRY, min_size=1, max_size=6).map(",".join))
def test_index_lists_match_torchs_parser(value):
    """Oracle: torch's own CUDA_VISIBLE_DEVICES parser (entries < 8, so its NVML trim is moot)."""
    import torch.cuda

    mine = _ids(gpu_detect.visible_gpus(NVIDIA, NV8, {"CUDA_VISIBLE_DEVICES": value}).gpus)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", value)
        assert mine == torch.cuda._parse_visible_devices(), value


# ------------------------------------------------------------------ dry runs: counts and env


@pytest.mark.parametrize(
    "vendor, env, gpus",
    [
        (NVIDIA, {}, "0-7"),
        (NVIDIA, {"CUDA_VISIBLE_DEVICES": "0,2"}, "0,2"),
        (NVIDIA, {"CUDA_VISIBLE_DEVICES": "0,2,-1,1"}, "0,2"),
        (NVIDIA, {"CUDA_VISIBLE_DEVICES": "6,7,5"}, "6-7,5"),
        (AMD, {}, "0-7"),
        (AMD, {"HIP_VISIBLE_DEVICES": "0,2,-1,1"}, "0,2"),
        (AMD, {"ROCR_VISIBLE_DEVICES": "1,3,5", "HIP_VISIBLE_DEVICES": "0,2"}, "1,5"),
        (AMD, {"ROCR_VISIBLE_DEVICES": "2,4", "CUDA_VISIBLE_DEVICES": "1"}, "4"),
    ],
)
def test_dry_run_process_count_follows_visibility(vendor, env, gpus):
    fake = (
        {"FAKE_NVIDIA": "ok", "FAKE_AMD": "absent"} if vendor == NVIDIA else {"FAKE_NVIDIA": "absent", "FAKE_AMD": "ok"}
    )
    r = dry(vendor, "--engine", "fsdp", "--count-from", "smi", **fake, **env)
    assert r.rc == 0, r.err
    count = sum(len(range(int(a), int(b) + 1)) if b else 1 for a, _, b in (p.partition("-") for p in gpus.split(",")))
    assert r.nproc == count
    assert f"GPU{'s' if count > 1 else ''}: {gpus}: " in r.notes
    if count > 1:
        assert r.cmd[1:6] == ["-m", "anygpu.reliability.torchrun", "--standalone", "--nnodes", "1"]
    for name, value in env.items():  # the caller's visibility variables reach the job untouched
        assert name not in r.exports and name not in r.kept, (name, value)


def test_dry_run_vendor_variables():
    nv = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi")
    amd = dry(AMD, "--engine", "fsdp", "--count-from", "smi", FAKE_NVIDIA="absent", FAKE_AMD="ok")
    assert nv.rc == amd.rc == 0, nv.err + amd.err
    common = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(max(1, vendor_env.cpu_count() // 8)),
        "NCCL_DEBUG": "WARN",
    }
    assert nv.exports == {
        **common,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    }
    assert amd.exports == {
        **common,
        "HSA_NO_SCRATCH_RECLAIM": "1",
        "HIP_FORCE_DEV_KERNARG": "1",
        "RCCL_MSCCL_ENABLE": "0",
        "HIPBLASLT_ALLOW_TF32": "1",
        "HSA_FORCE_FINE_GRAIN_PCIE": "1",
        "GPU_MAX_HW_QUEUES": "2",
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        "NCCL_MIN_NCHANNELS": "112",
    }


def test_callers_values_survive_dry_run():
    r = dry(
        NVIDIA,
        "--engine",
        "fsdp",
        "--count-from",
        "smi",
        NCCL_DEBUG="INFO",
        OMP_NUM_THREADS="3",
        PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512",
    )
    assert r.rc == 0, r.err
    assert r.kept == {
        "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "3",
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
    }
    # Nor is an alias of theirs shadowed by the other name of the same knob.
    assert not {"NCCL_DEBUG", "OMP_NUM_THREADS", "PYTORCH_ALLOC_CONF"} & set(r.exports)


@pytest.mark.parametrize("engine", ["hf", "fsdp"])
@pytest.mark.parametrize("value", ["", "abc", "0"])
def test_a_thread_count_no_process_can_read_is_refused_in_one_line(engine, value):
    """OMP_NUM_THREADS='' (an unset shell variable) or 'abc' would be kept and crash accelerate launch with a
    ValueError traceback (int('')); the launcher refuses it first, naming the variable, its value and a fix."""
    r = dry(NVIDIA, "--engine", engine, "--count-from", "smi", "--nproc", "2", OMP_NUM_THREADS=value)
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and "Traceback" not in r.err, r.err
    assert f"OMP_NUM_THREADS={value!r}" in lines[0] and "unset it" in lines[0] and "OMP_NUM_THREADS=4" in lines[0]


@pytest.mark.parametrize("vendor", [NVIDIA, AMD])
def test_real_exec_environment_and_arguments(vendor, tmp_path):
    """Not a dry run: the script the launcher execs sees the presets, the caller's values and its
    arguments unchanged, and the launcher's exit code is the script's."""
    fake = (
        {"FAKE_NVIDIA": "ok", "FAKE_AMD": "absent"} if vendor == NVIDIA else {"FAKE_NVIDIA": "absent", "FAKE_AMD": "ok"}
    )
    p = launch_real(
        vendor,
        "--count-from",
        "smi",
        "--gpus",
        "3",
        "--script",
        str(FAKES / "show_env.py"),
        "--",
        "--output_dir",
        "a b",
        "--nproc",
        "5",
        "--",
        "x",
        NCCL_DEBUG="INFO",
        ANYGPU_TEST_EXIT="7",
        **fake,
    )
    assert p.returncode == 7, p.stderr
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["argv"] == ["--output_dir", "a b", "--nproc", "5", "--", "x"]
    env = seen["env"]
    assert env["NCCL_DEBUG"] == "INFO" and env["PYTHONUNBUFFERED"] == "1"
    if vendor == NVIDIA:
        assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    else:
        assert env["HIP_VISIBLE_DEVICES"] == "3" and env["HSA_NO_SCRATCH_RECLAIM"] == "1"
        assert "CUDA_DEVICE_ORDER" not in env
    assert "one process: plain python" in p.stderr


@pytest.mark.parametrize(
    "visible, args, pinned, nproc",
    [
        (None, ["--gpus", "0,1,3"], "0,1,3", 3),
        ("4,5,6,7", ["--gpus", "0,2"], "4,6", 2),  # indices into the usable GPUs, as printed
        (None, ["--nproc", "3"], None, 3),
    ],
)
def test_gpus_and_nproc(visible, args, pinned, nproc):
    env = {"CUDA_VISIBLE_DEVICES": visible} if visible else {}
    r = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi", *args, **env)
    assert r.rc == 0, r.err
    assert r.nproc == nproc and r.exports.get("CUDA_VISIBLE_DEVICES") == pinned


def test_amd_gpus_index_what_rocr_leaves():
    # usable: ROCR leaves 1,3,5,7; CUDA's 3,2,1 index that -> 7,5,3; --gpus 1,2 picks 5,3, which
    # HIP_VISIBLE_DEVICES (preferred over CUDA's) must name by their place in ROCR's list: 2,1.
    r = dry(
        AMD,
        "--engine",
        "fsdp",
        "--count-from",
        "smi",
        "--gpus",
        "1,2",
        FAKE_NVIDIA="absent",
        FAKE_AMD="ok",
        ROCR_VISIBLE_DEVICES="1,3,5,7",
        CUDA_VISIBLE_DEVICES="3,2,1",
    )
    assert r.rc == 0, r.err
    assert r.exports["HIP_VISIBLE_DEVICES"] == "2,1" and "ROCR_VISIBLE_DEVICES" not in r.exports
    assert "GPUs: 5,3: AMD Instinct MI300X" in r.notes
    env = {"ROCR_VISIBLE_DEVICES": "1,3,5,7", "CUDA_VISIBLE_DEVICES": "3,2,1", "HIP_VISIBLE_DEVICES": "2,1"}
    assert _ids(gpu_detect.visible_gpus(AMD, AMD8, env).gpus) == [5, 3]  # what the job will see


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "9"], "only 8 NVIDIA GPU(s) usable here (valid: 1..8)"),
        (["--gpus", "0,8"], "'8' is not a usable GPU (valid: indices 0..7"),
        (["--gpus", "1,1"], "GPU 1 is named twice"),
        (["--gpus", "0,1", "--nproc", "3"], "--nproc 3 disagrees with --gpus 0,1"),
        (["--max_steps", "3"], "training-script arguments go after --"),
        (["--engine", "fsdp", "--accelerate-config", "ddp"], "only applies to --engine hf"),
        (["--accelerate-config", "nope"], "valid names: ddp, deepspeed_zero2, deepspeed_zero3"),
        (["--script", "/no/such/train.py"], "training script not found"),
    ],
)
def test_bad_options_are_refused_with_a_reason(args, message):
    engine = [] if "--engine" in args or "--accelerate-config" in args else ["--engine", "fsdp"]
    r = dry(NVIDIA, "--count-from", "smi", *engine, *args)
    assert r.rc == 2 and message in r.err, r.err


@pytest.mark.parametrize(
    "extra", [["--vendor", "amd"], ["--vendor=amd"], ["--vendor", "nvidia"], ["--interactive", "--vendor", "amd"]]
)
def test_a_second_vendor_is_refused_not_silently_taken(extra):
    """run_nvidia_all.sh passes --vendor nvidia itself: a --vendor of the user's is refused in one line that names
    the script for the other vendor, where argparse took the last one and the launcher's own checks the first."""
    r = dry(NVIDIA, "--count-from", "smi", *extra, FAKE_AMD="ok")
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and not r.out, r.out + r.err
    assert "--vendor" in lines[0] and "run_amd_all.sh for AMD GPUs" in lines[0], lines[0]


def test_an_accelerate_config_path_in_any_case_is_used(tmp_path):
    """--accelerate-config /path/My.YAML (a file that is there) is that file, not 'no such file'."""
    cfg = tmp_path / "My.YAML"
    cfg.write_text("distributed_type: MULTI_GPU\n")
    r = dry(NVIDIA, "--count-from", "smi", "--accelerate-config", str(cfg))
    assert r.rc == 0 and r.opt("--config_file") == str(cfg), r.err


def test_port_and_restarts():
    default = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi")
    fixed = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi", "--master-port", "29999", "--max-restarts", "2")
    assert "--standalone" in default.cmd and "--max-restarts" not in default.cmd
    assert "--standalone" not in fixed.cmd and fixed.opt("--rdzv-endpoint") == "localhost:29999"
    assert fixed.opt("--max-restarts") == "2"
    assert fixed.exports["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in default.exports
    # Slurm's --signal=USR1: torchrun forwards SIGUSR1 to the workers (they save and exit 143) where it can
    if launch.torchrun_forwards_signals():
        assert "SIGUSR1" in fixed.opt("--signals-to-handle").split(",")


# -------------------------------------------------------------------- no GPU, wrong vendor


def test_driver_failure_falls_back_to_cpu_and_torch_agrees():
    # --count-from auto: torch is asked too, under the same environment; with no driver it must see
    # no GPU either (the visibility variables keep that true on a machine that has GPUs).
    r = dry(NVIDIA, "--engine", "fsdp", FAKE_NVIDIA="driver-fail", CUDA_VISIBLE_DEVICES="")
    assert r.rc == 0, r.err
    assert "no NVIDIA GPU (nvidia-smi failed with exit 9: NVIDIA driver not loaded): training on the CPU" in r.notes
    assert r.cmd == [sys.executable, "-m", "anygpu.engines.run_fsdp"] and "warning" not in r.notes
    assert "CUDA_DEVICE_ORDER" not in r.exports and "NCCL_DEBUG" not in r.exports  # no GPU presets on CPU


def test_a_job_that_would_import_another_anygpu_runs_this_checkouts_script(tmp_path):
    """`python -m anygpu.engines.…` imports whichever anygpu the job's folder or interpreter holds: where that is not
    the launcher's own (here the folder holds another anygpu), the checkout's script runs it, and the launcher says so."""
    (tmp_path / "anygpu").mkdir()
    (tmp_path / "anygpu" / "__init__.py").write_text("")
    args = ["--dry-run", "--engine", "fsdp", "--count-from", "smi", "--cpu"]
    p = subprocess.run(
        ["bash", str(SCRIPT[NVIDIA]), *args], cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=120
    )
    r = DryRun(p.returncode, p.stdout, p.stderr)
    assert r.rc == 0, r.err
    assert r.cmd == [sys.executable, str(ROOT / "run_fsdp_standalone.py")]
    assert (
        f"{sys.executable} imports anygpu from {(tmp_path / 'anygpu').resolve()} here, not this launcher's "
        f"{ROOT / 'anygpu'}: running the checkout's run_fsdp_standalone.py"
    ) in r.notes


@pytest.mark.parametrize("value", ["", "-1", "0,0"])
def test_hidden_by_a_variable_is_not_no_driver(value):
    r = dry(NVIDIA, "--engine", "fsdp", CUDA_VISIBLE_DEVICES=value)
    assert r.rc == 0, r.err
    assert (
        f"8 NVIDIA GPUs present, but CUDA_VISIBLE_DEVICES={value!r} hides all of them: training on the CPU" in r.notes
    )
    assert r.nproc == 1 and "warning" not in r.notes  # torch, asked under the same env, agrees: 0


@pytest.mark.parametrize(
    "vendor, other, fakes",
    [
        (AMD, "run_nvidia_all.sh", {"FAKE_NVIDIA": "ok", "FAKE_AMD": "driver-fail"}),
        (NVIDIA, "run_amd_all.sh", {"FAKE_NVIDIA": "absent", "FAKE_AMD": "ok"}),
    ],
)
def test_wrong_vendor_script_says_what_to_run(vendor, other, fakes):
    r = dry(vendor, "--engine", "fsdp", "--count-from", "smi", **fakes)
    assert r.rc == 2 and f"run `bash {other}` instead" in r.err, r.err


def test_no_driver_anywhere_is_cpu_not_an_error():
    r = dry(AMD, "--engine", "fsdp", "--count-from", "smi", FAKE_NVIDIA="absent", FAKE_AMD="absent")
    assert r.rc == 0 and "no AMD GPU (rocm-smi not found: no driver installed; amd-smi not found" in r.notes


def test_cpu_only_torch_refuses_listed_gpus():
    import torch

    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip("needs a CPU-only torch build")
    p = launch_real(NVIDIA, "--engine", "fsdp", timeout=60)
    assert p.returncode == 2 and "is a CPU-only build and cannot use the NVIDIA GPU(s)" in p.stderr, p.stderr
    assert "--cpu" in p.stderr


@pytest.mark.slow
def test_detection_and_dry_run_need_only_the_standard_library(tmp_path):
    bare = tmp_path / "bare"  # a virtualenv with no packages at all
    subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(bare)],
        check=True,
        timeout=120,
    )
    python = str(bare / "bin" / "python")
    r = dry(NVIDIA, "--engine", "fsdp", "--gpus", "0,1", PYTHON=python)
    assert r.rc == 0, r.err
    assert r.cmd[0] == python and r.nproc == 2 and r.exports["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "torch is not importable here: counted with the smi tools only" in r.notes
    p = launch_real(NVIDIA, "--engine", "fsdp", PYTHON=python)
    assert p.returncode == 2 and "torch not importable by " + python in p.stderr, p.stderr


# ---------------------------------------------------------------------------- HF engine


@pytest.fixture
def hf_engine():
    if not (ROOT / "run_hf_standalone.py").is_file():
        pytest.fail("run_hf_standalone.py is missing")


@pytest.mark.slow
def test_hf_engine_configs(hf_engine):
    many = dry(NVIDIA, "--count-from", "smi")
    one = dry(NVIDIA, "--count-from", "smi", "--gpus", "2", "--max-restarts", "1")
    cpu = dry(NVIDIA, "--count-from", "smi", "--cpu", "--nproc", "2", "--accelerate-config", "deepspeed_zero3")
    cpu1 = dry(NVIDIA, "--count-from", "smi", "--cpu", "--accelerate-config", "fsdp")
    assert many.opt("--config_file") == str(ROOT / "anygpu" / "launch" / "accelerate_configs" / "fsdp.yaml")
    assert Path(many.opt("--config_file")).samefile(ROOT / "accelerate_configs" / "fsdp.yaml") and many.nproc == 8
    assert many.cmd[-2:] == ["-m", "anygpu.engines.run_hf"]
    assert many.opt("--main_process_port") == "0" and "--cpu" not in many.cmd
    assert one.opt("--config_file").endswith("ddp.yaml") and one.opt("--max_restarts") == "1" and one.nproc == 1
    # DeepSpeed runs on CPU by itself: its config goes through, without accelerate's CPU switch
    assert cpu.opt("--config_file").endswith("deepspeed_zero3.yaml") and cpu.nproc == 2 and "--cpu" not in cpu.cmd
    assert "ACCELERATE_USE_CPU" not in cpu.exports and cpu.exports["CUDA_VISIBLE_DEVICES"] == ""
    assert "DeepSpeed's CPU accelerator over gloo" in cpu.notes
    # FSDP asked for on CPU goes to the engine, whose strategy check stops it (or falls back when told)
    assert cpu1.opt("--config_file").endswith("fsdp.yaml") and "--cpu" not in cpu1.cmd
    assert "--allow_strategy_fallback true" in cpu1.notes
    ddp2 = dry(NVIDIA, "--count-from", "smi", "--cpu", "--nproc", "2")
    assert ddp2.opt("--config_file").endswith("ddp.yaml") and ddp2.exports["ACCELERATE_USE_CPU"] == "true"


# ------------------------------------------------------------------------------ many nodes


def test_multi_node_all_nodes_agree():
    env = {"NNODES": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555"}
    nodes = [dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi", NODE_RANK=str(r), **env) for r in (0, 1)]
    assert all(n.rc == 0 for n in nodes), [n.err for n in nodes]
    for n in nodes:
        assert n.opt("--nnodes") == "2" and n.opt("--rdzv-endpoint") == "10.0.0.1:29555" and n.nproc == 8
    assert nodes[0].opt("--rdzv-id") == nodes[1].opt("--rdzv-id")
    assert [n.opt("--rdzv-conf") for n in nodes] == ["is_host=true", "is_host=false"]
    hf = dry(NVIDIA, "--count-from", "smi", NODE_RANK="1", **env)
    if (ROOT / "run_hf_standalone.py").is_file():
        assert (
            hf.opt("--num_processes"),
            hf.opt("--num_machines"),
            hf.opt("--machine_rank"),
            hf.opt("--main_process_ip"),
            hf.opt("--main_process_port"),
        ) == ("16", "2", "1", "10.0.0.1", "29555")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "2", "MASTER_ADDR": "h"}, "NNODES=2 needs NODE_RANK"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2 is out of range"),
        ({"NNODES": "two"}, "NNODES='two' is not a whole number"),
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_NNODES": "2",
                "SLURM_NODEID": "0",
                "SLURM_LOCALID": "1",
                "SLURM_JOB_NODELIST": "n[1-2]",
            },
            "start one per node: srun --ntasks-per-node=1",
        ),
    ],
)
def test_multi_node_mistakes(env, message):
    r = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi", **env)
    assert r.rc == 2 and message in r.err, r.err


def test_elastic_node_counts():
    """NNODES=MIN:MAX: torchrun's elastic c10d rendezvous on every node, the tuned timeouts after is_host, the
    restarts, and ANYGPU_ELASTIC for the workers (each start continues the run); N:N is a fixed count."""
    env = {"NNODES": "1:2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555"}
    opts = ["--engine", "fsdp", "--count-from", "smi", "--max-restarts", "3", "--rdzv-conf", "last_call_timeout=10"]
    nodes = [dry(NVIDIA, *opts, NODE_RANK=str(r), **env) for r in (0, 1)]
    for n, host in zip(nodes, ("true", "false")):
        assert n.rc == 0, n.err
        assert (n.opt("--nnodes"), n.opt("--rdzv-backend"), n.opt("--rdzv-endpoint")) == (
            "1:2",
            "c10d",
            "10.0.0.1:29555",
        )
        assert n.opt("--rdzv-conf") == f"is_host={host},last_call_timeout=10" and n.opt("--max-restarts") == "3"
        assert n.exports["ANYGPU_ELASTIC"] == "1:2" and "elastic: the job goes on with 1 to 2 nodes" in n.out
    assert nodes[0].opt("--rdzv-id") == nodes[1].opt("--rdzv-id")
    off = dry(NVIDIA, *opts[:-1], "is_host=false", NODE_RANK="0", **env)  # the store hosted elsewhere
    assert off.opt("--rdzv-conf") == "is_host=false"
    fixed = dry(NVIDIA, *opts, NODE_RANK="1", **{**env, "NNODES": "2:2"})
    assert fixed.opt("--nnodes") == "2" and "ANYGPU_ELASTIC" not in fixed.exports
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[1-4]"}
    r = dry(NVIDIA, *opts, MIN_NODES="3", **slurm)  # Slurm: the allocation is MAX, MIN_NODES the fewest
    assert r.rc == 0 and (r.opt("--nnodes"), r.opt("--rdzv-id")) == ("3:4", "77") and "node 2 of 3:4" in r.out


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            [],
            {"NNODES": "1:2"},
            "NNODES=1:2 (elastic) with --engine hf: accelerate launch starts the nodes with a static",
        ),
        (["--engine", "fsdp"], {"NNODES": "1:2"}, "NNODES=1:2 (elastic) needs --max-restarts K >= 1"),
        (["--engine", "fsdp"], {"NNODES": "2:1"}, "NNODES='2:1' is not a node count: give N, or MIN:MAX"),
        (["--engine", "fsdp", "--rdzv-conf", "timeout=5"], {}, "'timeout=5' is not KEY=SECONDS (is_host=true|false)"),
        (["--rdzv-conf", "join_timeout=60"], {}, "--rdzv-conf only applies to --engine fsdp"),
        (
            ["--engine", "fsdp", "--max-restarts", "1"],
            {
                "SLURM_JOB_ID": "7",
                "SLURM_NNODES": "2",
                "SLURM_NODEID": "0",
                "SLURM_JOB_NODELIST": "n[1-2]",
                "MIN_NODES": "3",
            },
            "MIN_NODES=3 is out of range (valid: 1..2)",
        ),
    ],
)
def test_elastic_mistakes(args, env, message):
    """What cannot be elastic, or is not a valid elastic setting, is refused in one line naming it."""
    nodes = {"NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"} if "NNODES" in env else {}
    r = dry(NVIDIA, "--count-from", "smi", *args, **nodes, **env)
    assert r.rc == 2 and message in r.err and len(r.err.strip().splitlines()) == 1, r.err


def test_slurm_head_node_and_rendezvous(tmp_path):
    log = tmp_path / "calls"
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "gpu[017-018]",
        "FAKE_SMI_LOG": str(log),
    }
    r = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi", **env)
    assert r.rc == 0, r.err
    assert r.opt("--rdzv-endpoint") == "gpu017:29500" and r.opt("--rdzv-id") == "4242"
    assert r.opt("--rdzv-conf") == "is_host=false"
    assert "scontrol show hostnames gpu[017-018]" in log.read_text()


def test_slurm_head_node_without_scontrol():
    missing = lambda argv: (127, "", "not found")  # noqa: E731
    assert launch.first_slurm_host("gpu[003-005,9],login1", missing) == "gpu003"
    assert launch.first_slurm_host("login1,gpu2", missing) == "login1"
    # Slurm's own expansion puts the first of every bracket group first: rack[1-2]-n[3-4] -> rack1-n3, rack1-n4, …
    assert launch.first_slurm_host("rack[1-2]-n[3-4]", missing) == "rack1-n3"
    assert launch.first_slurm_host("a[1-2],b3", missing) == "a1"
    assert launch.first_slurm_host("b3,a[1-2]", missing) == "b3"
    assert launch.first_slurm_host("n[08-09]x,gpu[1,2]", missing) == "n08x"


def test_sbatch_example_starts_one_launcher_per_node(tmp_path):
    """slurm/train.sbatch under a fake srun that starts one task per node, as srun does."""
    env = base_env(SLURM_JOB_ID="99", SLURM_NNODES="3", SLURM_JOB_NODELIST="node[07-09]", SLURM_SUBMIT_DIR=str(ROOT))
    p = subprocess.run(
        ["bash", str(ROOT / "slurm" / "train.sbatch"), "--engine", "fsdp", "--dry-run", "--count-from", "smi"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    runs = [DryRun(0, chunk, "") for chunk in p.stdout.split("# anygpu dry run")[1:]]
    assert len(runs) == 3
    assert {r.opt("--rdzv-endpoint") for r in runs} == {"node07:" + runs[0].opt("--rdzv-endpoint").split(":")[1]}
    assert {r.opt("--rdzv-id") for r in runs} == {"99"}
    assert sorted(r.opt("--rdzv-conf") for r in runs) == ["is_host=false", "is_host=false", "is_host=true"]
    # each node's launcher passes its own GPU count: torchrun's LOCAL_WORLD_SIZE, the FSDP2 engine's default
    # HSDP shard group (shard within a node, replicate across the 3 nodes)
    assert [(r.opt("--nnodes"), r.nproc) for r in runs] == [("3", 8)] * 3


def _sbatch_directives(text: str) -> list[str]:
    """The `#SBATCH` options as sbatch reads them: from the top of the script up to its first command."""
    found = []
    for line in text.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            found.append(line.split(None, 1)[1].strip())
        elif line.strip() and not line.startswith("#"):
            break
    return found


def test_sbatch_asks_for_an_early_signal_that_the_job_survives_to_save(tmp_path):
    """Slurm signals the job steps before the time limit with a signal every rank handles (a checkpoint, exit
    143) and torchrun forwards; torchrun then waits for its workers longer than its 30 s default, but less
    than the lead, so the save ends before Slurm's SIGKILL."""
    from anygpu.reliability.preempt import SIGNALS

    signal_opts = [d for d in _sbatch_directives((ROOT / "slurm" / "train.sbatch").read_text()) if "--signal" in d]
    assert len(signal_opts) == 1, "slurm/train.sbatch: no #SBATCH --signal=USR1@<seconds> before its first command"
    name, lead = signal_opts[0].split("=", 1)[1].split("@")
    assert not name.startswith("B:"), "B: signals the batch shell alone, not the training processes"
    assert f"SIG{name}" in {s.name for s in SIGNALS} and f"SIG{name}" in launch.TORCHRUN_SIGNALS.split(",")
    # a fake launcher where the real one would be: what the sbatch hands every node's launcher
    (tmp_path / "run_nvidia_all.sh").write_text('echo "shutdown=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"\n')
    env = base_env(SLURM_JOB_ID="99", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[1-2]", ANYGPU_ROOT=str(tmp_path))
    p = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch")], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    shutdown = {int(line.split("=")[1]) for line in p.stdout.split()}
    assert len(shutdown) == 1 and 30 < shutdown.pop() < int(lead) - 30, (p.stdout, lead)


# ------------------------------------------------------------------------- real CPU runs

# Launches below that start several processes skip the torch cross-check (--count-from smi),
# which test_cpu_end_to_end and the dry-run tests above cover: one torch import less each.
FAST = ["--count-from", "smi"]


def _cpu_env(**extra: str) -> dict[str, str]:
    # No driver at all (and nothing visible, should the test machine have GPUs).
    return {"FAKE_NVIDIA": "absent", "FAKE_AMD": "absent", **HIDE_GPUS, "OMP_NUM_THREADS": "1", **extra}


def _losses(output_dir: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


_CPU_RUNS: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}


def cpu_run(engine: str, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One launcher run per engine on a machine with no GPU driver, shared by the tests below."""
    if engine not in _CPU_RUNS:
        out = tmp_path_factory.mktemp(f"cpu-{engine}")
        p = launch_real(
            NVIDIA, "--engine", engine, "--", *TINY, "--max_steps", "3", "--output_dir", str(out), **_cpu_env()
        )
        _CPU_RUNS[engine] = (p, out)
    return _CPU_RUNS[engine]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "hf"])
def test_cpu_end_to_end(engine, tmp_path_factory):
    p, out = cpu_run(engine, tmp_path_factory)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "no NVIDIA GPU (nvidia-smi not found: no driver installed): training on the CPU, 1 process" in p.stderr
    assert f"[anygpu] exec: {sys.executable} -m anygpu.engines.run_{engine} --config_name tiny" in p.stderr
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3]
    assert all(r["world_size"] == 1 for r in recs if "loss" in r)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "hf"])
def test_two_nodes_on_one_machine_match_one_node(engine, tmp_path, tmp_path_factory):
    """Two launchers (NNODES=2, NODE_RANK=0/1, one CPU process each) train one job together.

    Both engines: compared with the one-node, one-process run of test_cpu_end_to_end (the global
    batch makes losses independent of the world size, which the engines' own tests check on 1, 2
    and 3 ranks), which saves a third launcher job on a 2-core machine.
    """
    port = str(free_port())
    args = [*FAST, "--engine", engine, "--", *TINY, "--max_steps", "3"]
    nodes = [
        subprocess.Popen(
            ["bash", str(SCRIPT[NVIDIA]), *args, "--output_dir", str(tmp_path / "two")],
            env=base_env(
                **_cpu_env(
                    NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONFAULTHANDLER="1"
                )
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    one, ref_dir = cpu_run(engine, tmp_path_factory)
    ref_world = 1
    logs = outputs(nodes, timeout=240)
    assert [n.returncode for n in nodes] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    assert one.returncode == 0, one.stderr[-4000:]
    assert "node 1 of 2" in logs[1] and ("is_host=false" if engine == "fsdp" else "--machine_rank 1") in logs[1]
    if engine == "fsdp":  # the default mesh: one replica group per node (its one process), replicated across the two
        assert "mesh 2 × 1 (dp_replicate × dp_shard): HSDP" in logs[0], logs[0][-3000:]
    two, ref = _losses(tmp_path / "two"), _losses(ref_dir)
    worlds = [
        {json.loads(ln)["world_size"] for ln in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln}
        for d in (tmp_path / "two", ref_dir)
    ]
    assert worlds == [{2}, {ref_world}]
    assert sorted(two) == sorted(ref) == [1, 2, 3]
    assert all(abs(two[s] - ref[s]) <= 1e-5 * abs(ref[s]) for s in ref), (two, ref)


@pytest.mark.slow
def test_failing_rank_ends_the_job_fast():
    start = time.monotonic()
    p = launch_real(
        NVIDIA,
        *FAST,
        "--engine",
        "fsdp",
        "--nproc",
        "2",
        "--script",
        str(FAKES / "fault_train.py"),
        "--",
        "--fail-rank",
        "1",
        "--fail-step",
        "3",
        timeout=120,
        **_cpu_env(),
    )
    elapsed = time.monotonic() - start
    out = p.stdout + p.stderr
    assert p.returncode != 0, (p.returncode, elapsed)  # within run()'s 120 s: rank 0 would wait gloo's 30 minutes
    assert "RuntimeError: rank 1 fails at step 3 on purpose" in out
    assert "rank 0 step 2 sum 2" in out and "rank 0 step 4" not in out  # rank 0 was really waiting on it


@pytest.mark.slow
def test_max_restarts_restarts_the_workers():
    p = launch_real(
        NVIDIA,
        *FAST,
        "--engine",
        "fsdp",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "--script",
        str(FAKES / "fault_train.py"),
        "--",
        "--steps",
        "4",
        "--fail-attempts",
        "1",
        timeout=120,
        **_cpu_env(),
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "rank 1 fails at step 3 on purpose" in out  # attempt 0 failed …
    assert "rank 0 finished 4 steps in attempt 1" in out and "rank 1 finished 4 steps in attempt 1" in out


@pytest.mark.slow
def test_the_engines_help_and_refusals_come_once_through_the_launcher():
    """Under torchrun the engine's own checks run once, in one process, before any rank starts: --help exits 0
    with the module's usage, a bad argument is one line and exit 2 (test_cli covers a missing model)."""
    ok = launch_real(NVIDIA, *FAST, "--engine", "fsdp", "--nproc", "2", "--", "--help", **_cpu_env())
    assert ok.returncode == 0 and ok.stdout.startswith("usage: python -m anygpu.engines.run_fsdp [config.yaml]"), (
        ok.stderr
    )
    assert "exec:" not in ok.stderr
    bad = launch_real(NVIDIA, *FAST, "--nproc", "2", "--", "--max_stepz", "3", **_cpu_env())
    assert bad.returncode == 2 and "unknown option --max_stepz (did you mean --max_steps?)" in bad.stderr, bad.stderr
    assert "exec:" not in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, args, says",
    [
        ("fsdp", ["--config_name", "tinyy"], "--config_name 'tinyy' is neither a preset"),
        ("fsdp", ["--global_batch_size", "10", "--per_device_train_batch_size", "3"], "--global_batch_size 10"),
        ("hf", ["--report_to", "wandbx"], "--report_to 'wandbx' is unknown"),
        ("hf", ["--config_name", "tiny", "--block_size", "100000"], "--block_size 100000"),
    ],
)
def test_refusals_that_need_the_model_or_the_world_size_come_before_the_ranks(engine, args, says):
    """The launcher's check also reads the model's config, the world size it launches and the trackers: these were
    refused by every rank after torch's import (torchrun's ChildFailedError report, exit 1), not in one line, exit 2."""
    p = launch_real(NVIDIA, *FAST, "--engine", engine, "--nproc", "2", "--", *args, "--max_steps", "1", **_cpu_env())
    assert p.returncode == 2 and says in p.stderr, p.stderr[-3000:]
    assert "exec:" not in p.stderr and "Traceback" not in p.stderr


# ------------------------------------------------------------------------------ the scripts


def test_help_and_the_two_scripts_differ_only_in_vendor():
    for vendor in (NVIDIA, AMD):
        p = subprocess.run(
            ["bash", str(SCRIPT[vendor]), "--help"], env=base_env(), capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0 and f"usage: bash run_{vendor}_all.sh" in p.stdout
        assert all(opt in p.stdout for opt in ("--engine", "--nproc", "--gpus", "--max-restarts", "--dry-run"))
    nv, amd = (
        SCRIPT[v].read_text().replace("run_nvidia_all.sh", "run_X_all.sh").replace("run_amd_all.sh", "run_X_all.sh")
        for v in (NVIDIA, AMD)
    )
    diff = [(a, b) for a, b in zip(nv.splitlines(), amd.splitlines()) if a != b]
    assert len(nv.splitlines()) == len(amd.splitlines()) and all(
        ("NVIDIA" in a and "AMD" in b) or (a, b) == ("VENDOR=nvidia", "VENDOR=amd") for a, b in diff
    ), diff


@pytest.mark.parametrize("vendor", [NVIDIA, AMD])
def test_help_and_the_script_header_name_every_option(vendor):
    """Every launcher option, and --interactive (which the script itself handles), is in --help's option list and in
    the script's own header, so neither leaves out one a user can pass."""
    parser = launch.build_parser(vendor)
    options = {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings} | {"--interactive"}
    header = "".join(ln for ln in SCRIPT[vendor].read_text().splitlines(keepends=True) if ln.startswith("#"))
    listed = parser.format_help().split("options:", 1)[1]
    assert not {o for o in options if o not in listed}, "missing from --help"
    assert not {o for o in options if o not in header}, "missing from the header"


def test_shellcheck_every_shell_file():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    files = sorted({*ROOT.glob("*.sh"), *ROOT.glob("scripts/*.sh"), *(ROOT / "slurm").glob("*")})
    assert SCRIPT[NVIDIA] in files and SCRIPT[AMD] in files and any(f.parent.name == "slurm" for f in files)
    p = subprocess.run([str(shellcheck), "--shell=bash", *map(str, files)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
