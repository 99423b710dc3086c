"""What both engines build before the model: checks, tokenizer, packed data, config, batch plan.

Every check that can refuse the run happens first, before tokenising or touching a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import DatasetDict
from transformers import PretrainedConfig

from anygpu.config import attention
from anygpu.config.args import DataArguments, ModelArguments, TrainArguments, warn_warmup
from anygpu.config.batch import BatchPlan, plan_batch, resolve_global_batch
from anygpu.data import corpus, corpus_rows, shared_prep
from anygpu.data import tokenizer as tok_lib
from anygpu.data.collate import Collator, packing_supported, uses_attention_interface
from anygpu.data import preference, prompts
from anygpu.data.formats import PREFERENCE, TEXT, training_texts
from anygpu.data.mixture_order import MixtureOrder
from anygpu.data.order import GlobalOrder, eval_subset, steps_for_epochs
from anygpu.data.samples import TrainingRows, make_rows
from anygpu.data.token_rows import Concatenation
from anygpu.data.sources import data_format, fingerprint, load_raw_text
from anygpu.errors import UsageError
from anygpu.model import dropout, fp8, lean_loss, lora, modeling, moe, qlora, varlen_attention
from anygpu.runtime import checkpointing, distributed, hardware
from anygpu.runtime.distributed import DistInfo

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    config: PretrainedConfig
    tokenizer: Any
    datasets: DatasetDict | dict  # 'train' and 'validation' rows (datasets', or memory-mapped token rows), input_ids
    block_size: int
    plan: BatchPlan
    order: GlobalOrder | MixtureOrder
    total_steps: int  # the schedule's length (max_steps or epochs × steps per epoch)
    from_scratch: bool
    used_default_corpus: bool
    collator: Collator | None = None  # rows → batches (padding, position ids, labels)
    data_lines: list[str] = field(default_factory=list)  # format, counts, template: for the banner
    data_fingerprint: str = ""  # the raw corpus (resume fingerprint, ranks-agree check)
    eval_sets: dict[str, Any] = field(default_factory=dict)  # a mixture's sources' evaluation rows, by name
    pairs_key: str = ""  # preference pairs: their cache key (the reference log-probs' cache is keyed by it)
    prompts: prompts.PromptRows | None = None  # --objective grpo: the prompt rows (also `datasets`; no collator)


def check_output_dir(output_dir: str) -> None:
    """Writable, or creatable: probed in the folder or its nearest existing parent, creating nothing (a run
    refused later must not leave an empty folder behind; rank 0 creates it when it claims it)."""
    path = Path(output_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        probe = existing / f".write-test-{uuid.uuid4().hex}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"--output_dir {output_dir} cannot be written ({e.strerror or e}): choose a writable folder, e.g. ./outputs/run1."
        ) from e


# The corpus path's preparers are spawned workers that start in ~0.3 s (~1 MB of tokenising), and pieces keep them all
# busy on one file (`shared_prep`): one per 2 MB; the datasets path's start in ~1 s (preprocessing_workers' default).
CORPUS_BYTES_PER_WORKER = 2_000_000


def preprocessing_workers(
    requested: int | None, num_bytes: int, max_workers: int = 64, bytes_per_worker: int = 4_000_000
) -> int:
    """Tokenising processes: as asked, else one per core of this node (local rank 0 prepares while the
    others wait), at most `max_workers`, and none idle on a small corpus (a process costs ~1 s to start)."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, max_workers, num_bytes // bytes_per_worker))


def check_run(
    model_args: ModelArguments, data_args: DataArguments, train_args: TrainArguments, world_size: int
) -> tuple[PretrainedConfig, int, BatchPlan]:
    """The cheap checks: model config, block size, batch math, output dir. Raises UsageError."""
    config = modeling.resolve_config(model_args)
    if train_args.is_grpo:
        check_grpo_run(data_args, train_args, config)
    block_size = modeling.resolve_block_size(data_args.block_size, config)
    G = resolve_global_batch(
        train_args.global_batch_size,
        train_args.global_batch_tokens,
        block_size,
        train_args.per_device_train_batch_size,
        train_args.gradient_accumulation_steps,
        world_size,
    )
    k = train_args.num_generations if train_args.is_grpo else 1
    if G % k and train_args.global_batch_size is None:  # G followed from the per-device numbers
        unit = math.lcm(k, world_size)
        raise UsageError(
            f"--objective grpo: a global batch of {G} completions is not whole groups of --num_generations {k}: "
            f"give --global_batch_size, e.g. {unit * max(1, G // unit)}."
        )
    m, A = train_args.per_device_train_batch_size, train_args.gradient_accumulation_steps
    plan = plan_batch(G, world_size, m, A, groups=k)
    preference.check_reference(model_args, train_args, config)
    check_output_dir(train_args.output_dir)
    # empty globs, unreadable sources, a missing text column: refused (grpo's prompt sources: check_grpo_run)
    if not train_args.is_grpo and corpus.plan_corpus(data_args) is not None:
        preference.check_format(TEXT, train_args.is_dpo, [data_args.text_column], data_args)  # raw text is no pairs
    return config, block_size, plan


def total_steps(train_args: TrainArguments, steps_per_epoch: int, per_round: int = 1) -> int:
    """--max_steps, else --num_train_epochs in steps (grpo: each round of prompts serves `per_round` steps, its
    --num_iterations), warned where the warm-up outlasts them."""
    if train_args.max_steps > 0:
        return train_args.max_steps
    total = steps_for_epochs(train_args.num_train_epochs, steps_per_epoch) * per_round
    warn_warmup(train_args, total, f"the run's {total} steps (--num_train_epochs {train_args.num_train_epochs:g})")
    return total


def check_grpo_run(data_args: DataArguments, train_args: TrainArguments, config: PretrainedConfig) -> None:
    """What --objective grpo asks of the batch, the lengths and the data (before any work)."""
    if train_args.global_batch_tokens is not None:
        raise UsageError(
            f"--global_batch_tokens {train_args.global_batch_tokens} with --objective grpo: a step is a number of "
            "completions, give --global_batch_size (completions per step, whole groups of --num_generations) instead."
        )
    prompts.check_lengths(
        train_args.max_prompt_length, train_args.max_completion_length, modeling.max_positions(config)
    )
    prompts.check_source(data_args)


@dataclass
class _Data:
    """What either data path gives the common end of `prepare`."""

    tokenizer: Any
    rows: TrainingRows
    fingerprint: str
    is_default: bool = False
    order: GlobalOrder | MixtureOrder | None = None  # None: a GlobalOrder of the training rows (made at the end)
    eval_sets: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def prepare(
    model_args: ModelArguments,
    data_args: DataArguments,
    train_args: TrainArguments,
    info: DistInfo,
    checked: tuple[PretrainedConfig, int, BatchPlan] | None = None,
) -> Prepared:
    """`checked`: what `check_run` already returned for this world size (it is not redone)."""
    config, block_size, plan = checked or check_run(model_args, data_args, train_args, info.world_size)
    if train_args.is_grpo:
        return _prompts_prepared(model_args, data_args, train_args, config, block_size, plan, info)
    corpus_plan = corpus.plan_corpus(data_args)
    if corpus_plan is None:
        data = _datasets_data(model_args, data_args, train_args, config, block_size, info)
    else:
        data = _corpus_data(corpus_plan, model_args, data_args, train_args, block_size, plan, info)
    packed = data.rows.rows
    if len(packed["validation"]) == 0:
        raise UsageError(
            f"the validation split has no full {block_size}-token block: lower --block_size or give more validation text."
        )
    from_scratch = model_args.model_name_or_path is None
    config = modeling.fit_config_to_tokenizer(config, data.tokenizer, from_scratch)
    order = data.order or GlobalOrder(len(packed["train"]), plan.global_batch_size, train_args.seed)
    total = total_steps(train_args, order.steps_per_epoch)
    return Prepared(
        config,
        data.tokenizer,
        packed,
        block_size,
        plan,
        order,
        total,
        from_scratch,
        data.is_default,
        dataclasses.replace(data.rows.collator, varlen=data.rows.collator.packed and takes_offsets(model_args)),
        data.rows.describe() + data.lines,
        data.fingerprint,
        data.eval_sets,
        getattr(data.rows, "pairs_key", ""),
    )


def _datasets_data(model_args, data_args: DataArguments, train_args, config, block_size: int, info: DistInfo) -> _Data:
    """A hub or saved data set, the embedded corpus, prompt-completion and chat files: through `datasets`,
    prepared by local rank 0 of each node."""
    with distributed.local_main_first(info):
        raw, is_default = load_raw_text(data_args)
        fmt = data_format(raw, data_args.text_column)
        preference.check_format(fmt, train_args.is_dpo, raw["train"].column_names, data_args)
        fp = fingerprint(raw, data_args.text_column)
        tokenizer = tok_lib.load_or_train(
            model_args.tokenizer_name or model_args.model_name_or_path,
            lambda: training_texts(raw["train"], fmt, data_args.text_column),
            fp,
            model_args.vocab_size,
            data_args.data_cache_dir,
            info.is_local_main,
            model_args.trust_remote_code,
        )
        packing = resolve_packing(data_args.packing, fmt, config.model_type, model_args.attn_implementation)
        if packing:
            packed_rows_kernel(model_args, train_args, config, info)
        workers = preprocessing_workers(data_args.preprocessing_num_workers, raw["train"].data.nbytes)
        data = training_data(raw, fmt, tokenizer, block_size, data_args, packing, fp, workers)
    distributed.wait_for_all("preparing the data")  # other nodes may still be packing: no collective timeout
    packed = data.rows
    if data_args.max_train_samples:
        packed["train"] = packed["train"].select(range(min(data_args.max_train_samples, len(packed["train"]))))
    if data_args.max_eval_samples and 0 < data_args.max_eval_samples < len(packed["validation"]):
        packed["validation"] = packed["validation"].select(
            eval_subset(len(packed["validation"]), data_args.max_eval_samples)
        )
    return _Data(tokenizer, data, fp, is_default)


def _corpus_data(
    corpus_plan: corpus.CorpusPlan, model_args, data_args: DataArguments, train_args, block_size: int, plan, info
) -> _Data:
    """Raw-text files or a mixture: tokenised by every rank of the job (or found prepared), memory-mapped."""
    with distributed.local_main_first(info):
        tokenizer = tok_lib.load_or_train(
            model_args.tokenizer_name or model_args.model_name_or_path,
            lambda: corpus.sample_texts(corpus_plan),
            corpus.sample_identity(corpus_plan),
            model_args.vocab_size,
            data_args.data_cache_dir,
            info.is_local_main,
            model_args.trust_remote_code,
        )
    workers = rank_workers(data_args.preprocessing_num_workers, corpus_plan.num_bytes)
    prepared = shared_prep.prepare_units(corpus_plan, tokenizer, data_args.data_cache_dir, workers)
    rows = corpus_rows.source_rows(prepared, corpus_plan, block_size, data_args.validation_split_percentage)
    corpus_rows.limit_train(rows, data_args.max_train_samples)
    train, order = corpus_rows.training_order(rows, corpus_plan, plan.global_batch_size, train_args.seed)
    evals = corpus_rows.eval_sets(rows, data_args.max_eval_samples)
    validation = Concatenation(list(evals.values())) if corpus_plan.mixture else evals.get(corpus.SINGLE)
    packed = {"train": train, "validation": validation if validation is not None else train.select([])}
    data = TrainingRows(
        packed, Collator(tokenizer.pad_token_id, False), TEXT, True, carved_validation=bool(rows.carved)
    )
    lines = corpus_rows.describe(rows, prepared, corpus_plan)
    return _Data(tokenizer, data, corpus_plan.fingerprint(), False, order, evals if corpus_plan.mixture else {}, lines)


def _prompts_prepared(
    model_args, data_args: DataArguments, train_args, config, block_size: int, plan: BatchPlan, info: DistInfo
) -> Prepared:
    """--objective grpo: prompt rows (`prompts`), prepared by local rank 0 of each node; a step draws
    --global_batch_size / --num_generations of them (`order.global_batch(step)`)."""
    with distributed.local_main_first(info):
        raw, is_default = prompts.load_prompts(data_args)
        fp = prompts.fingerprint(raw)
        tokenizer = tok_lib.load_or_train(
            model_args.tokenizer_name or model_args.model_name_or_path,
            lambda: prompts.prompt_texts(raw["train"]),
            fp,
            model_args.vocab_size,
            data_args.data_cache_dir,
            info.is_local_main,
            model_args.trust_remote_code,
        )
        prompts.check_tokenizer(tokenizer, model_args)
        workers = preprocessing_workers(data_args.preprocessing_num_workers, raw["train"].data.nbytes)
        rows = prompts.make_prompts(raw, tokenizer, data_args, train_args.max_prompt_length, is_default, workers)
    distributed.wait_for_all("preparing the prompts")
    from_scratch = model_args.model_name_or_path is None
    config = modeling.fit_config_to_tokenizer(config, tokenizer, from_scratch)
    num_prompts = plan.global_batch_size // train_args.num_generations
    if len(rows.train) < num_prompts:
        raise UsageError(
            f"the training set has {len(rows.train)} prompts, fewer than a step's {num_prompts} (--global_batch_size "
            f"{plan.global_batch_size} / --num_generations {train_args.num_generations}): lower --global_batch_size "
            f"(≤ {len(rows.train) * train_args.num_generations}), or add prompts."
        )
    order = GlobalOrder(len(rows.train), num_prompts, train_args.seed)  # one global batch of prompts a round
    total = total_steps(train_args, order.steps_per_epoch, per_round=train_args.num_iterations)
    return Prepared(
        config,
        tokenizer,
        DatasetDict(train=rows.train, validation=rows.validation),
        train_args.max_prompt_length + train_args.max_completion_length,  # the longest row a step trains on
        plan,
        order,
        total,
        from_scratch,
        is_default,
        None,
        rows.describe(),
        fp,
        prompts=rows,
    )


def rank_workers(requested: int | None, num_bytes: int) -> int:
    """This rank's tokenising processes: the node's (`preprocessing_workers`, one per CORPUS_BYTES_PER_WORKER) shared
    by its ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, preprocessing_workers(requested, num_bytes, bytes_per_worker=CORPUS_BYTES_PER_WORKER) // local)


def training_data(raw, fmt: str, tokenizer, block_size: int, data_args, packing: bool, fp: str, workers: int):
    """The rows of any format: preference pairs (`preference.make_pairs`), else `make_rows`."""
    if fmt == PREFERENCE:
        return preference.make_pairs(raw, tokenizer, block_size, data_args, packing, fp, workers)
    return make_rows(raw, fmt, tokenizer, block_size, data_args, packing, fp, workers)


def takes_offsets(model_args: ModelArguments) -> bool:
    """Whether packed rows reach the attention as samples' offsets (flash, torch's varlen), not a mask."""
    return model_args.attn_implementation in attention.OFFSETS


def packed_rows_kernel(model_args: ModelArguments, train_args, config, info: DistInfo) -> None:
    """Packed rows on an NVIDIA GPU with --attn_implementation left out take torch's varlen kernel instead of sdpa's
    dense T × T mask (the same losses; the lease measured 1.8× the tokens/s); a dense-mask kernel asked for by name
    stays, with a word of advice."""
    if varlen_attention.chosen_by_default(model_args, train_args, config, info.device) and uses_attention_interface(
        config.model_type
    ):
        model_args.attn_implementation = attention.VARLEN
        if info.is_main:
            logger.info("packed rows on an NVIDIA GPU: attention through torch's varlen kernel (varlen_attention)")
        return
    if info.is_main and hardware.on_nvidia_gpu(info.device) and model_args.attn_implementation in attention.DENSE_MASK:
        logger.warning(
            "packed rows under --attn_implementation %s build a dense T × T mask per forward: "
            "--attn_implementation varlen_attention takes the samples' boundaries instead (the same losses; 1.8× "
            "the tokens/s of packed sdpa rows on an H200, docs/benchmarks.md)",
            model_args.attn_implementation,
        )


def resolve_packing(requested: bool | None, fmt: str, model_type: str, attn_implementation: str) -> bool:
    """Pack variable-length samples unless asked not to, where the model's attention honours sample boundaries."""
    if fmt == TEXT or requested is False:
        return requested is not False
    supported = packing_supported(model_type, attn_implementation)
    if requested and not supported:
        raise UsageError(
            f"--packing true: {model_type} with --attn_implementation {attn_implementation} cannot confine "
            "attention to each packed sample; use --packing false (padding per micro-batch)."
        )
    if not supported:
        logger.info(
            "%s cannot confine attention to packed samples: one sample per row, padded per micro-batch", model_type
        )
    return supported


def summary_lines(prep: Prepared, model, train_args: TrainArguments, tf32: bool) -> list[str]:
    """The banner lines both engines print: hardware, model, data, batch decomposition, schedule."""
    import torch

    n = modeling.count_parameters(model)
    precision = "bf16 mixed" if train_args.bf16 else "fp16 mixed" if train_args.fp16 else "fp32"
    return [
        hardware.describe(),
        f"model: {prep.config.model_type}, {n / 1e6:.1f}M parameters, vocab {prep.config.vocab_size}, block {prep.block_size}"
        f", attention {getattr(modeling.hf_model(model).config, '_attn_implementation', None) or 'sdpa'}",
        (
            prep.data_lines[0]
            if prep.data_lines
            else f"data: {len(prep.datasets['train'])} train / {len(prep.datasets['validation'])} eval blocks"
        )
        + (" (embedded default: Python standard library sources)" if prep.used_default_corpus else ""),
        *prep.data_lines[1:],
        prep.plan.banner(),
        f"steps: {prep.total_steps} ({prep.order.steps_per_epoch} per epoch), precision: {precision}"
        + (", TF32 matmuls" if tf32 else "")
        + (", deterministic algorithms" if torch.are_deterministic_algorithms_enabled() else ""),
        *[
            line
            for line in (
                dropout.note(model),
                not train_args.is_grpo and lean_loss.note(model),  # grpo: log-probs of the completions' logits
                lora.is_peft(model) and lora.trainable_line(model),
                qlora.note(model),
                fp8.note(model),
                checkpointing.note(model),
                modeling.experts_line(model),
                moe.random_router_note(model),
            )
            if line
        ],
    ]
