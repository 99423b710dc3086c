"""--objective dpo in one process, no training launched: a pair batch's layouts (packed and padded) and log-prob paths
(the lean loss's checkpointed chunks and the model's own logits) give the same sequence log-probs and gradients; the
reference cache's key follows the weights; the memory plan counts pairs and the reference; every bad input is one
line before any work."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY
from dpo_data import rows, write

from anygpu.config.args import parse_args
from anygpu.data.pair_batches import PairCollator
from anygpu.engines.fsdp import main
from anygpu.model import lean_loss, sequence_log_probs
from anygpu.train import dpo


def tiny_llama(vocab: int = 300, tie: bool = False, model_type: str = "llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def pairs(n: int, seed: int = 0) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: torch.randint(3, 300, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    return {"prompt_ids": [draw(2, 20) for _ in range(n)], "chosen_ids": [draw(1, 15) for _ in range(n)],
            "rejected_ids": [draw(1, 15) for _ in range(n)]}  # fmt: skip


def sequence_logps(model, batch) -> torch.Tensor:
    n = batch["completion_tokens"].numel()
    values, _ = sequence_log_probs.token_log_probs(
        model, model, {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch},
        batch["labels"],
    )  # fmt: skip
    return sequence_log_probs.sequence_sums(values, batch["segment"], n)


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True), ("gemma2", True), ("granite", False)])
def test_packed_padded_lean_and_full_logits_agree(model_type, tie, monkeypatch):
    """The four ways to a pair batch's sequence log-probs (packed or padded rows, the lean loss's 48-token
    checkpointed chunks or the model's own logits) give the same values and the same gradients of a DPO loss; tied
    or separate output projections, and families that cap (gemma2) or scale (granite) their logits."""
    monkeypatch.setenv("ANYGPU_LEAN_LOSS_CHUNK_TOKENS", "48")
    columns, found = pairs(5), []
    for lean in (False, True):
        for packed in (False, True):
            model = tiny_llama(tie=tie, model_type=model_type).train()
            if lean:
                lean_loss.install(model, True)
            batch = PairCollator(0, 40, packed=packed).collate(columns)
            logps = sequence_logps(model, batch)
            cfg = dpo.LossConfig(("sigmoid", "sft"), (1.0, 0.5))
            p = dpo.PairLogps(logps[:5], logps[5:], logps[:5].detach() * 0.9, logps[5:].detach(),
                              batch["completion_tokens"].double(), dpo.scored_tokens(batch, 10).double())  # fmt: skip
            (dpo.pair_terms(cfg, p).sum() - p.chosen.sum()).backward()
            found.append((logps.detach(), [q.grad.clone() for q in model.parameters()]))
    for logps, grads in found[1:]:
        assert torch.allclose(logps, found[0][0], atol=1e-4, rtol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(grads, found[0][1]))


def test_batch_layout_follows_trl():
    """Chosen sequences first, then rejected; cut per sequence as TRL's collator cuts (keep_start / keep_end); the
    completion tokens are the labels, never a sequence's first token; the count is [pairs, chosen tokens scored]."""
    columns = {"prompt_ids": [[5, 6, 7], [8]], "chosen_ids": [[9, 10], [11, 12, 13, 14]], "rejected_ids": [[15], [16]]}
    batch = PairCollator(0, 4).collate(columns)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9], [8, 11, 12, 13], [5, 6, 7, 15], [8, 16, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 9], [-100, 11, 12, 13], [-100, -100, -100, 15],
                                        [-100, 16, -100, -100]]  # fmt: skip
    assert batch["completion_tokens"].tolist() == [1, 3, 1, 1]  # TRL's completion_mask.sum(1), after the cut
    assert PairCollator(0, 4).count(batch) == [2, 4]
    end = PairCollator(0, 4, "keep_end").collate(columns)
    assert end["input_ids"][1].tolist() == [11, 12, 13, 14]
    assert end["labels"][1].tolist() == [-100, 12, 13, 14] and end["completion_tokens"][1] == 4


def test_the_cache_key_follows_the_weights(tmp_path):
    from anygpu.train import reference

    model = tiny_llama()
    model.save_pretrained(tmp_path)
    before = reference.identity(str(tmp_path))
    assert reference.identity(str(tmp_path)) == before
    model.lm_head.weight.data.mul_(2)
    model.save_pretrained(tmp_path)
    assert reference.identity(str(tmp_path)) != before
    path = lambda ident, precision: reference.cache_file("c", "pairs", ident, precision, "all")  # noqa: E731
    assert path(before, "fp32") != path(before, "bf16") and path(before, "fp32") == path(before, "fp32")


def test_the_plan_counts_pairs_and_the_reference():
    """Two sequences of activations per pair; a frozen reference's parameters in the compute dtype, sharded like the
    policy's; none when precomputed or for LoRA; the HF engine's ZeRO rows left out."""
    from anygpu.tools import plan

    def rows_of(*extra: str):
        args = plan.build_parser().parse_args(
            ["--config_name", "tiny", "--num_gpus", "4", "--gpu_memory_gb", "80", "--block_size", "64", *extra]
        )
        return plan.plan(args)

    lm, _ = rows_of()
    pre, pre_lora = rows_of("--objective", "dpo")
    frozen, frozen_lora = rows_of("--objective", "dpo", "--precompute_ref_log_probs", "false")

    def pick(result, strategy="fsdp2", precision="bf16"):
        return next(
            r
            for r in result.rows
            if (r.strategy, r.precision) == (strategy, precision) and not r.activation_checkpointing
        )

    assert pick(pre).per_gpu_bytes["activations"] > 1.9 * pick(lm).per_gpu_bytes["activations"]
    assert "reference" not in pick(pre).per_gpu_bytes and "reference" not in pick(frozen_lora).per_gpu_bytes
    params = pick(frozen).per_gpu_bytes["parameters"]  # fp32 masters, sharded: the reference is half that in bf16
    assert abs(pick(frozen).per_gpu_bytes["reference"] - params / 2) <= 0.01 * params
    assert {r.strategy for r in frozen.rows} == {"ddp", "zero2", "zero3", "fsdp2"}
    # under ZeRO-3 the reference is sharded by FSDP2 (its rows), as under FSDP2
    assert pick(frozen, "zero3").per_gpu_bytes["reference"] == pick(frozen).per_gpu_bytes["reference"]


# ---------------------------------------------------------------------- one-line refusals, before any work
@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> SimpleNamespace:
    from test_lora import build_base

    root = tmp_path_factory.mktemp("dpo-refusals")
    build_base(root / "base")
    other = tiny_llama(vocab=2048)
    other.save_pretrained(root / "other-vocab")
    return SimpleNamespace(root=root, base=root / "base", other=root / "other-vocab")


def refuse(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert e.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def dpo_args(folders, train: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        *("--model_name_or_path", str(folders.base), "--objective", "dpo", "--train_file", str(train)),
        *("--block_size", "64", "--global_batch_size", "2", "--max_steps", "1", "--report_to", "none"),
        *("--warmup_steps", "0", "--output_dir", str(tmp_path / "run"), *extra),
    ]


def edited(tmp_path: Path, index: int, **change) -> Path:
    data = rows("plain", 6, 0)
    data[index].update(change)
    return write(tmp_path / "pairs.jsonl", [{k: v for k, v in r.items() if v is not None} for r in data])


@pytest.mark.parametrize(
    "change, says",
    [
        ({"chosen": " the same", "rejected": " the same"}, ["row 2", "its chosen equals its rejected"]),
        ({"prompt": "def " * 80}, ["row 2", "its prompt is", "within --block_size 64", "--truncation_mode drop"]),
        ({"chosen": [{"role": "assistant", "content": "hi"}]}, ["row 2", "mixes strings and message lists"]),
        ({"rejected": None}, ["row 2", "has no chosen or no rejected"]),
    ],
)
def test_bad_rows(folders, tmp_path, capsys, change, says):
    err = refuse(dpo_args(folders, edited(tmp_path, 2, **change), tmp_path), capsys)
    assert "--train_file" in err and all(s in err for s in says), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_long_prompt_is_dropped_when_asked(folders, tmp_path):
    """--truncation_mode drop leaves such pairs out, counted, instead of the refusal."""
    from anygpu.data import preference
    from datasets import Dataset
    from transformers import AutoTokenizer

    data = rows("plain", 6, 0)
    data[2]["prompt"] = "def " * 80
    tok = AutoTokenizer.from_pretrained(folders.base)
    out, stats = preference.encode_split(Dataset.from_list(data), tok, 64, "drop", None, "x")
    assert len(out) == 5 and stats.dropped_too_long == 1 and "1 longer than the block, dropped" in stats.describe()


def test_data_and_objective_must_match(folders, tmp_path, capsys):
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "plain text"}) + "\n")
    err = refuse(dpo_args(folders, text, tmp_path), capsys)
    assert "--objective dpo: --train_file" in err and "has no 'chosen' and 'rejected' columns" in err
    lm = [a for a in dpo_args(folders, edited(tmp_path, 0), tmp_path) if a not in ("--objective", "dpo")]
    assert "train on them with --objective dpo" in refuse(lm, capsys)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--loss_type", "sigmoid,kto"], "--loss_type kto is unknown: use one or more of sigmoid, hinge, ipo"),
        (["--loss_type", "sigmoid,sft", "--loss_weights", "1"], "--loss_weights 1: give one weight per --loss_type"),
        (["--loss_type", "robust", "--label_smoothing", "0.5"], "--label_smoothing 0.5 must be in [0, 0.5)"),
        (
            ["--global_batch_tokens", "128"],
            "--global_batch_tokens 128 with --objective dpo",
        ),
        (["--per_device_train_batch_size", "auto"], "--per_device_train_batch_size auto with --objective dpo"),
    ],
)
def test_bad_options(folders, tmp_path, capsys, extra, says):
    args = dpo_args(folders, edited(tmp_path, 0), tmp_path, *extra)
    if "--global_batch_tokens" in extra:  # instead of the pairs
        i = args.index("--global_batch_size")
        del args[i : i + 2]
    assert says in refuse(args, capsys)


def test_no_starting_model(capsys, tmp_path):
    err = refuse([*TINY, "--objective", "dpo", "--output_dir", str(tmp_path)], capsys)
    assert "--objective dpo needs --model_name_or_path" in err


def test_a_reference_with_another_vocabulary(folders, tmp_path, capsys):
    err = refuse(
        dpo_args(folders, edited(tmp_path, 0), tmp_path, "--ref_model_name_or_path", str(folders.other)), capsys
    )
    assert f"--ref_model_name_or_path {folders.other}: its vocabulary of 2048 differs from the policy's (1024" in err


def test_a_grpo_reference_with_another_vocabulary(folders, tmp_path, capsys):
    """GRPO's KL term scores the completions with the reference too: refused as DPO's, before any work (it ended
    mid-run in an IndexError)."""
    prompts = write(tmp_path / "prompts.jsonl", [{"prompt": f"def f{i}():"} for i in range(8)])
    grpo = ["--reward_funcs", "format", "--num_generations", "2", "--beta", "0.1", "--max_prompt_length", "16",
            "--max_completion_length", "16"]  # fmt: skip
    args = dpo_args(folders, prompts, tmp_path, *grpo, "--ref_model_name_or_path", str(folders.other))
    args[args.index("dpo")] = "grpo"
    i = args.index("--block_size")
    del args[i : i + 2]  # grpo's rows are prompts and completions
    err = refuse(args, capsys)
    assert f"--ref_model_name_or_path {folders.other}: its vocabulary of 2048 differs from the policy's (1024" in err


def test_the_hf_engine_trains_pairs_under_every_strategy_but_dataparallel(monkeypatch):
    from anygpu.config.args import HFEngineArguments
    from anygpu.engines.hf import engine, strategy
    from anygpu.errors import UsageError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")  # the policy partitioned: a sharded reference copy
    m, d, t, e = parse_args(["--model_name_or_path", "/tmp", "--objective", "dpo"], extra=(HFEngineArguments,))
    assert engine.refuse_early(m, t, e).kind == "deepspeed"
    for kind in ("single", "ddp", "fsdp", "deepspeed"):
        engine.check_objective(t, strategy.Plan(strategy.Request(kind, 2), kind, False, None))
    one_process = strategy.Plan(strategy.Request("dataparallel", 1), "dataparallel", False, None)
    with pytest.raises(UsageError, match="--objective dpo with the HF engine under .*one process driving every"):
        engine.check_objective(t, one_process)
