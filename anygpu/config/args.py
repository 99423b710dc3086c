"""The argument dataclasses both engines share, parsed by `HfArgumentParser`.

Names follow Hugging Face's (`run_clm.py`, `TrainingArguments`) so that a command line
written for one engine runs on the other. Checks that need only the arguments live in
`__post_init__` and raise `UsageError` naming the argument, the value and an alternative.
"""

from __future__ import annotations

import copy
import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import yaml
from transformers import HfArgumentParser

from anygpu.config import attention, locate
from anygpu.config.mixture import as_argument, parse_mixture
from anygpu.config.objective import ObjectiveArguments, check_with_model
from anygpu.config.ranges import check_ranges
from anygpu.config.optimizers import OPTIMIZERS, state_kind
from anygpu.errors import UsageError, exit_refused
from anygpu.launch import suggest

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_GLOBAL_BATCH_SIZE = 16  # sequences, when no batch number at all is given
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
TRUNCATION_MODES = ("keep_start", "keep_end", "drop")
TXT_SAMPLE_BY = ("auto", "line", "paragraph", "document")
# Every field says in its metadata "resume" whether a resume may change it (anygpu.checkpoint.resume_guard
# derives its check from these markings; tests/test_resume_fields.py fails on a field without one):
# FREE may change; SAME must equal the checkpoint's value; any other value names the entry of the
# checkpoint's fingerprint that covers the argument (e.g. "corpus": the data's content), and a difference
# there is reported under the argument's name.
FREE, SAME = "free", "same"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "resume": "model_config",
            "help": "Pretrained model: a local folder or a hub id already in the cache (nothing is downloaded "
            "unless HF_HUB_OFFLINE=0). Leave out to train from scratch with --config_name.",
        },
    )
    config_name: str | None = field(
        default=None,
        metadata={
            "resume": "model_config",
            "help": "Model shape for training from scratch: a config.json path or folder, or a preset shipped "
            f"with anygpu ({', '.join(preset_names())}). Default: 'default' (15.7M parameters) when "
            "--model_name_or_path is not given.",
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "resume": "tokenizer",
            "help": "Tokenizer folder or cached hub id. Default: the model's own; when there is none, a byte-level "
            "BPE is trained on the training text and saved with the run.",
        },
    )
    vocab_size: int = field(
        default=8192, metadata={"resume": "tokenizer", "help": "Vocabulary size of a tokenizer trained on the spot."}
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "Attention kernel: sdpa (eager for a family without sdpa, e.g. gpt-oss), eager, flash_attention_2/3 (needs its flash-attn package, a GPU and --bf16), flex_attention (a GPU), or varlen_attention (torch's own varlen flash kernel: packed samples without a mask and without flash-attn; a GPU needs --bf16). Default: sdpa, and varlen_attention for packed rows on an NVIDIA GPU in bf16/fp16 without --torch_compile (the same losses, 1.8x packed sdpa's tokens/s on an H200).",
        },
    )
    experts_implementation: str | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "Mixture-of-experts families: how the experts compute their tokens — grouped_mm (transformers' "
            "default: one grouped GEMM over all experts, torch's grouped_mm where the device has it, a per-expert "
            "loop elsewhere), eager (the family's per-expert loop) or batched_mm. The same numbers within the "
            "dtype's tolerance (docs/moe.md).",
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"resume": FREE, "help": "Run model/tokenizer code from the model's folder. Off unless you trust it."},
    )
    # LoRA (anygpu.model.lora), named as TRL's ModelConfig names them
    use_peft: bool = field(
        default=False,
        metadata={"resume": SAME, "help": "Train a LoRA adapter (peft) over the frozen --model_name_or_path."},
    )
    lora_r: int = field(default=16, metadata={"resume": SAME, "help": "LoRA rank."})
    lora_alpha: int = field(
        default=32, metadata={"resume": SAME, "help": "LoRA alpha (the update is scaled by alpha / r)."}
    )
    lora_dropout: float = field(
        default=0.05, metadata={"resume": SAME, "help": "Dropout on the LoRA input (keyed per sample, as all dropout)."}
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "Module names to adapt, or all-linear. Default: peft's choice for the model type, else the attention's query and value projections, else all-linear.",
        },
    )
    lora_modules_to_save: list[str] | None = field(
        default=None,
        metadata={"resume": SAME, "help": "Modules trained in full and saved with the adapter (e.g. lm_head)."},
    )
    merge_lora: bool = field(
        default=False,
        metadata={"resume": FREE, "help": "Also write <output_dir>/final-merged: the base with the adapter merged in."},
    )
    # QLoRA (anygpu.model.qlora; the FSDP2 engine), named as TRL's ModelConfig names bitsandbytes' options
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "resume": SAME,
            "help": "QLoRA: hold the frozen base's linear weights in 4-bit NF4 (torchao; nested scales), with --use_peft true.",
        },
    )
    bnb_4bit_quant_type: str = field(
        default="nf4", metadata={"resume": SAME, "help": "The 4-bit format of --load_in_4bit: nf4 (the only one here)."}
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        split_commas(self)
        if self.vocab_size < 300:
            raise UsageError(
                f"--vocab_size {self.vocab_size} is too small for a byte-level BPE (256 bytes + specials): use at least 300, e.g. 8192."
            )
        # left out: sdpa, which packed rows on an NVIDIA GPU trade for varlen_attention (`varlen_attention.chosen_by_default`)
        self.attention_chosen = self.attn_implementation is not None
        self.attn_implementation = self.attn_implementation or "sdpa"
        if self.attn_implementation not in attention.IMPLEMENTATIONS:
            raise UsageError(
                f"--attn_implementation {self.attn_implementation!r} is unknown: use one of {', '.join(attention.IMPLEMENTATIONS)}."
            )
        if self.experts_implementation not in (None, *attention.EXPERTS):
            raise UsageError(
                f"--experts_implementation {self.experts_implementation!r} is unknown: use {', '.join(attention.EXPERTS)}."
            )
        if self.lora_r < 1:
            raise UsageError(f"--lora_r {self.lora_r} must be at least 1, e.g. 16.")
        if self.lora_alpha <= 0:
            raise UsageError(f"--lora_alpha {self.lora_alpha} must be positive, e.g. 32.")
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_dropout {self.lora_dropout} must be in [0, 1), e.g. 0.05.")
        if self.merge_lora and not self.use_peft:
            raise UsageError("--merge_lora true needs --use_peft true (there is no adapter to merge).")
        if self.load_in_4bit and not self.use_peft:
            raise UsageError(
                "--load_in_4bit true trains a LoRA adapter over a 4-bit base (QLoRA): add --use_peft true (a full "
                "fine-tune cannot update 4-bit weights), or leave --load_in_4bit out."
            )
        if self.bnb_4bit_quant_type != "nf4":
            raise UsageError(f"--bnb_4bit_quant_type {self.bnb_4bit_quant_type!r} is not offered: use nf4.")
        if self.use_peft and not self.model_name_or_path:
            raise UsageError(
                "--use_peft true needs --model_name_or_path (LoRA adapts a pretrained model): give the base model's folder."
            )


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=None,
        metadata={
            "resume": "corpus",
            "help": "A datasets hub id (from the local cache, offline) or a folder saved with save_to_disk.",
        },
    )
    dataset_config_name: str | None = field(
        default=None, metadata={"resume": "corpus", "help": "The dataset's configuration name."}
    )
    train_file: str | None = field(
        default=None,
        metadata={
            "resume": "corpus",
            "help": "Training text: a .txt, .json/.jsonl, .csv or .parquet file (.gz/.zst compressed too), a folder "
            "of them or a glob; thousands of files are fine.",
        },
    )
    validation_file: str | None = field(
        default=None, metadata={"resume": "corpus", "help": "Validation text, same formats as --train_file."}
    )
    dataset_mixture: str | None = field(
        default=None,
        metadata={
            "resume": "corpus",
            "help": "Several raw-text sources mixed by weight (shares of the samples drawn), TRL's shape: "
            "{datasets: [{name, path, weight, text_column?, validation_path?}, ...]}, in the run config or as a "
            "YAML/JSON file or text. See docs/data.md.",
        },
    )
    skip_bad_rows: bool = field(
        default=False,
        metadata={
            "resume": "corpus",
            "help": "Raw-text files: drop unreadable rows (corrupt JSON, non-text values, invalid UTF-8) and empty "
            "files, and count them, instead of refusing the run at the first one.",
        },
    )
    text_column: str = field(
        default="text",
        metadata={"resume": "corpus", "help": "Column that holds the text in json/csv/parquet/hub data."},
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "resume": "block_size",
            "help": "Tokens per training sequence (texts are concatenated and cut into blocks). Default: "
            "min(1024, the model's maximum positions).",
        },
    )
    validation_split_percentage: float = field(
        default=5.0,
        metadata={
            "resume": "corpus",
            "help": "Percent of the training texts kept for validation when no validation set is given.",
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"resume": "num_train_samples", "help": "Keep only this many packed training blocks."}
    )
    max_eval_samples: int | None = field(
        default=256,
        metadata={
            "resume": FREE,
            "help": "Evaluate on at most this many packed validation rows, a seeded uniform sample of them (0 or less: all).",
        },
    )
    max_corpus_mb: float | None = field(
        default=None,
        metadata={
            "resume": "corpus",
            "help": "Read at most this many MB of the embedded standard-library corpus (for quick runs).",
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "Processes for tokenising, per node (split among the node's ranks, each preparing its share of "
            "the files). Default: one per core of the node (at most 64, fewer for a corpus under 4 MB per process).",
        },
    )
    data_cache_dir: str | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "Where tokenised/packed data and trained tokenizers are cached. Default: $ANYGPU_CACHE or ~/.cache/anygpu.",
        },
    )
    # Fine-tuning data (TRL's SFTConfig names). The format is detected from the columns: `text`,
    # `prompt` + `completion`, or `messages`; --block_size is the maximum length (TRL's max_length).
    completion_only_loss: bool = field(
        default=True,
        metadata={
            "resume": SAME,
            "help": "prompt + completion data: train only on the completion tokens (false: on every token).",
        },
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata={
            "resume": SAME,
            "help": "messages data: train only on the assistant turns (false: on every token of the chat).",
        },
    )
    packing: bool | None = field(
        default=None,
        metadata={
            "resume": "packed",
            "help": "prompt-completion and messages data: several samples per --block_size row, attention confined to "
            "each sample (position ids restart per sample); false: one sample per row, padded per "
            "micro-batch. Default: packed where the model's attention honours sample boundaries. "
            "Raw text is always cut into full blocks.",
        },
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={
            "resume": SAME,
            "help": "Samples longer than --block_size: keep_start (cut the end), keep_end (cut the start) or drop "
            "(leave the sample out). Counted in the banner.",
        },
    )
    txt_sample_by: str = field(
        default="auto",
        metadata={
            "resume": "corpus",
            "help": ".txt files: one document per line, per paragraph (blank-line separated) or per file "
            "(document); auto: paragraph when the file has blank lines, else line.",
        },
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.dataset_name and self.train_file:
            raise UsageError(
                f"--dataset_name {self.dataset_name} and --train_file {self.train_file} both name the data: give one."
            )
        self._check_mixture()
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path and not _glob_matches(path):
                raise UsageError(
                    f"--{name} {path}: no such file. Give an existing .txt/.jsonl/.json/.csv/.parquet file."
                )
        if self.validation_file and not (self.train_file or self.dataset_name):
            raise UsageError("--validation_file needs --train_file (or --dataset_name) too.")
        if self.block_size is not None and self.block_size < 2:
            raise UsageError(f"--block_size {self.block_size} must be at least 2 tokens, e.g. 512.")
        if not 0 < self.validation_split_percentage < 100:
            raise UsageError(
                f"--validation_split_percentage {self.validation_split_percentage} must be in (0, 100), e.g. 5."
            )
        if self.data_cache_dir is None:
            self.data_cache_dir = os.environ.get("ANYGPU_CACHE", str(Path.home() / ".cache" / "anygpu"))
        _check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        _check_choice("txt_sample_by", self.txt_sample_by, TXT_SAMPLE_BY)

    def _check_mixture(self) -> None:
        if not self.dataset_mixture:
            return
        other = self.train_file or self.dataset_name or self.validation_file
        if other:
            raise UsageError(
                f"--dataset_mixture and {other} both name the data: give the sources in the mixture alone (each "
                "may have a validation_path)."
            )
        parse_mixture(self.dataset_mixture, self.text_column)


@dataclass
class TrainArguments(ObjectiveArguments):
    """The training vocabulary of both engines (Hugging Face `TrainingArguments` names; the objective's, TRL's)."""

    output_dir: str = field(
        default="outputs/default",
        metadata={"resume": FREE, "help": "Where metrics, checkpoints and the final model go."},
    )
    max_steps: int = field(
        default=-1, metadata={"resume": SAME, "help": "Optimizer steps to train; -1: follow --num_train_epochs."}
    )
    num_train_epochs: float = field(
        default=1.0,
        metadata={
            "resume": SAME,
            "help": "Epochs over the packed training set when --max_steps is -1 (steps rounded up, as Trainer's).",
        },
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={
            "resume": "global_batch_size",
            "help": "Sequences per optimizer step over all devices. Fixed whatever the number of devices: the "
            "per-device batch and accumulation steps follow from it. Default 16 (when no per-device "
            "numbers are given).",
        },
    )
    global_batch_tokens: int | None = field(
        default=None,
        metadata={
            "resume": "global_batch_size",
            "help": "The global batch in tokens instead (divided by --block_size); not with --global_batch_size.",
        },
    )
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "Sequences per device per micro-step, or 'auto': the largest divisor of the per-device "
            "share that fits in memory (probed; see --max_memory_per_device_gb). Default: the largest "
            "divisor of the per-device share up to 8.",
        },
    )
    per_device_eval_batch_size: int = field(
        default=8, metadata={"resume": FREE, "help": "Sequences per device per evaluation step."}
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "Micro-steps per optimizer step. Derived from the global batch; if given it must agree.",
        },
    )
    optim: str = field(
        default="adamw_torch",
        metadata={
            "resume": SAME,
            "help": "The optimizer, by Hugging Face's names: adamw_torch (AdamW, fp32 moments; adamw_torch_fused is "
            "the same here), adamw_torch_8bit or adamw_torch_4bit (AdamW with 8- or 4-bit moments, torchao's "
            "block-wise quantisation: 2.03 or 1.06 bytes of state per parameter instead of 8, the same curve on any "
            "world size; docs/memory.md#low-bit-optimizer-state), or adamw_anyprecision with --optim_args "
            "momentum_dtype=bfloat16,variance_dtype=bfloat16 (bf16 moments: 4 bytes; float32, its default, is AdamW).",
        },
    )
    optim_args: str | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "--optim adamw_anyprecision's options, Hugging Face's form: momentum_dtype=bfloat16,variance_dtype=bfloat16.",
        },
    )
    learning_rate: float = field(default=1e-3, metadata={"resume": SAME, "help": "Peak AdamW learning rate."})
    weight_decay: float = field(
        default=0.1, metadata={"resume": SAME, "help": "AdamW weight decay (not applied to biases and norm weights)."}
    )
    adam_beta1: float = field(default=0.9, metadata={"resume": SAME, "help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"resume": SAME, "help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"resume": SAME, "help": "AdamW epsilon."})
    warmup_steps: int = field(default=10, metadata={"resume": SAME, "help": "Linear warmup steps."})
    lr_scheduler_type: str = field(
        default="cosine", metadata={"resume": SAME, "help": f"Decay after warmup: {', '.join(SCHEDULERS)}."}
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"resume": SAME, "help": "Clip the total gradient norm to this (0: no clipping)."}
    )
    seed: int = field(default=42, metadata={"resume": SAME, "help": "Seed for initialisation and the data order."})
    bf16: bool = field(
        default=False,
        metadata={
            "resume": SAME,
            "help": "bf16 mixed precision (bf16 compute, fp32 master weights and gradient reduction; a LoRA run holds its frozen base in bf16).",
        },
    )
    fp16: bool = field(
        default=False,
        metadata={"resume": SAME, "help": "fp16 mixed precision (HF engine only; the FSDP2 engine asks for --bf16)."},
    )
    tf32: bool | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "TF32 matmuls on GPUs that have them (NVIDIA compute capability ≥ 8.0). Default on; --tf32 false turns it off.",
        },
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"resume": FREE, "help": "Recompute activations in the backward pass to save memory."}
    )
    gradient_checkpointing_policy: str = field(
        default="full",
        metadata={
            "resume": FREE,
            "help": "What --gradient_checkpointing keeps of each decoder layer (FSDP2 engine): full (only its input; "
            "the whole layer is recomputed in the backward) or selective (torchtitan's per-op policy: the outputs "
            "of the matrix multiplications and attention are kept, the cheap rest is recomputed; more memory "
            "than full, less recomputation). selective turns --gradient_checkpointing on.",
        },
    )
    torch_compile: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "torch.compile each decoder layer; graph breaks and recompilations are counted and logged.",
        },
    )
    fp8: str | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "FSDP2 engine: train the decoder layers' linear layers in FP8 with torchao's float8: rowwise "
            "(a scale per token and weight row) or tensorwise (a scale per tensor, weights all-gathered in FP8); "
            "scales are powers of two; curves on other GPU counts and micro-batches agree to FP8's own effect on the "
            "loss, not to float tolerance (docs/fp8.md). "
            "Needs FP8 matmuls (NVIDIA compute capability 8.9+, AMD gfx942+); emulated on CPU.",
        },
    )
    cpu_offload: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine: keep each rank's shards of the parameters, gradients and AdamW state in host "
            "memory (pinned) and step the optimizer on the CPU (FSDP2's CPUOffloadPolicy); the GPU holds the "
            "gathered layers and the activations. The same losses, slower steps; refused when the node's host "
            "memory cannot hold it (docs/memory.md#cpu-offload). The HF engine offloads through its accelerate "
            "config (fsdp_offload, deepspeed_zero3_offload).",
        },
    )
    lean_loss: bool = field(
        default=True,
        metadata={
            "resume": FREE,
            "help": "Compute the token cross-entropy a chunk of tokens at a time from the final hidden states "
            "and the output projection, so the (tokens × vocabulary) logits never exist whole: the same loss, "
            "less memory at large vocabularies (docs/lean-loss.md). A family whose forward changes the logits in a "
            "way it does not repeat, DataParallel and DeepSpeed ZeRO-3 keep the model's own loss (the banner "
            "says so). false: the model's own loss.",
        },
    )
    dp_replicate: int | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine, HSDP: replica groups R of the 2-D device mesh (R × --dp_shard = world size); "
            "each group holds a full copy of the sharded model and gradients are averaged across groups. "
            "Default: world size / --dp_shard when that is given, else the number of nodes (1 on one node: plain "
            "FSDP2 over every rank).",
        },
    )
    dp_shard: int | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine, HSDP: ranks S each replica group shards the model over (R × S = world size). "
            "Default: the processes per node (LOCAL_WORLD_SIZE), or the world size when only "
            "--dp_replicate is given. The global batch and the losses do not depend on R and S.",
        },
    )
    cp: int = field(
        default=1,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine, context parallelism: split each sequence into C contiguous parts over C "
            "consecutive ranks (Ulysses: an all-to-all over attention heads around the model's own attention "
            "kernel), so a rank holds the activations of block_size / C tokens. The mesh becomes --dp_replicate "
            "× --dp_shard × --cp = world size; the global batch is split over the data-parallel ranks (world "
            "size / C). C must divide the world size and --block_size; where it does not divide the model's "
            "attention or key/value heads, each rank's queries attend to the whole sequence's keys and values, "
            "gathered. The losses do not depend on C (docs/long-context.md).",
        },
    )
    ep: int = field(
        default=1,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine, expert parallelism: split the experts of every mixture-of-experts layer over E "
            "consecutive ranks and send each token to its experts' ranks and back (all-to-all; transformers' own "
            "expert-parallel plan and dispatch), so a rank computes and holds only its E-th of the experts; the "
            "experts are FSDP2-sharded over the (dp_shard × cp) / E copies left, everything else as without it. E "
            "must divide the experts and dp_shard × cp. The losses, the router loss and the gradient norm do not "
            "depend on E, and checkpoints resume under any other E (docs/moe.md).",
        },
    )
    logging_steps: int = field(
        default=10, metadata={"resume": FREE, "help": "Log loss, tokens/s and memory every N steps."}
    )
    eval_steps: int = field(
        default=100, metadata={"resume": FREE, "help": "Evaluate every N steps and at the end (0: only at the end)."}
    )
    eval_on_start: bool = field(
        default=True,
        metadata={"resume": FREE, "help": "Evaluate once before the first step (the baseline of the eval curve)."},
    )
    save_steps: int = field(
        default=0, metadata={"resume": FREE, "help": "Checkpoint every N steps (0: only at the end and on SIGTERM)."}
    )
    save_every_minutes: float = field(
        default=0,
        metadata={
            "resume": FREE,
            "help": "Also checkpoint once M minutes have passed since the last checkpoint (0: off), so a lost node "
            "or a crash costs at most M minutes of training: rank 0's clock decides at a step boundary, every rank "
            "agrees in the collective that boundary already holds. Counts from the start of training.",
        },
    )
    stop_at_step: int | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "End this run after step N with a checkpoint, keeping the schedule of --max_steps "
            "(for time-sliced jobs: resume later with --resume_from_checkpoint latest).",
        },
    )
    save_total_limit: int | None = field(
        default=2,
        metadata={
            "resume": FREE,
            "help": "Keep at most this many checkpoints (oldest deleted; never the newest or the only intact one; a damaged one is moved to <output_dir>/abandoned/, never deleted).",
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "'latest' (the newest intact checkpoint in --output_dir; damaged ones are skipped with a warning and "
            "moved to <output_dir>/abandoned/), 'auto' (the same, or a fresh start when there is no checkpoint: "
            "for restarted or requeued jobs; with damaged checkpoints only it stops naming them, unless "
            "--overwrite_output_dir true), or a checkpoint folder (refused if damaged).",
        },
    )
    report_to: list[str] = field(
        default_factory=lambda: ["tensorboard"],
        metadata={
            "resume": FREE,
            "help": "Trackers that get metrics.jsonl's scalars, comma-separated: tensorboard (<output_dir>/runs), "
            "mlflow (MLFLOW_TRACKING_URI, or else a local file store in <output_dir>/mlruns), wandb, "
            "trackio; all (every one installed) or none. mlflow, wandb and trackio are extras: "
            "pip install 'anygpu[mlflow]'.",
        },
    )
    ddp_timeout: int = field(
        default=1800,
        metadata={
            "resume": FREE,
            "help": "Process-group timeout in seconds (collectives and rendezvous) until the first step is done, "
            "and for checkpoints and the final export.",
        },
    )
    train_timeout: int = field(
        default=300,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine: the collective timeout in seconds once the first step is done (torchtitan's "
            "train_timeout_seconds), so a rank that hangs mid-training ends the job in minutes instead of "
            "--ddp_timeout; checkpoints and the export keep --ddp_timeout. 0: --ddp_timeout throughout.",
        },
    )
    dataloader_num_workers: int | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine: loader processes per rank that read the next steps while one computes (Hugging "
            "Face's name). Default: 1 on a GPU's host or where a core is spare, else 0 (each step read inline). The "
            "HF engine reads inline (0).",
        },
    )
    gc_steps: int = field(
        default=50,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine: run Python's garbage collector every N steps, between steps (its automatic "
            "collections, which can start mid-step on any rank and stall the others, are off while training; "
            "torchtitan's gc_freq). 0: leave the automatic collector on.",
        },
    )
    disable_tqdm: bool = field(default=False, metadata={"resume": FREE, "help": "No progress bar."})
    export_final: bool = field(
        default=True, metadata={"resume": FREE, "help": "Export the final model as safetensors to <output_dir>/final."}
    )
    export_dtype: str = field(
        default="auto",
        metadata={
            "resume": FREE,
            "help": "The dtype of <output_dir>/final's weights: auto (the pretrained checkpoint's own storage dtype; "
            "from scratch the training precision, bfloat16 with --bf16, else float32), float32, bfloat16 or float16.",
        },
    )
    save_max_shard_size: str = field(
        default="5GB",
        metadata={
            "resume": FREE,
            "help": "The largest safetensors file of <output_dir>/final (save_pretrained's max_shard_size, e.g. "
            "5GB or 500MB); a larger model is split into several files with a model.safetensors.index.json.",
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "Start a fresh run in an --output_dir that holds another run's metrics or checkpoints, "
            "deleting them; damaged checkpoints are moved to <output_dir>/abandoned/, never deleted "
            "(without it such a run is refused, unless it resumes).",
        },
    )
    allow_changed_args: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "Resume although arguments that define the training math (data, tokenizer, model, seed, "
            "schedule…) differ from the checkpoint's; the banner lists the differences.",
        },
    )
    allow_rewind: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "Resume from a checkpoint older than the newest: the newer ones are moved aside to "
            "<output_dir>/abandoned/ (without it such a resume is refused).",
        },
    )
    save_strategy: str = field(
        default="steps",
        metadata={
            "resume": FREE,
            "help": "steps: checkpoint every --save_steps, at the end and on SIGTERM. no: no checkpoint at all, "
            "for a benchmark or a throwaway run (a 70B run's end-of-run checkpoint is ~1 TB of model and optimizer "
            "state; nothing to resume; the final export still follows --export_final; SIGTERM exits at once, 75).",
        },
    )
    save_on_preempt: bool = field(
        default=True,
        metadata={
            "resume": FREE,
            "help": "On SIGTERM or SIGUSR1, every rank finishes its step, saves a checkpoint and exits with "
            "code 143. False: stop at once (exit 75), keeping the previous checkpoint.",
        },
    )
    auto_micro_batch: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "Set by --per_device_train_batch_size auto: choose the micro-batch by memory.",
        },
    )
    max_memory_per_device_gb: float | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "Memory budget per device in GiB for --per_device_train_batch_size auto (needed on "
            "CPU, where the plan's estimate is checked against it; on a GPU the smaller of this and "
            "the GPU's memory).",
        },
    )
    async_save: bool | None = field(
        default=None,
        metadata={
            "resume": FREE,
            "help": "FSDP2 engine: write periodic checkpoints (--save_steps) in the background; training stops "
            "only to copy the state to host memory. Each still counts only once complete. Default on "
            "when the host has room for the copy; the last and SIGTERM checkpoints are always written "
            "before exit. The HF engine saves synchronously.",
        },
    )

    @property
    def optim_state(self) -> str:
        """What AdamW keeps as its moments (`anygpu.config.optimizers.state_kind`): fp32, low-bit or bf16."""
        return state_kind(self.optim, self.optim_args)

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.lr_scheduler_type not in SCHEDULERS:
            raise UsageError(
                f"--lr_scheduler_type {self.lr_scheduler_type!r} is unknown: use one of {', '.join(SCHEDULERS)}."
            )
        if self.bf16 and self.fp16:
            raise UsageError("--bf16 and --fp16 both set: choose one (bf16 on GPUs that have it).")
        if self.max_steps == 0 or self.max_steps < -1:
            raise UsageError(f"--max_steps {self.max_steps} must be positive, or -1 to follow --num_train_epochs.")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise UsageError(f"--num_train_epochs {self.num_train_epochs} must be positive (or set --max_steps).")
        for name in ("logging_steps",):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name} {getattr(self, name)} must be at least 1.")
        for name in ("eval_steps", "save_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name} {getattr(self, name)} must be 0 or more.")
        if self.learning_rate <= 0:
            raise UsageError(f"--learning_rate {self.learning_rate} must be positive, e.g. 3e-4.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UsageError(
                f"--save_total_limit {self.save_total_limit} must be at least 1 (or leave it out to keep all)."
            )
        if self.auto_micro_batch and self.gradient_accumulation_steps is not None:
            raise UsageError(
                "--per_device_train_batch_size auto with --gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps}: leave the accumulation out (it follows from the choice)."
            )
        if self.max_memory_per_device_gb is not None and self.max_memory_per_device_gb <= 0:
            raise UsageError(f"--max_memory_per_device_gb {self.max_memory_per_device_gb} must be positive, e.g. 40.")
        if self.optim in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"):
            raise UsageError(
                f"--optim {self.optim}: bitsandbytes' 8-bit AdamW is not offered here; --optim adamw_torch_8bit "
                "keeps the same 8-bit state (torchao's), and shards it."
            )
        _check_choice("optim", self.optim, OPTIMIZERS)
        try:
            state_kind(self.optim, self.optim_args)
        except ValueError as e:
            raise UsageError(str(e)) from None
        _check_choice("export_dtype", self.export_dtype, EXPORT_DTYPES)
        _check_choice("gradient_checkpointing_policy", self.gradient_checkpointing_policy, CHECKPOINTING_POLICIES)
        if self.gradient_checkpointing_policy == "selective":
            self.gradient_checkpointing = True
        if self.fp8 in ("none", ""):
            self.fp8 = None
        if self.fp8 is not None:
            _check_choice("fp8", self.fp8, FP8_RECIPES)
        self._check_save_strategy()
        check_shard_size(self.save_max_shard_size)
        split_commas(self)
        self.check_objective()
        if (
            self.global_batch_size is None
            and self.global_batch_tokens is None
            and self.per_device_train_batch_size is None
            and self.gradient_accumulation_steps is None
        ):
            self.global_batch_size = DEFAULT_GLOBAL_BATCH_SIZE

    def _check_save_strategy(self) -> None:
        _check_choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        if self.save_strategy == "no":
            for name in ("save_steps", "save_every_minutes", "stop_at_step"):  # stop_at_step: its checkpoint
                if getattr(self, name):
                    raise UsageError(
                        f"--{name} {getattr(self, name)} with --save_strategy no: no checkpoint is written; "
                        f"leave --{name} out, or use --save_strategy steps."
                    )


@dataclass
class HFEngineArguments:
    """Options of the HF engine only (the FSDP2 engine has no strategy to choose)."""

    allow_strategy_fallback: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "When the accelerate config asks for a strategy this machine cannot run (FSDP on a CPU-only "
            "host), train with the one accelerate falls back to (DDP) instead of stopping; the banner "
            "reports the fallback.",
        },
    )


def split_commas(obj: Any) -> None:
    """List options take the comma form users type (`--lora_target_modules q_proj,v_proj`) as well as spaces."""
    for name, value in vars(obj).items():
        if isinstance(value, list) and any(isinstance(v, str) and "," in v for v in value):
            setattr(obj, name, [part.strip() for v in value for part in str(v).split(",") if part.strip()])


EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")
CHECKPOINTING_POLICIES = ("full", "selective")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's recipe names (anygpu.model.fp8 says what each keeps)
SAVE_STRATEGIES = ("steps", "no")  # Hugging Face's names; its "epoch" and "best" have no meaning here


def check_shard_size(value: str) -> None:
    """--save_max_shard_size as save_pretrained reads it (digits and a unit: 5GB, 500MB)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if parse_size_to_int(value) <= 0:
            raise ValueError(value)
    except (ValueError, TypeError):
        raise UsageError(f"--save_max_shard_size {value!r} is not a size: use digits and a unit, e.g. 5GB or 500MB.")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"--{name} {value!r} is unknown: use one of {', '.join(choices)}.")


def _glob_matches(path: str) -> bool:
    import glob

    return bool(glob.glob(path)) or Path(path).exists()


def _file_to_argv(path: str) -> list[str]:
    """A YAML/JSON file of {argument: value} as command-line words, so the CLI can override it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise UsageError(
            f"config file {path} cannot be read ({str(e).splitlines()[0]}): give a YAML/JSON mapping such as 'learning_rate: 3e-4'."
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of argument names to values, got {type(data).__name__}.")
    argv: list[str] = []
    for key, value in data.items():
        if value is None:
            continue
        if key == "dataset_mixture" and isinstance(value, (dict, list)):  # nested: one word, parsed by the field
            argv += [f"--{key}", as_argument(value)]
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, (dict, list, tuple)) for v in items):
            raise UsageError(
                f"{path}: the value of {key!r} is {value!r}: give a number, a string, a boolean or a list of them."
            )
        argv.append(f"--{key}")
        if isinstance(value, (list, tuple)):
            argv.extend(str(v) for v in value)
        else:
            argv.append(str(value).lower() if isinstance(value, bool) else str(value))
    return argv


def _auto_micro_batch(argv: list[str]) -> list[str]:
    """`--per_device_train_batch_size auto` → `--auto_micro_batch true` (the field stays an int)."""
    out = []
    for i, word in enumerate(argv):
        if word == "auto" and i and argv[i - 1] == "--per_device_train_batch_size":
            out[-1:] = ["--auto_micro_batch", "true"]
        elif word == "--per_device_train_batch_size=auto":
            out += ["--auto_micro_batch", "true"]
        else:
            out.append(word)
    return out


class ArgumentParser(HfArgumentParser):
    """HfArgumentParser that keeps the fields' "resume" marking out of argparse (it passes metadata on as keywords)."""

    @staticmethod
    def _parse_dataclass_field(parser: Any, f: Any) -> None:
        plain = copy.copy(f)
        plain.metadata = MappingProxyType({k: v for k, v in f.metadata.items() if k != "resume"})
        HfArgumentParser._parse_dataclass_field(parser, plain)


# Help groups: each option sits in its dataclass's group unless named here (one table, read only for --help).
GROUP_TITLES = {
    "model": "model",
    "lora": "LoRA and QLoRA",
    "data": "data",
    "training": "training",
    "checkpoints": "checkpoints and resume",
    "reporting": "logging, evaluation and reporting",
    "preference": "preference training (--objective dpo)",
    "engine": "HF engine",
}
DATACLASS_GROUP = {
    "ModelArguments": "model",
    "DataArguments": "data",
    "TrainArguments": "training",
    "HFEngineArguments": "engine",
}
FIELD_GROUP = {
    **dict.fromkeys(
        (
            "use_peft",
            "lora_r",
            "lora_alpha",
            "lora_dropout",
            "lora_target_modules",
            "lora_modules_to_save",
            "merge_lora",
            "load_in_4bit",
            "bnb_4bit_quant_type",
        ),
        "lora",
    ),
    **dict.fromkeys(
        (
            "output_dir",
            "save_steps",
            "save_every_minutes",
            "save_total_limit",
            "stop_at_step",
            "resume_from_checkpoint",
            "overwrite_output_dir",
            "allow_changed_args",
            "allow_rewind",
            "save_strategy",
            "save_on_preempt",
            "async_save",
            "export_final",
            "export_dtype",
            "save_max_shard_size",
        ),
        "checkpoints",
    ),
    **dict.fromkeys(
        (
            "objective",
            "beta",
            "loss_type",
            "loss_weights",
            "label_smoothing",
            "simpo_gamma",
            "discopop_tau",
            "ref_model_name_or_path",
            "precompute_ref_log_probs",
        ),
        "preference",
    ),
    **dict.fromkeys(
        (
            "logging_steps",
            "eval_steps",
            "eval_on_start",
            "per_device_eval_batch_size",
            "max_eval_samples",
            "report_to",
            "disable_tqdm",
        ),
        "reporting",
    ),
}


class HelpFormatter(argparse.HelpFormatter):
    """Shows a default only where there is one worth reading (no '(default: None)')."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.default not in (None, argparse.SUPPRESS, [], "")
            and "default" not in text.lower()
            and action.option_strings
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text

    def _format_action_invocation(self, action: argparse.Action) -> str:
        """`--learning_rate X` once, not every alias with a repeated metavar."""
        if not action.option_strings:
            return super()._format_action_invocation(action)
        option = action.option_strings[0]
        if action.nargs == 0:
            return ", ".join(action.option_strings) if action.dest == "help" else option
        if action.nargs == "?" and action.const is True:  # HfArgumentParser's booleans
            return f"{option} [true|false]"
        if getattr(action.type, "__name__", "") == "string_to_bool":  # an optional boolean (default: decided later)
            return f"{option} true|false"
        word = {int: "N", float: "X"}.get(action.type, "TEXT")  # type: ignore[arg-type]
        return f"{option} {word}[,{word}...]" if action.nargs in ("+", "*") else f"{option} {word}"


def _group_options(parser: argparse.ArgumentParser, dtypes: tuple[type, ...]) -> None:
    """Regroup the flat option list into model / LoRA / data / training / checkpoints / reporting for --help."""
    owner = {f: DATACLASS_GROUP.get(d.__name__, "training") for d in dtypes for f in d.__dataclass_fields__}
    groups: dict[str, Any] = {}
    for key in GROUP_TITLES:
        groups[key] = parser.add_argument_group(GROUP_TITLES[key])
    for action in list(parser._optionals._group_actions):
        if action.option_strings and action.option_strings[0].startswith("--no_"):
            action.help = argparse.SUPPRESS  # HfArgumentParser's --no_X twin of --X false: one spelling in --help
        if action.dest in owner:
            parser._optionals._group_actions.remove(action)
            groups[FIELD_GROUP.get(action.dest, owner[action.dest])]._group_actions.append(action)
    parser._action_groups = [g for g in parser._action_groups if g._group_actions]


def build_parser(extra: tuple[type, ...] = (), prog: str | None = None) -> HfArgumentParser:
    """The engines' parser (HfArgumentParser over the dataclasses), with grouped help and one-line errors."""
    dtypes = (ModelArguments, DataArguments, TrainArguments, *extra)
    parser = ArgumentParser(
        dtypes,
        formatter_class=lambda prog: HelpFormatter(prog, max_help_position=36),
        usage=f"{prog or Path(sys.argv[0]).name} [config.yaml] [--option value ...]",
    )
    parser.prog = prog or Path(sys.argv[0]).name
    parser.allow_abbrev = False  # a typo such as --learning_rat must not silently match --learning_rate
    parser.epilog = "Arguments may also come from one YAML or JSON file given first; the command line overrides it."
    parser.error = _refuse  # argparse would print usage and exit; one line and exit 2 through UsageError instead
    _group_options(parser, dtypes)
    return parser


def parse_args(
    argv: list[str] | None = None, extra: tuple[type, ...] = (), prog: str | None = None, warn: bool = True
) -> tuple[Any, ...]:
    """(ModelArguments, DataArguments, TrainArguments, *extra) from argv and/or one YAML/JSON file.

    The file, when given, is the first positional word; options on the command line override it.
    Unknown options are refused, and so are models, tokenizers and data sets that are not there.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith((".yaml", ".yml", ".json")):
        if not Path(argv[0]).is_file():
            raise UsageError(f"config file {argv[0]}: no such file.")
        argv = _file_to_argv(argv[0]) + argv[1:]
    argv = _auto_micro_batch(argv)
    parser = build_parser(extra, prog)
    parsed, unknown = parser.parse_known_args(argv)
    if unknown:
        late_file = [w for w in unknown if w.lower().endswith((".yaml", ".yml", ".json")) and Path(w).is_file()]
        if late_file:
            raise UsageError(
                f"{late_file[0]}: a config file must be the first argument, e.g. {late_file[0]} --max_steps 3."
            )
        raise UsageError(f"{suggest.unknown_options_message(unknown, parser)}. See --help for the valid ones.")
    _refuse_empty(vars(parsed))
    outputs = []
    for dtype in parser.dataclass_types:
        keys = {f for f in dtype.__dataclass_fields__ if dtype.__dataclass_fields__[f].init}
        outputs.append(dtype(**{k: v for k, v in vars(parsed).items() if k in keys}))
    locate.check_sources(outputs[0], outputs[1], preset_names())
    check_with_model(*outputs[:3])
    if warn:
        _warn_warmup(outputs[2])
    return tuple(outputs)


def _refuse_empty(values: dict[str, Any]) -> None:
    """An empty string (an unset shell variable) is no value: `--model_name_or_path ""` would read as "no model" and
    start the embedded default's preparation before failing on a folder named ''."""
    for name, value in values.items():
        if value == "" or (isinstance(value, list) and value == [""]):
            raise UsageError(f"--{name} '' is empty: give a value, or leave --{name} out (see --help).")


def _warn_warmup(train_args: TrainArguments) -> None:
    """A warmup longer than the run never reaches the peak learning rate: worth one line, not a refusal."""
    if train_args.max_steps > 0:
        warn_warmup(train_args, train_args.max_steps, f"--max_steps {train_args.max_steps}")


def warn_warmup(train_args: TrainArguments, total: int, what: str) -> None:
    """Rank 0's line when --warmup_steps exceed the run's `total` steps (`what` says where they come from)."""
    if total < train_args.warmup_steps and os.environ.get("RANK", "0") == "0":
        print(
            f"warning: --warmup_steps {train_args.warmup_steps} is more than {what}: the learning rate never reaches "
            f"--learning_rate {train_args.learning_rate:g}; use --warmup_steps {max(1, total // 10)} or fewer.",
            file=sys.stderr,
            flush=True,
        )


def print_help(extra: tuple[type, ...] = (), prog: str | None = None) -> None:
    """--help without importing torch (the engines' imports take seconds)."""
    build_parser(extra, prog).print_help()


def preflight(
    argv: list[str] | None = None,
    extra: tuple[type, ...] = (),
    prog: str | None = None,
    deeper: Callable[[tuple[Any, ...]], None] | None = None,
) -> None:
    """Before the engines' heavy imports: --help at once, and bad arguments or missing models/data as one line
    (rank 0 prints it) and exit 2, before torch, the process group or any accelerator work. Under the launchers'
    check (ANYGPU_PREFLIGHT_ONLY=1, one process before the ranks) `deeper(parsed)` runs too: the checks that read
    the model's config and the world size, which every rank would otherwise make after torch's import."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help(extra, prog)
        sys.exit(0)
    try:
        parsed = parse_args(argv, extra, prog, warn=False)
        if os.environ.get("ANYGPU_PREFLIGHT_ONLY") == "1" and deeper is not None:
            deeper(parsed)
    except UsageError as e:
        exit_refused(e)
    if os.environ.get("ANYGPU_PREFLIGHT_ONLY") == "1":  # the launchers' check before they start the ranks
        sys.exit(0)


def _refuse(message: str) -> None:
    raise UsageError(f"{message.rstrip('.')}. See --help for the valid options and values.")


def resolved_dict(*args_objs: Any) -> dict[str, Any]:
    """All arguments as one flat dict, for the banner, the checkpoint and the run folder."""
    out: dict[str, Any] = {}
    for obj in args_objs:
        out.update(asdict(obj))
    return out
