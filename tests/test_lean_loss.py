"""The lean loss (anygpu.model.lean_loss) against each family's own loss, in process: the same loss
and gradients, with masked labels, tied embeddings, soft-capping / logit scaling, LoRA on the head and
a MoE router loss; and, in a fresh process, a step's peak memory at a 128k vocabulary."""

import copy
import json
import sys

import pytest
import torch
from conftest import python
from transformers import AutoConfig, AutoModelForCausalLM

from anygpu.model import lean_loss

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Families with what makes each differ from Llama switched on: every one with logit post-processing
# (lean_loss.POST), and a spread of those whose forward hands the logits straight to the loss (read from
# their source). Dropout off: no random masks to compare.
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
CONFIGS = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, **NO_DROPOUT),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, **NO_DROPOUT),
    "phi": dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "falcon": dict(num_kv_heads=2, new_decoder_architecture=True, hidden_dropout=0.0, attention_dropout=0.0),
    "bloom": dict(n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
    "stablelm": {},
    "glm4": {},
    "smollm3": {},
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1),
    "granitemoe": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        logits_scaling=4.0,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
    ),
    "llama": {},
    "mistral": {},
    "qwen3": {},
    "phi3": {},
    "olmo2": {},
    "starcoder2": {},
    "qwen2": dict(tie_word_embeddings=True),
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, final_logit_softcapping=2.0),  # a cap small enough to bend these logits
    "gemma3_text": dict(head_dim=8, final_logit_softcapping=2.0),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(logit_scale=0.5),
    "granite": dict(logits_scaling=4.0),
    "gpt_neox": {},
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
    ),
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
    ),
}


def _model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **CONFIGS[model_type]})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SMALL["vocab_size"], (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :7] = -100  # a masked prompt
    labels[1, 20:] = -100  # padding
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, lean: bool, num_items: torch.Tensor | None):
    model.zero_grad(set_to_none=True)
    with lean_loss.active(model) if lean else torch.enable_grad():
        out = model(**_batch(), use_cache=False, num_items_in_batch=num_items)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(own_model, lean_model, num_items=torch.tensor(37)):
    own, own_grads = _loss_and_grads(own_model, False, num_items)
    lean, lean_grads = _loss_and_grads(lean_model, True, num_items)
    assert abs(lean.item() - own.item()) <= 1e-5 * abs(own.item()), f"lean {lean.item():.8f} vs own {own.item():.8f}"
    assert own_grads.keys() == lean_grads.keys()
    for name, g in own_grads.items():
        torch.testing.assert_close(lean_grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("model_type", CONFIGS)
def test_lean_loss_equals_the_models_own(model_type, monkeypatch):
    """Loss within 1e-5 relative and every gradient close, with the engines' global-batch token count."""
    own = _model(model_type)
    assert lean_loss.unsupported_reason(own) is None
    lean = copy.deepcopy(own)
    monkeypatch.setenv(lean_loss.CHUNK_TOKENS_ENV, "5")  # 48 tokens: 10 chunks, the last one short
    assert lean_loss.install(lean, True).startswith(
        "loss: lean (chunked cross-entropy, 5 tokens ($ANYGPU_LEAN_LOSS_CHUNK_TOKENS) at a time"
    )
    _compare(own, lean)
    if model_type == "llama":
        _compare(own, lean, num_items=None)  # no count given: the mean over the target tokens, as transformers


def test_every_family_with_post_processing_is_checked():
    assert set(lean_loss.POST) - {"granitemoeshared"} <= set(CONFIGS)  # granitemoeshared: granitemoe's forward


def test_a_forward_that_changes_the_logits_keeps_its_own_loss():
    """Falcon-H1 multiplies the logits by a config factor the lean loss does not know: read from its source,
    it keeps the model's own loss, with the reason in the banner."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon_h1", **SMALL))
    assert "forward changes the logits before its loss_function" in lean_loss.unsupported_reason(model)
    line = lean_loss.install(model, True)
    assert line.startswith(
        "loss: the model's own (full logits): lean loss off, FalconH1ForCausalLM"
    ) and not lean_loss.is_installed(model)


def test_lora_on_the_head():
    """A LoRA adapter on lm_head (and the attention) trains the same under the lean loss."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM"
    )
    own = get_peft_model(_model("llama"), config)
    with torch.no_grad():  # B starts at zero: give the adapter a visible effect
        for name, p in own.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lean = copy.deepcopy(own)
    lean_loss.install(lean, True)
    _compare(own, lean)


def test_a_bad_chunk_size_is_refused(monkeypatch):
    monkeypatch.setenv(lean_loss.CHUNK_TOKENS_ENV, "0")
    with pytest.raises(ValueError, match="ANYGPU_LEAN_LOSS_CHUNK_TOKENS='0': give a positive number"):
        lean_loss.install(_model("llama"), True)


def test_a_gpu_chunk_holds_eight_times_the_logits_and_the_variable_sets_both(monkeypatch):
    """A GPU sums the head's fp32 gradient once per chunk, a memory-bound pass a CPU does not feel: its chunk is
    1 GiB of fp32 logits (2,092 tokens at 128k: 4 chunks per 8192 tokens instead of 32), a CPU's 128 MiB."""
    monkeypatch.delenv(lean_loss.CHUNK_TOKENS_ENV, raising=False)
    assert lean_loss.chunk_rows(128256, "cuda") == 2092
    assert lean_loss.chunk_rows(128256, "cpu") == lean_loss.chunk_rows(128256) == 261
    assert lean_loss.chunk_rows(10**9, "cuda") == 1  # a vocabulary past a chunk's bytes still moves on
    monkeypatch.setenv(lean_loss.CHUNK_TOKENS_ENV, "300")
    assert lean_loss.chunk_rows(128256, "cuda") == lean_loss.chunk_rows(128256, "cpu") == 300


def test_outside_active_the_model_is_untouched():
    """Without `active` (exports, generation) the model gives full logits and its own loss."""
    model = _model("llama")
    lean = copy.deepcopy(model)
    lean_loss.install(lean, True)
    batch = _batch()
    torch.testing.assert_close(lean(**batch).logits, model(**batch).logits)
    with lean_loss.active(lean):
        assert lean(**batch).logits.shape[-1] == 0  # the logits never exist there


def test_install_says_what_it_does():
    assert "--lean_loss false" in lean_loss.install(_model("llama"), False)


@pytest.mark.slow
def test_peak_memory_at_128k_vocabulary():
    """A step's peak RSS (fresh process per loss) at vocab 128k: the lean loss needs at most half the model's own."""
    # a narrow body (hidden 64) keeps the test short; the README's figure is the benchmark's default (hidden 256)
    out = python(
        "benchmarks/lean_loss.py", ["--vocab", "131072", "--hidden", "64", "--memory_only", "--json"], timeout=300
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])[0]
    print(row, file=sys.stderr)
    assert row["peak_memory_ratio"] <= 0.5, row
