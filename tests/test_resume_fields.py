"""What a resume may change, read from each argument's own marking; prepared data keyed by every tokenizer
setting it depends on; the eval subset a uniform sample. In one process, no training."""

from __future__ import annotations

import json
import random
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, DatasetDict

from anygpu.checkpoint import resume_guard
from anygpu.config.args import FREE, SAME, DataArguments, ModelArguments, TrainArguments, parse_args, resolved_dict
from anygpu.data import packing
from anygpu.data import tokenizer as tok_lib
from anygpu.data.order import eval_subset
from anygpu.data.prepare import prepare
from anygpu.engines.hf.engine import HFEngineArguments
from anygpu.runtime.distributed import DistInfo

MEASURED = {"block_size", "global_batch_size", "num_train_samples", "packed", "corpus", "tokenizer", "model_config"}
WORDS = "the sky is blue and green red cat dog runs fast slow why how".split()


def test_every_argument_says_whether_a_resume_may_change_it():
    """A new option without a marking fails here, so the resume guard cannot forget it."""
    for dtype in (ModelArguments, DataArguments, TrainArguments, HFEngineArguments):
        for f in fields(dtype):
            assert f.metadata.get("resume") in {FREE, SAME, *MEASURED}, (
                f"{dtype.__name__}.{f.name}: no valid 'resume' marking"
            )


def test_the_options_the_issue_names_are_guarded():
    marks = resume_guard.markings()
    for name in (
        "completion_only_loss",
        "assistant_only_loss",
        "truncation_mode",
        "lora_alpha",
        "lora_dropout",
        "lora_modules_to_save",
        "lora_r",
        "lora_target_modules",
        "use_peft",
        "packing",
        "train_file",
    ):
        assert marks[name] != FREE, name


class FakeTokenizer:
    """What the fingerprint reads of a tokenizer."""

    chat_template = None
    eos_token, eos_token_id, bos_token, bos_token_id, pad_token, pad_token_id = "</s>", 1, None, None, "<pad>", 2

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "</s>": 1, "<pad>": 2}


def fake_prep(corpus: str = "c0") -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(to_dict=lambda: {"hidden_size": 8}),
        block_size=64,
        plan=SimpleNamespace(global_batch_size=8),
        total_steps=10,
        order=SimpleNamespace(num_samples=100),
        collator=SimpleNamespace(packed=True),
        data_fingerprint=corpus,
        tokenizer=FakeTokenizer(),
    )


def changed(value):
    """Another valid value of an argument's type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    return ["q_proj"] if value is None or isinstance(value, list) else None


@pytest.mark.parametrize("name", sorted(n for n, m in resume_guard.markings().items() if m == SAME))
def test_a_changed_option_that_must_stay_is_named(name):
    base = resolved_dict(ModelArguments(), DataArguments(), TrainArguments())
    saved = resume_guard.fingerprint(base, fake_prep())
    now = resume_guard.fingerprint({**base, name: changed(base[name])}, fake_prep())
    diffs = resume_guard.differences(saved, now)
    assert len(diffs) == 1 and diffs[0].startswith(f"--{name}: "), diffs


@pytest.mark.parametrize("name", sorted(n for n, m in resume_guard.markings().items() if m == FREE))
def test_a_changed_free_option_resumes(name):
    base = resolved_dict(ModelArguments(), DataArguments(), TrainArguments())
    saved = resume_guard.fingerprint(base, fake_prep())
    assert (
        resume_guard.differences(saved, resume_guard.fingerprint({**base, name: changed(base[name])}, fake_prep()))
        == []
    )


def test_a_changed_data_file_is_named_by_its_argument():
    base = {**resolved_dict(ModelArguments(), DataArguments(), TrainArguments()), "train_file": "data.jsonl"}
    saved = resume_guard.fingerprint(base, fake_prep("c0"))
    same_path = resume_guard.differences(saved, resume_guard.fingerprint(base, fake_prep("c1")))
    assert len(same_path) == 1 and "corpus fingerprint" in same_path[0] and "--train_file data.jsonl" in same_path[0], (
        same_path
    )
    other = resume_guard.differences(
        saved, resume_guard.fingerprint({**base, "train_file": "b.jsonl"}, fake_prep("c1"))
    )
    assert "--train_file 'data.jsonl' → 'b.jsonl'" in other[0], other


def test_a_checkpoint_without_the_new_entries_still_resumes():
    """Checkpoints written before an entry existed are compared on what they hold."""
    base = resolved_dict(ModelArguments(), DataArguments(), TrainArguments())
    now = resume_guard.fingerprint(base, fake_prep())
    old = {k: v for k, v in now.items() if k not in ("truncation_mode", "packed", resume_guard.SOURCES)}
    assert resume_guard.differences(old, now) == []


@pytest.fixture(scope="module")
def tok():
    return tok_lib.train_bpe(iter(WORDS * 20), 300)


def test_a_changed_eos_token_is_not_served_stale_packed_blocks(tok, tmp_path):
    """EOS joins the texts of a block: another EOS must re-pack, and change the tokenizer's fingerprint."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(200)]
    raw = DatasetDict(train=Dataset.from_dict({"text": texts}))
    first = packing.pack(raw, tok, 16, "text", "fp", str(tmp_path))
    before = resume_guard.tokenizer_fingerprint(tok)
    other = tok_lib.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, eos_token=tok_lib.PAD, pad_token=tok_lib.PAD
    )
    assert other.eos_token_id != tok.eos_token_id
    second = packing.pack(raw, other, 16, "text", "fp", str(tmp_path))
    ids = [t for row in second["train"]["input_ids"] for t in row]
    assert other.eos_token_id in ids and tok.eos_token_id not in ids
    assert first["train"]["input_ids"] != second["train"]["input_ids"]
    assert resume_guard.tokenizer_fingerprint(other) != before


def test_eval_subset_is_a_seeded_uniform_sample():
    picked = eval_subset(10_000, 500)
    assert picked == eval_subset(10_000, 500) and len(set(picked)) == 500 and picked == sorted(picked)
    # uniform: each tenth of the rows holds about a tenth of the sample (binomial sd ≈ 6.7)
    tenths = [sum(1 for i in picked if k * 1000 <= i < (k + 1) * 1000) for k in range(10)]
    assert all(25 <= n <= 75 for n in tenths), tenths
    assert eval_subset(10, 0) == eval_subset(10, 20) == list(range(10))


def test_max_eval_samples_takes_the_subset_not_the_first_rows(tmp_path):
    """Packed chat rows come fullest first: --max_eval_samples picks the seeded sample of them."""
    rng = random.Random(0)
    path = tmp_path / "chat.jsonl"
    with path.open("w") as f:
        for _ in range(120):
            msgs = [
                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))},
                {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    common = [
        "--train_file",
        str(path),
        "--config_name",
        "tiny",
        "--block_size",
        "64",
        "--global_batch_size",
        "2",
        "--vocab_size",
        "300",
        "--output_dir",
        str(tmp_path / "out"),
        "--data_cache_dir",
        str(tmp_path / "c"),
        "--validation_split_percentage",
        "40",
    ]
    info = DistInfo(0, 0, 1, torch.device("cpu"))
    full = prepare(*parse_args([*common, "--max_eval_samples", "0"]), info).datasets["validation"]
    some = prepare(*parse_args([*common, "--max_eval_samples", "5"]), info).datasets["validation"]
    assert len(full) > 10 and len(some) == 5
    assert some["input_ids"] == full.select(eval_subset(len(full), 5))["input_ids"]
    assert some["input_ids"] != full.select(range(5))["input_ids"]


def test_a_lora_or_reference_run_resumed_over_other_base_weights_is_refused(tmp_path):
    """Two folders with one config and tokenizer but other weights: a LoRA checkpoint holds only the adapter (and a
    DPO run reads its reference from the base), so resuming over the other folder trained another model (the curve
    moved 0.4% at step 4) and was accepted. The base's weights are now in the fingerprint where the run reads them;
    a full fine-tune, whose checkpoint holds every weight, does not depend on them."""
    from hub_sources import write

    config = dict(model_type="llama", vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2)  # fmt: skip
    a = write(tmp_path / "a", config, "float32")
    b = write(tmp_path / "b", config, "float32")
    b_model = b / "model.safetensors"
    data = bytearray(b_model.read_bytes())
    data[-100] ^= 0xFF  # same shapes and header, other weights
    b_model.write_bytes(bytes(data))

    def weights(folder, *extra):
        argv = ["--model_name_or_path", str(folder), *extra, "--output_dir", str(tmp_path / "out")]
        return resume_guard.base_weights(resolved_dict(*parse_args(argv, warn=False)))

    lora = ("--use_peft", "true")
    assert weights(a, *lora) != weights(b, *lora) and weights(a, *lora) == weights(a, *lora)
    assert weights(a, "--objective", "dpo") != weights(b, "--objective", "dpo")
    assert weights(a) == weights(b) == ""  # a full fine-tune: the checkpoint holds every weight
    saved, now = {"base_weights": weights(a, *lora)}, {"base_weights": weights(b, *lora)}
    (diff,) = resume_guard.differences({**saved, "sources": {"model_name_or_path": str(a)}},
                                       {**now, "sources": {"model_name_or_path": str(a)}})  # fmt: skip
    assert diff.startswith("base model weights: ") and f"the content behind --model_name_or_path {a}" in diff


def test_a_refusal_names_arguments_the_user_has_not_words_of_its_own():
    """The measured entries are named in words ('total steps', 'training samples'), not as options that do not
    exist (--total_steps, --num_train_samples); a tokenizer that changed with --model_name_or_path is not blamed
    on --vocab_size, which the user never gave."""
    sources = {"model_name_or_path": "a", "vocab_size": 8192, "tokenizer_name": None, "max_train_samples": None}
    saved = {"total_steps": 6, "num_train_samples": 10, "tokenizer": "x", "sources": sources}
    now = {"total_steps": 4, "num_train_samples": 8, "tokenizer": "y",
           "sources": {**sources, "model_name_or_path": "b"}}  # fmt: skip
    diffs = resume_guard.differences(saved, now)
    text = "; ".join(diffs)
    assert "--total_steps" not in text and "--num_train_samples" not in text and "--vocab_size" not in text, text
    assert "total steps: 6 → 4" in text and "training samples: 10 → 8" in text and "tokenizer fingerprint: 'x'" in text
