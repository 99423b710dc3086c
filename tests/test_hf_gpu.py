"""The HF engine where it needs a GPU: accelerate's FSDP2 really in effect, DeepSpeed on CUDA/ROCm,
single-process DataParallel, bf16. Skipped without a GPU (CI runs on CPU)."""

from __future__ import annotations

import pytest
from conftest import TINY, assert_close, losses, python, records, torchrun
from test_hf_engine import accelerate

torch = pytest.importorskip("torch")
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NUM_GPUS == 0, reason="needs a CUDA or ROCm GPU")]

# fp32 without TF32, so the engines can be compared to float tolerance
EXACT = [*TINY, "--max_steps", "10", "--max_eval_samples", "24", "--tf32", "false"]


@pytest.fixture(scope="module")
def fsdp_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("native")
    torchrun(1, "run_fsdp_standalone.py", [*EXACT, "--output_dir", str(out), "--export_final", "false"])
    return losses(out)


@pytest.mark.parametrize(
    "config, banner",
    [
        ("fsdp", "strategy: FSDP2 (accelerate) over"),
        ("ddp", "strategy: DDP over"),
        ("deepspeed_zero3", "strategy: DeepSpeed ZeRO-3 over"),
    ],
)
def test_strategy_in_effect_and_same_losses(config, banner, fsdp_engine, tmp_path):
    n = NUM_GPUS
    proc = accelerate(config, n, [*EXACT, "--output_dir", str(tmp_path)])
    assert banner in proc.stdout or (n == 1 and "strategy: one process" in proc.stdout and config == "ddp")
    assert "FALLBACK" not in proc.stdout
    assert_close(fsdp_engine, losses(tmp_path), rel=1e-4 if config != "deepspeed_zero3" else 5e-4)
    rec = [r for r in records(tmp_path) if "loss" in r][-1]
    assert rec["max_memory_allocated_gb"] > 0 and rec.get("mfu", 0) >= 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final") is not None


def test_fsdp_resume(tmp_path, fsdp_engine):
    args = [*EXACT, "--output_dir", str(tmp_path), "--export_final", "false"]
    accelerate("fsdp", NUM_GPUS, [*args, "--stop_at_step", "5"])
    accelerate("fsdp", NUM_GPUS, [*args, "--resume_from_checkpoint", "latest"])
    assert_close(fsdp_engine, losses(tmp_path), rel=1e-4, steps=range(6, 11))


@pytest.mark.skipif(NUM_GPUS < 2, reason="DataParallel needs at least two GPUs")
def test_plain_python_drives_every_gpu_with_dataparallel(fsdp_engine, tmp_path):
    proc = python("run_hf_standalone.py", [*EXACT, "--output_dir", str(tmp_path), "--export_final", "false"])
    assert "strategy: DataParallel over one process driving every visible GPU" in proc.stdout
    assert f"× {NUM_GPUS} devices" in proc.stdout
    assert_close(fsdp_engine, losses(tmp_path), rel=1e-4)


@pytest.mark.parametrize("config", ["ddp", "fsdp", "deepspeed_zero3"])
def test_bf16_trains_close_to_fp32(config, fsdp_engine, tmp_path):
    accelerate(config, NUM_GPUS, [*EXACT, "--bf16", "true", "--output_dir", str(tmp_path), "--export_final", "false"])
    got = losses(tmp_path)
    for s in got:
        assert abs(got[s] - fsdp_engine[s]) / fsdp_engine[s] < 2e-2


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs at least two GPUs: rank 0 builds, the others receive")
def test_fsdp_ranks_but_rank_0_build_no_host_copy_of_the_model(tmp_path):
    """accelerate's FSDP2 (fsdp_cpu_ram_efficient_loading): rank 0 builds the seeded 85M-parameter model on the host
    and broadcasts it shard by shard; every other rank builds it on the meta device, so its host memory never
    holds the model (the losses of that path equal the native engine's: test_strategy_in_effect_and_same_losses)."""
    import sys

    from conftest import ROOT, WARM, env

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_scaling

    args = memory_scaling.train_args(tmp_path, "hf-fsdp", NUM_GPUS, 2)
    peaks = memory_scaling.launch(
        NUM_GPUS, [("hf", "hf", args)], [*WARM[:2], "accelerate", "launch"], env(), config="fsdp"
    )["hf"]
    size = memory_scaling.model_bytes()
    assert peaks[0] > size, peaks  # rank 0 held the whole fp32 model on the host
    assert max(peaks[1:]) < peaks[0] - 0.75 * size, peaks
