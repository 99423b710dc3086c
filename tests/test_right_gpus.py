"""The right machine, the right GPUs (issue #23, items 12-19): one process pinned to one GPU, --cpu hiding AMD
GPUs at the runtime level, MIG instances chosen by their MIG- ids, a LOCAL_RANK beyond the visible GPUs refused
in one line, the connectivity check exercising the training transport, setup.sh's ROCm index table, the
vendor presets, and CPU tests blanking every vendor's visibility variables. CPU-only wherever the mechanism
allows (fake smi tools, --dry-run, real gloo ranks); the transport on GPUs is a `gpu` test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import BIN, HIDE_GPUS, ROOT, env
from packaging.requirements import Requirement
from packaging.version import Version
from test_launch import AMD8, FAKES, _ids, dry

from anygpu.errors import UsageError
from anygpu.launch import detect as gpu_detect
from anygpu.launch import vendor_env
from anygpu.launch.detect import AMD, NVIDIA, Gpu
from anygpu.runtime import distributed, hardware

sys.path.insert(0, str(FAKES))
import fake_smi  # noqa: E402

NV8 = [Gpu(i, "NVIDIA H100 80GB HBM3", fake_smi.nvidia_uuid(i)) for i in range(8)]
ONLY = {NVIDIA: {"FAKE_NVIDIA": "ok", "FAKE_AMD": "absent"}, AMD: {"FAKE_NVIDIA": "absent", "FAKE_AMD": "ok"}}


# ------------------------------------------------------------------ 12. --nproc 1 pins one GPU
@pytest.mark.parametrize("engine", ["hf", "fsdp"])
@pytest.mark.parametrize(
    "vendor, caller, first",
    [
        (NVIDIA, {}, 0),
        (NVIDIA, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 4),
        (AMD, {}, 0),
        (AMD, {"ROCR_VISIBLE_DEVICES": "1,3,5", "CUDA_VISIBLE_DEVICES": "2,0"}, 5),
        (AMD, {"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "2,3"}, 2),  # HIP reads an empty value as unset
    ],
)
def test_one_process_on_a_multi_gpu_node_sees_exactly_one_gpu(engine, vendor, caller, first):
    """`--nproc 1` where several GPUs are usable: the one process (plain python) sees only the first usable GPU,
    so the HF engine cannot take them all through DataParallel and bench/verify measure one GPU."""
    r = dry(vendor, "--engine", engine, "--count-from", "smi", "--nproc", "1", **ONLY[vendor], **caller)
    assert r.rc == 0, r.err
    assert r.nproc == 1 and r.cmd[1:3] == ["-m", f"anygpu.engines.run_{engine}"]
    job_env = {**caller, **r.exports}
    assert _ids(gpu_detect.visible_gpus(vendor, NV8 if vendor == NVIDIA else AMD8, job_env).gpus) == [first]


def test_one_gpu_named_by_gpus_stays_pinned_to_it():
    r = dry(NVIDIA, "--engine", "hf", "--count-from", "smi", "--gpus", "5", "--nproc", "1")
    assert r.rc == 0 and r.exports["CUDA_VISIBLE_DEVICES"] == "5", r.err


class Started(Exception):
    """The training command a tool was about to start: its argv and environment."""


def fake_gpu_node(monkeypatch, vendor: str) -> None:
    """This process sees a node of 8 fake GPUs of `vendor`, all visible, and torch (a GPU build) counts them."""
    from anygpu.launch import launcher

    monkeypatch.setenv("PATH", f"{FAKES}:{env()['PATH']}")
    for key, value in ONLY[vendor].items():
        monkeypatch.setenv(key, value)
    for key in HIDE_GPUS:
        monkeypatch.delenv(key, raising=False)
    build = {"cuda": "12.8", "hip": None} if vendor == NVIDIA else {"cuda": None, "hip": "6.4"}
    counted = launcher.make_plan
    monkeypatch.setattr(
        launcher,
        "make_plan",
        lambda argv, environ, **kw: counted(argv, environ, probe_torch=lambda e: {"torch": "2.9", "count": 8, **build}),
    )


def trainings_not_started(monkeypatch) -> None:
    """No training process is started: its command and environment are raised as Started."""
    real = subprocess.run

    def run(cmd, *a, **kw):
        if any("anygpu.engines.run_" in str(c) for c in cmd):
            raise Started(cmd, kw.get("env"))
        return real(cmd, *a, **kw)  # the smi tools

    monkeypatch.setattr(subprocess, "run", run)


@pytest.mark.parametrize("engine", ["hf", "fsdp"])
@pytest.mark.parametrize("vendor", [NVIDIA, AMD])
def test_bench_and_verify_at_world_size_1_see_one_gpu(monkeypatch, tmp_path, vendor, engine):
    """`anygpu bench` and `anygpu verify` start their world-size-1 runs as the launcher would: on a node of 8 GPUs
    the one process sees exactly one, so the HF engine measures one GPU, not DataParallel over all 8."""
    from anygpu.launch import launcher
    from anygpu.tools import bench, verify

    fake_gpu_node(monkeypatch, vendor)
    trainings_not_started(monkeypatch)
    found = NV8 if vendor == NVIDIA else AMD8
    args = bench.build_parser().parse_args(["--engine", engine, "--output_dir", str(tmp_path / "bench")])
    assert bench.vendor_here() == vendor
    with pytest.raises(Started) as bench_run:
        bench.run_one(args, 1, 8)
    run = verify.Run("run1", engine, 1, str(tmp_path / "verify" / "run1"))
    (tmp_path / "verify").mkdir()
    with pytest.raises(Started) as verify_run:
        # verify's own torch probe, which the fake node's count replaces (this machine's torch is a CPU build)
        verify.launch(run, ["--config_name", "tiny"], 2, False, vendor, launcher.once(launcher.torch_probe))
    for started in (bench_run.value, verify_run.value):
        cmd, job_env = started.args
        assert f"anygpu.engines.run_{engine}" in cmd and "torchrun" not in " ".join(cmd), cmd
        assert _ids(gpu_detect.visible_gpus(vendor, found, job_env).gpus) == [0], {
            k: v for k, v in job_env.items() if k.endswith("VISIBLE_DEVICES")
        }


# ------------------------------------------------------------------ 13. --cpu on AMD
def test_cpu_on_amd_hides_the_gpus_at_the_runtime_level():
    """HIP reads an empty HIP_VISIBLE_DEVICES as unset: only ROCR_VISIBLE_DEVICES='' hides the GPUs (also
    from Slurm's ROCR_VISIBLE_DEVICES)."""
    caller = {"ROCR_VISIBLE_DEVICES": "0,1"}
    r = dry(AMD, "--engine", "fsdp", "--count-from", "smi", "--cpu", **ONLY[AMD], **caller)
    assert r.rc == 0, r.err
    assert r.exports["ROCR_VISIBLE_DEVICES"] == ""
    assert gpu_detect.visible_gpus(AMD, AMD8, {**caller, **r.exports}).gpus == []


def test_doctor_hides_every_vendors_gpus_for_its_cpu_check(monkeypatch):
    from anygpu.tools import doctor

    seen = {}

    def fake_run(cmd, env, **kw):  # the doctor's subprocess, not torch.distributed
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped by the test")

    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(doctor.subprocess, "run", fake_run)
    doctor.check_collective(2, use_gpus=False)
    assert {k: seen.get(k) for k in HIDE_GPUS} == HIDE_GPUS


# ------------------------------------------------------------------ 14. MIG instances
def test_gpus_on_mig_instances_passes_their_mig_ids():
    """GPUs in MIG mode are used through their instances: --gpus indexes the instances and pins their MIG- ids
    (an index would name the whole parent GPU)."""
    r = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi", "--gpus", "1", FAKE_GPUS="2", FAKE_MIG="2")
    assert r.rc == 0, r.err
    assert r.exports["CUDA_VISIBLE_DEVICES"] == fake_smi.mig_uuid(0, 1)
    mine = f"{fake_smi.mig_uuid(1, 0)},{fake_smi.mig_uuid(1, 1)}"
    r = dry(NVIDIA, "--engine", "fsdp", "--count-from", "smi", "--gpus", "1", FAKE_MIG="2", CUDA_VISIBLE_DEVICES=mine)
    assert r.rc == 0, r.err
    assert r.exports["CUDA_VISIBLE_DEVICES"] == fake_smi.mig_uuid(1, 1)


# ------------------------------------------------------------------ 15. LOCAL_RANK beyond the visible GPUs
@pytest.fixture
def two_visible_gpus(monkeypatch):
    """A GPU build of torch that sees 2 GPUs, as far as the rank check asks (it needs only the count)."""
    monkeypatch.setattr(hardware, "vendor", lambda: "nvidia")
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")


MESSAGE = "LOCAL_RANK 3: this process sees only 2 GPU(s) (CUDA_VISIBLE_DEVICES='0,1') but 4 processes run on this node"


def test_native_engine_refuses_a_local_rank_beyond_the_visible_gpus(two_visible_gpus):
    with pytest.raises(UsageError, match=re.escape(MESSAGE)) as e:
        distributed.init_distributed()
    assert "\n" not in str(e.value) and "--nproc 2" in str(e.value)


def test_hf_engine_refuses_a_local_rank_beyond_the_visible_gpus(two_visible_gpus):
    from anygpu.engines.hf.run import HFRun

    run = object.__new__(HFRun)  # only what _join reads before TrainingArguments picks cuda:LOCAL_RANK
    with pytest.raises(UsageError, match=re.escape(MESSAGE)):
        run._join()


# ------------------------------------------------------------------ 16. the training transport
TRANSPORT = r"""
import os, torch, torch.distributed as dist
from anygpu.reliability import run_guard
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
device = torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
try:
    run_guard.check_connectivity(timeout_s=3, device=device)
    print("CHECK: passed", flush=True)
except RuntimeError as e:
    print("CHECK:", str(e).splitlines()[0], flush=True)
    os._exit(3)  # not waiting for gloo's pending all-reduce; torchrun then ends the other rank at once
"""


def transport_check(tmp_path, nproc: int = 2, **extra: str) -> tuple[str, float]:
    script = tmp_path / "transport.py"
    script.write_text(TRANSPORT)
    start = time.time()
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(script)],
        cwd=ROOT,
        env={**env(), "PYTHONPATH": str(ROOT), **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK:")]
    return "\n".join(lines) or proc.stdout + proc.stderr[-2000:], time.time() - start


@pytest.mark.slow  # waits out a connect timeout
def test_the_transport_check_names_the_rank_that_never_joins(tmp_path):
    """Rank 1 passes the barrier but its all-reduce never comes (as over a wrong interface): rank 0 names it
    within the check's timeout instead of waiting for the collective's own."""
    out, _ = transport_check(tmp_path, ANYGPU_TEST_STALL_TRANSPORT="1:30")
    # rank 0 names rank 1 while it is still stalled: had it waited, the all-reduce would have completed after 30 s
    assert "transport check failed (backend gloo on cpu, 2 ranks): rank(s) 1 did not join the all-reduce" in out, out


@pytest.mark.gpu
@pytest.mark.skipif(
    not (hardware.torch.cuda.is_available() and hardware.torch.cuda.device_count() >= 2), reason="needs 2 GPUs"
)
def test_the_transport_check_passes_over_nccl(tmp_path):
    out, _ = transport_check(tmp_path)
    assert out.splitlines() == ["CHECK: passed", "CHECK: passed"], out


# ------------------------------------------------------------------ 17. setup.sh's ROCm index
def test_setup_installs_a_rocm_torch_that_requirements_accept():
    torch_req = next(
        Requirement(ln)
        for ln in (ROOT / "requirements.txt").read_text().splitlines()
        if re.match(r"torch\b", ln) and not ln.startswith("#")
    )
    rows = [
        ln.split("\t")
        for ln in (ROOT / "scripts" / "rocm_torch_index.tsv").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert rows and all(len(r) == 3 and r[2].strip() for r in rows), rows  # series, index, why
    for series, index, _ in rows:
        assert torch_req.specifier.contains(Version(f"{series}.0")), (series, str(torch_req.specifier))
        assert re.fullmatch(r"https://download\.pytorch\.org/whl/rocm\d+\.\d+(\.\d+)?", index), index
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "rocm_torch_index.tsv" in setup and not re.search(r"whl/rocm\d", setup)  # one table, no second copy


def test_setup_pins_the_installed_torch_as_pip_knows_it(tmp_path):
    """PyPI's CUDA wheel (what setup.sh installs on an NVIDIA machine, and the GPU lease's device has) is distribution
    2.11.0 whose torch.__version__ says 2.11.0+cu130: the pin must be the distribution's, or pip refuses to resolve."""
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('__version__ = "2.11.0+cu130"\n')
    (fake / "torch-2.11.0.dist-info").mkdir()
    (fake / "torch-2.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    snippet = re.search(r'echo "torch==\$\("\$PY" -c \'([^\']+)\'\)" >"\$constraints"', setup)[1]
    pin = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(fake)}
    )
    assert pin.stdout.strip() == "2.11.0", pin.stderr
    assert Requirement(f"torch=={pin.stdout.strip()}").specifier.contains(Version("2.11.0"))


def test_setup_leaves_out_the_pins_the_installed_torch_excludes(tmp_path):
    """The constraints were frozen beside one torch; a machine's own torch (PyPI's 2.11 requires setuptools<82, the
    freeze has 84) must not make pip refuse the install: that pin is left to torch, every other pin stays."""
    fake = tmp_path / "site"
    (fake / "torch-2.11.0.dist-info").mkdir(parents=True)
    (fake / "torch-2.11.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\nRequires-Dist: setuptools<82\n"
        "Requires-Dist: sympy>=1.13.3\nRequires-Dist: nvidia-nccl-cu13==2.28.9; platform_system == 'Linux'\n"
    )
    pins = tmp_path / "constraints.txt"
    pins.write_text("# frozen\nsetuptools==84.0.0\nsympy==1.14.0\ntransformers==5.23.0\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "constraints_for_torch.py"), str(pins)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(fake)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["# frozen", "sympy==1.14.0", "transformers==5.23.0"]
    assert "setuptools==84.0.0 left to torch's own requirement setuptools<82" in out.stderr


# ------------------------------------------------------------------ 18. vendor presets
@pytest.mark.parametrize(
    "vendor, kwargs", [(NVIDIA, {}), (AMD, {"rocm_version": (7, 0), "gpu_names": ["AMD Instinct MI300X"] * 8})]
)
def test_presets_use_the_vendor_neutral_allocator_variable_and_torchs_error_handling(vendor, kwargs):
    names = [p.name for p in vendor_env.presets(vendor, use_gpus=True, nproc_per_node=8, **kwargs)]
    assert "PYTORCH_ALLOC_CONF" in names
    assert not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} & set(names)
    assert all(p.why for p in vendor_env.presets(vendor, use_gpus=True, nproc_per_node=8, **kwargs))


# ------------------------------------------------------------------ 19. CPU tests stay on the CPU
def test_cpu_tests_blank_every_vendors_visibility_variables(monkeypatch):
    for name in HIDE_GPUS:
        monkeypatch.setenv(name, "0,1")
    assert {k: env().get(k) for k in HIDE_GPUS} == HIDE_GPUS
