"""The native FSDP2 engine's GPU paths at world size 1: bf16 through FSDP2's mixed precision, activation checkpointing,
CPU offload, torch.compile, the lean loss, background checkpoints staged in pinned host memory, and flash attention over packed
samples (where flash-attn is installed). Skipped without a GPU (CI runs on CPU).

Each run is a fresh `python run_fsdp_standalone.py` (no fork of a process that imported torch), offline, on the
embedded corpus, with deterministic algorithms (anygpu verify's switch), so fp32 runs with TF32 off can be compared
to float tolerance and bf16 runs to bf16's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, assert_close, env, losses, prompt_completion_file, records

torch = pytest.importorskip("torch")
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NUM_GPUS == 0, reason="needs a CUDA or ROCm GPU")]

# fp32 without TF32 on one GPU, 8 steps of the tiny preset: the reference the other runs are compared with
EXACT = [*TINY, "--max_steps", "8", "--tf32", "false", "--export_final", "false", "--save_steps", "0"]
# the default preset at a size where activations and logits dominate a step's memory (the memory tests)
LARGER = [
    *TINY,
    "--config_name",
    "default",
    "--block_size",
    "256",
    "--global_batch_size",
    "16",
    "--per_device_train_batch_size",
    "16",
    "--max_steps",
    "3",
    "--tf32",
    "false",
    "--export_final",
    "false",
    "--save_steps",
    "0",
]
DETERMINISTIC = {"ANYGPU_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUDA_VISIBLE_DEVICES": "0"}
BF16_REL = 2e-2  # bf16 keeps 8 significant bits: a few steps' losses stay within 2% of fp32's


def native(args: list[str], out: Path, extra_env: dict[str, str] | None = None) -> str:
    """One native-engine run on GPU 0; its stdout and stderr together (in order), or an AssertionError with them."""
    proc = subprocess.run(
        [sys.executable, "run_fsdp_standalone.py", *args, "--output_dir", str(out)],
        cwd=ROOT,
        env={**env(), **DETERMINISTIC, "PYTHONUNBUFFERED": "1", **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}"
    return proc.stdout


def peak_gb(out: Path) -> float:
    return max(r.get("max_memory_allocated_gb") or 0 for r in records(out) if "loss" in r)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("fp32")
    log = native(EXACT, out)
    assert "precision: fp32" in log and "TF32" not in log.split("precision:")[1].splitlines()[0]
    return losses(out)


@pytest.fixture(scope="module")
def larger(tmp_path_factory) -> dict[str, Path]:
    """The default preset three ways: as is (the lean loss), activation checkpointing, the model's own loss."""
    root = tmp_path_factory.mktemp("larger")
    runs = {"plain": [], "checkpointing": ["--gradient_checkpointing", "true"], "own_loss": ["--lean_loss", "false"]}
    for name, extra in runs.items():
        # the lean loss's default chunk is 128 MiB of fp32 logits, 4,096 tokens at this vocabulary: a whole
        # micro-batch; 256-token chunks are what it does at a 128k vocabulary
        native([*LARGER, *extra], root / name, {"ANYGPU_LEAN_LOSS_CHUNK_TOKENS": "256"})
    return {name: root / name for name in runs}


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    """EXACT in bf16 (FSDP2's mixed precision): its output folder, with the log beside it."""
    out = tmp_path_factory.mktemp("bf16")
    (out / "stdout.log").write_text(native([*EXACT, "--bf16", "true"], out))
    return out


def test_bf16_through_fsdp2_trains_close_to_fp32(reference, bf16):
    """bf16 keeps FSDP2 at world size 1 (its mixed-precision policy: bf16 compute, fp32 master weights)."""
    log = (bf16 / "stdout.log").read_text()
    assert "FSDP2, parameters, gradients and optimizer state sharded over all 1 ranks" in log
    assert "precision: bf16 mixed" in log
    assert_close(reference, losses(bf16), rel=BF16_REL)
    last = [r for r in records(bf16) if "loss" in r][-1]
    assert last["max_memory_allocated_gb"] > 0


def test_activation_checkpointing_same_losses_less_memory(larger):
    assert_close(losses(larger["plain"]), losses(larger["checkpointing"]), rel=1e-5)
    assert peak_gb(larger["checkpointing"]) < peak_gb(larger["plain"])


def test_lean_loss_same_losses_less_memory(larger):
    """The lean loss never holds the (tokens × vocabulary) logits whole: the model's own loss, less memory."""
    assert_close(losses(larger["own_loss"]), losses(larger["plain"]), rel=1e-5)
    assert peak_gb(larger["plain"]) < peak_gb(larger["own_loss"])


def test_cpu_offload_same_losses_less_gpu_memory(larger, tmp_path):
    """--cpu_offload on a GPU: each unit's fp32 shard copied from pinned host memory for its all-gather and the
    gradient back, AdamW stepped on the CPU: the plain run's losses (to the CPU's and the GPU's AdamW rounding) and
    a GPU peak lower by about the parameters, gradients and AdamW state it no longer holds (16 bytes per parameter,
    ~0.25 GB for the default preset), with a checkpoint that resumes exactly."""
    out = tmp_path / "run"
    log = native([*LARGER, "--cpu_offload", "true", "--save_steps", "2"], out, {"ANYGPU_LEAN_LOSS_CHUNK_TOKENS": "256"})
    assert "(--cpu_offload: the same curve)" in log
    assert_close(losses(larger["plain"]), losses(out), rel=1e-4)
    params = 15.7e6
    assert peak_gb(out) < peak_gb(larger["plain"]) - 0.5 * 16 * params / 2**30, (peak_gb(out), peak_gb(larger["plain"]))
    resumed = tmp_path / "resumed"
    native(
        [*LARGER, "--cpu_offload", "true", "--resume_from_checkpoint", str(out / "checkpoint-2")],
        resumed,
        {"ANYGPU_LEAN_LOSS_CHUNK_TOKENS": "256"},
    )
    assert_close(losses(out), losses(resumed), rel=1e-6, steps=[3])


def test_low_bit_state_near_adamw_less_gpu_memory_and_offloadable(larger, tmp_path):
    """--optim adamw_torch_8bit on a GPU: the moments in 8 bits (uint8 codes, fp32 scales) near fp32 AdamW's losses, a
    peak lower by part of the 6 bytes per parameter it no longer holds (~0.09 GB for the default preset), a
    checkpoint that resumes exactly, and the same 8-bit run with its state offloaded (the step on the CPU)."""
    env = {"ANYGPU_LEAN_LOSS_CHUNK_TOKENS": "256"}
    out = tmp_path / "run"
    log = native([*LARGER, "--optim", "adamw_torch_8bit", "--save_steps", "2"], out, env)
    assert "optimizer: AdamW with 8-bit moments" in log
    assert_close(losses(larger["plain"]), losses(out), rel=1e-2)
    assert peak_gb(out) < peak_gb(larger["plain"]) - 0.5 * 6 * 15.7e6 / 2**30, (peak_gb(out), peak_gb(larger["plain"]))
    resumed = tmp_path / "resumed"
    native(
        [*LARGER, "--optim", "adamw_torch_8bit", "--resume_from_checkpoint", str(out / "checkpoint-2")], resumed, env
    )
    assert_close(losses(out), losses(resumed), rel=1e-6, steps=[3])
    offloaded = tmp_path / "offloaded"
    native([*LARGER, "--optim", "adamw_torch_8bit", "--cpu_offload", "true"], offloaded, env)
    assert_close(losses(out), losses(offloaded), rel=1e-4)


def test_torch_compile_matches_eager_without_recompiling(reference, tmp_path):
    """Each decoder layer compiled by inductor: eager's losses to fp32 fusion order, no recompile after step 2."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_matrix_summary

    log = native([*EXACT, "--torch_compile", "true"], tmp_path, {"TORCH_LOGS": "recompiles"})
    assert_close(reference, losses(tmp_path), rel=1e-4)
    assert gpu_matrix_summary.recompiles_after(log) == 0, log[-6000:]


def test_background_checkpoint_resumes_exactly(reference, tmp_path):
    """A checkpoint written in the background (the state staged in pinned host memory while training goes on)
    changes nothing in the run, and a run resumed from it continues with the uninterrupted run's losses."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    log = native([*EXACT, "--save_steps", "4", "--async_save", "true"], first)
    assert "periodic checkpoints: asynchronous" in log, log[-3000:]
    assert (first / "checkpoint-4").is_dir()
    assert_close(reference, losses(first), rel=1e-6)
    native([*EXACT, "--resume_from_checkpoint", str(first / "checkpoint-4")], resumed)
    assert sorted(losses(resumed)) == [5, 6, 7, 8]
    assert_close(losses(first), losses(resumed), rel=1e-6, steps=range(5, 9))


def test_flash_attention_over_packed_samples_matches_sdpa(tmp_path):
    """Prompt-completion data packed several samples to a row: flash attention confined to each sample through its
    position ids (its varlen path) gives the losses of sdpa confined through transformers' mask, to bf16 tolerance."""
    pytest.importorskip("flash_attn")
    packed_losses_match_sdpa(tmp_path, "flash_attention_2")


def test_varlen_attention_over_packed_samples_matches_sdpa(tmp_path):
    """Packed prompt-completion rows under torch's own varlen kernel (no flash-attn package): the losses of sdpa
    confined through transformers' dense mask, to bf16 tolerance."""
    packed_losses_match_sdpa(tmp_path, "varlen_attention")


def packed_losses_match_sdpa(tmp_path: Path, kernel: str) -> None:
    data = prompt_completion_file(tmp_path / "pc.jsonl")
    corpus = EXACT.index("--max_corpus_mb")  # the embedded corpus's option: this job has its own data
    job = [*EXACT[:corpus], *EXACT[corpus + 2 :], "--train_file", str(data), "--bf16", "true", "--packing", "true"]
    native([*job, "--attn_implementation", kernel], tmp_path / kernel)
    native([*job, "--attn_implementation", "sdpa"], tmp_path / "sdpa")
    assert_close(losses(tmp_path / "sdpa"), losses(tmp_path / kernel), rel=BF16_REL)


def test_packed_rows_take_varlen_when_no_kernel_is_named(tmp_path):
    """--attn_implementation left out, packed prompt-completion rows in bf16 on an NVIDIA GPU: the banner's model
    line says varlen_attention runs; raw-text blocks (nothing packed) keep sdpa."""
    data = prompt_completion_file(tmp_path / "pc.jsonl", count=200)
    corpus = EXACT.index("--max_corpus_mb")
    job = [*EXACT[:corpus], *EXACT[corpus + 2 :], "--bf16", "true", "--max_steps", "2"]
    packed = native([*job, "--train_file", str(data)], tmp_path / "packed")
    assert "attention varlen_attention" in packed, packed[-3000:]
    plain = native([*EXACT, "--bf16", "true", "--max_steps", "2"], tmp_path / "plain")
    assert "attention sdpa" in plain, plain[-3000:]


def test_hub_moe_checkpoint_fine_tunes_in_bf16_and_exports_its_own_layout(tmp_path):
    """A Mixtral folder as save_pretrained writes it (experts one tensor each, bf16 over several files) on GPU 0
    with --bf16: the loader copies each tensor to the device's shards, and final/ comes back in bf16 with the
    source's keys, loadable with no missing or unexpected key."""
    from hub_sources import build, tensors
    from transformers import AutoModelForCausalLM

    source = build(tmp_path / "hub", ["mixtral"])["mixtral"]
    i = TINY.index("--config_name")
    args = [*TINY[:i], *TINY[i + 2 :], "--max_steps", "2", "--tf32", "false", "--save_steps", "0", "--bf16", "true"]
    native([*args, "--model_name_or_path", str(source)], tmp_path / "run")
    final = tensors(tmp_path / "run" / "final")
    assert sorted(final) == sorted(tensors(source))
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_resumes_and_exports_without_fp8_leftovers(bf16, recipe, tmp_path):
    """--fp8 on a GPU with FP8 matmuls, bf16 through FSDP2 (tensorwise: the weights all-gathered in FP8, their scales
    precomputed after each step; rowwise: gathered in bf16): close to bf16, a checkpoint that resumes exactly, final/
    in the training dtype with the names of the model without FP8. Eager: compiled FP8 is the lease's rows, and
    three compiled runs took more than a lease's whole test call (2026-11-26)."""
    from safetensors import safe_open

    from anygpu.model import fp8

    if not fp8.gpu_has_fp8()[0]:
        pytest.skip("this GPU has no FP8 matmuls (--fp8 is refused here)")
    out = tmp_path / "run"
    log = native([*EXACT, "--bf16", "true", "--fp8", recipe, "--save_steps", "4", "--export_final", "true"], out)
    assert f"FP8 {recipe} (torchao float8)" in log and "FP8 matmuls" in log, log[-3000:]
    assert ("weights all-gathered in FP8" in log) == (recipe == "tensorwise")
    assert_close(losses(bf16), losses(out), rel=BF16_REL)
    resumed = tmp_path / "resumed"
    native([*EXACT, "--bf16", "true", "--fp8", recipe, "--resume_from_checkpoint", str(out / "checkpoint-4")], resumed)
    assert_close(losses(out), losses(resumed), rel=1e-5, steps=range(5, 9))
    exported = list((out / "final").glob("*.safetensors"))
    assert exported, list((out / "final").iterdir())
    for f in exported:
        with safe_open(str(f), "pt") as st:
            assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}, f


def test_selective_checkpointing_sits_between_none_and_full(larger, tmp_path):
    """Selective checkpointing keeps the matmul outputs: the same losses, a peak between none's and full's."""
    native(
        [*LARGER, "--gradient_checkpointing_policy", "selective"], tmp_path, {"ANYGPU_LEAN_LOSS_CHUNK_TOKENS": "256"}
    )
    assert_close(losses(larger["plain"]), losses(tmp_path), rel=1e-5)
    assert peak_gb(larger["checkpointing"]) < peak_gb(tmp_path) < peak_gb(larger["plain"])


def test_a_step_that_does_not_log_has_no_host_sync_on_the_gpu(tmp_path):
    """CUDA's own count (set_sync_debug_mode) over the engine's steps: raw text in bf16, compiled, and packed
    prompt-completion rows under sdpa."""
    data = tmp_path / "pc.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    data.write_text(
        "".join(
            json.dumps({"prompt": " ".join(words[: 1 + i % 11]) + " =>", "completion": f" {words[i % 12]} {i % 7}"})
            + "\n"
            for i in range(300)
        )
    )
    common = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--save_strategy", "no", "--bf16", "true"]
    corpus = TINY.index("--max_corpus_mb")  # the embedded corpus's option: the second job has its own data
    runs = [
        [*TINY, *common, "--torch_compile", "true"],
        [*TINY[:corpus], *TINY[corpus + 2 :], *common, "--train_file", str(data), "--vocab_size", "400"],
    ]
    argv = []
    for i, args in enumerate(runs):
        argv += [":::"] * (i > 0) + [*args, "--output_dir", str(tmp_path / f"run{i}")]
    proc = subprocess.run(
        [sys.executable, "tests/scripts/step_syncs.py", *argv],
        cwd=ROOT,
        env={**env(), "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = [json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines() if line.startswith("SYNCS ")]
    assert len(counts) == len(runs), proc.stdout[-3000:]
    for steps in counts:
        assert all(s["count"] == 0 for s in steps[1:]), steps  # step 1 compiles and warms up


def test_qlora_in_bf16_near_lora_and_resumes_exactly(tmp_path):
    """--use_peft true --load_in_4bit true on a GPU in bf16 (torchao's NF4 under FSDP2's mixed precision, the
    weights dequantised on the device): near LoRA over the same base, and a checkpoint that resumes exactly."""
    from test_qlora import ARGS as Q_ARGS
    from test_qlora import qlora_base

    base = tmp_path / "base"
    qlora_base(base)
    args = [*Q_ARGS, "--model_name_or_path", str(base), "--bf16", "true", "--save_steps", "2"]
    lora, qlora, resumed = tmp_path / "lora", tmp_path / "qlora", tmp_path / "resumed"
    native(args, lora)
    log = native([*args, "--load_in_4bit", "true"], qlora)
    assert "QLoRA: 14 linear weights in 4-bit NF4" in log and "in bfloat16" in log, log[-3000:]
    assert_close(losses(lora), losses(qlora), rel=3e-2)
    native([*args, "--load_in_4bit", "true", "--resume_from_checkpoint", str(qlora / "checkpoint-2")], resumed)
    assert_close(losses(qlora), losses(resumed), rel=1e-6, steps=[3])
