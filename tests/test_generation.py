"""GRPO's sampling (anygpu.train.generation): keyed noise that depends on (seed, round, prompt, generation index,
token) alone, a sampler whose argmax is a draw from HF's filtered softmax, batched `generate` whose rows do not
depend on their batch, and `gathered`, which lets FSDP2 ranks generate different numbers of tokens without a
collective per token (tests/scripts/generation_ranks.py, 2 gloo ranks)."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from conftest import torchrun
from torch import nn

from anygpu.train import generation
from anygpu.train.generation import Completion, KeyedSampler, Sampling, generate, keyed_uniform, sample_keys

MASK = (1 << 64) - 1
VOCAB, EOS, PAD = 64, 1, 0


def py_mix(z: int) -> int:
    """splitmix64's finaliser on Python integers: the reference the tensor code must match bit for bit."""
    z = (z ^ (z >> 30)) * generation._M1 & MASK
    z = (z ^ (z >> 27)) * generation._M2 & MASK
    return z ^ (z >> 31)


def py_absorb(state: int, part: int) -> int:
    return py_mix(state ^ py_mix((part + generation._GOLDEN) & MASK))


def tiny_model(family: str = "llama", seed: int = 0, eos_bias: float = 2.0) -> nn.Module:
    """A random fp32 model of `family` (vocabulary 64) whose logits matter (lm_head std 0.15) and whose head
    leans towards EOS (a bias), so some completions stop and some run to max_new_tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=2,
        initializer_range=0.2,
    )  # fmt: skip
    if family == "llama":
        config = LlamaConfig(**common)
    elif family == "mistral":  # a window shorter than the prompts: the sliding-window cache at work
        config = MistralConfig(**common, sliding_window=3)
    else:
        config = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    head = nn.Linear(32, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.normal_(0, 0.15)
        head.bias.zero_()
        head.bias[EOS] = eos_bias
    model.lm_head = head
    return model


SAMPLING = Sampling(max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=PAD)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33]]


def keys_for(prompts: list[int], generations: list[int] | None = None, seed: int = 0, round: int = 0):
    return sample_keys(seed, round, prompts, generations or [0] * len(prompts), "cpu")


# --- the keyed noise


def test_keys_and_uniforms_are_exact_integer_hashes():
    """Bit for bit the Python-integer splitmix64 (no float rounding, no generator), so CPU and CUDA give the same
    noise."""
    keys = sample_keys(5, 7, [0, 1, 2, -3, 2**40], [0, 3, 1, 2, 7], "cpu")
    u = keyed_uniform(keys, 4, 10)
    expected = [py_absorb(py_absorb(py_absorb(5, 7), p & MASK), g) for p, g in [(0, 0), (1, 3), (2, 1), (-3, 2)]]
    expected.append(py_absorb(py_absorb(py_absorb(5, 7), 2**40), 7))
    assert [k & MASK for k in keys.tolist()] == expected
    for row, key in enumerate(expected):
        stream = py_absorb(key, 4)
        bits = [py_mix((stream + (v + 1) * generation._GOLDEN) & MASK) >> 41 for v in range(10)]
        assert u[row].tolist() == [(b + 0.5) / 2**23 for b in bits]


def test_uniforms_do_not_use_the_global_generator():
    """The global RNG is left untouched, and its seed changes nothing."""
    keys = sample_keys(0, 0, range(8), [0] * 8, "cpu")
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = keyed_uniform(keys, 0, 16)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(456)
    assert torch.equal(keyed_uniform(keys, 0, 16), first)


def test_uniforms_do_not_depend_on_the_batch():
    """A row's values are the same in any batch, at any place in it, alone or among others."""
    keys = keys_for(list(range(10)), [3] * 10)
    whole = keyed_uniform(keys, 2, 50)
    order = torch.tensor([7, 2, 9, 0])
    others = keys_for(list(range(100, 105)))
    mixed = keyed_uniform(torch.cat([others[:2], keys[order], others[2:]]), 2, 50)
    assert torch.equal(mixed[2:6], whole[order])
    assert torch.equal(keyed_uniform(keys[4:5], 2, 50)[0], whole[4])
    assert torch.equal(keyed_uniform(keys, 2, 20), whole[:, :20])  # the vocabulary size is no input either


def test_every_part_of_the_key_changes_the_noise():
    variants = [
        keyed_uniform(sample_keys(0, 0, [1], [2], "cpu"), 3, 64),
        keyed_uniform(sample_keys(1, 0, [1], [2], "cpu"), 3, 64),  # seed
        keyed_uniform(sample_keys(0, 1, [1], [2], "cpu"), 3, 64),  # round
        keyed_uniform(sample_keys(0, 0, [2], [2], "cpu"), 3, 64),  # prompt
        keyed_uniform(sample_keys(0, 0, [1], [1], "cpu"), 3, 64),  # generation index
        keyed_uniform(sample_keys(0, 0, [2], [1], "cpu"), 3, 64),  # prompt and generation index swapped
        keyed_uniform(sample_keys(0, 0, [1], [2], "cpu"), 4, 64),  # token position
    ]
    rows = torch.cat(variants)
    for i in range(len(rows)):
        for j in range(i):
            assert (rows[i] != rows[j]).float().mean() > 0.95, (i, j)


def test_uniforms_are_uniform_in_the_open_interval():
    u = keyed_uniform(keys_for(list(range(2000))), 0, 500).double()  # a million values
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=20, min=0, max=1) / u.numel()
    assert (counts - 0.05).abs().max() < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_the_noise_is_the_same_on_a_gpu():
    keys = sample_keys(3, 1, range(64), list(range(64)), "cpu")
    on_gpu = sample_keys(3, 1, range(64), list(range(64)), "cuda")
    assert torch.equal(on_gpu.cpu(), keys)
    assert torch.equal(keyed_uniform(on_gpu, 5, 1000).cpu(), keyed_uniform(keys, 5, 1000))


def test_sample_keys_wants_one_generation_index_per_prompt():
    with pytest.raises(ValueError, match="one generation index per prompt index"):
        sample_keys(0, 0, [1, 2], [0], "cpu")


# --- the sampler


def hf_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The probabilities HF's do_sample=True draws from, written out here (temperature, then top-k, then top-p)."""
    scores = logits / temperature
    if top_k:
        kth = scores.topk(top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1:
        ascending, order = scores.sort()
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[-1] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.8), (1.3, 5, 0.9)]
)
def test_the_sampler_draws_from_the_filtered_softmax(temperature, top_k, top_p):
    """20000 keys on one logits vector: token frequencies within 0.015 of the filtered softmax (4.2 standard
    errors at worst; the keys are fixed, so the outcome is too), and no filtered token ever drawn."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3])
    n = 20000
    sampler = KeyedSampler(Sampling(temperature=temperature, top_k=top_k, top_p=top_p), keys_for(list(range(n))), 0)
    drawn = sampler(torch.zeros(n, 0, dtype=torch.long), logits.expand(n, -1).clone()).argmax(-1)
    freq = torch.bincount(drawn, minlength=len(logits)).double() / n
    expected = hf_filtered(logits.double(), temperature, top_k, top_p)
    assert (freq - expected).abs().max() < 0.015, (freq, expected)
    assert freq[expected == 0].sum() == 0
    if top_k or top_p < 1:
        assert (expected == 0).any()  # the case filters something


def test_the_noise_follows_the_token_index():
    """Token t's noise is keyed_uniform(key, t): the index within the completion, whatever the prompt width."""
    keys = keys_for([0, 1])
    sampler = KeyedSampler(Sampling(), keys, prompt_width=5)
    out = sampler(torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 16))
    assert torch.equal(out, -torch.log(-torch.log(keyed_uniform(keys, 2, 16))))


def test_top_k_1_is_greedy():
    model = tiny_model()
    ids = torch.tensor([PROMPTS[1]])
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                            eos_token_id=EOS, pad_token_id=PAD)[0, ids.shape[1]:].tolist()  # fmt: skip
    sampled = generate(model, [PROMPTS[1]], keys_for([0]), Sampling(top_k=1, **_ends()))[0]
    assert sampled.ids == (greedy[: greedy.index(EOS) + 1] if EOS in greedy else greedy)


def _ends() -> dict:
    return dict(max_new_tokens=SAMPLING.max_new_tokens, eos_token_ids=SAMPLING.eos_token_ids, pad_token_id=PAD)


# --- generate


def test_a_completion_does_not_depend_on_its_batch():
    """The same prompt and key alone, among longer and shorter prompts, at another row: the same completion."""
    model = tiny_model()
    keys = keys_for([0, 1, 2, 3])
    batch = generate(model, PROMPTS, keys, SAMPLING)
    alone = [generate(model, [p], keys[i : i + 1], SAMPLING)[0] for i, p in enumerate(PROMPTS)]
    order = [2, 0, 3, 1]
    moved = generate(model, [PROMPTS[i] for i in order], keys[order], SAMPLING)
    assert batch == alone == [moved[order.index(i)] for i in range(4)]
    assert len({tuple(c.ids) for c in batch}) == 4


def test_generations_of_one_prompt_differ():
    model = tiny_model()
    prompts = [PROMPTS[1]] * 6
    out = generate(model, prompts, keys_for([0] * 6, list(range(6))), SAMPLING)
    assert len({tuple(c.ids) for c in out}) == 6
    assert generate(model, prompts[:1], keys_for([0], [3]), SAMPLING)[0] == out[3]


def test_stops_at_eos_and_flags_truncation():
    model = tiny_model()
    prompts = [PROMPTS[i % 4] for i in range(16)]
    out = generate(model, prompts, keys_for(list(range(16))), SAMPLING)
    stopped = [c for c in out if not c.truncated]
    truncated = [c for c in out if c.truncated]
    assert stopped and truncated, out  # this setup has both
    for c in stopped:
        assert c.ids[-1] == EOS and EOS not in c.ids[:-1] and len(c.ids) <= SAMPLING.max_new_tokens
    for c in truncated:
        assert EOS not in c.ids and len(c.ids) == SAMPLING.max_new_tokens
    short = Sampling(max_new_tokens=3, eos_token_ids=(EOS,), pad_token_id=PAD)
    for long, cut in zip(out, generate(model, prompts, keys_for(list(range(16))), short)):
        assert cut.ids == long.ids[:3] and cut.truncated == (EOS not in long.ids[:3])


def test_no_eos_token_runs_to_the_end():
    out = generate(tiny_model(), PROMPTS, keys_for([0, 1, 2, 3]), Sampling(max_new_tokens=5, pad_token_id=PAD))
    assert all(c.truncated and len(c.ids) == 5 for c in out)


def test_the_models_own_generation_config_and_mode_change_nothing():
    """A Hub model's generation config (sampling, penalties, forced and suppressed tokens) adds no processor or
    stop of HF's own; generation runs in eval mode and leaves the mode as it was; HF logs no warning."""
    from transformers import GenerationConfig

    model = tiny_model(eos_bias=0.0)
    for layer in model.model.layers:  # dropout would change the logits in training mode
        layer.self_attn.attention_dropout = 0.5
    keys = keys_for([0, 1, 2, 3])
    model.eval()
    clean = generate(model, PROMPTS, keys, SAMPLING)
    assert not model.training
    hostile = GenerationConfig(
        do_sample=True, temperature=0.3, top_k=2, top_p=0.5, repetition_penalty=3.0, no_repeat_ngram_size=1,
        min_new_tokens=12, suppress_tokens=[EOS], forced_bos_token_id=3, max_length=7, bad_words_ids=[[4]],
    )  # fmt: skip
    model.generation_config = hostile
    model.train()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        again = generate(model, PROMPTS, keys, SAMPLING)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert again == clean and model.training and model.generation_config is hostile
    assert not records, [r.getMessage() for r in records]


def test_bad_calls_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="one key per prompt"):
        generate(model, PROMPTS, keys_for([0]), SAMPLING)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], keys_for([0]), SAMPLING)
    with pytest.raises(ValueError, match="not a valid sampling"):
        Sampling(temperature=0)
    assert generate(model, [], keys_for([]), SAMPLING) == []


def test_a_lora_model_samples_as_its_merged_weights():
    """A PEFT LoRA model (adapters that change the logits) gives its merged model's completions, batch-free."""
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    torch.manual_seed(1)
    peft_model = get_peft_model(
        tiny_model(), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    keys = keys_for([0, 1, 2, 3])
    out = generate(peft_model, PROMPTS, keys, SAMPLING)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    assert out == generate(merged, PROMPTS, keys, SAMPLING)
    assert out != generate(tiny_model(), PROMPTS, keys, SAMPLING)  # the adapters matter
    assert generate(peft_model, PROMPTS[1:2], keys[1:2], SAMPLING)[0] == out[1]
    # PEFT's generate copies the config it sees into the base model: still the one set aside for the call
    peft_model.get_base_model().generation_config = GenerationConfig(do_sample=True, top_k=2, suppress_tokens=[EOS])
    assert generate(peft_model, PROMPTS, keys, SAMPLING) == out


@pytest.mark.parametrize("family", ["mistral", "qwen3_moe"])
def test_other_families_are_batch_free(family):
    """Mistral's sliding-window cache (a window of 3, shorter than the prompts) and Qwen3-MoE's routed experts."""
    model = tiny_model(family)
    keys = keys_for([0, 1, 2, 3])
    batch = generate(model, PROMPTS, keys, SAMPLING)
    assert batch == [generate(model, [p], keys[i : i + 1], SAMPLING)[0] for i, p in enumerate(PROMPTS)]
    assert all(isinstance(c, Completion) for c in batch)


def test_a_moe_that_returns_its_router_logits_samples_and_scores_as_one_that_does_not():
    """A config with output_router_logits (the language model's load-balancing loss): generation and the rollout's
    log-probs leave the router logits out (HF's balancing loss took a cached step's logits with the whole mask and
    ended the run), so the completions and log-probs are those of the same weights without the flag."""
    from anygpu.train import rollout

    plain, routed = tiny_model("qwen3_moe"), tiny_model("qwen3_moe")
    routed.config.output_router_logits = True
    keys = keys_for([0, 1, 2, 3])
    done = generate(routed, PROMPTS, keys, SAMPLING)
    assert done == generate(plain, PROMPTS, keys, SAMPLING)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(6)[None],
             "completion_ids": ids[:, 3:]}  # fmt: skip
    logps = rollout.token_log_probs(routed, routed, batch, 1.0)[0]
    assert torch.equal(logps, rollout.token_log_probs(plain, plain, batch, 1.0)[0])


def test_fsdp_param_groups_of_either_torch_layout():
    """torch 2.12+ keeps a list of parameter groups per FSDP2 state, torch 2.11 (the lease's GPU image) one optional
    group: `gathered` read the list only and failed there (AttributeError: '_fsdp_param_groups', the H200 lease of
    2026-11-28's GRPO row)."""
    import types

    from anygpu.train.generation import param_groups

    a, b = object(), object()
    assert param_groups(types.SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert param_groups(types.SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []


def test_gathered_leaves_a_plain_model_alone():
    model = tiny_model()
    with generation.gathered(model):
        out = generate(model, PROMPTS[:1], keys_for([0]), SAMPLING)
    assert out == generate(model, PROMPTS[:1], keys_for([0]), SAMPLING)


@pytest.mark.slow
def test_fsdp_ranks_generate_apart_inside_gathered():
    """2 gloo ranks, a tiny Llama under FSDP2 (per layer + root): rank 0 and rank 1 hold different numbers of
    prompts (rank 1 none in the second round) and stop after different numbers of tokens. Inside `gathered`, one
    all-gather per unit for the round and no other collective; the completions are an unsharded copy's; after,
    the parameters are sharded DTensors again, resharded after each layer's forward as before, and a training
    forward/backward matches the copy's loss. Outside `gathered`, HF's synced_gpus keeps the ranks together."""
    proc = torchrun(2, "tests/scripts/generation_ranks.py", [], timeout=180)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    ranks = json.loads(line[len("RESULT ") :])
    assert len(ranks) == 2
    for r in ranks:
        units = r["units"]
        assert units == 3
        for round_ in r["gathered_rounds"]:
            assert round_["all_gathers"] == units and round_["other_collectives"] == 0, r
            assert round_["same_as_unsharded"], r
        assert r["synced"]["same_as_unsharded"] and r["synced"]["all_reduces"] > 0, r
        assert r["sharded_after"] and r["layers_reshard_after_forward"] and r["root_keeps_after_forward"], r
        assert r["loss_matches"] and r["grads_sharded"], r
    forwards = [[rd["forwards"] for rd in r["gathered_rounds"]] for r in ranks]
    assert forwards[0][0] != forwards[1][0] and forwards[1][1] == 0, forwards  # the ranks stepped apart


def test_vllm_push_gives_the_checkpoints_names_and_shapes(tmp_path):
    """--use_vllm pushes the policy in the layout vLLM's loaders read, a checkpoint's: for a MoE family whose experts
    transformers fuses in memory (Qwen3-MoE), the same tensor names and shapes `save_pretrained` writes, values equal;
    with LoRA, what peft's `merge_and_unload` saves (adapters on the attention, the experts' 3-D weights, the router,
    an embedding)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from anygpu.train.vllm_generation import policy_weights

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    pushed = dict(policy_weights(model))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved  # the checkpoint splits what memory fuses
    assert sorted(pushed) == sorted(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(pushed[name], tensor, atol=0, rtol=0, msg=name)
    # LoRA merged as peft merges it: all-linear (on a MoE: the experts' 3-D weights and the router too, peft's nested
    # ParamWrappers), and an embedding
    for targets in ("all-linear", ["embed_tokens", "q_proj"]):
        lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=targets))
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name or "lora_embedding_" in name:  # peft starts an embedding's A at 0, not its B
                    p.copy_(0.1 * torch.randn_like(p))
        merged = dict(policy_weights(lora))
        copy.deepcopy(lora).merge_and_unload().save_pretrained(tmp_path / "merged")
        reference = load_file(tmp_path / "merged/model.safetensors")
        assert sorted(merged) == sorted(reference) == sorted(saved)
        changed = [n for n in saved if not torch.equal(merged[n], saved[n])]
        assert (
            any(".experts." in n for n in changed)
            if targets == "all-linear"
            else "model.embed_tokens.weight" in changed
        )
        for name, tensor in reference.items():
            torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
