"""Strategy honesty: the HF engine never trains with another strategy than the one the launcher
asked for without saying so. Unit tests of the decision, and the real thing: fsdp.yaml on a
CPU-only host stops with the message (or, with --allow_strategy_fallback, trains DDP and says so)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, losses
from test_hf_engine import accelerate

from anygpu.engines.hf import strategy as hf_strategy
from anygpu.engines.hf.strategy import Request, check_in_effect, check_resume_world, plan, requested


def test_what_the_launcher_asked_for():
    assert requested({}, num_gpus=0) == Request("single", 1)
    assert requested({"WORLD_SIZE": "4", "LOCAL_RANK": "0"}, num_gpus=0) == Request("ddp", 4)
    assert requested(
        {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, num_gpus=0
    ) == Request("fsdp", 2, fsdp_version=2)
    assert requested(
        {
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        },
        num_gpus=0,
    ) == Request("deepspeed", 2, zero_stage=3)
    # plain `python` on a host with several GPUs: Trainer's nn.DataParallel
    assert requested({}, num_gpus=4) == Request("dataparallel", 1)
    # one process started by a launcher on that host uses one GPU
    assert requested({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, num_gpus=4) == Request("single", 1)


def test_a_deepspeed_config_file_says_its_own_zero_stage(tmp_path):
    """An accelerate config with `deepspeed_config_file` (a ds_config_zero3.json, as TRL's and axolotl's users have):
    accelerate passes the file and no stage, so the stage is the file's. Taken as ZeRO-2, a ZeRO-3 job kept the lean
    loss on (it calls lm_head outside the hooks that gather its partitioned weight) and built the whole model on
    every rank."""
    ds = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "ACCELERATE_USE_DEEPSPEED": "true"}
    got = {}
    for stage in (3, 1):
        config = tmp_path / f"ds_zero{stage}.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_batch_size": "auto"}))
        got[stage] = requested({**ds, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)}, num_gpus=0)
        assert got[stage] == Request("deepspeed", 2, zero_stage=stage)
    assert hf_strategy.lean_loss_off_reason(plan(got[3], on_cpu=False, allow_fallback=False)) is not None
    no_stage = tmp_path / "ds_default.json"
    no_stage.write_text(json.dumps({"train_batch_size": "auto"}))  # DeepSpeed's default: stage 0
    assert requested({**ds, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(no_stage)}, num_gpus=0).zero_stage == 0
    # the accelerate config's own zero_stage, where it sets one, is what accelerate uses
    both = {**ds, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(no_stage), "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    assert requested(both, num_gpus=0).zero_stage == 2


def test_fsdp_on_cpu_is_refused_with_what_runs_instead():
    req = Request("fsdp", 2, fsdp_version=2)
    with pytest.raises(ValueError) as err:
        plan(req, on_cpu=True, allow_fallback=False)
    msg = str(err.value)
    for hint in (
        "cannot run FSDP on CPU",
        "accelerate_configs/ddp.yaml",
        "deepspeed_zero3.yaml",
        "run_fsdp_standalone.py",
        "--allow_strategy_fallback",
    ):
        assert hint in msg
    p = plan(req, on_cpu=True, allow_fallback=True)
    assert p.kind == "ddp" and p.use_cpu and p.ddp_backend == "gloo"
    assert "FALLBACK" in p.describe() and "FSDP was requested" in p.describe()
    assert ("ACCELERATE_USE_FSDP", "false") in p.env_overrides
    # on a GPU host FSDP runs as asked
    assert plan(req, on_cpu=False, allow_fallback=False).kind == "fsdp"


def test_deepspeed_and_ddp_run_on_cpu_as_asked():
    ds = plan(Request("deepspeed", 2, zero_stage=3), on_cpu=True, allow_fallback=False)
    # not accelerate's CPU switch (it would drop DeepSpeed), but gloo named for DeepSpeed's CPU accelerator
    assert (ds.kind, ds.use_cpu, ds.ddp_backend, ds.fallback_note) == ("deepspeed", False, "gloo", None)
    ddp = plan(Request("ddp", 2), on_cpu=True, allow_fallback=False)
    assert (ddp.kind, ddp.use_cpu, ddp.ddp_backend) == ("ddp", True, "gloo")
    assert ddp.describe() == "strategy: DDP over 2 processes, gloo"
    assert plan(Request("single", 1), on_cpu=True, allow_fallback=False).ddp_backend is None


def test_a_different_strategy_in_effect_is_refused():
    ddp = plan(Request("ddp", 2), on_cpu=False, allow_fallback=False)
    check_in_effect(ddp, "MULTI_GPU", 2)
    with pytest.raises(ValueError, match="world of 1"):  # each process alone: the classic silent failure
        check_in_effect(ddp, "NO", 1)
    fsdp = plan(Request("fsdp", 2, fsdp_version=2), on_cpu=False, allow_fallback=False)
    check_in_effect(fsdp, "FSDP", 2, fsdp_version=2)
    with pytest.raises(ValueError, match="asked for FSDP2 .accelerate. but accelerate set up MULTI_GPU"):
        check_in_effect(fsdp, "MULTI_GPU", 2)
    with pytest.raises(ValueError, match="FSDP version 1"):
        check_in_effect(fsdp, "FSDP", 2, fsdp_version=1)
    zero = plan(Request("deepspeed", 2, zero_stage=2), on_cpu=False, allow_fallback=False)
    with pytest.raises(ValueError, match="asked for DeepSpeed ZeRO-2 but accelerate set up MULTI_CPU"):
        check_in_effect(zero, "MULTI_CPU", 2)


def test_apply_env_sets_overrides(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    hf_strategy.apply_env(plan(Request("fsdp", 2, fsdp_version=2), on_cpu=True, allow_fallback=True))
    import os

    assert os.environ["ACCELERATE_USE_FSDP"] == "false"


def test_fsdp_config_on_cpu_stops_before_training(tmp_path):
    out = tmp_path / "run"
    proc = accelerate("fsdp", 2, [*TINY, "--max_steps", "2", "--output_dir", str(out)], check=False)
    assert proc.returncode != 0
    assert "accelerate cannot run FSDP on CPU" in proc.stderr
    assert "run_fsdp_standalone.py" in proc.stderr and "accelerate_configs/ddp.yaml" in proc.stderr
    assert proc.stderr.count("error: the accelerate config asks for FSDP") == 1  # once, from rank 0
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("checkpoint-*"))  # nothing trained


@pytest.mark.slow  # a 2-rank training launch
def test_fsdp_config_with_explicit_fallback_trains_ddp_and_says_so(tmp_path):
    proc = accelerate(
        "fsdp",
        2,
        [
            *TINY,
            "--max_steps",
            "2",
            "--output_dir",
            str(tmp_path),
            "--export_final",
            "false",
            "--allow_strategy_fallback",
            "true",
        ],
    )
    assert "strategy: DDP over 2 processes, gloo (FALLBACK: FSDP was requested" in proc.stdout
    assert sorted(losses(tmp_path)) == [1, 2]


@pytest.mark.parametrize(
    "saved, saved_world, now, now_world, error",
    [
        ("ddp", 2, Request("ddp", 4), 4, None),  # whole tensors: any world size
        ("ddp", 2, Request("single", 1), 1, None),
        ("deepspeed", 2, Request("deepspeed", 2, zero_stage=3), 2, None),
        ("deepspeed", 2, Request("deepspeed", 4, zero_stage=3), 4, "partitions its checkpoints over 2 processes"),
        ("deepspeed", 2, Request("ddp", 2), 2, "a DeepSpeed checkpoint cannot be resumed with DDP"),
        ("ddp", 2, Request("deepspeed", 2, zero_stage=2), 2, "a DDP checkpoint cannot be resumed with DeepSpeed"),
    ],
)
def test_resume_refuses_another_strategy_family(tmp_path, saved, saved_world, now, now_world, error):
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    (ckpt / "anygpu_state.json").write_text(
        json.dumps({"global_step": 5, "world_size": saved_world, "strategy": saved})
    )
    p = plan(now, on_cpu=False, allow_fallback=False)
    if error is None:
        check_resume_world(ckpt, p)
    else:
        with pytest.raises(ValueError, match=error):
            check_resume_world(ckpt, p)


@pytest.mark.parametrize("kind, each_batch", [("fsdp", True), ("ddp", False), ("deepspeed", False)])
def test_accelerate_fsdp2_reduce_scatters_every_micro_batch(kind, each_batch):
    """Under accelerate's FSDP2 the HF engine has Trainer sync every micro-batch (accelerate's `sync_each_batch`),
    so a rank holds its shard of the gradients through accumulation, not the whole model's unsharded ones (as
    no_sync left them: +4 bytes per parameter per rank); DDP, whose gradients are whole anyway, and DeepSpeed, which
    reduces each micro-batch itself, sync as before. (The bytes a rank holds are a 2-GPU check: accelerate's FSDP2
    does not run on CPU.)"""
    from anygpu.config.args import parse_args
    from anygpu.engines.hf.run import training_arguments

    train_args = parse_args([*TINY, "--output_dir", "/tmp/unused"])[2]
    request = Request(
        kind, 2, zero_stage=3 if kind == "deepspeed" else None, fsdp_version=2 if kind == "fsdp" else None
    )
    targs = training_arguments(train_args, plan(request, on_cpu=False, allow_fallback=False))
    assert targs.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": each_batch}
