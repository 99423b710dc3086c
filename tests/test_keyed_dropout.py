"""Dropout masks are a function of (seed, step, sample, call site): the same whatever the micro-batch
split and under activation checkpointing's recomputation (in one process; the 1-vs-2-rank runs of GPT-2
and OPT with their shipped dropout are in test_model_families.py)."""
import pytest
import torch
from transformers import AutoConfig

from anygpu import dropout, modeling
from anygpu.args import ModelArguments

CONFIGS = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),  # nn.Dropout modules, attention dropout
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                word_embed_proj_dim=32),  # functional dropout, on (batch·seq, hidden) rows in the MLP
}


def _model(name: str, checkpointing: bool = False):
    config = AutoConfig.for_model(name, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **CONFIGS[name])
    model = modeling.build_full_model(config, ModelArguments(), seed=1)
    note = dropout.install(model, seed=3)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(), note


@pytest.mark.parametrize("name", CONFIGS)
def test_masks_follow_the_sample_not_the_split(name):
    model, note = _model(name)
    assert "keyed" in note
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with dropout.keys(model, 0, [10, 11, 12, 13]):
        whole = model(input_ids=ids).logits
    with dropout.keys(model, 0, [12, 13]):
        half = model(input_ids=ids[2:]).logits
    with dropout.keys(model, 1, [12, 13]):
        next_step = model(input_ids=ids[2:]).logits
    assert torch.equal(whole[2:], half)
    assert not torch.equal(half, next_step)  # masks do change from step to step
    model.eval()
    assert torch.equal(model(input_ids=ids[2:]).logits, model(input_ids=ids[2:]).logits)  # no dropout in eval


@pytest.mark.parametrize("name", CONFIGS)
def test_recomputation_draws_the_same_masks(name):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        model, _ = _model(name, checkpointing)
        with dropout.keys(model, 0, [5, 6]):
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_attention_dropout_runs_eager_attention():
    model, note = _model("gpt2")
    assert model.config._attn_implementation == "eager" and "eager attention" in note


def test_model_without_loss_kwargs_is_refused():
    class NoKwargs(torch.nn.Module):
        def forward(self, input_ids, labels=None):
            return None

    with pytest.raises(ValueError, match="num_items_in_batch"):
        modeling.check_loss_kwargs(NoKwargs())
