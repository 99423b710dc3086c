"""SFT rows as TRL's SFTTrainer tokenises them, on unlike tokenizers (byte-level BPE, SentencePiece-style BPE that
adds a BOS) and templates (Qwen2.5 with tools, Qwen3 with `enable_thinking`, DeepSeek-R1, which renders a prompt
differently once its answer follows): string prompt + completion tokenised as one text (a completion that already ends
with EOS gets no second one), conversational prompt + completion split where the rendered prompt and the whole
conversation diverge, `tools` and `chat_template_kwargs` passed to the template. The same ids; the same targets, less
the first token (never a target in anygpu) and whitespace the template puts between turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trl
from datasets import Dataset

from anygpu.data import formats

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<s>", "</s>", "<unk>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]  # fmt: skip
WORDS = "the sky is blue green why how what colour sea too hello world today weather paris city think".split()
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
ASK = [{"role": "user", "content": "what colour is the sky"}]
EARLIER = [*ASK, {"role": "assistant", "content": "<think>sky</think>blue"}, {"role": "user", "content": "and the sea"}]
ANSWER = [{"role": "assistant", "content": "blue too"}]


def tokenizer(kind: str, template: str, eos: str, bos: str | None = None):
    """A small trained tokenizer of `kind` (bytelevel, or metaspace: SentencePiece's ▁ words, BOS added)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None if kind == "bytelevel" else "<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder, alphabet = decoders.Metaspace(replacement="▁", prepend_scheme="first"), []
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) + ":\n\n" for i in range(len(WORDS))] * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, bos_token=bos)
    out.chat_template = (TEMPLATES / template).read_text()
    return out


def trl_rows(tok, rows: list[dict], tmp_path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each row as TRL's SFTTrainer prepares them (completion-only loss, TRL's default;
    the assistant-only loss for `messages`, anygpu's default)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    args = SFTConfig(output_dir=str(tmp_path), max_length=None, packing=False, padding_free=False, report_to="none",
                     use_cpu=True, dataset_num_proc=None, assistant_only_loss="messages" in rows[0])  # fmt: skip
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    return [(list(r["input_ids"]), list(r["labels"])) for r in trainer.train_dataset]


def assert_as_trl(tok, rows: list[dict], tmp_path, between_turns: bool) -> None:
    """anygpu's ids are TRL's; its targets are TRL's but the first token and, where `between_turns`, tokens of
    whitespace alone (a template's newline after a turn's end)."""
    for row, (ids_trl, labels_trl) in zip(rows, trl_rows(tok, rows, tmp_path)):
        fmt = formats.MESSAGES if "messages" in row else formats.PROMPT_COMPLETION
        ids, labels, _ = formats.encode_sample(tok, row, formats.EncodeOptions(fmt, 10_000))
        assert ids == ids_trl, (row, tok.decode(ids), tok.decode(ids_trl))
        ours = {i for i, y in enumerate(labels) if y != formats.IGNORE}
        theirs = {i for i, y in enumerate(labels_trl) if y != formats.IGNORE} - {0}
        left_out = {i for i in theirs - ours if between_turns and not tok.decode([ids[i]]).strip()}
        assert ours == theirs - left_out, (row, tok.decode([ids[i] for i in sorted(ours)]))
        assert all(labels[i] == ids[i] for i in ours)


@pytest.mark.parametrize("kind,bos", [("bytelevel", None), ("metaspace", "<s>")])
def test_string_prompt_and_completion_are_tokenised_as_one_text(kind, bos, tmp_path):
    """A completion that starts mid-word trains the tokens of the whole text (TRL's), not a second word's start; an
    EOS the completion ends with is not doubled."""
    tok = tokenizer(kind, "qwen2_5.jinja", eos="<|im_end|>", bos=bos)
    rows = [
        {"prompt": "hello wor", "completion": "ld today"},
        {"prompt": "what colour is the sky", "completion": " blue"},
        {"prompt": "why", "completion": " blue<|im_end|>"},
    ]
    assert_as_trl(tok, rows, tmp_path, between_turns=False)
    ids, labels, _ = formats.encode_sample(tok, rows[2], formats.EncodeOptions(formats.PROMPT_COMPLETION, 100))
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id


def test_conversations_take_their_tools_and_template_arguments(tmp_path):
    """Qwen2.5 renders the `tools` column (a list, or JSON text as datasets often hold it) into its system turn;
    Qwen3 takes `chat_template_kwargs` (no thinking) and renders an earlier answer without its reasoning."""
    qwen25 = tokenizer("bytelevel", "qwen2_5.jinja", eos="<|im_end|>")
    rows = [
        {"prompt": ASK, "completion": ANSWER, "tools": TOOLS},
        {"prompt": EARLIER, "completion": ANSWER, "tools": TOOLS},
    ]
    assert_as_trl(qwen25, rows, tmp_path, between_turns=True)
    assert_as_trl(qwen25, [{**row, "tools": json.dumps(TOOLS)} for row in rows], tmp_path, between_turns=True)
    chats = [{"messages": row["prompt"] + row["completion"], "tools": TOOLS} for row in rows]
    assert_as_trl(qwen25, chats, tmp_path, between_turns=True)
    ids, _, _ = formats.encode_sample(qwen25, rows[0], formats.EncodeOptions(formats.PROMPT_COMPLETION, 10_000))
    assert '"name": "weather"' in qwen25.decode(ids)
    qwen3 = tokenizer("metaspace", "qwen3.jinja", eos="<|im_end|>")
    off = {"enable_thinking": False}
    rows = [
        {"prompt": ASK, "completion": ANSWER, "chat_template_kwargs": off},
        {"prompt": EARLIER, "completion": ANSWER, "chat_template_kwargs": off},
    ]
    assert_as_trl(qwen3, rows, tmp_path, between_turns=True)
    ids, _, _ = formats.encode_sample(qwen3, rows[1], formats.EncodeOptions(formats.PROMPT_COMPLETION, 10_000))
    chats = [{"messages": row["prompt"] + row["completion"], "chat_template_kwargs": off} for row in rows]
    assert_as_trl(qwen3, chats, tmp_path, between_turns=True)  # TRL's training template, given the arguments too
    assert "sky</think>" not in qwen3.decode(ids) and "<unk>" not in qwen3.decode(
        ids
    )  # reasoning dropped, as at inference


def test_a_prompt_rendered_differently_before_its_answer_trains_from_where_they_diverge(tmp_path):
    """DeepSeek-R1's template opens `<think>` after a prompt's generation prompt, not inside the conversation: the
    completion starts where the two renderings part (TRL's rule), instead of a refusal."""
    tok = tokenizer(
        "bytelevel", "deepseek_r1_distill.jinja", eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"
    )
    rows = [{"prompt": ASK, "completion": ANSWER}, {"prompt": EARLIER, "completion": ANSWER}]
    assert_as_trl(tok, rows, tmp_path, between_turns=True)
    ids, labels, _ = formats.encode_sample(tok, rows[0], formats.EncodeOptions(formats.PROMPT_COMPLETION, 10_000))
    assert tok.decode([t for t, y in zip(ids, labels) if y != formats.IGNORE]) == "blue too<｜end▁of▁sentence｜>"
