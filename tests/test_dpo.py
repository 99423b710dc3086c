"""--objective dpo keeps the same curve: 1, 2, 3 and 4 ranks (HSDP 2 × 2, context parallelism --cp 2), micro-batches
of 1 to 12 pairs, packed and padded rows, both engines, the reference's log-probs computed, read from the cache or from a frozen copy at every
step, LoRA (its base as the reference), and a resume on another world size and mesh. Five launches share the runs."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import fsdp_runs, hf_runs, losses, python, records, torchrun
from dpo_data import build_models, write_kinds

G, STEPS, BETA = 12, 3, 0.1  # 24 training pairs: 2 steps per epoch, the third in the second epoch; TRL's beta
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def job(base, ref, files, out, *extra: str) -> list[str]:
    train, validation = files["conv"]
    return [
        *("--model_name_or_path", str(base), "--objective", "dpo", "--train_file", str(train)),
        *("--validation_file", str(validation), "--block_size", "64", "--global_batch_size", str(G)),
        *("--max_steps", str(STEPS), "--logging_steps", "1", "--eval_steps", "0", "--eval_on_start", "true"),
        *("--report_to", "none", "--disable_tqdm", "true", "--warmup_steps", "0", "--learning_rate", "2e-2"),
        *("--lr_scheduler_type", "constant", "--export_final", "false", "--output_dir", str(out)),
        *(("--ref_model_name_or_path", str(ref)) if ref is not None else ()),
        *extra,
    ]


LORA = ("--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear")


@pytest.fixture(scope="module")
def dpo(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dpo")
    base, ref = build_models(root)
    files = write_kinds(root, train=24, validation=8)
    out = {name: root / name for name in "abcdefghijklmnwxyz"}
    said = {}
    # 1 rank: the reference run (the reference's log-probs computed), a frozen reference copy with padded rows and
    # micro-batches of 3, LoRA (its base's log-probs computed)
    one = fsdp_runs(
        1,
        [
            job(base, ref, files, out["a"], "--export_final", "true"),
            job(base, ref, files, out["b"], "--precompute_ref_log_probs", "false", "--packing", "false",
                "--per_device_train_batch_size", "3"),
            job(base, None, files, out["c"], *LORA),
            job(base, None, files, out["l"], "--data_cache_dir", str(root / "cache-l")),
        ],
    )  # fmt: skip
    # 2 ranks: micro-batches of 1 reading the cache; LoRA with the adapter disabled as the reference at every step;
    # one CP group of 2 (each sequence cut in two): the cache read, a frozen reference copy split like the policy
    # over padded rows, LoRA's base
    two = fsdp_runs(
        2,
        [
            job(base, ref, files, out["d"], "--per_device_train_batch_size", "1"),
            job(base, None, files, out["e"], *LORA, "--precompute_ref_log_probs", "false",
                "--per_device_train_batch_size", "3"),
            job(base, ref, files, out["i"], "--cp", "2", "--per_device_train_batch_size", "4"),
            job(base, ref, files, out["j"], "--cp", "2", "--precompute_ref_log_probs", "false", "--packing", "false",
                "--per_device_train_batch_size", "3"),
            job(base, None, files, out["k"], *LORA, "--cp", "2", "--precompute_ref_log_probs", "false"),
            job(base, None, files, out["m"], "--data_cache_dir", str(root / "cache-m")),
            job(base, None, files, out["n"], *LORA, "--data_cache_dir", str(root / "cache-n")),
        ],
    )  # fmt: skip
    # 3 ranks, stopped after step 2; resumed on 4 ranks as HSDP 2 × 2, after a run of its own there
    torchrun(3, "run_fsdp_standalone.py", job(base, ref, files, out["f"], "--per_device_train_batch_size", "2",
                                             "--stop_at_step", "2"))  # fmt: skip
    hsdp = ("--dp_replicate", "2", "--dp_shard", "2")
    four = fsdp_runs(
        4,
        [
            job(base, ref, files, out["g"], *hsdp),
            job(base, ref, files, out["f"], *hsdp, "--resume_from_checkpoint", "latest"),
        ],
    )
    # the HF engine: DDP over 2 processes, DeepSpeed ZeRO-2 (optimizer state and gradients partitioned)
    hf_runs(2, [job(base, ref, files, out["h"], "--per_device_train_batch_size", "2")])
    said["z"] = hf_runs(
        2, [job(base, ref, files, out["z"], "--per_device_train_batch_size", "2")], config="deepspeed_zero2"
    )[0]
    # DeepSpeed ZeRO-3 (the policy partitioned before Trainer wraps it): a frozen copy sharded by FSDP2 at every step;
    # the table computed by that copy (a cache folder of its own, so it is computed, not read); LoRA's base
    zero3 = hf_runs(
        2,
        [
            job(base, ref, files, out["y"], "--per_device_train_batch_size", "2", "--precompute_ref_log_probs", "false"),
            job(base, ref, files, out["x"], "--per_device_train_batch_size", "3",
                "--data_cache_dir", str(root / "cache-zero3")),
            job(base, None, files, out["w"], *LORA, "--precompute_ref_log_probs", "false", "--export_final", "true",
                "--merge_lora", "true"),
        ],
        config="deepspeed_zero3",
    )  # fmt: skip
    said.update(a=one[0], c=one[2], l=one[3], d=two[0], e=two[1], f=four[1], i=two[2], j=two[3], k=two[4])
    said.update(m=two[5], n=two[6])
    said.update(y=zero3[0], x=zero3[1], w=zero3[2])
    return {"out": out, "said": said, "base": base, "ref": ref, "files": files, "root": root}


def scale(rec: dict, key: str) -> float:
    """What a difference in `key` is relative to: the value, or for a reward (β · a difference of two sequence
    log-probs) β times the log-probs it is the difference of."""
    if "rewards/" in key and "accuracies" not in key:
        return BETA * abs(rec[key.replace("rewards/margins", "logps/chosen").replace("rewards/", "logps/")])
    return abs(rec[key])


def assert_same(a: list[dict], b: list[dict], what: str) -> None:
    """Every record of `a` (train and eval: loss, grad norm, TRL's metrics) within 1e-5 of `b`'s (relative)."""
    keys = ("loss", "grad_norm", "eval_loss", *METRICS, *(f"eval_{k}" for k in METRICS))
    index = {(r["step"], "eval_loss" in r): r for r in b}
    for rec in a:
        other = index[(rec["step"], "eval_loss" in rec)]
        for key in (k for k in keys if k in rec):
            tolerance = 1e-5 * max(1.0, scale(other, key))
            assert abs(rec[key] - other[key]) <= tolerance, (what, rec["step"], key, rec, other)


@pytest.mark.slow
@pytest.mark.parametrize(
    "run,what",
    [
        ("b", "a frozen reference copy at every step, padded rows, micro-batches of 3"),
        ("d", "2 ranks, micro-batches of 1, the cache read"),
        ("g", "4 ranks, HSDP 2 × 2"),
        ("h", "the HF engine, DDP over 2 processes"),
        ("z", "the HF engine, DeepSpeed ZeRO-2 over 2 processes"),
        ("i", "one CP group of 2 ranks (--cp 2), the cache read"),
        ("j", "--cp 2, a frozen reference copy split like the policy, padded rows, micro-batches of 3"),
        ("f", "3 ranks, resumed after step 2 on 4 ranks as HSDP 2 × 2"),
    ],
)
def test_the_same_curve(dpo, run, what):
    ref, got = records(dpo["out"]["a"]), records(dpo["out"][run])
    assert sorted(losses(dpo["out"][run])) == list(range(1, STEPS + 1)), what
    assert_same(got, ref, what)
    assert len([r for r in got if "eval_loss" in r]) == 2, what  # step 0 and the end
    if run == "z":  # DeepSpeed took the run (its batch numbers are the engine's), not a fallback
        assert "strategy: DeepSpeed ZeRO-2 over 2 processes" in dpo["said"]["z"], dpo["said"]["z"][-2000:]


@pytest.mark.slow
def test_the_hf_engine_under_zero3_runs_the_reference_sharded(dpo):
    """ZeRO-3 partitions the policy as it is built, so the reference is a frozen copy FSDP2 shards over the processes,
    for the precompute pass too. Its table equals the 1-rank run's; the two ZeRO-3 curves (a copy at every step,
    micro-batches of 2; the table, micro-batches of 3) are one (1e-5), and LoRA's (its base at every step) is the 1-rank
    LoRA run's, and a full fine-tune the 1-rank run's (1e-5; it drifted by up to 1e-3 while ZeRO-3's partitioned
    matrices got no weight decay)."""
    from safetensors.torch import load_file

    said, out = dpo["said"], dpo["out"]
    assert "strategy: DeepSpeed ZeRO-3 over 2 processes" in said["y"], said["y"][-2000:]
    assert f"reference: a frozen copy of {dpo['ref']}, at every step" in said["y"]
    assert "reference: the base model (the LoRA adapter disabled), at every step" in said["w"]
    computed = [
        re.search(r"log-probs of 32 pairs computed in .* on (\d) ranks?, cached at (\S+)", said[r]) for r in "ax"
    ]
    assert [c and c.group(1) for c in computed] == ["1", "2"], said["x"][-2000:]
    tables = [load_file(c.group(2)) for c in computed]
    for split, table in tables[0].items():
        assert torch.allclose(tables[1][split], table, rtol=1e-6, atol=0), split
    assert_same(records(out["y"]), records(out["x"]), "ZeRO-3: a frozen copy at every step, and its table")
    assert_same(records(out["w"]), records(out["c"]), "ZeRO-3: LoRA, its base at every step")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out["w"] / "final-merged")  # rank 0's merge (it hung under ZeRO-3)
    assert all(p.numel() > 0 for p in merged.parameters())
    assert_same(records(out["y"]), records(out["a"]), "ZeRO-3: a full fine-tune against the 1-rank run")


@pytest.mark.slow
def test_lora_on_one_and_two_ranks(dpo):
    """LoRA's reference is its base: log-probs computed once, or the adapter disabled at every step on 2 ranks."""
    assert "reference: the base model (the LoRA adapter disabled), at every step" in dpo["said"]["e"]
    assert sorted(losses(dpo["out"]["c"])) == [1, 2, 3]
    assert_same(records(dpo["out"]["e"]), records(dpo["out"]["c"]), "LoRA, 2 ranks")
    assert "reference: the base model (the LoRA adapter disabled), at every step" in dpo["said"]["k"]
    assert_same(records(dpo["out"]["k"]), records(dpo["out"]["c"]), "LoRA, --cp 2")
    first = records(dpo["out"]["c"])[0]
    assert first["step"] == 0 and abs(first["eval_loss"] - 0.6931472) < 1e-6  # the policy starts as its reference


@pytest.mark.slow
def test_the_policy_computing_its_own_reference_on_two_ranks_trains_every_weight(dpo):
    """The default reference (the policy as it starts) computed by the sharded policy itself on 2 ranks, full and
    LoRA: the same curve as on 1 rank. The pass used to leave the units FSDP2 keeps gathered after a forward (the
    last layer, the head, the root) unsharded when the optimizer was built, so it held copies that never trained."""
    said, out = dpo["said"], dpo["out"]
    for run, one_rank in (("m", "l"), ("n", "c")):
        assert re.search(r"reference: log-probs of 32 pairs computed in .* on 2 ranks", said[run]), said[run][-2000:]
        assert_same(records(out[run]), records(out[one_rank]), f"2 ranks, run {run}: the policy's own table")


@pytest.mark.slow
def test_the_cache_is_computed_once_then_read(dpo):
    computed = re.search(r"reference: log-probs of 32 pairs computed in .* cached at (\S+)", dpo["said"]["a"])
    read = re.search(r"reference: log-probs of 32 pairs read from the cache at (\S+)", dpo["said"]["d"])
    assert computed and read and computed.group(1) == read.group(1), (
        dpo["said"]["a"][-2000:],
        dpo["said"]["d"][-2000:],
    )
    assert "read from the cache" in dpo["said"]["f"] and "resumed from" in dpo["said"]["f"]
    assert "was 3 ranks, now 4" in dpo["said"]["f"]


@pytest.mark.slow
def test_metrics_and_the_final_model(dpo):
    """TRL's metric names in metrics.jsonl (train and eval_), no perplexity for a preference loss, and final/ as the
    Hub's layout: loadable by from_pretrained, changed by the training."""
    import torch
    from transformers import AutoModelForCausalLM

    recs = records(dpo["out"]["a"])
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    assert all(set(METRICS) <= set(r) for r in train) and all({f"eval_{k}" for k in METRICS} <= set(r) for r in evals)
    assert not any("perplexity" in r for r in evals)
    assert all(0.0 <= r["rewards/accuracies"] <= 1.0 for r in train)
    assert train[-1]["rewards/margins"] > train[0]["rewards/margins"]  # preference training separates the pairs
    trained = AutoModelForCausalLM.from_pretrained(dpo["out"]["a"] / "final")
    start = AutoModelForCausalLM.from_pretrained(dpo["base"])
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), start.parameters()))


@pytest.mark.slow
def test_a_step_that_does_not_log_has_no_host_sync(dpo):
    """As the language model's steps (tests/test_host_syncs.py): a DPO step queues its work and never waits for the
    device, with the reference's table, or a frozen bf16 reference copy and the sft term."""
    base, ref, files, root = dpo["base"], dpo["ref"], dpo["files"], dpo["root"]
    quiet = ("--logging_steps", "10", "--eval_on_start", "false", "--save_strategy", "no", "--max_steps", "2")
    runs = [
        job(base, ref, files, root / "syncs0", "--per_device_train_batch_size", "3", *quiet),
        job(base, ref, files, root / "syncs1", "--per_device_train_batch_size", "3", "--bf16", "true",
            "--precompute_ref_log_probs", "false", "--loss_type", "sigmoid,sft", *quiet),
    ]  # fmt: skip
    out = python("tests/scripts/step_syncs.py", [*runs[0], ":::", *runs[1]], timeout=600).stdout
    counts = {int(m[1]): json.loads(m[2]) for m in re.finditer(r"^SYNCS (\d+) (.*)$", out, flags=re.MULTILINE)}
    assert sorted(counts) == [0, 1], out[-3000:]
    for i, steps in counts.items():
        assert [s["step"] for s in steps] == [1, 2] and all(s["count"] == 0 for s in steps), (runs[i], steps)
