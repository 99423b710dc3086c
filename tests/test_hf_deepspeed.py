"""DeepSpeed ZeRO-2 and ZeRO-3 through the shipped accelerate configs, on CPU (DeepSpeed's CPU
accelerator over gloo): the same losses as 1-process DDP, DeepSpeed's batch numbers filled from
the engine's batch math, exact resume under ZeRO-3, and a final export gathered from the
partitions that Hugging Face loads."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from conftest import TINY, assert_close, hf_runs, losses, records
from test_hf_engine import accelerate, hf_reference

pytestmark = pytest.mark.slow  # starts training processes

TEN = [*TINY, "--max_steps", "10", "--max_eval_samples", "24"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """ZeRO-2 with accumulation (2 per device × 2 devices × 2 steps); ZeRO-3 without (4 × 2 × 1), saving checkpoint-5,
    then in the same launch the same run stopped at step 5 (`zero3r`) and resumed from its checkpoint-5 by path, and
    a run of 3 steps that never saves (`zero3n`: its export is the first gather after the evaluation)."""
    out = {name: tmp_path_factory.mktemp(name) for name in ("zero2", "zero3", "zero3r", "zero3n")}
    root, stdouts = hf_reference(tmp_path_factory)
    out["ddp1"], out["ddp1_stdout"] = root / "ws1", stdouts["ws1"]  # the same run as test_hf_engine.py's 1-process one
    out["zero2_proc"] = accelerate(
        "deepspeed_zero2",
        2,
        [*TEN, "--output_dir", str(out["zero2"]), "--per_device_train_batch_size", "2", "--export_final", "false"],
    )
    resumed = [*TEN, "--output_dir", str(out["zero3r"]), "--export_final", "false"]
    zero3, _, out["resume_stdout"], _ = hf_runs(
        2,
        [
            [*TEN, "--output_dir", str(out["zero3"]), "--save_steps", "5"],
            [*resumed, "--save_steps", "5", "--stop_at_step", "5"],
            [*resumed, "--resume_from_checkpoint", str(out["zero3r"] / "checkpoint-5")],
            [*TEN, "--output_dir", str(out["zero3n"]), "--max_steps", "3", "--save_strategy", "no"],
        ],
        config="deepspeed_zero3",
    )
    out["zero3_proc"] = SimpleNamespace(stdout=zero3)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_matches_one_process(runs, stage):
    """1e-5 on every step: ZeRO-3 once drifted by 3e-5 in 10 steps (its partitioned parameters are 1-D placeholders,
    so the weight decay of the matrices was never applied); ZeRO-2 does not partition them."""
    ref, got = losses(runs["ddp1"]), losses(runs[f"zero{stage}"])
    assert sorted(got) == list(range(1, 11)) and got[10] < got[1]
    assert_close(ref, got, rel=1e-5)
    out = runs[f"zero{stage}_proc"].stdout
    assert f"strategy: DeepSpeed ZeRO-{stage} over 2 processes, gloo" in out
    # the model's size, not the partition's (ZeRO-3 leaves each parameter an empty placeholder: it said 0.0M)
    model_line = next(ln for ln in runs["ddp1_stdout"].splitlines() if ln.startswith("model: "))
    assert model_line in out, (model_line, out[-3000:])
    split = (
        "2 per device × 2 devices × 2 accumulation steps"
        if stage == 2
        else "4 per device × 2 devices × 1 accumulation step"
    )
    assert f"global batch 8 = {split}" in out  # and DeepSpeed accepted it: its batch numbers are ours
    lean = "loss: lean" if stage == 2 else "loss: the model's own (full logits): lean loss off, ZeRO-3 gathers lm_head"
    assert lean in out
    lr_ref = {r["step"]: r["learning_rate"] for r in records(runs["ddp1"]) if "loss" in r}
    lr_got = {r["step"]: r["learning_rate"] for r in records(runs[f"zero{stage}"]) if "loss" in r}
    assert lr_got == pytest.approx(lr_ref)  # the learning rate each step used, not the next step's


def assert_export_is_the_trained_model(out, step: int) -> None:
    """final/ loads with every tensor whole (not ZeRO-3's empty placeholders) and gives the engine's last eval_loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from anygpu.config.args import parse_args
    from anygpu.data.prepare import prepare
    from anygpu.runtime import distributed

    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert all(p.numel() > 0 for p in model.parameters())
    m_args, d_args, t_args = parse_args([*TEN, "--output_dir", str(out)])
    val = prepare(m_args, d_args, t_args, distributed.DistInfo(0, 0, 1, torch.device("cpu"))).datasets["validation"]
    ids = torch.tensor(val["input_ids"])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    engine_eval = [r for r in records(out) if "eval_loss" in r][-1]
    assert engine_eval["step"] == step and math.isclose(loss, engine_eval["eval_loss"], rel_tol=1e-5)


def test_zero3_checkpoint_holds_partitions_and_export_holds_the_model(runs):
    ckpt = runs["zero3"] / "checkpoint-10"
    assert (ckpt / "latest").read_text().strip() == "global_step10"
    assert len(list((ckpt / "global_step10").glob("*optim_states.pt"))) == 2  # one partition per process
    assert_export_is_the_trained_model(runs["zero3"], 10)


def test_zero3_exports_a_run_that_never_saved(runs):
    """The export gathers right after the final evaluation, whose prefetched parameters were still in flight (it
    failed: 'Cannot partition a param in flight'); a checkpoint's save used to release them first."""
    assert not list(runs["zero3n"].glob("checkpoint-*"))
    assert_export_is_the_trained_model(runs["zero3n"], 3)


def test_zero3_resume_at_the_exact_position(runs):
    """The ZeRO-3 run stopped at step 5 (its partitions, and its metrics up to step 5), resumed up to 10."""
    assert sorted(p.name for p in runs["zero3"].glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]
    assert (runs["zero3"] / "checkpoint-5" / "latest").read_text().strip() == "global_step5"
    # by path this time (the DDP tests resume with "latest")
    assert "at step 5 (was 2 devices, now 2)" in runs["resume_stdout"]
    resumed = losses(runs["zero3r"])
    assert sorted(resumed) == list(range(1, 11))
    assert_close(losses(runs["zero3"]), resumed, rel=1e-4, steps=range(6, 11))
    state = json.loads((runs["zero3r"] / "checkpoint-10" / "anygpu_state.json").read_text())
    assert state["global_step"] == 10 and state["world_size"] == 2


def test_zero_checkpoint_refuses_another_world_size(runs):
    """ZeRO partitions are per process: resuming on another count stops with a clear message before
    anything starts (refusing another strategy is tested in test_hf_strategy.py)."""
    args = [*TEN, "--output_dir", str(runs["zero3"]), "--max_steps", "12", "--resume_from_checkpoint", "latest"]
    proc = accelerate("deepspeed_zero3", 1, args, check=False)
    assert proc.returncode != 0  # the script exits 2; the launcher reports the failure with 1
    assert "partitions its checkpoints over 2 processes" in proc.stderr and "--num_processes 2" in proc.stderr
    assert max(losses(runs["zero3"])) == 10  # nothing trained
