"""The GRPO family's loss (`anygpu.train.grpo`) against TRL 1.16's GRPOTrainer, the outside oracle, called in this
process on a tiny Llama (CPU, fp32): with the whole batch in one micro-batch, TRL's own `_compute_loss` gives the same
loss, gradients, kl and clip ratios and entropy for every loss type, importance-sampling level and β; TRL's own
`_generate_and_score_completions` (a dummy reward function reading each row's reward) gives the same advantages for
every `scale_rewards`. Then the promise TRL does not keep: the same batch cut into 1 to 4 micro-batches of unequal
completion lengths gives the same summed loss, gradients and metrics. And the refusals."""

from __future__ import annotations

import math

import pytest
import tiny_llm
import torch

from anygpu.errors import UsageError
from anygpu.train import grpo

G, B, PROMPT, L = 3, 6, 3, 6  # generations per prompt, completions, prompt tokens, max_completion_length
VOCAB = 32
LENGTHS = [6, 3, 1, 5, 2, 4]  # completion tokens of each completion (unequal: the normalisations differ)
EPSILON, EPSILON_HIGH = 0.1, 0.15
CASES = [(t, level, beta) for t in grpo.LOSS_TYPES for level in grpo.IMPORTANCE_SAMPLING_LEVELS for beta in (0.0, 0.04)]
# TRL's KL term without its (default) bias correction: the plain k3 term
PLAIN_KL = [("grpo", level, 0.04, False) for level in grpo.IMPORTANCE_SAMPLING_LEVELS]


def reward_column(prompts, completions, reward, **kwargs):
    """TRL reward function: each row's own `reward` (None: unscorable)."""
    return list(reward)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer, saved where TRL loads them (its reference model too)."""
    path = tmp_path_factory.mktemp("grpo_model")
    torch.manual_seed(0)
    tiny_llm.llama(VOCAB).save_pretrained(path)
    tiny_llm.word_tokenizer(VOCAB).save_pretrained(path)
    return path


def trl_trainer(folder, **overrides):
    """TRL's GRPOTrainer on the tiny model, in train mode, one micro-batch per step (one process)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(folder / "trl"),
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=L,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        **overrides,
    )
    rows = Dataset.from_dict({"prompt": ["t2 t3 t4", "t5 t6 t7"], "reward": [0.0, 0.0]})
    trainer = GRPOTrainer(
        model=str(folder),
        reward_funcs=reward_column,
        args=args,
        train_dataset=rows,
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    trainer.current_gradient_accumulation_steps = 1  # the Trainer's loop sets it at each step
    trainer.model.train()
    return trainer


def batch_inputs(beta: float) -> dict[str, torch.Tensor]:
    """The inputs dict TRL's `_compute_loss` reads: prompts (one left-padded), fixed completions of `LENGTHS` tokens,
    advantages of both signs, old log-probs that differ from the policy's (so the clip cuts) and the reference's."""
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(2, VOCAB, (B, PROMPT), generator=gen)
    prompt_mask = torch.ones(B, PROMPT, dtype=torch.long)
    prompt_mask[0, 0] = 0
    prompt_ids[0, 0] = 0
    completion_mask = (torch.arange(L) < torch.tensor(LENGTHS)[:, None]).long()
    completion_ids = torch.randint(2, VOCAB, (B, L), generator=gen) * completion_mask
    advantages = grpo.group_advantages(torch.randn(B, generator=gen), G, "group")
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
        "old_shift": 0.3 * torch.randn(B, L, generator=gen),
    }
    if beta:
        inputs["ref_shift"] = 0.5 * torch.randn(B, L, generator=gen)
    return inputs


def our_logps(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) log-probs of the completion tokens and the entropies there, from the model's plain logits."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=input_ids, attention_mask=mask).logits[:, PROMPT - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1), entropy.detach()


def grads(model) -> torch.Tensor:
    out = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(("loss_type", "level", "beta", "corrected"), [(*c, True) for c in CASES] + PLAIN_KL)
def test_one_micro_batch_is_trls_loss(folder, loss_type, level, beta, corrected):
    trainer = trl_trainer(
        folder,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        use_bias_correction_kl=corrected,
    )
    model, inputs = trainer.model, batch_inputs(beta)
    logps, entropies = our_logps(model, inputs)
    old = logps.detach() + inputs["old_shift"]
    ref = logps.detach() + inputs["ref_shift"] if beta else None
    loss, sums = grpo.grpo_loss(
        logps,
        old,
        ref,
        inputs["advantages"],
        inputs["completion_mask"],
        grpo.batch_counts(inputs["completion_mask"]),
        loss_type,
        beta,
        EPSILON,
        EPSILON_HIGH,
        level,
        L,
        entropies,
        corrected,
    )
    loss.backward()
    ours = grads(model)

    trl_inputs = {k: v for k, v in inputs.items() if not k.endswith("_shift")}
    trl_inputs["old_per_token_logps"] = old
    if beta:
        trl_inputs["ref_per_token_logps"] = ref
    trl_loss = trainer._compute_loss(model, trl_inputs)
    trl_loss.backward()
    torch.testing.assert_close(loss, trl_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, grads(model), atol=1e-5, rtol=1e-4)

    logged = trainer._metrics["train"]
    means = grpo.metric_means(sums, beta, with_entropy=True)
    assert ("kl" in means) == bool(beta)
    for name, value in means.items():
        assert math.isclose(value, logged[name][-1], abs_tol=1e-5), (name, value, logged[name][-1])
    assert means["clip_ratio/region_mean"] > 0  # the old log-probs' shift makes the clip cut
    if level == "token":
        assert means["clip_ratio/low_mean"] > 0 and means["clip_ratio/high_mean"] > 0


REWARDS = [1.0, 3.0, None, 2.0, 2.0, 2.0]  # a group with an unscorable completion, a group of equal rewards


@pytest.mark.parametrize("scale_rewards", grpo.SCALE_REWARDS)
def test_advantages_are_trls(folder, scale_rewards):
    trainer = trl_trainer(folder, scale_rewards=scale_rewards)
    rows = [{"prompt": "t2 t3 t4" if i < G else "t5 t6 t7", "reward": r} for i, r in enumerate(REWARDS)]
    trl = trainer._generate_and_score_completions(rows)["advantages"]
    rewards = torch.tensor([float("nan") if r is None else r for r in REWARDS])
    ours = grpo.group_advantages(rewards, G, scale_rewards)
    torch.testing.assert_close(ours, trl.float(), atol=1e-6, rtol=0)
    assert ours[2] == 0 and torch.all(ours[G:] == 0)


def split_batch():
    """12 completions (4 prompts × 3), fp64, completion lengths 0 to 7, the policy's log-probs a leaf."""
    gen = torch.Generator().manual_seed(2)
    n, t = 12, 7
    lengths = torch.tensor([7, 2, 0, 5, 1, 6, 3, 7, 4, 1, 2, 5])
    mask = (torch.arange(t) < lengths[:, None]).double()
    policy = (-3 * torch.rand(n, t, generator=gen, dtype=torch.float64)).requires_grad_()
    old = policy.detach() + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    ref = policy.detach() + 0.5 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    entropies = torch.rand(n, t, generator=gen, dtype=torch.float64)
    advantages = grpo.group_advantages(torch.randn(n, generator=gen, dtype=torch.float64), G, "group")
    return policy, old, ref, entropies, advantages, mask


SPLITS = [[12], [5, 7], [3, 4, 5], [2, 3, 3, 4]]


def split_loss(loss_type, level, beta, sizes, counts=None):
    """The summed shares of the micro-batches of `sizes` (each padded to its own longest completion), the gradient
    of the policy's log-probs and the metric means; `counts` None: the global ones."""
    policy, old, ref, entropies, advantages, mask = split_batch()
    counts_all = grpo.batch_counts(mask)
    total, sums, start = 0.0, 0.0, 0
    for size in sizes:
        rows = slice(start, start + size)
        width = max(int(mask[rows].sum(-1).max()), 1)
        part = [x[rows, :width] for x in (policy, old, ref, mask, entropies)]
        use = counts_all if counts is None else grpo.batch_counts(part[3]) * len(sizes)
        loss, s = grpo.grpo_loss(
            part[0], part[1], part[2] if beta else None, advantages[rows], part[3], use,
            loss_type, beta, EPSILON, EPSILON_HIGH, level, 8, part[4],
        )  # fmt: skip
        total, sums, start = total + loss, sums + s, start + size
    total.backward()
    return total.detach(), policy.grad, grpo.metric_means(sums, beta, with_entropy=True)


@pytest.mark.parametrize(("loss_type", "level", "beta"), CASES)
def test_any_split_gives_the_same_loss_and_gradients(loss_type, level, beta):
    whole, whole_grad, whole_metrics = split_loss(loss_type, level, beta, SPLITS[0])
    for sizes in SPLITS[1:]:
        loss, grad, metrics = split_loss(loss_type, level, beta, sizes)
        torch.testing.assert_close(loss, whole, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, whole_grad, atol=1e-6, rtol=0)
        assert metrics == pytest.approx(whole_metrics, abs=1e-9)


def test_a_per_micro_batch_token_mean_would_change_with_the_split():
    """The check above can fail: bnpo's token mean taken per micro-batch (TRL's) and averaged differs by split."""
    whole, _, _ = split_loss("bnpo", "token", 0.0, SPLITS[0])
    local, _, _ = split_loss("bnpo", "token", 0.0, SPLITS[3], counts="per micro-batch")
    assert abs(float(local - whole)) > 1e-3


def test_bnpo_and_dapo_are_one_loss_when_global():
    assert split_loss("bnpo", "token", 0.04, SPLITS[2])[0] == split_loss("dapo", "token", 0.04, SPLITS[2])[0]


def test_no_old_log_probs_is_the_policys_detached():
    policy, _, _, _, advantages, mask = split_batch()
    counts = grpo.batch_counts(mask)
    none, _ = grpo.grpo_loss(policy, None, None, advantages, mask, counts, "grpo")
    same, _ = grpo.grpo_loss(policy, policy.detach(), None, advantages, mask, counts, "grpo")
    assert torch.equal(none, same)


def call_loss(**changes):
    policy, old, _, _, advantages, mask = split_batch()
    args = dict(loss_type="grpo", beta=0.0, importance_sampling_level="token", max_completion_length=8)
    args.update(changes)
    return grpo.grpo_loss(policy, old, None, advantages, mask, grpo.batch_counts(mask), **args)


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda: call_loss(loss_type="cispo"), "loss_type 'cispo'"),
        (lambda: call_loss(importance_sampling_level="tokens"), "importance_sampling_level 'tokens'"),
        (lambda: call_loss(beta=-0.1), "beta -0.1"),
        (lambda: call_loss(beta=0.1), "pass ref_logps"),
        (lambda: call_loss(max_completion_length=0), "max_completion_length 0"),
        (lambda: grpo.group_advantages(torch.zeros(6), 3, "std"), "scale_rewards 'std'"),
        (lambda: grpo.group_advantages(torch.zeros(6), 4, "group"), "num_generations 4"),
        (lambda: grpo.group_advantages(torch.zeros(6), 0, "group"), "num_generations 0"),
    ],
)
def test_refusals_name_the_argument_and_value(call, said):
    with pytest.raises(UsageError, match=said.replace("(", r"\(")) as refused:
        call()
    if "not one of" in str(refused.value):
        assert "valid choices" in str(refused.value)


def test_vllm_is_ratio_modes_by_hand():
    """--use_vllm's correction, TRL's four modes, on log-prob gaps whose ratios are known: per token exp(old −
    sampling), per completion the exp of their sum; truncate clamps to the bounds, mask zeroes what is outside; a
    padded token counts nothing, a NaN (no log-prob from vLLM) as ratio 1."""
    old = torch.zeros(2, 3)
    sampling = -torch.tensor([[math.log(2.0), math.log(5.0), 9.0], [math.log(0.5), float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tok = grpo.vllm_is_ratio(old, sampling, mask, "token_truncate", None, 3.0)
    torch.testing.assert_close(tok, torch.tensor([[2.0, 3.0, 1.0], [0.5, 1.0, 1.0]]))
    torch.testing.assert_close(grpo.vllm_is_ratio(old, sampling, mask, "token_mask", 0.6, 3.0),
                               torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 1.0]]))  # fmt: skip
    seq = grpo.vllm_is_ratio(old, sampling, mask, "sequence_truncate", None, 3.0)
    torch.testing.assert_close(seq, torch.tensor([[3.0], [0.5]]))  # exp(ln 10) clamped; exp(ln 0.5)
    torch.testing.assert_close(grpo.vllm_is_ratio(old, sampling, mask, "sequence_mask", None, 3.0),
                               torch.tensor([[0.0], [0.5]]))  # fmt: skip
    from anygpu.config import grpo_args

    assert grpo_args.IS_MODES == grpo.IS_MODES  # the flag's choices are the loss's modes


@pytest.mark.parametrize("mode", grpo.IS_MODES)
def test_the_vllm_correction_weighs_the_loss_as_trls(folder, mode):
    """TRL multiplies the clipped term (not the KL) by its `importance_sampling_ratio`: the same loss, gradients
    and metrics with the ratio our `vllm_is_ratio` gives for vLLM log-probs a little off the old policy's."""
    trainer = trl_trainer(folder, loss_type="dapo", beta=0.04, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    model, inputs = trainer.model, batch_inputs(0.04)
    logps, entropies = our_logps(model, inputs)
    old, ref = logps.detach() + inputs["old_shift"], logps.detach() + inputs["ref_shift"]
    sampling = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    ratio = grpo.vllm_is_ratio(old, sampling, inputs["completion_mask"], mode, 0.5, 2.0)
    assert 0 < ratio.mean() and (ratio != 1).any()
    counts = grpo.batch_counts(inputs["completion_mask"])
    args = (inputs["advantages"], inputs["completion_mask"], counts, "dapo", 0.04, EPSILON, EPSILON_HIGH, "token", L)
    loss, _ = grpo.grpo_loss(logps, old, ref, *args, entropies, is_ratio=ratio)
    loss.backward()
    ours = grads(model)
    trl_inputs = {k: v for k, v in inputs.items() if not k.endswith("_shift")}
    trl_inputs.update(old_per_token_logps=old, ref_per_token_logps=ref, importance_sampling_ratio=ratio)
    trl_loss = trainer._compute_loss(model, trl_inputs)
    trl_loss.backward()
    torch.testing.assert_close(loss, trl_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, grads(model), atol=1e-5, rtol=1e-4)
    plain, _ = grpo.grpo_loss(logps.detach(), old, ref, *args, entropies)
    assert not torch.isclose(loss.detach(), plain)  # the weights change the loss
