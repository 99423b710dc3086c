"""--objective grpo's step (`GRPOObjective`) against TRL 1.16's GRPOTrainer, the outside oracle, both driven in this
process on a tiny Llama (CPU, fp32): the same policy, reference (the policy's weights before the noise the policy was
given, so kl > 0 from the first step), prompts, completions (each side's generation replaced by the same fixed
completions), rewards (one reward function, called by both) and temperature. One micro-batch holds the whole batch
(TRL's per-micro-batch normalisations are then ours). A round of num_iterations 2 gives, at each of its two steps, TRL's
loss, gradients, kl, clip ratios and entropy, for every loss type, importance-sampling level and β; between the steps
both sides take the same SGD step, so the second step's ratios leave 1 and the clip cuts (at token level both ends). The
first step also gives TRL's reward and completion metrics, and the round TRL's advantages and old and reference
log-probs. With num_iterations 1 each step is a round of its own, with no old log-probs.

TRL forwards with the attention mask alone (positions 0, 1, ... counting a left-padded prompt's padding); the objective
counts positions from a row's first real token. With RoPE the logits then differ only by rounding, so both prompt sets
share one tolerance: 1e-5 where the measured worst is about 1e-7 (per-token log-probs: 2.4e-7 apart with equal prompts,
from TRL's chunked LM head against our log_softmax; 4.8e-7 with a left-padded prompt, the shifted positions adding
2.4e-7). No ratio lies within 1e-4 of a clip bound (measured), so the clip ratios, counts of tokens, are equal."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import tiny_llm
import torch

from anygpu.runtime import distributed
from anygpu.train import generation, grpo, grpo_objective, rollout
from anygpu.train.rewards import RewardSet

G, L, VOCAB = 3, 6, 32  # generations per prompt, max_completion_length, vocabulary
EOS = 1  # t1; t0 pads
EPSILON, EPSILON_HIGH = 0.05, 0.08
TEMPERATURE = 0.7
INIT, PERTURB = 0.1, 0.02  # the reference's init std (log-probs far from uniform); the policy's noise over it
LR = 0.02  # the SGD step between a round's steps: the ratios move to about 0.6 .. 1.3
TOL = 1e-5
PROMPTS = {
    "equal": ["t2 t3 t4", "t5 t6 t7"],  # no padding: the same positions on both sides
    "left-padded": ["t2 t3", "t5 t6 t7 t8 t9"],  # TRL's positions count the padding, ours do not
}
COMPLETIONS = [  # G per prompt, of unequal lengths; those without the EOS are cut at L
    [4, 9, 1],
    [7, 7, 8, 3, 2, 12],
    [5, 1],
    [11, 13, 14, 1],
    [20, 21, 22, 23, 24, 25],
    [30, 1],
]
REWARDS = {tuple(c): r for c, r in zip(COMPLETIONS, [1.0, 3.0, 0.5, 2.0, -1.0, 0.25])}
CASES = [(t, level, beta) for t in grpo.LOSS_TYPES for level in grpo.IMPORTANCE_SAMPLING_LEVELS for beta in (0.0, 0.04)]
LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy")
ROUND_METRICS = (
    "reward",
    "reward_std",
    "rewards/fixed_reward/mean",
    "rewards/fixed_reward/std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


def fixed_reward(completion_ids, **kwargs):
    """Each completion's given reward (both sides pass `completion_ids`)."""
    return [REWARDS[tuple(ids)] for ids in completion_ids]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The reference (a tiny Llama) and the policy (its weights plus noise), each with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("grpo_trl")
    torch.manual_seed(0)
    model = tiny_llm.llama(VOCAB, initializer_range=INIT)
    tokenizer = tiny_llm.word_tokenizer(VOCAB)
    out = {}
    for name in ("reference", "policy"):
        if name == "policy":
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(PERTURB * torch.randn_like(p))
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out[name] = root / name
    return out


def load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


def trl_trainer(folders, prompts, loss_type, level, beta, num_iterations, mask_truncated=False):
    """TRL's GRPOTrainer on the policy, its reference given the reference folder's weights, its generation replaced by
    COMPLETIONS in order; one micro-batch (the whole generation batch) per step. With the rows of one generation
    batch (each prompt G times, as TRL's sampler gives them)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(folders["policy"].parent / "trl"),
        per_device_train_batch_size=len(COMPLETIONS),
        num_generations=G,
        max_completion_length=L,
        num_iterations=num_iterations,
        mask_truncated_completions=mask_truncated,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        temperature=TEMPERATURE,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(folders["policy"])
    trainer = GRPOTrainer(
        model=str(folders["policy"]),
        reward_funcs=fixed_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    if beta:  # TRL's reference is a copy of the policy as loaded: give it the reference's weights
        trainer.ref_model.load_state_dict(load(folders["reference"]).state_dict())
    expected = [tokenizer(p)["input_ids"] for p in prompts for _ in range(G)]

    def fixed_generation(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert [list(ids) for ids in prompt_ids] == expected
        return [list(c) for c in COMPLETIONS], None

    trainer._generate_single_turn = fixed_generation
    trainer.current_gradient_accumulation_steps = 1  # the Trainer's loop sets it at each step
    return trainer, [{"prompt": p} for p in prompts for _ in range(G)]


def our_objective(folders, prompts, loss_type, level, beta, num_iterations, output_dir, mask_truncated=False):
    """anygpu's GRPOObjective for one process and one micro-batch, its sampling replaced by COMPLETIONS (completion
    c = prompt p · G + generation i, as TRL orders them); the reference as the native engine builds it."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["policy"])
    cfg = grpo_objective.Config(
        num_generations=G,
        loss_type=loss_type,
        beta=beta,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        num_iterations=num_iterations,
        scale_rewards="group",
        mask_truncated_completions=mask_truncated,
        importance_sampling_level=level,
        max_completion_length=L,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        seed=0,
        num_completions_to_print=0,
    )
    rows = [{"prompt": p, "prompt_ids": tokenizer(p)["input_ids"]} for p in prompts]
    prep = SimpleNamespace(
        tokenizer=tokenizer,
        config=AutoConfig.from_pretrained(folders["policy"]),
        plan=SimpleNamespace(per_device_train_batch_size=len(COMPLETIONS)),  # one micro-batch
        datasets={"train": rows},
        order=SimpleNamespace(global_batch=lambda index: list(range(len(prompts)))),  # every round: all prompts
    )
    reference = None
    if beta:
        ref_model = load(folders["reference"])

        def reference(batch):  # as engines.trunk.objectives._grpo's frozen copy
            with torch.no_grad():
                return rollout.token_log_probs(ref_model, ref_model, batch, TEMPERATURE)[0]

    rewards = RewardSet(("fixed_reward",), (fixed_reward,), (1.0,))
    info = distributed.DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    objective = grpo_objective.GRPOObjective(cfg, rewards, prep, info, reference, "reference", str(output_dir))

    def fixed_sample(model, index, prompt_rows, generations, rows):
        done = [COMPLETIONS[p * G + i] for p, i in zip(prompt_rows, generations)]
        return [generation.Completion(list(c), truncated=c[-1] != EOS) for c in done]

    objective._sample = fixed_sample
    return objective


@dataclass
class Step:
    loss: float
    grads: dict[str, torch.Tensor]
    metrics: dict[str, float]


def take_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sgd_step(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(LR * p.grad)
    model.zero_grad(set_to_none=True)


def run_both(folders, prompts, loss_type, level, beta, num_iterations, output_dir, mask_truncated=False):
    """Two steps on both sides, each followed by the same SGD step: per step (TRL's, ours), and both sides' objects."""
    torch.manual_seed(0)  # TRL shuffles each generation batch
    trainer, trl_rows = trl_trainer(folders, prompts, loss_type, level, beta, num_iterations, mask_truncated)
    objective = our_objective(folders, prompts, loss_type, level, beta, num_iterations, output_dir, mask_truncated)
    model = load(folders["policy"])
    steps = []
    for step in range(2):
        trl_loss = trainer.training_step(trainer.model, trl_rows, None)
        trl = Step(trl_loss.item(), take_grads(trainer.model), {k: v[-1] for k, v in trainer._metrics["train"].items()})
        loss = objective.train_step(model, step)
        ours = Step(loss.item(), take_grads(model), objective.logged())
        steps.append((trl, ours))
        sgd_step(trainer.model)
        sgd_step(model)
    return steps, trainer, objective


def assert_step_is_trls(trl: Step, ours: Step, beta: float) -> None:
    assert math.isclose(ours.loss, trl.loss, rel_tol=0, abs_tol=TOL), (ours.loss, trl.loss)
    assert ours.grads.keys() == trl.grads.keys()
    for name, grad in ours.grads.items():
        torch.testing.assert_close(grad, trl.grads[name], atol=TOL, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert ("kl" in ours.metrics) == bool(beta) == ("kl" in trl.metrics)
    for name in [m for m in LOSS_METRICS if beta or m != "kl"]:
        assert math.isclose(ours.metrics[name], trl.metrics[name], abs_tol=TOL), (name, ours.metrics, trl.metrics)


def by_completion(ids: torch.Tensor, values: torch.Tensor) -> dict[tuple[int, ...], torch.Tensor]:
    """Rows of `values` keyed by their completion (TRL shuffles its rows; pads are 0, no completion holds a 0)."""
    return {tuple(i for i in row.tolist() if i): v for row, v in zip(ids, values)}


@pytest.mark.parametrize("prompt_set", PROMPTS)
@pytest.mark.parametrize(("loss_type", "level", "beta"), CASES)
def test_a_round_of_two_steps_is_trls(folders, tmp_path, loss_type, level, beta, prompt_set):
    prompts = PROMPTS[prompt_set]
    steps, trainer, objective = run_both(folders, prompts, loss_type, level, beta, 2, tmp_path)

    # the round: TRL's advantages, and its old (generation-time) and reference log-probs, completion by completion
    batch, trl_batch = objective.round.batches[0], trainer._buffered_inputs[0]
    assert bool((batch["attention_mask"][:, 0] == 0).any()) == (prompt_set == "left-padded")
    ours_ids, trl_ids = batch["completion_ids"], trl_batch["completion_ids"]
    pairs = [("advantages", "advantages"), ("old_logps", "old_per_token_logps")]
    for mine, theirs in pairs + ([("ref_logps", "ref_per_token_logps")] if beta else []):
        expected = by_completion(trl_ids, trl_batch[theirs])
        for key, value in by_completion(ours_ids, batch[mine]).items():
            theirs = expected[key].float()
            if value.dim():  # per token: the completion's own tokens
                value, theirs = value[: len(key)], theirs[: len(key)]
            torch.testing.assert_close(value, theirs, atol=TOL, rtol=0)

    for trl, ours in steps:
        assert_step_is_trls(trl, ours, beta)
    (trl0, ours0), (_, ours1) = steps
    for name in ROUND_METRICS:
        assert math.isclose(ours0.metrics[name], trl0.metrics[name], abs_tol=TOL), (name, ours0.metrics[name])

    # not vacuous: kl from the first step, the clip cutting at the second, gradients that are not all zero
    assert ours0.metrics["clip_ratio/region_mean"] == 0
    assert ours1.metrics["clip_ratio/region_mean"] > 0
    if level == "token":
        assert ours1.metrics["clip_ratio/low_mean"] > 0 and ours1.metrics["clip_ratio/high_mean"] > 0
    if beta:
        assert ours0.metrics["kl"] > 0.01 and ours1.metrics["kl"] > ours0.metrics["kl"]
    assert max(g.abs().max() for g in ours1.grads.values()) > 1e-2


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_rounds_of_one_step_are_trls(folders, tmp_path, loss_type):
    """num_iterations 1 (both sides' default): no old log-probs (the ratio is 1, nothing is clipped); the second
    step is a new round, scored and given its reference log-probs again, from the stepped policy."""
    steps, trainer, _ = run_both(folders, PROMPTS["left-padded"], loss_type, "token", 0.04, 1, tmp_path)
    assert "old_per_token_logps" not in trainer._buffered_inputs[0]
    for trl, ours in steps:
        assert_step_is_trls(trl, ours, 0.04)
        assert ours.metrics["clip_ratio/region_mean"] == 0
    assert steps[1][1].metrics["kl"] > steps[0][1].metrics["kl"] > 0.01


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_masked_truncated_completions_are_trls(folders, tmp_path, loss_type):
    """--mask_truncated_completions (DAPO): a completion cut at the length adds nothing, as in TRL; it changes the
    loss (the cut completions are in the batch, so the test would see them counted)."""
    steps, _, _ = run_both(folders, PROMPTS["left-padded"], loss_type, "token", 0.04, 2, tmp_path, mask_truncated=True)
    for trl, ours in steps:
        assert_step_is_trls(trl, ours, 0.04)
    plain, _, _ = run_both(folders, PROMPTS["left-padded"], loss_type, "token", 0.04, 2, tmp_path / "plain")
    assert abs(plain[1][1].loss - steps[1][1].loss) > 1e-4


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_the_share_of_zero_std_rewards_is_trls(scale_rewards):
    """frac_reward_zero_std as TRL computes it (its nanstd, torch.isclose to 0, per completion): a group of equal
    rewards counts, one with a single scored reward does not (its std is NaN), the batch's std under batch."""
    from trl.trainer.utils import nanstd

    nan = math.nan
    for rewards in (
        [1.0, 1.0, 1.0, 0.0, 2.0, 1.0, nan, 3.0, nan, nan, nan, nan, 2.0, 2.0, nan],
        [0.5] * 6 + [nan] * 3,
        [nan, 1.0, 1.0, 4.0, nan, 4.0],
    ):
        grouped = torch.tensor(rewards, dtype=torch.float32).view(-1, 3)
        std = nanstd(grouped.flatten()).expand(grouped.numel()) if scale_rewards == "batch" else (
            nanstd(grouped, dim=1).repeat_interleave(3))  # fmt: skip
        trl_share = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
        share = grpo.zero_std_fraction(torch.tensor(rewards, dtype=torch.float64), 3, scale_rewards)
        assert share == pytest.approx(trl_share), rewards
