"""Dropout masks are a function of (seed, step, sample, call site): the same whatever the micro-batch
split and under activation checkpointing's recomputation, and different for each call of one dropout module
(Phi's `resid_dropout`) (in one process; the 1-vs-2-rank runs of GPT-2 and OPT with their shipped dropout are
in test_model_families.py)."""

import pytest
import torch
from transformers import AutoConfig

from anygpu.config.args import ModelArguments
from anygpu.model import dropout, modeling

CONFIGS = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64),  # nn.Dropout modules, attention dropout
    "opt": dict(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
    ),  # functional dropout, on (batch·seq, hidden) rows in the MLP
    # phi-2's layout (partial rotary, parallel attention and MLP): one resid_dropout module for both outputs
    "phi": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attention_dropout=0.1,
    ),
    "gpt_neox": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
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
def test_recomputation_draws_the_same_masks(name, monkeypatch):
    """Activation checkpointing's recomputation draws, at every call site, exactly the masks of the first pass.

    The property is asserted on the masks themselves (bitwise). The gradients are compared with a
    tolerance: transformers switches `use_cache` off under checkpointing, and with the cache on (the plain
    pass) GPT-2's eager attention multiplies in another float order (7e-9 apart with transformers 5.23;
    bitwise equal when both passes run with `use_cache=False`), which says nothing about the masks.
    """
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    drawn, grads = [], []
    real = dropout._masks

    def recorded(state, site, input, p):
        mask = real(state, site, input, p)
        drawn[-1].append((site, mask.clone()))
        return mask

    monkeypatch.setattr(dropout, "_masks", recorded)
    for checkpointing in (False, True):
        model, _ = _model(name, checkpointing)
        drawn.append([])
        with dropout.keys(model, 0, [5, 6]):
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    plain, checkpointed = drawn
    first = dict(plain)
    assert len(first) == len(plain) > 0  # one mask per call site
    assert len(checkpointed) > len(plain)  # the decoder layers' sites again, recomputed in the backward
    assert {site for site, _ in checkpointed} == set(first)
    assert all(site in first and torch.equal(mask, first[site]) for site, mask in checkpointed)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_one_module_called_twice_draws_two_masks(monkeypatch):
    """Phi applies its layer's `resid_dropout` to the attention output and to the MLP output: two masks."""
    model, _ = _model("phi")
    real, drawn = dropout._masks, []
    monkeypatch.setattr(dropout, "_masks", lambda *a: drawn.append((a[1], real(*a))) or drawn[-1][1])
    with dropout.keys(model, 0, [5]):
        model(input_ids=torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0)))
    layer0 = [
        mask for site, mask in drawn if site.startswith("model.layers.0") and mask.shape[-1] == 32
    ]  # (1, 16, hidden)
    assert len(layer0) == 2, [site for site, _ in drawn]  # attention output, MLP output
    assert not torch.equal(layer0[0], layer0[1])
    assert len({site for site, _ in drawn}) == len(drawn)  # every call its own site


def test_attention_dropout_runs_eager_attention():
    model, note = _model("gpt2")
    assert model.config._attn_implementation == "eager" and "eager attention" in note


def test_model_without_loss_kwargs_is_refused():
    class NoKwargs(torch.nn.Module):
        def forward(self, input_ids, labels=None):
            return None

    with pytest.raises(ValueError, match="num_items_in_batch"):
        modeling.check_loss_kwargs(NoKwargs())


@pytest.mark.slow  # an inductor compile
def test_compiled_layers_do_not_recompile_after_step_2():
    """--torch_compile compiles each decoder layer (runtime.parallel.shard_model): keyed dropout must not make
    dynamo recompile them at every step (a guard on the step, or on a dropout function made anew for each
    micro-batch, would; past torch's cache limit the layers would run uncompiled), and under compile the masks
    still follow the sample, not the split (the same rows, alone or in a larger micro-batch, get the same
    masks: the 1-vs-N-rank property)."""
    compiled_at: list[int] = []
    step = 0

    def counting_backend(gm, example_inputs):  # dynamo's own guards and graphs, no code generation
        compiled_at.append(step)
        return gm.forward

    torch._dynamo.reset()
    model, _ = _model("gpt2")
    for layer in model.transformer.h:
        layer.compile(backend=counting_backend)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for step in range(1, 7):
        rows = ids[:2] if step % 2 else ids[2:]  # two micro-batches a step, as with accumulation
        with dropout.keys(model, step, [2 * step, 2 * step + 1]):
            model(input_ids=rows, labels=rows).loss.backward()
    assert compiled_at and min(compiled_at) == 1, compiled_at  # the layers did compile
    assert [s for s in compiled_at if s > 2] == [], f"graphs compiled at steps {compiled_at}"
    step = 7
    with dropout.keys(model, 7, [10, 11, 12, 13]):
        whole = model(input_ids=ids).logits
    with dropout.keys(model, 7, [12, 13]):
        half = model(input_ids=ids[2:]).logits
    torch._dynamo.reset()
    assert torch.equal(whole[2:], half)
