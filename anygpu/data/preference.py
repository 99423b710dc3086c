"""Preference pairs (`--objective dpo`) in TRL's formats, tokenised as TRL's `DPOTrainer` tokenises them.

Rows hold `chosen` and `rejected`, with or without `prompt`, as strings or as message lists (conversational):
- explicit prompt: `prompt` / `chosen` / `rejected`;
- implicit prompt: `chosen` and `rejected` alone, sharing a prefix (strings: characters; conversations:
  messages), which becomes the prompt (TRL's `extract_prompt`, its rule kept: a space before the first differing
  character stays with the completions).

As TRL 1.16's `DPOTrainer._prepare_dataset`: a string completion gets the tokenizer's EOS appended unless it ends
with it; strings are tokenised with the tokenizer's own special tokens (BOS where it adds one) as `prompt`,
`prompt + chosen` and `prompt + rejected`; conversations are rendered with the chat template (the prompt with the
generation prompt, `tools` and `chat_template_kwargs` columns passed on); the completion starts where the prompt's
tokens and the whole sequence's first differ. A row becomes `prompt_ids`, `chosen_ids`, `rejected_ids`, cut to
`--block_size` per sequence when batched (`pair_batches`).

Refused in one line, naming the row: a row without a chosen or rejected, a chosen equal to its rejected, a prompt
that leaves no completion token within `--block_size` (TRL drops those silently; `--truncation_mode drop` leaves
them out here, counted), strings mixed with message lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset, DatasetDict, load_from_disk

from anygpu.data import chat_template
from anygpu.data.formats import PREFERENCE
from anygpu.data.pair_batches import PairCollator
from anygpu.data.samples import TrainingRows, carve_validation
from anygpu.data.tokenizer import tokenizer_key
from anygpu.errors import UsageError

PAIRS_VERSION = "1"
STATS_FILE = "anygpu_pair_stats.json"
COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
OK, MISSING, SAME, PROMPT_TOO_LONG, MIXED = "", "missing", "same", "prompt_too_long", "mixed"


def is_conversational(value: Any) -> bool:
    """A list of `{role, content}` messages (TRL's test: the first element is a dict with a role)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def extract_prompt(chosen, rejected) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of an implicit-prompt row: `trl.data_utils.extract_prompt` (TRL 1.16), whose loop
    leaves `idx` at the last compared position when no element differs. A space before the first differing character
    goes to the completions; unlike TRL, only after a shared character (TRL also moves a last character that is a space
    when the very first characters differ)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx > 0 and chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def tokenize_pair(tokenizer, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, chosen_ids, rejected_ids) of one row, as TRL's DPOTrainer makes them."""
    if row.get("prompt") is None:
        prompt, chosen, rejected = extract_prompt(row["chosen"], row["rejected"])
    else:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if is_conversational(chosen) or is_conversational(prompt):
        kwargs = chat_template.template_kwargs(row)
        prompt_ids = chat_template.chat_ids(tokenizer, prompt, add_generation_prompt=True, **kwargs)
        with_chosen = chat_template.chat_ids(tokenizer, prompt + chosen, **kwargs)
        with_rejected = chat_template.chat_ids(tokenizer, prompt + rejected, **kwargs)
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = tokenizer(prompt)["input_ids"]
        with_chosen = tokenizer(prompt + chosen)["input_ids"]
        with_rejected = tokenizer(prompt + rejected)["input_ids"]
    prefix = chat_template.common_prefix_length
    n = min(prefix(prompt_ids, with_chosen), prefix(prompt_ids, with_rejected))
    return prompt_ids[:n], with_chosen[n:], with_rejected[n:]


def problem_of(row: dict[str, Any]) -> str:
    """Why a raw row cannot be a pair (before tokenising), or OK."""
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    if chosen is None or rejected is None or chosen == [] or rejected == []:
        return MISSING
    kinds = {isinstance(v, str) for v in (chosen, rejected, prompt) if v is not None}
    if len(kinds) > 1:
        return MIXED
    return SAME if chosen == rejected else OK


@dataclass
class PairStats:
    """What happened to the pairs of one split, for the banner."""

    pairs: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    tokens: int = 0  # prompt + chosen and prompt + rejected, cut to the block
    conversational: bool = False
    implicit_prompt: bool = False

    def describe(self) -> str:
        kind = "conversational" if self.conversational else "plain text"
        parts = [f"{self.pairs} pairs ({kind}{', implicit prompt' if self.implicit_prompt else ''})"]
        if self.truncated:
            parts.append(f"{self.truncated} cut to the block")
        if self.dropped_too_long:
            parts.append(f"{self.dropped_too_long} longer than the block, dropped")
        return ", ".join(parts) + f", {self.tokens} tokens"


def _describe_row(row: dict[str, Any]) -> str:
    text = json.dumps(row.get("prompt") if row.get("prompt") is not None else row.get("chosen"), default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse(problem: str, where: str, index: int, row: dict[str, Any], max_length: int, prompt_tokens: int) -> None:
    """The one line for a row that cannot be trained on (`where`: the argument and the split)."""
    at = f"{where}, row {index} ({_describe_row(row)})"
    if problem == MISSING:
        raise UsageError(f"{at} has no chosen or no rejected: --objective dpo needs both in every row; remove it.")
    if problem == SAME:
        raise UsageError(f"{at}: its chosen equals its rejected, a pair that teaches nothing; remove it.")
    if problem == MIXED:
        raise UsageError(
            f"{at} mixes strings and message lists: give prompt, chosen and rejected all as strings or all as "
            "lists of {role, content} messages."
        )
    raise UsageError(
        f"{at}: its prompt is {prompt_tokens} tokens, leaving no completion token within --block_size {max_length}: "
        f"use --block_size {prompt_tokens + 1} or more, or --truncation_mode drop to leave such pairs out."
    )


def _encode_batch(batch: dict[str, list], tokenizer, max_length: int, truncation_mode: str) -> dict[str, list]:
    """`Dataset.map` body: the token ids of each row and what is wrong with it (checked in the main process)."""
    out: dict[str, list] = {c: [] for c in (*COLUMNS, "problem", "overlong", "conversational")}
    names = list(batch)
    for values in zip(*(batch[c] for c in names)):
        row = dict(zip(names, values))
        problem, ids = problem_of(row), ([], [], [])
        if problem == OK:
            ids = tokenize_pair(tokenizer, row)
            if truncation_mode != "keep_end" and len(ids[0]) >= max_length:
                problem = PROMPT_TOO_LONG
        for column, value in zip(COLUMNS, ids):
            out[column].append(value)
        out["problem"].append(problem)
        longest = len(ids[0]) + max(len(ids[1]), len(ids[2]))
        out["overlong"].append(longest > max_length)
        out["conversational"].append(is_conversational(row.get("chosen")))
    return out


def encode_split(
    ds: Dataset, tokenizer, max_length: int, truncation_mode: str, num_proc: int | None, where: str
) -> tuple[Dataset, PairStats]:
    """Tokenise every pair of a split; refuse the first bad row; drop (and count) what --truncation_mode drop drops."""
    enc = ds.map(
        _encode_batch,
        batched=True,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "truncation_mode": truncation_mode},
        remove_columns=ds.column_names,
        num_proc=num_proc,
        desc=f"encode {where} (preference pairs)",
    )
    problems, overlong = enc["problem"], enc["overlong"]
    drop = truncation_mode == "drop"
    for i, problem in enumerate(problems):
        if problem and not (drop and problem == PROMPT_TOO_LONG):
            refuse(problem, where, i, ds[i], max_length, len(enc[i]["prompt_ids"]))
    keep = [i for i, o in enumerate(overlong) if not (drop and o)]
    stats = PairStats(
        pairs=len(keep),
        truncated=0 if drop else sum(overlong),
        dropped_too_long=len(overlong) - len(keep),
        conversational=any(enc["conversational"]),
        implicit_prompt="prompt" not in ds.column_names,
    )
    enc = enc.select(keep) if len(keep) < len(enc) else enc
    enc = enc.remove_columns(["problem", "overlong", "conversational"])
    stats.tokens = int(sequence_lengths(enc, max_length).sum())
    return enc, stats


def sequence_lengths(pairs: Dataset, max_length: int) -> np.ndarray:
    """(pairs, 2): the tokens of prompt + chosen and of prompt + rejected of each pair, cut to the block, read from
    the Arrow list lengths (no row decoded)."""
    import pyarrow.compute as pc

    table = pairs.select_columns(list(COLUMNS)).with_format("arrow")[:]
    n = {c: pc.list_value_length(table[c]).to_numpy(zero_copy_only=False).astype(np.int64) for c in COLUMNS}
    both = np.stack([n["prompt_ids"] + n["chosen_ids"], n["prompt_ids"] + n["rejected_ids"]], axis=1)
    return np.minimum(both, max_length)


def pairs_key(corpus_fingerprint: str, tokenizer, max_length: int, truncation_mode: str) -> str:
    """The prepared pairs' cache key: the corpus, the tokenizer (vocabulary, specials, chat template), the options."""
    text = f"{PAIRS_VERSION}|{corpus_fingerprint}|{tokenizer_key(tokenizer)}|{max_length}|{truncation_mode}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def build_pairs(
    raw: DatasetDict,
    tokenizer,
    max_length: int,
    truncation_mode: str,
    corpus_fingerprint: str,
    cache_dir: str,
    where: dict[str, str],
    num_proc: int | None = None,
) -> tuple[DatasetDict, dict[str, PairStats], str]:
    """The pairs of every split (columns prompt_ids, chosen_ids, rejected_ids), their counts and the cache key."""
    key = pairs_key(corpus_fingerprint, tokenizer, max_length, truncation_mode)
    path = Path(cache_dir) / "pairs" / key
    if (path / STATS_FILE).exists():
        stats = {k: PairStats(**v) for k, v in json.loads((path / STATS_FILE).read_text()).items()}
        return load_from_disk(str(path)), stats, key
    rows, stats = DatasetDict(), {}
    for split, ds in raw.items():
        rows[split], stats[split] = encode_split(ds, tokenizer, max_length, truncation_mode, num_proc, where[split])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{key}."))
    rows.save_to_disk(str(tmp))
    (tmp / STATS_FILE).write_text(json.dumps({k: asdict(v) for k, v in stats.items()}))
    try:
        os.replace(tmp, path)
    except OSError:  # another node filled it first
        shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(path)), stats, key


def check_format(fmt: str, is_dpo: bool, columns: list[str], data_args) -> None:
    """Preference rows and --objective dpo go together."""
    source = split_names(data_args)["train"].removesuffix(" (train split)")
    if is_dpo and fmt != PREFERENCE:
        raise UsageError(
            f"--objective dpo: {source} has no 'chosen' and 'rejected' columns (its columns: {columns}); give "
            "preference rows (prompt, chosen, rejected: TRL's format), or train with --objective lm."
        )
    if fmt == PREFERENCE and not is_dpo:
        raise UsageError(
            f"{source} holds preference pairs ('chosen' and 'rejected' columns): train on them with --objective dpo."
        )


def split_names(data_args) -> dict[str, str]:
    """Each split's origin as a user names it, for the refusals."""
    if data_args.train_file or data_args.dataset_name:
        source = (
            f"--train_file {data_args.train_file}"
            if data_args.train_file
            else f"--dataset_name {data_args.dataset_name}"
        )
    else:
        source = "the embedded default corpus (no --train_file)"
    validation = f"--validation_file {data_args.validation_file}" if data_args.validation_file else source
    return {"train": f"{source} (train split)", "validation": f"{validation} (validation split)"}


@dataclass
class PairRows(TrainingRows):
    """The pairs both engines train and evaluate on (`TrainingRows` for preference data) and their cache key."""

    pairs_key: str = ""

    def describe(self) -> list[str]:
        kind = "packed (several sequences a row, attention confined to each)" if self.packed else "padded"
        lines = [
            f"data: {len(self.rows['train'])} train / {len(self.rows['validation'])} eval preference pairs, "
            f"chosen and rejected in one forward, {kind}"
            + (" (validation carved from the training pairs)" if self.carved_validation else "")
        ]
        lines += [f"  {split}: {s.describe()}" for split, s in self.stats.items()]
        if self.default_template:
            lines.append(
                "  chat template: the tokenizer has none; anygpu's default (ChatML layout, turns end with EOS)"
            )
        return lines


def make_pairs(
    raw: DatasetDict, tokenizer, block_size: int, data_args, packing: bool, corpus_fingerprint: str, num_proc=None
) -> PairRows:
    """Tokenise the raw preference rows into pairs; carve a validation split when there is none."""
    first = raw["train"][0]
    default_template = False
    if is_conversational(first.get("chosen")) or is_conversational(first.get("prompt")):
        default_template = chat_template.ensure_chat_template(tokenizer)
    rows, stats, key = build_pairs(
        raw,
        tokenizer,
        block_size,
        data_args.truncation_mode,
        corpus_fingerprint,
        data_args.data_cache_dir,
        split_names(data_args),
        num_proc,
    )
    carved = "validation" not in rows
    if carved:
        rows = carve_validation(rows["train"], data_args.validation_split_percentage)
    collator = PairCollator(tokenizer.pad_token_id, block_size, data_args.truncation_mode, packing)
    return PairRows(rows, collator, PREFERENCE, packing, stats, default_template, carved, key)


def check_reference(model_args, train_args, config) -> None:
    """--ref_model_name_or_path scores the policy's tokens: the same vocabulary, the same tokenizer (when the
    reference folder has one). Read from the folders before any work."""
    scores = train_args.is_dpo or (train_args.is_grpo and train_args.beta > 0)  # DPO's pairs, GRPO's KL term
    path = train_args.ref_model_name_or_path if scores else None
    if not path:
        return
    from transformers import AutoConfig, AutoTokenizer

    ref_config = AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    ref_vocab, vocab = getattr(ref_config, "vocab_size", None), getattr(config, "vocab_size", None)
    policy = model_args.tokenizer_name or model_args.model_name_or_path
    try:
        ref_tokens = AutoTokenizer.from_pretrained(path, trust_remote_code=model_args.trust_remote_code).get_vocab()
    except (OSError, ValueError):  # no tokenizer saved with the reference: its vocabulary size decides alone
        ref_tokens = None
    tokens = AutoTokenizer.from_pretrained(policy, trust_remote_code=model_args.trust_remote_code).get_vocab()
    if ref_vocab != vocab or (ref_tokens is not None and ref_tokens != tokens):
        what = f"vocabulary of {ref_vocab}" if ref_vocab != vocab else f"tokenizer ({len(ref_tokens)} tokens)"
        raise UsageError(
            f"--ref_model_name_or_path {path}: its {what} differs from the policy's ({vocab} in the model, "
            f"{len(tokens)} tokens in {policy}), so it cannot score the policy's tokens: give a reference with the "
            "policy's tokenizer (usually the SFT model the policy starts from), or leave it out (the starting model)."
        )
