"""The run's objective, both engines: None for the language model (the engines' own token-mean loss), a
`DPOObjective` for --objective dpo, whose reference is settled here before training starts (before a resumed
checkpoint is loaded: the policy still holds the starting weights the default reference is), a `GRPOObjective` for
--objective grpo (the native engine's), with its reward functions and reference."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from anygpu.model import lora
from anygpu.train import dpo, generation, grpo_objective, reference, rewards, rollout

# The engine's frozen reference model, built when needed: (the model, what runs its forward).
BuildReference = Callable[[], tuple[object, Callable]]


def precision_of(train_args) -> str:
    """The numerics a table of the reference's log-probs was computed in (part of its cache key)."""
    precision = "bf16" if train_args.bf16 else "fp16" if train_args.fp16 else "fp32"
    fp8 = getattr(train_args, "fp8", None)
    return f"{precision}+fp8 {fp8}" if fp8 else precision


def selection_of(prep, data_args) -> str:
    """The rows a run uses of the prepared pairs (they decide which pairs the cached table holds)."""
    return (
        f"train {len(prep.datasets['train'])}/{data_args.max_train_samples} "
        f"validation {len(prep.datasets['validation'])}/{data_args.max_eval_samples}/{data_args.validation_split_percentage}"
    )


def build(
    prep,
    model,
    call: Callable,
    model_args,
    data_args,
    train_args,
    info,
    frozen_reference: BuildReference,
    policy_runs: bool = True,
    reward_funcs: rewards.RewardSet | None = None,
):
    """The objective; with a precomputed reference, `prep.datasets` gain the reference's log-prob columns.
    `policy_runs`: the policy can run the precompute pass now (not where the HF engine's FSDP or ZeRO-3 holds it on
    rank 0 alone or partitioned until Trainer wraps it: the pass then runs on a frozen sharded copy of its weights).
    `reward_funcs`: grpo's, loaded already (`reward_set`)."""
    if train_args.is_grpo:
        reward_funcs = reward_funcs or reward_set(train_args)
        return _grpo(prep, model, model_args, train_args, info, frozen_reference, reward_funcs)
    if not train_args.is_dpo:
        return None
    cfg = dpo.LossConfig.of(train_args)
    if not train_args.needs_reference:
        return dpo.DPOObjective(cfg, None, f"reference: none (--loss_type {','.join(cfg.loss_type)}: reference-free)")
    ref_path = train_args.ref_model_name_or_path
    adapter = lora.is_peft(model) and ref_path is None  # LoRA's base: the policy with its adapter disabled
    if train_args.precompute_ref_log_probs:
        path = reference.cache_file(
            data_args.data_cache_dir,
            prep.pairs_key,
            reference.identity(ref_path or model_args.model_name_or_path),
            precision_of(train_args) + (" nf4" if adapter and model_args.load_in_4bit else ""),  # QLoRA's 4-bit base
            selection_of(prep, data_args),
        )

        @contextlib.contextmanager
        def source() -> Iterator[reference.RefForward]:
            if ref_path is None and policy_runs:  # the policy as it starts
                yield reference.forward_of(model, call, disable_adapter=adapter)
                return
            ref_model, ref_call = frozen_reference()  # built for the pass alone, freed after it
            yield reference.forward_of(ref_model, ref_call)

        splits, line = reference.precompute_or_read(
            dict(prep.datasets), prep.collator, source, info, train_args.per_device_eval_batch_size, path
        )
        prep.datasets.update(splits)
        return dpo.DPOObjective(cfg, None, line)
    if adapter:
        forward = reference.forward_of(model, call, disable_adapter=True)
        return dpo.DPOObjective(cfg, forward, "reference: the base model (the LoRA adapter disabled), at every step")
    ref_model, ref_call = frozen_reference()
    name = ref_path or model_args.model_name_or_path
    return dpo.DPOObjective(
        cfg, reference.forward_of(ref_model, ref_call), f"reference: a frozen copy of {name}, at every step"
    )


def reward_set(train_args) -> rewards.RewardSet | None:
    """--reward_funcs loaded and weighed (--objective grpo), before any other work: a bad one is refused first."""
    if not train_args.is_grpo:
        return None
    options = rewards.BuiltinOptions(
        train_args.solution_column,
        train_args.format_pattern or rewards.THINK_PATTERN,
        train_args.max_completion_length,
        train_args.soft_punish_cache,
    )
    return rewards.RewardSet.build(train_args.reward_funcs, train_args.reward_weights, options)


def check_reward_columns(reward_funcs: rewards.RewardSet | None, prep) -> None:
    """A built-in reward that reads a column the prompt rows of any split lack is refused (after the data, before the
    model): the evaluation scores the validation rows too."""
    for split, rows in prep.datasets.items() if reward_funcs is not None else ():
        reward_funcs.check_columns((c for c in rows.column_names if c != "prompt_ids"), f"the {split} split")


def _grpo(prep, model, model_args, train_args, info, frozen_reference: BuildReference, reward_funcs):
    """--objective grpo's objective: its rewards and reference."""
    temperature = train_args.temperature
    if train_args.beta == 0:
        ref, line = None, "reference: none (--beta 0: no KL term)"
    elif lora.is_peft(model) and train_args.ref_model_name_or_path is None:

        def ref(batch):
            with torch.no_grad(), lora.adapters_off(model):
                return rollout.token_log_probs(model, model, batch, temperature)[0]

        line = "reference: the base model (the LoRA adapter disabled), once per round"
    else:
        ref_model, ref_call = frozen_reference()

        def ref(batch):
            with torch.no_grad():
                return rollout.token_log_probs(ref_model, ref_call, batch, temperature)[0]

        name = train_args.ref_model_name_or_path or model_args.model_name_or_path
        line = f"reference: a frozen copy of {name}, once per round"
    cfg = grpo_objective.Config.of(train_args)
    generator = vllm_start(model, train_args) if train_args.use_vllm else generation.PolicyGenerator
    return grpo_objective.GRPOObjective(cfg, reward_funcs, prep, info, ref, line, train_args.output_dir, generator)


def vllm_start(model, train_args) -> Callable:
    """--use_vllm true: what starts a colocated vLLM engine for the objective's sampling (`vllm_generation`)."""
    from anygpu.train import vllm_generation

    def start(sampling):
        return vllm_generation.VllmGenerator.start(
            model,
            sampling,
            train_args.max_prompt_length + train_args.max_completion_length,
            train_args.vllm_gpu_memory_utilization,
            vllm_generation.vllm_dtype(train_args.bf16, train_args.fp16),
        )

    return start


def makes_batches(objective) -> bool:
    """The objective makes each step's rows itself (grpo: by generating), rather than reading the data's."""
    return isinstance(objective, grpo_objective.GRPOObjective)


def checkpoint_files(objective, steps_done: int) -> dict[str, dict]:
    """What a checkpoint keeps of the objective beyond the model (grpo within a round: the round's completions)."""
    if not makes_batches(objective):
        return {}
    state = objective.checkpoint_state(steps_done)
    return {grpo_objective.ROUND_FILE: state} if state is not None else {}


def close(objective) -> None:
    """The objective's own resources released at the run's end (grpo: a vLLM engine's process groups)."""
    if makes_batches(objective):
        objective.generator.close()


def resumed(objective, checkpoint) -> None:
    """The objective's part of a resumed checkpoint (`checkpoint_files`)."""
    if makes_batches(objective):
        objective.resume(checkpoint)


def logged(objective: dpo.DPOObjective | None) -> dict[str, float]:
    """A logging step's metrics beyond the loss (a collective under --objective dpo: every rank calls it)."""
    return objective.logged() if objective is not None else {}


def describe(objective: dpo.DPOObjective | None) -> list[str]:
    """The banner's lines on the objective (none for the language model)."""
    if objective is None:
        return []
    if isinstance(objective, grpo_objective.GRPOObjective):
        return objective.describe()
    cfg = objective.cfg
    losses = " + ".join(f"{w:g}·{t}" if len(cfg.loss_type) > 1 else t for t, w in zip(cfg.loss_type, cfg.weights))
    return [
        f"objective: dpo, loss {losses}, beta {cfg.beta:g}; the global batch counts pairs; dropout off",
        objective.reference_line,
    ]
