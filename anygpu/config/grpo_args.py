"""Online RL's arguments (`--objective grpo`), with TRL 1.16's `GRPOConfig` names, defaults and meanings.

`--loss_type` and `--beta` are shared with --objective dpo (TRL's names in both trainers): their defaults are the
objective's (`ObjectiveArguments.check_objective` settles them). `--global_batch_size` counts completions under grpo
(TRL's generation batch: `num_generations` completions of each of its prompts), `--per_device_train_batch_size`
completions per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from anygpu.errors import UsageError

FREE, SAME = "free", "same"  # the "resume" markings of anygpu.config.args

GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")  # anygpu.train.grpo.LOSS_TYPES (no torch import here)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # anygpu.train.grpo.IS_MODES
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPOArguments:
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "--objective grpo: the reward functions, comma-separated: a built-in (accuracy: the final answer "
            "against --solution_column; format: --format_pattern matched; overlong: DAPO's length penalty; "
            "repetition: an n-gram repetition penalty; or a name TRL's grpo script registers), path/to/rewards.py:fn or "
            "package.module:fn (or TRL's package.module.fn; TRL's "
            "signature: prompts=, completions=, completion_ids= and the row's other columns by name, one float or "
            "None per completion).",
        },
    )
    reward_weights: list[str] | None = field(
        default=None,
        metadata={"resume": SAME, "help": "--objective grpo: one weight per --reward_funcs (default 1 each)."},
    )
    solution_column: str = field(
        default="solution",
        metadata={"resume": SAME, "help": "--reward_funcs accuracy: the column holding each prompt's answer."},
    )
    format_pattern: str | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "--reward_funcs format: the regular expression a completion must match in full (default TRL's "
            "think format, ^<think>...</think>...$).",
        },
    )
    soft_punish_cache: int | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "--reward_funcs overlong: the last tokens before --max_completion_length where the penalty grows "
            "from 0 to -1 (default a fifth of it).",
        },
    )
    num_generations: int = field(
        default=8,
        metadata={
            "resume": SAME,
            "help": "--objective grpo: completions drawn for each prompt (a group: its advantages are its rewards "
            "against the group's). Must divide --global_batch_size.",
        },
    )
    max_prompt_length: int = field(
        default=512,
        metadata={
            "resume": SAME,
            "help": "--objective grpo: prompt tokens kept, the last ones (a longer prompt loses its start, as TRL's "
            "truncation did).",
        },
    )
    max_completion_length: int = field(
        default=512,
        metadata={"resume": SAME, "help": "--objective grpo: the most tokens a completion is sampled to."},
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "resume": SAME,
            "help": "--objective grpo: the sampling temperature (the log-probs are of logits / temperature, as TRL's).",
        },
    )
    top_p: float = field(
        default=1.0,
        metadata={"resume": SAME, "help": "--objective grpo: nucleus sampling's cumulative probability (1: off)."},
    )
    top_k: int = field(
        default=0,
        metadata={"resume": SAME, "help": "--objective grpo: sample among the k likeliest tokens only (0: off)."},
    )
    epsilon: float = field(
        default=0.2,
        metadata={"resume": SAME, "help": "--objective grpo: the ratio's clip below, 1 - epsilon (and above)."},
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "resume": SAME,
            "help": "--objective grpo: the ratio's clip above, 1 + epsilon_high (DAPO's clip-higher; default "
            "--epsilon).",
        },
    )
    num_iterations: int = field(
        default=1,
        metadata={
            "resume": SAME,
            "help": "--objective grpo: optimizer steps on each round of completions (TRL's mu; above 1 the ratio "
            "compares with the log-probs at generation time, and the clip matters).",
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "resume": SAME,
            "help": "--objective grpo: advantages over the std of the group's rewards (group), of the global "
            "batch's (batch), or not scaled (none: Dr. GRPO); TRL's former true and false are group and none.",
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "resume": SAME,
            "help": "--objective grpo: a completion cut at --max_completion_length (no end-of-sequence token) adds "
            "nothing to the loss (DAPO).",
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "resume": SAME,
            "help": "--objective grpo: one ratio per token (token), or per completion from its tokens' mean "
            "log-ratio (sequence: GSPO).",
        },
    )
    use_vllm: bool = field(
        default=False,
        metadata={
            "resume": FREE,
            "help": "--objective grpo: sample with vLLM (where installed), one colocated engine per GPU that the "
            "policy's weights are pushed into each round, instead of the policy's own batched generation with a KV "
            "cache; completions still keyed, the same on any number of GPUs (docs/grpo.md).",
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "resume": FREE,
            "help": "--use_vllm true: the share of each GPU's memory its vLLM engine takes, for the weights it "
            "samples from and its KV cache, held through training too (default 0.3, TRL's colocate default).",
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "resume": SAME,
            "help": "--use_vllm true: weigh each completion's loss by exp(policy − vLLM log-prob) of its tokens, "
            "correcting for vLLM's sampler rounding differently from the policy (TRL's, and its default).",
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "resume": SAME,
            "help": "--use_vllm true: the correction per token or per completion (token_*, sequence_*), its ratio "
            "clamped to the bounds (*_truncate) or zeroed outside them (*_mask): token_truncate, token_mask, "
            "sequence_truncate, sequence_mask (TRL's default).",
        },
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"resume": SAME, "help": "--use_vllm true: the correction's lower bound (default none)."},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"resume": SAME, "help": "--use_vllm true: the correction's upper bound (default 3.0, TRL's)."},
    )
    num_completions_to_print: int = field(
        default=4,
        metadata={
            "resume": FREE,
            "help": "--objective grpo: prompts and completions written to <output_dir>/completions.jsonl at each "
            "logging step (0: none).",
        },
    )

    @property
    def is_grpo(self) -> bool:
        return self.objective == "grpo"

    def check_grpo(self) -> None:
        """Refuse, before any work, a GRPO value out of its range (only under --objective grpo)."""
        _choice("loss_type", self.loss_type[0] if len(self.loss_type) == 1 else ",".join(self.loss_type),
                GRPO_LOSS_TYPES)  # fmt: skip
        _choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        self.scale_rewards = {"true": "group", "false": "none"}.get(str(self.scale_rewards).lower(), self.scale_rewards)
        _choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        if not self.reward_funcs:
            raise UsageError(
                "--objective grpo needs --reward_funcs: name one or more, e.g. --reward_funcs accuracy or "
                "--reward_funcs path/to/rewards.py:my_reward."
            )
        for name, value, least in (
            ("num_generations", self.num_generations, 2),
            ("max_prompt_length", self.max_prompt_length, 1),
            ("max_completion_length", self.max_completion_length, 1),
            ("num_iterations", self.num_iterations, 1),
        ):
            if value < least:
                raise UsageError(f"--{name} {value} must be at least {least}" + (
                    " (a group's advantages compare its completions)" if name == "num_generations" else ""
                ) + f", e.g. {max(least, 8 if name == 'num_generations' else least)}.")  # fmt: skip
        if self.temperature <= 0:
            raise UsageError(f"--temperature {self.temperature} must be positive, e.g. 1.0.")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top_p {self.top_p} must be in (0, 1], e.g. 0.95 (1: off).")
        if self.top_k < 0:
            raise UsageError(f"--top_k {self.top_k} must be 0 (off) or positive, e.g. 50.")
        if self.beta < 0:
            raise UsageError(f"--beta {self.beta} cannot be negative: 0 (no KL term, no reference) or more, e.g. 0.04.")
        if self.epsilon < 0:  # from 1 on the clip has no lower bound (TRL takes it)
            raise UsageError(f"--epsilon {self.epsilon} cannot be negative, e.g. 0.2.")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise UsageError(f"--epsilon_high {self.epsilon_high} cannot be negative, e.g. 0.28 (DAPO).")
        if self.num_completions_to_print < 0:
            raise UsageError(f"--num_completions_to_print {self.num_completions_to_print} cannot be negative, e.g. 4.")
        if self.use_vllm:
            check_vllm(self)
        if self.global_batch_size is not None and self.global_batch_size % self.num_generations:
            raise UsageError(
                f"--global_batch_size {self.global_batch_size} completions is not whole groups of --num_generations "
                f"{self.num_generations}: pass a multiple, e.g. {self.num_generations * max(1, self.global_batch_size // self.num_generations)}."
            )


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"--{name} {value!r} is not one of {', '.join(choices)} under --objective grpo.")


def check_vllm(args) -> None:
    """--use_vllm true: refused in one line where vLLM is not installed (QLoRA's base: `check_grpo_run`)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError(
            "--use_vllm true: vLLM is not installed here (pip install vllm, on a GPU machine); leave --use_vllm "
            "out to generate with the policy itself (batched, with a KV cache)."
        )
    _choice("vllm_importance_sampling_mode", args.vllm_importance_sampling_mode, IS_MODES)
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if low is not None and high is not None and not 0 <= low < high:
        raise UsageError(
            f"--vllm_importance_sampling_clip_min {low} and --vllm_importance_sampling_clip_max {high}: the bounds "
            "must satisfy 0 <= min < max, e.g. none and 3.0 (TRL's)."
        )
    if not 0 < args.vllm_gpu_memory_utilization < 1:
        raise UsageError(
            f"--vllm_gpu_memory_utilization {args.vllm_gpu_memory_utilization} must be in (0, 1), e.g. 0.3."
        )
