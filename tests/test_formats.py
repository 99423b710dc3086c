"""Fine-tuning data in one process: formats detected from the columns, which tokens are trained on (prompt,
completion, assistant turns, multi-turn), truncation and dropping counted, packing that keeps samples apart
(the same loss packed as padded), and .txt files with one document per line."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import LlamaConfig, LlamaForCausalLM

from anygpu.config.args import parse_args
from anygpu.data import chat_template, collate, formats, samples, sources
from anygpu.data import tokenizer as tok_lib
from anygpu.data.prepare import prepare
from anygpu.runtime.distributed import DistInfo

WORDS = "the sky is blue and green red cat dog runs fast slow why how".split()


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def chats(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [
                {"role": "user", "content": sentence(rng, 1, 12)},
                {"role": "assistant", "content": sentence(rng, 1, 20)},
            ]
        out.append({"messages": msgs})
    return out


@pytest.fixture(scope="module")
def tok():
    t = tok_lib.train_bpe(iter(WORDS * 20 + ["system user assistant be brief"]), 400)
    chat_template.ensure_chat_template(t)
    return t


def trained_text(tok, ids, labels) -> str:
    return tok.decode([t for t, y in zip(ids, labels) if y != formats.IGNORE])


def test_format_is_detected_from_the_columns():
    assert formats.detect_format(["messages", "id"], "text", "x") == formats.MESSAGES
    assert formats.detect_format(["prompt", "completion"], "text", "x") == formats.PROMPT_COMPLETION
    assert formats.detect_format(["body"], "body", "x") == formats.TEXT
    with pytest.raises(
        ValueError, match="--text_column 'text' is not a column of x.*'prompt' and 'completion'.*'messages'"
    ):
        formats.detect_format(["question", "answer"], "text", "x")


def test_default_template_is_set_and_logged(caplog):
    t = tok_lib.train_bpe(iter(WORDS), 300)
    with caplog.at_level(logging.INFO):
        assert chat_template.ensure_chat_template(t)
    assert "no chat template" in caplog.text and t.chat_template == chat_template.DEFAULT_CHAT_TEMPLATE
    assert not chat_template.ensure_chat_template(t)  # a template of its own is kept


def test_multi_turn_trains_exactly_the_assistant_turns(tok):
    """Generation markers and the prefix-rendering fallback find the same tokens; false trains every token."""
    opts = formats.EncodeOptions(formats.MESSAGES, 10_000)
    no_markers = tok_lib.train_bpe(iter(WORDS * 20 + ["system user assistant be brief"]), 400)
    no_markers.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    for row in chats(20):
        ids, labels, _ = formats.encode_sample(tok, row, opts)
        expected = "".join(m["content"] + tok.eos_token for m in row["messages"] if m["role"] == "assistant")
        assert trained_text(tok, ids, labels) == expected
        assert formats.encode_sample(no_markers, row, opts)[:2] == (ids, labels)
        ids_all, labels_all, _ = formats.encode_sample(
            tok, row, formats.EncodeOptions(formats.MESSAGES, 10_000, assistant_only_loss=False)
        )
        assert ids_all == ids and labels_all[1:] == ids[1:]


def test_prompt_completion_trains_the_completion_and_eos(tok):
    row = {"prompt": "why is the sky", "completion": " blue and green"}
    ids, labels, _ = formats.encode_sample(tok, row, formats.EncodeOptions(formats.PROMPT_COMPLETION, 100))
    assert tok.decode(ids) == "why is the sky blue and green" + tok.eos_token
    assert trained_text(tok, ids, labels) == " blue and green" + tok.eos_token
    _, labels_all, _ = formats.encode_sample(
        tok, row, formats.EncodeOptions(formats.PROMPT_COMPLETION, 100, completion_only_loss=False)
    )
    assert labels_all[0] == formats.IGNORE and labels_all[1:] == ids[1:]


def test_conversational_prompt_completion_is_rendered_and_trained_as_messages(tok):
    """One rendering, one set of targets: a conversational prompt-completion sample gives the ids and the targets
    of the same conversation as `messages` (the completion's assistant turns and their EOS, not the newline the
    template puts after it), with and without generation markers; only the prompt's own assistant turns differ."""
    no_markers = tok_lib.train_bpe(iter(WORDS * 20 + ["system user assistant be brief"]), 400)
    no_markers.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    pc, msgs = formats.EncodeOptions(formats.PROMPT_COMPLETION, 10_000), formats.EncodeOptions(formats.MESSAGES, 10_000)
    for row in chats(10, seed=4):
        prompt, completion = row["messages"][:-1], row["messages"][-1:]
        for t in (tok, no_markers):
            ids, labels, _ = formats.encode_sample(t, {"prompt": prompt, "completion": completion}, pc)
            ids_m, labels_m, _ = formats.encode_sample(t, row, msgs)
            assert ids == ids_m
            assert trained_text(t, ids, labels) == completion[0]["content"] + t.eos_token  # no trailing newline
            assert all(
                y == y_m for y, y_m in zip(labels, labels_m) if y != formats.IGNORE
            )  # the messages path's targets
            assert labels[-3:] == labels_m[-3:]  # to the end: EOS a target, the newline after it not
            ids_all, labels_all, _ = formats.encode_sample(
                t,
                {"prompt": prompt, "completion": completion},
                formats.EncodeOptions(formats.PROMPT_COMPLETION, 10_000, completion_only_loss=False),
            )
            assert ids_all == ids and labels_all[1:] == ids[1:]


@pytest.mark.parametrize("mode", ["keep_start", "keep_end", "drop"])
def test_overlong_samples_are_truncated_or_dropped_and_counted(tok, mode):
    rows = [{"prompt": "why", "completion": " " + " ".join(["blue"] * n)} for n in (2, 30, 3, 40)]
    rows.append(
        {"prompt": " ".join(["sky"] * 40), "completion": " cat"}
    )  # nothing of the completion survives keep_start
    enc, stats = formats.encode_split(
        Dataset.from_list(rows),
        tok,
        formats.EncodeOptions(formats.PROMPT_COMPLETION, 16, truncation_mode=mode),
        None,
        "train",
    )
    assert all(len(x) <= 16 for x in enc["input_ids"])
    if mode == "drop":
        assert (stats.samples, stats.dropped_too_long, stats.truncated) == (2, 3, 0)
    elif mode == "keep_start":
        assert (stats.samples, stats.truncated, stats.dropped_no_target) == (4, 3, 1)
    else:
        assert (stats.samples, stats.truncated, stats.dropped_no_target) == (5, 3, 0)
    # the banner's count is the rows written, and it names what was cut or left out
    assert stats.samples == len(enc["input_ids"])
    assert (
        stats.describe()
        == {
            "drop": "2 samples, 3 too long, dropped",
            "keep_start": "4 samples, 3 truncated, 1 without target tokens, dropped",
            "keep_end": "5 samples, 3 truncated",
        }[mode]
    )


def test_best_fit_decreasing_packs_every_sample_once():
    rng = random.Random(1)
    lengths = [rng.randint(1, 64) for _ in range(500)]
    rows = collate.best_fit_decreasing(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    assert len(rows) <= sum(lengths) / 64 * 1.1 + 1  # nearly full rows


def test_packed_rows_give_the_same_loss_and_gradients_as_padded_rows(tok):
    """The same samples, packed several per row (position ids restarting, no attention mask) or one per row
    padded per micro-batch: the same token-loss sum, target count and gradients (1e-5)."""
    enc, _ = formats.encode_split(
        Dataset.from_list(chats(24, seed=3)), tok, formats.EncodeOptions(formats.MESSAGES, 512), None, "train"
    )
    packed = collate.pack_samples(enc, 512)
    assert len(packed) < len(enc) / 2  # several samples per row
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    results = []
    for ds, collator in (
        (enc, collate.Collator(tok.pad_token_id, packed=False)),
        (packed, collate.Collator(tok.pad_token_id, packed=True)),
    ):
        model.zero_grad()
        total, count = 0.0, 0
        for start in range(0, len(ds), 5):  # micro-batches of 5 rows: padded ones have uneven widths
            batch = collator.read(ds, list(range(start, min(len(ds), start + 5))))
            loss = model(**batch, use_cache=False, num_items_in_batch=torch.tensor(1)).loss  # as the engines call it
            loss.backward()
            total, count = total + loss.item(), count + collate.count_targets(batch)
        results.append((total, count, [p.grad.clone() for p in model.parameters()]))
    (a, na, ga), (b, nb, gb) = results
    assert na == nb == sum(sum(1 for y in labels if y != formats.IGNORE) for labels in enc["labels"])
    assert a / na == pytest.approx(b / nb, rel=1e-5)
    assert max((x - y).abs().max().item() / y.abs().max().item() for x, y in zip(ga, gb)) < 1e-5


def test_packing_is_refused_where_attention_ignores_boundaries():
    assert collate.packing_supported("llama", "sdpa") and collate.packing_supported("anything", "flash_attention_2")
    assert not collate.packing_supported("no-such-model", "sdpa")


PACKING_FAMILIES = {  # tiny shapes: rotary, learned absolute positions and ALiBi; mask calls with and without positions
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    "mpt": dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=64),
    "biogpt": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gpt_oss": dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "gemma3_text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, sliding_window=8),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(PACKING_FAMILIES))
def test_a_family_packs_samples_only_where_its_attention_stays_in_each_sample(model_type):
    """Where anygpu packs a family's samples (sdpa, or eager), a packed row's loss is the sum of each sample's own loss; OPT,
    BLOOM, Falcon, MPT, BioGPT and gpt-oss build their mask without the position ids that mark the samples (attention
    ran across them): they get one sample per row. Rotary (Llama), learned positions (GPT-2) and Gemma 3's text model
    (its module is gemma3's: it got padding) pack."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=97, **PACKING_FAMILIES[model_type])
    model = AutoModelForCausalLM.from_config(config).eval()  # sdpa, or eager where it has none
    samples = [torch.randint(3, 97, (n,)) for n in (7, 12, 5)]
    batch = collate.Collator(0, packed=True).collate(
        {
            "input_ids": [torch.cat(samples).tolist()],
            "labels": [sum(([formats.IGNORE, *s[1:].tolist()] for s in samples), [])],
            "position_ids": [sum((list(range(len(s))) for s in samples), [])],
        }
    )
    with torch.no_grad():
        alone = sum(F.cross_entropy(model(input_ids=s[None]).logits[0, :-1], s[1:], reduction="sum") for s in samples)
        logits = model(**batch, use_cache=False).logits[0, :-1]
        packed = F.cross_entropy(logits, batch["labels"][0, 1:], reduction="sum", ignore_index=formats.IGNORE)
    supported = collate.packing_supported(model_type, model.config._attn_implementation)
    assert supported == (model_type in ("llama", "gpt2", "gemma3_text")), model_type
    if supported:
        assert packed.item() == pytest.approx(alone.item(), rel=1e-6)
    else:  # what packing would have trained: attention across samples
        assert abs(packed.item() - alone.item()) > 1e-5 * alone.item()


@pytest.mark.parametrize(
    "layout, sample_by, docs", [("lines", "auto", 6), ("paragraphs", "auto", 3), ("lines", "document", 1)]
)
def test_txt_documents(tmp_path, layout, sample_by, docs):
    sep = "\n" if layout == "lines" else "\n\n"
    path = tmp_path / "a.txt"
    path.write_text(
        sep.join(f"document {i} is about the {WORDS[i]}" for i in range(docs if layout == "paragraphs" else 6)) + "\n"
    )
    args = parse_args(["--train_file", str(path), "--txt_sample_by", sample_by])[1]
    raw, _ = sources.load_raw_text(args)
    assert len(raw["train"]) + len(raw.get("validation", [])) == docs
    assert "validation" not in raw  # too few documents to split: prepare carves blocks instead


def test_one_document_per_line_txt_prepares_with_a_carved_validation_split(tmp_path):
    """A .txt of one short document per line (no blank lines), too few to split: every line is a document,
    the validation split is carved from the packed blocks, and the banner says so."""
    rng = random.Random(0)
    path = tmp_path / "lines.txt"
    path.write_text("".join(sentence(rng, 5, 30) + "\n" for _ in range(15)))
    m, d, t = parse_args(
        [
            "--train_file",
            str(path),
            "--config_name",
            "tiny",
            "--block_size",
            "32",
            "--global_batch_size",
            "2",
            "--vocab_size",
            "300",
            "--output_dir",
            str(tmp_path / "out"),
            "--data_cache_dir",
            str(tmp_path / "c"),
        ]
    )
    prep = prepare(m, d, t, DistInfo(0, 0, 1, torch.device("cpu")))
    assert len(prep.datasets["validation"]) >= 1 and len(prep.datasets["train"]) >= 2
    assert "carved" in prep.data_lines[0]
    text = path.read_text()
    eos_count = sum(
        row.count(prep.tokenizer.eos_token_id)
        for split in ("train", "validation")
        for row in prep.datasets[split]["input_ids"]
    )
    assert eos_count >= 0.8 * len(text.splitlines()) - 2  # an EOS after (nearly) every line: one document each


def test_chat_rows_are_cached_with_their_counts(tmp_path, tok, caplog):
    raw = DatasetDict(train=Dataset.from_list(chats(10)))
    opts = formats.EncodeOptions(formats.MESSAGES, 64)
    rows, stats = samples.build_rows(raw, tok, opts, True, "fp", str(tmp_path))
    with caplog.at_level(logging.INFO):
        again, stats2 = samples.build_rows(raw, tok, opts, True, "fp", str(tmp_path))
    assert "from cache" in caplog.text and stats2 == stats and again["train"]["input_ids"] == rows["train"]["input_ids"]
    assert json.dumps(stats2["train"].__dict__)


@pytest.mark.parametrize("option, value", [("--truncation_mode", "cut"), ("--txt_sample_by", "sentence")])
def test_unknown_choices_are_refused_with_the_valid_ones(option, value):
    with pytest.raises(ValueError, match=f"{option} '{value}' is unknown: use one of"):
        parse_args([option, value])
