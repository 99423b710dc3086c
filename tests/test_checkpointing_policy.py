"""Activation checkpointing's policies (anygpu.runtime.checkpointing), in process: what each recomputes in the
backward, that none changes a gradient, and the memory plan's count of what each keeps."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from anygpu.planning import memory_plan
from anygpu.runtime import checkpointing


class Ops(TorchDispatchMode):
    """The aten ops run inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"  # sdpa's kernel on a CPU


@pytest.fixture(scope="module")
def traced():
    """For no checkpointing, full and selective: the ops of the forward, those of the backward, the gradients."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.vocab_size, config._attn_implementation = 256, "sdpa"
    base, ids = LlamaForCausalLM(config), torch.randint(0, 256, (2, 32))
    out = {}
    for policy in (None, "full", "selective"):
        model = copy.deepcopy(base).train()
        checkpointing.enable(model, policy)
        with Ops() as forward:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with Ops() as backward:
            loss.backward()
        out[policy] = forward.seen, backward.seen, torch.cat([p.grad.flatten() for p in model.parameters()])
    return out


def test_no_policy_changes_a_gradient(traced):
    grads = traced[None][2]
    assert torch.equal(traced["full"][2], grads) and torch.equal(traced["selective"][2], grads)


def test_full_recomputes_every_layer_matmul_and_attention_selective_none(traced):
    """Full checkpointing runs each decoder layer's forward again in the backward: its attention and its projections
    (but the last, down_proj, whose output nothing saves: the recomputation stops early); selective keeps their
    outputs and recomputes neither."""
    (_, none, _), (_, full, _), (_, sel, _) = traced[None], traced["full"], traced["selective"]
    layers = 2
    assert full["mm"] - none["mm"] == 6 * layers
    assert full[ATTENTION] - none.get(ATTENTION, 0) == layers
    assert sel["mm"] == none["mm"] and sel.get(ATTENTION, 0) == none.get(ATTENTION, 0)


def test_selective_recomputes_the_cheap_rest(traced):
    """What selective does recompute: the norms and activations (their elementwise ops run again in the backward)."""
    (_, none, _), (_, sel, _) = traced[None], traced["selective"]
    assert sel["rsqrt"] > none.get("rsqrt", 0) and sel["silu"] > none.get("silu", 0)


def test_the_plan_counts_selective_between_none_and_full():
    """Llama-3-8B at block 8192 in bf16, per GPU: selective keeps far more than full and far less than none."""
    shapes = memory_plan.Shapes(
        params=(),
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        layer_param_numel=218_103_808,
    )
    act = {c: memory_plan.activation_bytes(shapes, 1, 8192, "bf16", c) for c in (False, "selective", True)}
    assert act[True] < act["selective"] < act[False]
    assert 0.4 < act["selective"] / act[False] < 0.7  # matmul outputs: about half of what a layer saves
