"""Data formats detected from the columns, as TRL does, and their encoding into trainable samples.

- `text`: raw text, packed into full `block_size` blocks across documents (anygpu.data.packing);
- `prompt` + `completion` (strings, or lists of messages: conversational prompt-completion);
- `messages`: a list of `{role, content}`, rendered with the tokenizer's chat template.

A prompt-completion or messages sample becomes `input_ids` and `labels`, where `labels` is -100 on
the tokens that are not trained on (the prompt, the non-assistant turns) and always on the first
token: no token predicts it within its sample, so a packed row never trains one sample's last token
to predict the next sample's first. Samples longer than the maximum length are truncated or dropped
(`--truncation_mode`); samples left without any target token are dropped; both are counted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Iterator

from datasets import Dataset, DatasetDict

from anygpu.data import chat_template, training_template
from anygpu.errors import UsageError

TEXT, PROMPT_COMPLETION, MESSAGES, PREFERENCE = "text", "prompt_completion", "messages", "preference"
IGNORE = -100
TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")  # what a row gives the chat template besides its messages
logger = logging.getLogger(__name__)


def detect_format(columns: list[str], text_column: str, where: str) -> str:
    """The format of a data set with these columns; TRL's precedence: preference pairs (chosen + rejected, with or
    without prompt), messages, prompt + completion, text."""
    if "chosen" in columns and "rejected" in columns:
        return PREFERENCE
    if "messages" in columns:
        return MESSAGES
    if "prompt" in columns and "completion" in columns:
        return PROMPT_COMPLETION
    if text_column in columns:
        return TEXT
    raise UsageError(
        f"--text_column {text_column!r} is not a column of {where}: its columns are {columns}. Name the text column "
        "with --text_column, or give 'prompt' and 'completion' columns, or a 'messages' column (chat)."
    )


def training_texts(ds: Dataset, fmt: str, text_column: str, batch: int = 1000) -> Iterator[str]:
    """Every string of the data set, for training a tokenizer on the spot."""
    columns = {
        TEXT: [text_column],
        PROMPT_COMPLETION: ["prompt", "completion"],
        MESSAGES: ["messages"],
        PREFERENCE: [c for c in ("prompt", "chosen", "rejected") if c in ds.column_names],
    }[fmt]
    for i in range(0, len(ds), batch):
        rows = ds[i : i + batch]
        for column in columns:
            for value in rows[column]:
                if isinstance(value, str):
                    if value:
                        yield value
                elif value:  # a list of messages (None: a row without this column's value)
                    yield from (m["content"] for m in value if m.get("content"))


def row_key(ds: Dataset, fmt: str, text_column: str) -> Iterator[bytes]:
    """The content of each row as bytes, for fingerprinting in-memory data sets."""
    known = ("prompt", "completion", "messages", "chosen", "rejected", *TEMPLATE_COLUMNS)
    columns = [text_column] if fmt == TEXT else [c for c in known if c in ds.column_names]
    for i in range(0, len(ds), 1000):
        rows = ds[i : i + 1000]
        for values in zip(*(rows[c] for c in columns)):
            yield json.dumps(values, sort_keys=True, default=str).encode("utf-8", errors="replace")


def _encode_chat(
    tokenizer, messages: list[dict[str, Any]], assistant_only: bool, kwargs: dict[str, Any]
) -> tuple[list[int], list[bool]]:
    """`chat_template.encode_chat`, rendered with TRL's training version of the template where the tokenizer's own
    cannot find the assistant's tokens (`training_template`)."""
    template = training_template.for_assistant_loss(tokenizer) if assistant_only else None
    return chat_template.encode_chat(tokenizer, messages, assistant_only, template, **kwargs)


def _encode_text_completion(
    tokenizer, prompt: str, completion: str, completion_only: bool
) -> tuple[list[int], list[bool]]:
    """TRL's: prompt and completion tokenised as one text (a completion may start mid-word), with the tokenizer's
    usual specials (BOS where it adds one) and EOS at the end, a target, so the model learns where to stop (not a
    second one where the completion ends with it). The targets start where the prompt's own tokens and the whole's
    diverge."""
    ids = list(tokenizer(prompt + completion)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    start = chat_template.common_prefix_length(tokenizer(prompt)["input_ids"], ids) if completion_only else 0
    return ids, [i >= start for i in range(len(ids))]


def _encode_chat_completion(
    tokenizer, prompt: list[dict], completion: list[dict], completion_only: bool, kwargs: dict[str, Any]
) -> tuple[list[int], list[bool]]:
    """TRL's: the conversation rendered with the tokenizer's own template, the targets from where it and the prompt
    rendered with its generation prompt diverge (a template may render a prompt differently once its answer
    follows: DeepSeek-R1 opens its reasoning there); of those, the assistant's tokens where the template marks them,
    else all but the whitespace the template ends with."""
    prompt, completion = chat_template.clean_messages(prompt), chat_template.clean_messages(completion)
    marked = completion_only and chat_template.has_generation_markers(tokenizer)
    ids, trained = chat_template.encode_chat(tokenizer, prompt + completion, marked, **kwargs)
    if not completion_only:
        return ids, trained
    prompt_ids = chat_template.chat_ids(tokenizer, prompt, add_generation_prompt=True, **kwargs)
    start = chat_template.common_prefix_length(prompt_ids, ids)
    if start < len(prompt_ids):
        _say_diverged(tokenizer, prompt_ids[start:])
    end = len(ids)
    while not marked and end > start and not tokenizer.decode([ids[end - 1]]).strip():
        end -= 1
    return ids, [t and start <= i < end for i, t in enumerate(trained)]


_DIVERGED: set[str] = set()  # the templates already said


def _say_diverged(tokenizer, tail: list[int]) -> None:
    """Once per template: the prompt's rendering ends differently inside the conversation (TRL warns the same)."""
    if tokenizer.chat_template in _DIVERGED:
        return
    _DIVERGED.add(tokenizer.chat_template)
    logger.warning(
        "the chat template renders a prompt alone differently from inside its conversation: the completion is trained "
        "from where they part, and the prompt's own ending %r is not in the trained row (as TRL does)",
        tokenizer.decode(tail),
    )


@dataclass
class EncodeStats:
    """What happened to the samples of one split, for the banner."""

    samples: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    target_tokens: int = 0

    def describe(self) -> str:
        parts = [f"{self.samples} samples"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        if self.dropped_too_long:
            parts.append(f"{self.dropped_too_long} too long, dropped")
        if self.dropped_no_target:
            parts.append(f"{self.dropped_no_target} without target tokens, dropped")
        return ", ".join(parts)


@dataclass(frozen=True)
class EncodeOptions:
    fmt: str
    max_length: int
    completion_only_loss: bool = True
    assistant_only_loss: bool = True
    truncation_mode: str = "keep_start"

    def key(self) -> str:
        return f"{self.fmt}|{self.max_length}|{self.completion_only_loss}|{self.assistant_only_loss}|{self.truncation_mode}"


def encode_sample(tokenizer, row: dict[str, Any], opts: EncodeOptions) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels, overlong) of one sample, before dropping; labels -100 where not trained on."""
    kwargs = chat_template.template_kwargs(row)
    if opts.fmt == MESSAGES:
        ids, trained = _encode_chat(tokenizer, row["messages"], opts.assistant_only_loss, kwargs)
    elif isinstance(row["prompt"], str):
        ids, trained = _encode_text_completion(tokenizer, row["prompt"], row["completion"], opts.completion_only_loss)
    else:
        prompt, completion = row["prompt"], row["completion"]
        ids, trained = _encode_chat_completion(tokenizer, prompt, completion, opts.completion_only_loss, kwargs)
    labels = [t if keep else IGNORE for t, keep in zip(ids, trained)]
    overlong = len(ids) > opts.max_length
    if overlong and opts.truncation_mode == "keep_start":
        ids, labels = ids[: opts.max_length], labels[: opts.max_length]
    elif overlong and opts.truncation_mode == "keep_end":
        ids, labels = ids[-opts.max_length :], labels[-opts.max_length :]
    if labels:
        labels[0] = IGNORE
    return ids, labels, overlong


def encode_split(
    ds: Dataset, tokenizer, opts: EncodeOptions, num_proc: int | None, split: str
) -> tuple[Dataset, EncodeStats]:
    """Tokenise and mask every sample of a split; drop what cannot be trained on; count what happened."""
    columns = ["messages"] if opts.fmt == MESSAGES else ["prompt", "completion"]
    columns += [c for c in TEMPLATE_COLUMNS if c in ds.column_names]

    def encode(batch: dict) -> dict:
        out = {"input_ids": [], "labels": [], "overlong": [], "num_targets": []}
        for values in zip(*(batch[c] for c in columns)):
            ids, labels, overlong = encode_sample(tokenizer, dict(zip(columns, values)), opts)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["overlong"].append(overlong)
            out["num_targets"].append(sum(1 for t in labels if t != IGNORE))
        return out

    enc = ds.map(
        encode, batched=True, remove_columns=ds.column_names, num_proc=num_proc, desc=f"encode {split} ({opts.fmt})"
    )
    overlong, num_targets = enc["overlong"], enc["num_targets"]
    drop_long = opts.truncation_mode == "drop"
    keep = [i for i, (o, n) in enumerate(zip(overlong, num_targets)) if n > 0 and not (drop_long and o)]
    stats = EncodeStats(
        samples=len(keep),
        truncated=0 if drop_long else sum(overlong),
        dropped_too_long=sum(overlong) if drop_long else 0,
        dropped_no_target=sum(1 for o, n in zip(overlong, num_targets) if n == 0 and not (drop_long and o)),
        target_tokens=sum(num_targets[i] for i in keep),
    )
    enc = enc.select(keep) if len(keep) < len(enc) else enc
    stats.tokens = sum(len(x) for x in enc["input_ids"])
    return enc.remove_columns(["overlong", "num_targets"]), stats


def encode(
    raw: DatasetDict, tokenizer, opts: EncodeOptions, num_proc: int | None
) -> tuple[DatasetDict, dict[str, EncodeStats]]:
    out, stats = DatasetDict(), {}
    for split, ds in raw.items():
        out[split], stats[split] = encode_split(ds, tokenizer, opts, num_proc, split)
    return out, stats
