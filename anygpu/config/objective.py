"""The training objective's arguments: the language model (pretraining, SFT), preference training (DPO and its
family), with TRL's `DPOConfig` names and meanings, or online RL (GRPO and its family: `grpo_args`, TRL's
`GRPOConfig`'s). A base of `TrainArguments`, so both engines parse them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from anygpu.config import locate
from anygpu.config.grpo_args import GRPO_LOSS_TYPES, GRPOArguments
from anygpu.errors import UsageError

FREE, SAME = "free", "same"  # the "resume" markings of anygpu.config.args (which imports this module)

OBJECTIVES = ("lm", "dpo", "grpo")
# TRL's DPOTrainer loss types the objective computes per pair (each a function of that pair alone), `sft` (a token
# mean), and SimPO, reference-free (TRL's CPOTrainer loss_type="simpo"). TRL's aot/aot_unpaired sort the pairs of a
# micro-batch against each other, so their loss would change with the micro-batch: not offered.
PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm", "exo_pair", "nca_pair", "bco_pair", "sppo_hard")
PAIR_LOSSES += ("apo_zero", "apo_down", "discopop", "simpo")
LOSS_TYPES = (*PAIR_LOSSES, "sft")
REFERENCE_FREE = ("simpo", "sft")  # a run whose loss types are all of these needs no reference model


DPO_BETA, GRPO_BETA = 0.1, 0.0  # TRL's defaults: DPOConfig's, GRPOConfig's (no KL term, no reference)


@dataclass
class ObjectiveArguments(GRPOArguments):
    objective: str = field(
        default="lm",
        metadata={
            "resume": SAME,
            "help": "lm: the language-model loss (pretraining, SFT: the mean over the target tokens of the global "
            "batch). dpo: preference training on prompt/chosen/rejected rows (TRL's DPOTrainer formats and "
            "options; --global_batch_size counts pairs; docs/dpo.md). grpo: online RL on prompt rows, completions "
            "sampled and scored by --reward_funcs (TRL's GRPOTrainer options; --global_batch_size counts "
            "completions; native engine; docs/grpo.md).",
        },
    )
    beta: float | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": f"--objective dpo: how far the policy may move from the reference (TRL's beta, default {DPO_BETA}; "
            "for ipo its tau, for simpo its temperature). --objective grpo: the KL term's weight (default "
            f"{GRPO_BETA}: no KL term, no reference model).",
        },
    )
    loss_type: list[str] | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": f"--objective dpo: the loss, or several summed with --loss_weights: {', '.join(LOSS_TYPES)} "
            "(TRL's names, default sigmoid; simpo is reference-free; sft: the chosen completions' token "
            "cross-entropy, a mean over the chosen tokens of the global batch). --objective grpo: one of "
            f"{', '.join(GRPO_LOSS_TYPES)} (default dapo: a mean over the global batch's completion tokens).",
        },
    )
    # parsed as words (the comma form too), numbers once checked
    loss_weights: list[str] | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "--objective dpo: one weight per --loss_type (default 1 each), e.g. --loss_type sigmoid,sft "
            "--loss_weights 1,0.5.",
        },
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={
            "resume": SAME,
            "help": "--objective dpo: robust's probability that a label is flipped, in [0, 0.5); exo_pair's epsilon "
            "(> 0, e.g. 1e-3).",
        },
    )
    simpo_gamma: float = field(
        default=0.5,
        metadata={"resume": SAME, "help": "--loss_type simpo: the target reward margin (TRL's CPOConfig name)."},
    )
    discopop_tau: float = field(
        default=0.05, metadata={"resume": SAME, "help": "--loss_type discopop: its temperature tau."}
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "--objective dpo: the reference model (a folder or a cached hub id, with the policy's tokenizer). "
            "Default: the starting model (--model_name_or_path); with --use_peft, the base with the adapter "
            "disabled (no second copy).",
        },
    )
    precompute_ref_log_probs: bool = field(
        default=True,
        metadata={
            "resume": FREE,
            "help": "--objective dpo: compute the reference's log-probs of every pair once, before training, on all "
            "ranks, and cache them on disk (keyed by the reference, the data and the tokenisation; a resume, "
            "another run or another number of GPUs reads them). false: a frozen reference copy, sharded like the "
            "policy, runs beside it at every step.",
        },
    )

    @property
    def is_dpo(self) -> bool:
        return self.objective == "dpo"

    @property
    def dropout_off(self) -> bool:
        """Whether the objective runs without any dropout (TRL's disable_dropout): DPO and GRPO."""
        return self.is_dpo or self.is_grpo

    @property
    def needs_reference(self) -> bool:
        """Whether any loss type compares the policy with a reference model."""
        return self.is_dpo and not set(self.loss_type) <= set(REFERENCE_FREE)

    def check_objective(self) -> None:
        """Refuse an unknown objective or loss type, weights that do not match, a smoothing out of its range; the
        objective's defaults of --loss_type and --beta."""
        if self.objective not in OBJECTIVES:
            raise UsageError(f"--objective {self.objective!r} is unknown: use one of {', '.join(OBJECTIVES)}.")
        if self.is_grpo:
            self.loss_type = self.loss_type or ["dapo"]
            self.beta = GRPO_BETA if self.beta is None else self.beta
            self.check_grpo()
            return
        self.loss_type = self.loss_type or ["sigmoid"]
        self.beta = DPO_BETA if self.beta is None else self.beta
        unknown = [t for t in self.loss_type if t not in LOSS_TYPES]
        if unknown or not self.loss_type:
            raise UsageError(
                f"--loss_type {','.join(unknown) or '(none)'} is unknown: use one or more of {', '.join(LOSS_TYPES)}."
            )
        if self.loss_weights is not None:
            self.loss_weights = weights_for("loss_weights", self.loss_weights, "loss_type", self.loss_type)
        if self.beta <= 0:
            raise UsageError(f"--beta {self.beta} must be positive, e.g. 0.1.")
        if "robust" in self.loss_type and not 0 <= self.label_smoothing < 0.5:
            raise UsageError(f"--label_smoothing {self.label_smoothing} must be in [0, 0.5) for robust, e.g. 0.1.")
        if "exo_pair" in self.loss_type and not 0 < self.label_smoothing < 1:
            raise UsageError(f"--label_smoothing {self.label_smoothing} must be in (0, 1) for exo_pair, e.g. 1e-3.")

    def weights(self) -> list[float]:
        return list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(self.loss_type)


def weights_for(flag: str, words: Sequence[str | float], per: str, names: Sequence[str]) -> list[float]:
    """`--<flag>`: one finite number for each of `--<per>`'s `names` (--loss_weights, --reward_weights)."""
    values = [_number(flag, word, per) for word in words]
    if len(values) != len(names):
        raise UsageError(
            f"--{flag} {','.join(f'{w:g}' for w in values)}: give one weight per --{per} "
            f"({len(names)}: {','.join(names)}), e.g. {','.join(['1'] * len(names))}."
        )
    return values


def _number(flag: str, word: str | float, per: str) -> float:
    import math

    try:
        value = float(word)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise UsageError(f"--{flag} {word!r} is not a number: give one per --{per}, e.g. 1,0.5.")
    return value


def check_with_model(model_args, data_args, train_args) -> None:
    """What --objective dpo and grpo ask of the other arguments (before any work)."""
    if train_args.is_grpo:
        check_grpo_run(model_args, train_args)
        if data_args.packing:
            raise UsageError(
                "--packing true with --objective grpo: each completion is its own row (prompt left-padded, completion "
                "right-padded); leave --packing out."
            )
        return
    if train_args.reward_funcs:
        raise UsageError(
            f"--reward_funcs {','.join(train_args.reward_funcs)} with --objective {train_args.objective}: rewards "
            "are --objective grpo's; add --objective grpo, or leave --reward_funcs out."
        )
    if not train_args.is_dpo:
        return
    locate.check_pretrained("--ref_model_name_or_path", train_args.ref_model_name_or_path, ("config.json",))
    if not model_args.model_name_or_path:
        raise UsageError(
            "--objective dpo needs --model_name_or_path: preference training starts from a pretrained (usually "
            "instruction-tuned) model; train one first with the default --objective lm."
        )
    if train_args.global_batch_tokens is not None:
        raise UsageError(
            f"--global_batch_tokens {train_args.global_batch_tokens} with --objective dpo: a step is a number of "
            "pairs, give --global_batch_size (pairs per step) instead."
        )
    if train_args.auto_micro_batch:
        raise UsageError(
            "--per_device_train_batch_size auto with --objective dpo: the probe measures language-model batches; "
            "give a number of pairs per device, e.g. --per_device_train_batch_size 2 (anygpu plan --objective dpo "
            "estimates what fits)."
        )


def check_grpo_run(model_args, train_args) -> None:
    """The levers --objective grpo does not combine with (yet), refused before any work, each saying why."""
    locate.check_pretrained("--ref_model_name_or_path", train_args.ref_model_name_or_path, ("config.json",))
    refusals = [
        (train_args.global_batch_tokens is not None, f"--global_batch_tokens {train_args.global_batch_tokens}",
         "a step is a number of completions; give --global_batch_size (completions per step) instead"),
        (train_args.auto_micro_batch, "--per_device_train_batch_size auto",
         "the probe measures language-model batches; give a number of completions per device, e.g. 4"),
        (train_args.cp != 1, f"--cp {train_args.cp}",
         "completions are generated whole on each rank; use --cp 1 (context parallelism is for long rows)"),
        (train_args.ep != 1, f"--ep {train_args.ep}",
         "generation would need every rank's experts at every token; use --ep 1"),
        (bool(train_args.fp8), f"--fp8 {train_args.fp8}",
         "FP8 training with generation is not wired; leave --fp8 out"),
        (train_args.torch_compile, "--torch_compile true",
         "generation grows its rows a token at a time and would recompile each block at every length; leave it out"),
        (train_args.cpu_offload, "--cpu_offload true",
         "generation gathers the whole model for a round, which offloading is meant to avoid; leave it out"),
        (train_args.use_vllm and model_args.load_in_4bit, "--use_vllm true and --load_in_4bit true",
         "vLLM would hold the 4-bit base dequantised on every GPU, the memory QLoRA saves; leave --use_vllm out "
         "(the policy samples over its NF4 base itself)"),
        (train_args.beta > 0 and not model_args.model_name_or_path and not train_args.ref_model_name_or_path,
         f"--beta {train_args.beta} without --model_name_or_path",
         "the KL term compares with a pretrained reference; pass --model_name_or_path (or --ref_model_name_or_path), "
         "or --beta 0"),
    ]  # fmt: skip
    for refused, what, why in refusals:
        if refused:
            raise UsageError(f"{what} with --objective grpo: {why}.")
