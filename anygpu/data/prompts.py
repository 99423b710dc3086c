"""Prompt rows (`--objective grpo`) in TRL's prompt-only format, tokenised as TRL's GRPOTrainer tokenises them.

A row holds `prompt`: a string, or a conversation (a list of `{role, content}` messages, a system turn allowed).
Every other column is kept and passed to the reward functions by name (TRL's `reward_kwargs`: all columns but
`prompt`, `completion` and `completion_ids`), `chosen`, `rejected` and `messages` included. A data set with
`messages` and no `prompt` is refused (which turns make the prompt is the user's choice, not ours).

As TRL 1.16's `_tokenize_prompts` and the DPO prompts of `preference`: a string with the tokenizer's own special
tokens (BOS where it adds one), a conversation through the chat template with the generation prompt (`tools` and
`chat_template_kwargs` columns passed on). The last `--max_prompt_length` tokens are kept (TRL's former
`truncation_side="left"`), and the cut ones counted. An empty prompt is refused, naming its row.

With no data arguments the prompts are the opening lines of the standard library's functions (`default_prompts`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from datasets import Dataset, DatasetDict, List, Value

from anygpu.config.args import DataArguments
from anygpu.data import chat_template, files, readers
from anygpu.data.order import eval_subset
from anygpu.data.preference import is_conversational, split_names
from anygpu.data.sources import content_key, load_given, stdlib_corpus
from anygpu.errors import UsageError

PROMPT, IDS = "prompt", "prompt_ids"
CUT, EMPTY = "anygpu_cut", "anygpu_empty"  # the encoding's own, dropped after
NOT_PASSED = ("prompt", "completion", "completion_ids")  # TRL passes these under its own names, never as columns
DEFAULT_TRAIN, DEFAULT_EVAL = 4096, 256  # the embedded default's prompts per split
# a default prompt's length: ~64 tokens or fewer with a BPE trained on such code (~3 characters a token); a longer
# one is cut by --max_prompt_length
DEFAULT_MAX_CHARS = 160
_DEF = re.compile(r"^([ \t]*)def \w+\(.*\).*:[ \t]*$")  # a signature on one line
_DOCSTRING = ('"""', "'''", 'r"""', "r'''")


# ---- checks before any work ------------------------------------------------------------------------------------


def check_columns(columns: list[str], where: str) -> None:
    """Refuse data without a `prompt` column, naming the columns it has."""
    if PROMPT in columns:
        return
    if "messages" in columns:
        raise UsageError(
            f"--objective grpo: {where} has a 'messages' column but no 'prompt' column: grpo samples the replies "
            "itself, so give each row's conversation up to the turn to answer as 'prompt' (a list of {role, "
            "content} messages, ending with the user's turn), or train on the conversations with --objective lm."
        )
    raise UsageError(
        f"--objective grpo: {where} has no 'prompt' column (its columns: {columns}); give prompt rows (TRL's "
        "prompt-only format: 'prompt', text or a list of {role, content} messages, other columns passed to "
        "--reward_funcs by name), or train on this data with --objective lm."
    )


def check_source(args: DataArguments) -> None:
    """The prompt sources the arguments name, from their files' first rows (a hub data set's columns are checked
    once loaded): raw text files and mixtures give no prompts."""
    if args.dataset_mixture:
        raise UsageError(
            "--dataset_mixture with --objective grpo: a mixture's sources are raw text, not prompts; give prompt "
            "rows with --train_file or --dataset_name."
        )
    if args.dataset_name or not args.train_file:
        return
    for option, path in (("--train_file", args.train_file), ("--validation_file", args.validation_file)):
        if path:
            first = files.expand(path, option)[0]
            columns = readers.first_columns(first, args.text_column)
            if columns:  # [] : unreadable, refused in one line when loaded
                check_columns(columns, f"{option} {path}" + (" (raw text)" if first.builder == "text" else ""))


def check_lengths(max_prompt_length: int, max_completion_length: int, limit: int | None) -> None:
    """A prompt and its completion fit the model's positions."""
    if limit is None or max_prompt_length + max_completion_length <= limit:
        return
    prompt = min(max_prompt_length, max(1, limit // 4))
    raise UsageError(
        f"--max_prompt_length {max_prompt_length} + --max_completion_length {max_completion_length} = "
        f"{max_prompt_length + max_completion_length} tokens exceed the model's {limit} positions "
        f"(max_position_embeddings): use e.g. --max_prompt_length {prompt} --max_completion_length {limit - prompt}."
    )


def check_tokenizer(tokenizer, model_args) -> None:
    """Completions end at the EOS token, and a batch of prompts is padded: both must exist."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        source = (
            f"--tokenizer_name {model_args.tokenizer_name}"
            if model_args.tokenizer_name
            else f"--model_name_or_path {model_args.model_name_or_path}"
        )
        raise UsageError(
            f"{source}: the tokenizer has no {'EOS' if tokenizer.eos_token_id is None else 'padding'} token, which "
            "--objective grpo needs (completions end at EOS; prompts are padded): use a tokenizer that has one."
        )


# ---- raw prompts --------------------------------------------------------------------------------------------------


def function_prompts(text: str) -> Iterator[str]:
    """The opening of each function of a Python source whose signature fits one line: the `def` line, dedented,
    and the first line of its docstring where one follows, each ending with a line break."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _DEF.match(line)
        if not m:
            continue
        indent = len(m.group(1))
        prompt = line[indent:] + "\n"
        after = lines[i + 1] if i + 1 < len(lines) else ""
        if after.strip().startswith(_DOCSTRING):
            prompt += after[indent:].rstrip() + "\n"
            if after.strip() in _DOCSTRING and i + 2 < len(lines):  # a bare opener: its text starts a line below
                prompt += lines[i + 2][indent:].rstrip() + "\n"
        if len(prompt) <= DEFAULT_MAX_CHARS:
            yield prompt


def _pick(texts: list[str], n: int, exclude: set[str] = frozenset()) -> list[str]:
    """`n` distinct prompts of `texts`, spread over the library: the first by a hash of their text."""
    found = {p for t in texts for p in function_prompts(t)} - exclude
    return sorted(found, key=lambda p: hashlib.sha1(p.encode()).hexdigest())[:n]


def default_prompts(args: DataArguments) -> DatasetDict:
    """The embedded default: the openings of standard-library functions (the lm default's files and split)."""
    corpus = stdlib_corpus(args.validation_split_percentage, args.max_corpus_mb)
    train = _pick(corpus["train"]["text"], DEFAULT_TRAIN)
    validation = _pick(corpus["validation"]["text"], DEFAULT_EVAL, set(train))
    return DatasetDict(train=Dataset.from_dict({PROMPT: train}), validation=Dataset.from_dict({PROMPT: validation}))


def load_prompts(args: DataArguments) -> tuple[DatasetDict, bool]:
    """{'train', 'validation'?} raw prompt rows, checked for a `prompt` column, and whether they are the default."""
    if not args.dataset_name and not args.train_file:
        return default_prompts(args), True
    raw = load_given(args)
    if "train" not in raw:
        raise UsageError(
            f"--dataset_name {args.dataset_name} has no 'train' split to draw prompts from (its splits: "
            f"{list(raw)}): save the prompts as its 'train' split."
        )
    raw = DatasetDict({k: raw[k] for k in ("train", "validation") if k in raw})
    names = split_names(args)
    for split, ds in raw.items():
        check_columns(ds.column_names, names[split])
        if len(ds) == 0:
            raise UsageError(f"{names[split]} has no rows: give prompts.")
    return raw, False


def fingerprint(raw: DatasetDict) -> str:
    """A content key of the raw prompts (`sources.content_key`, over every column: the rewards read them all)."""

    def rows(ds: Dataset) -> Iterator[bytes]:
        for i in range(0, len(ds), 1000):
            batch = ds[i : i + 1000]
            for values in zip(*(batch[c] for c in sorted(batch))):
                yield json.dumps(values, sort_keys=True, default=str).encode("utf-8", errors="replace")

    return content_key(raw, rows)


def prompt_texts(ds: Dataset, batch: int = 1000) -> Iterator[str]:
    """The prompts' text, for a tokenizer trained on the spot."""
    for i in range(0, len(ds), batch):
        for value in ds[i : i + batch][PROMPT]:
            if isinstance(value, str):
                yield value
            elif value:
                yield from (m["content"] for m in value if isinstance(m.get("content"), str) and m["content"])


# ---- encoding -------------------------------------------------------------------------------------------------


def encode_prompt(tokenizer, row: dict[str, Any]) -> list[int]:
    """The prompt's token ids before truncation: `preference.tokenize_pair`'s prompt."""
    prompt = row[PROMPT]
    if is_conversational(prompt):
        messages = chat_template.clean_messages(prompt)
        return chat_template.chat_ids(
            tokenizer, messages, add_generation_prompt=True, **chat_template.template_kwargs(row)
        )
    return list(tokenizer(prompt)["input_ids"])


def _encode_batch(batch: dict[str, list], tokenizer, max_length: int) -> dict[str, list]:
    """`Dataset.map` body: the kept ids, how many were cut, whether the row has no prompt."""
    out: dict[str, list] = {IDS: [], CUT: [], EMPTY: []}
    names = list(batch)
    for values in zip(*(batch[c] for c in names)):
        row = dict(zip(names, values))
        empty = row[PROMPT] is None or (isinstance(row[PROMPT], str) and not row[PROMPT].strip()) or row[PROMPT] == []
        ids = [] if empty else encode_prompt(tokenizer, row)
        out[IDS].append(ids[-max_length:])  # the end of a prompt is what the completion follows
        out[CUT].append(max(0, len(ids) - max_length))
        out[EMPTY].append(empty or not ids)
    return out


def _excerpt(prompt: Any) -> str:
    text = json.dumps(prompt, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class SplitStats:
    prompts: int = 0
    truncated: int = 0
    tokens: int = 0  # kept
    longest: int = 0  # kept tokens of the longest prompt


def is_chat_column(ds: Dataset, where: str) -> bool:
    """Whether the split's prompts are conversations (message lists) rather than strings, from the column's type
    (one type a column: Arrow holds no mix); refused when they are neither."""
    feature = ds.features[PROMPT]
    if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        return False
    if isinstance(feature, Value) and feature.dtype == "null":
        raise UsageError(f"{where}: its 'prompt' column is empty in every row: give prompts.")
    inner = getattr(feature, "feature", None)
    if isinstance(feature, (List, list)) and isinstance(inner if inner is not None else feature[0], dict):
        return True
    raise UsageError(
        f"{where}: its 'prompt' column holds {feature} values: give each prompt as text, or as a list of {{role, "
        "content}} messages."
    )


def encode_split(
    ds: Dataset, tokenizer, max_length: int, where: str, conversational: bool | None, num_proc: int | None = None
) -> tuple[Dataset, bool]:
    """The split with `prompt_ids` and CUT (the tokens cut) columns, all others kept, and whether it is
    conversational; refuses an empty prompt, and strings where another split (`conversational`) holds message
    lists, or the reverse."""
    kind = is_chat_column(ds, where)
    if conversational is not None and kind != conversational:
        raise UsageError(
            f"{where} holds {'message lists' if kind else 'strings'} as prompts, the training split "
            f"{'strings' if kind else 'message lists'}: give every prompt as a string, or every one as a list of "
            "{role, content} messages."
        )
    enc = ds.map(
        _encode_batch,
        batched=True,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
        num_proc=num_proc,
        desc=f"encode {where} (prompts)",
    )
    for i, empty in enumerate(enc[EMPTY]):
        if empty:
            raise UsageError(
                f"{where}, row {i} ({_excerpt(ds[i][PROMPT])}): an empty prompt gives grpo nothing to answer; "
                "remove the row or fill its prompt."
            )
    return enc.remove_columns(EMPTY), kind


def split_stats(ds: Dataset) -> SplitStats:
    """The counts of an encoded split's prompts (read from the Arrow list lengths: no row decoded)."""
    import pyarrow.compute as pc

    table = ds.select_columns([IDS, CUT]).with_format("arrow")[:]
    lengths = pc.list_value_length(table[IDS]).to_numpy(zero_copy_only=False)
    cut = table[CUT].to_numpy(zero_copy_only=False)
    return SplitStats(len(ds), int((cut > 0).sum()), int(lengths.sum()), int(lengths.max(initial=0)))


# ---- the rows the objective reads -------------------------------------------------------------------------------


def reward_columns(rows: dict[str, list]) -> tuple[list, dict[str, list]]:
    """(prompts as given, the other columns by name) of some rows (`Dataset[indices]`), as TRL passes them to the
    reward functions: the string or the message list; neither `prompt_ids` nor TRL's own names among the columns."""
    return list(rows[PROMPT]), {k: list(v) for k, v in rows.items() if k not in (*NOT_PASSED, IDS)}


@dataclass
class PromptBatch:
    """Some prompts: their token ids (to generate from), as given and their other columns (for the rewards)."""

    prompt_ids: list[list[int]]
    prompts: list
    columns: dict[str, list]

    def per_completion(self, num_generations: int) -> tuple[list, dict[str, list]]:
        """(prompts, columns) with each prompt's row repeated for its `num_generations` consecutive completions (TRL's
        RepeatSampler order): what `RewardSet.score` takes."""
        rep = lambda values: [v for v in values for _ in range(num_generations)]  # noqa: E731
        return rep(self.prompts), {k: rep(v) for k, v in self.columns.items()}


@dataclass
class PromptRows:
    """The prompts a GRPO run draws from ('train') and evaluates on ('validation'), and what the banner says."""

    train: Dataset
    validation: Dataset
    columns: list[str]  # passed to the reward functions by name
    conversational: bool
    max_prompt_length: int
    stats: dict[str, SplitStats] = field(default_factory=dict)
    default_template: bool = False
    carved_validation: bool = False
    is_default: bool = False

    @property
    def truncated(self) -> int:
        return sum(s.truncated for s in self.stats.values())

    def batch(self, indices: list[int], split: str = "train") -> PromptBatch:
        """The rows `indices` of a split (a step's prompts: `order.global_batch(step)`)."""
        rows = (self.train if split == "train" else self.validation)[indices]
        prompts, columns = reward_columns(rows)
        return PromptBatch([list(ids) for ids in rows[IDS]], prompts, columns)

    def describe(self) -> list[str]:
        kind = "conversational" if self.conversational else "text"
        lines = [
            f"data: {len(self.train)} train / {len(self.validation)} eval prompts ({kind}), {self.truncated} "
            f"truncated to --max_prompt_length {self.max_prompt_length}; reward columns: "
            f"{', '.join(self.columns) or '(none)'}"
            + (" (validation carved from the training prompts)" if self.carved_validation else "")
        ]
        lines += [
            f"  {split}: {s.prompts} prompts, {s.tokens} tokens, longest {s.longest}" for split, s in self.stats.items()
        ]
        if self.is_default:
            lines.append("  prompts: the opening lines (signature, docstring) of standard-library functions")
        if "completion" in self.train.column_names:
            lines.append("  column 'completion' is not passed to the reward functions (TRL's rule: a name of its own)")
        if self.default_template:
            lines.append(
                "  chat template: the tokenizer has none; anygpu's default (ChatML layout, turns end with EOS)"
            )
        return lines


def _split(raw: DatasetDict, percentage: float) -> tuple[DatasetDict, bool]:
    """A validation split where there is none: a seeded share of the rows (sources.load_raw_text's), else the last
    row(s) (samples.carve_validation's); whether it was carved."""
    if "validation" in raw:
        return raw, False
    train = raw["train"]
    if len(train) * percentage / 100 >= 1:
        parts = train.train_test_split(test_size=percentage / 100, seed=0)  # fixed: --seed must not move it
        return DatasetDict(train=parts["train"], validation=parts["test"]), False
    if len(train) < 2:
        raise UsageError(
            f"the training data has {len(train)} prompt: too few to carve a validation prompt from; give "
            "--validation_file or more prompts."
        )
    num_val = min(len(train) - 1, max(1, round(len(train) * percentage / 100)))
    cut = len(train) - num_val
    return DatasetDict(train=train.select(range(cut)), validation=train.select(range(cut, len(train)))), True


def make_prompts(
    raw: DatasetDict,
    tokenizer,
    args: DataArguments,
    max_prompt_length: int,
    is_default: bool = False,
    num_proc: int | None = None,
) -> PromptRows:
    """Encode the raw prompt rows of every split (a validation split carved where there is none, after encoding:
    a refusal names the row of the file), then keep --max_train_samples of the training prompts and a seeded
    --max_eval_samples of the validation ones."""
    names = split_names(args)
    chats = is_chat_column(raw["train"], names["train"])
    default_template = chats and chat_template.ensure_chat_template(tokenizer)
    out, conversational = {}, None
    for split in [s for s in ("train", "validation") if s in raw]:  # train first: the others must match it
        out[split], conversational = encode_split(
            raw[split], tokenizer, max_prompt_length, names[split], conversational, num_proc
        )
    out, carved = _split(DatasetDict(out), args.validation_split_percentage)
    if args.max_train_samples:
        out["train"] = out["train"].select(range(min(args.max_train_samples, len(out["train"]))))
    if args.max_eval_samples and 0 < args.max_eval_samples < len(out["validation"]):
        out["validation"] = out["validation"].select(eval_subset(len(out["validation"]), args.max_eval_samples))
    stats = {split: split_stats(ds) for split, ds in out.items()}  # of what is kept
    out = {split: ds.remove_columns(CUT) for split, ds in out.items()}
    columns = [c for c in out["train"].column_names if c not in (*NOT_PASSED, IDS)]
    return PromptRows(
        out["train"], out["validation"], columns, bool(conversational), max_prompt_length, stats,
        bool(default_template), carved, is_default,
    )  # fmt: skip
