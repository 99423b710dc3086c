"""--use_vllm's weight push and keyed sampling (tests/test_grpo_vllm.py), one process or 2 gloo ranks under FSDP2.

`vllm_weights.py FAMILY [lora] [bf16]`: a small random model of FAMILY (fp32), its LoRA adapter given non-zero B where
asked (q, v, the MLP's projections: a MoE's experts by parameter); under torchrun each decoder layer and the root are sharded; bf16: the engine runs in bf16. A colocated vLLM engine takes the policy's
weights (`VllmGenerator.push`), samples a completion for each keyed prompt, and reports its log-probs of the tokens
it drew; the policy's own log-probs of the same tokens come from an unsharded copy. Then one SGD step changes the
weights (on every rank, on the same rows), and the next round must sample from the new ones. Rank 0 prints
`RESULT <json>`: per round, the completions by key and the largest log-prob gap."""

import copy
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from anygpu.train.generation import Sampling, sample_keys
from anygpu.train.vllm_generation import VllmGenerator

BODY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=320, max_position_embeddings=128)
FAMILIES = {
    # GQA, untied head
    "llama": dict(model_type="llama", num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False),
    # q/k/v biases, tied head
    "qwen2": dict(model_type="qwen2", num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True),
    # q/k norms, explicit head_dim, GQA
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False),
    # a family vLLM runs through its Transformers backend (which rewrites transformers' own class in this process);
    # q/k norms over whole projections, norms after the blocks, GQA
    "olmo2": dict(model_type="olmo2", num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False),
    # routed experts (vLLM's fused MoE; an expert width its CPU kernel pads), q/k norms; LoRA on the experts' 3-D
    # weights (peft's nested ParamWrappers: gate_up_proj and down_proj)
    "qwen3_moe": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=48, tie_word_embeddings=False),
}  # fmt: skip
# many stop tokens (1 in 9 of the vocabulary): most completions end on one, some are cut at max_new_tokens
STOPS = tuple(range(2, 38))
SAMPLING = Sampling(temperature=0.9, top_p=1.0, top_k=0, max_new_tokens=12, eos_token_ids=STOPS, pad_token_id=0)
PROMPTS = [[1, 5, 9, 33, 7], [1, 200, 3], [1, 44, 45, 46, 47, 48, 49, 50], [1, 8], [1, 99, 98, 97], [1, 12, 13]]


def build(family: str, lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(**FAMILIES[family], **BODY, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norms away from 1 (and 0 for zero-centred ones): their weights must arrive too
                param.add_(0.1 * torch.randn_like(param))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.05 * torch.randn_like(param))  # a trained adapter: B A is not zero
    return model


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def policy_logps(plain: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """The unsharded policy's log-probs of `ids` after `prompt`, of logits / temperature (vLLM's processed ones)."""
    with torch.no_grad():
        logits = plain(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    logps = torch.log_softmax(logits / SAMPLING.temperature, -1)
    return logps.gather(-1, torch.tensor(ids)[:, None])[:, 0]


def one_round(gen: VllmGenerator, model, plain, version: int, rank: int, world: int) -> dict:
    """This rank's share of the prompts sampled (the keys of the whole list), checked against the policy."""
    keys = sample_keys(7, version, list(range(len(PROMPTS))), [0] * len(PROMPTS), "cpu")
    mine = list(range(rank, len(PROMPTS), world))
    done = gen.complete(model, [PROMPTS[i] for i in mine], keys[mine], version)
    from vllm import SamplingParams

    again = gen.llm.generate(  # the same keyed requests, with vLLM's log-probs of what it draws
        [{"prompt_token_ids": PROMPTS[i]} for i in mine],
        [SamplingParams(temperature=SAMPLING.temperature, max_tokens=SAMPLING.max_new_tokens, stop_token_ids=list(STOPS),
                        seed=int(keys[i]) & ((1 << 63) - 1), logprobs=0)
         for i in mine],
        use_tqdm=False,
    )  # fmt: skip
    gap, repeat = 0.0, True
    for i, c, o in zip(mine, done, again):
        out = o.outputs[0]
        repeat &= list(out.token_ids) == c.ids
        # a completion that stopped ends on its stop token, as the policy's own generation gives it
        repeat &= c.truncated == (len(c.ids) == SAMPLING.max_new_tokens and c.ids[-1] not in STOPS)
        repeat &= c.truncated or c.ids[-1] in STOPS
        theirs = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
        repeat &= torch.equal(theirs, torch.tensor(c.logps))  # the completion carries vLLM's own log-probs
        gap = max(gap, (theirs - policy_logps(plain, PROMPTS[i], c.ids)).abs().max().item())
    return {"completions": {str(i): c.ids for i, c in zip(mine, done)}, "gap": gap, "repeat": repeat,
            "truncated": {str(i): c.truncated for i, c in zip(mine, done)}}  # fmt: skip


def sgd_step(model: torch.nn.Module) -> None:
    """One step on the same rows on every rank (FSDP2 averages equal gradients: the plain copy takes the same)."""
    rows = torch.tensor([[1, 5, 9, 33, 7, 11, 12, 13], [1, 200, 3, 4, 5, 6, 7, 8]])
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.5 * p.grad)
                p.grad = None


def main() -> None:
    family, lora, bf16 = sys.argv[1], "lora" in sys.argv[2:], "bf16" in sys.argv[2:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank() if world > 1 else 0
    model = build(family, lora)
    plain = copy.deepcopy(model)
    if world > 1:
        shard(model)
    dtype = "bfloat16" if bf16 else "float32"  # bf16: the engine's weights cast from the fp32 policy's shards
    gen = VllmGenerator.start(model, SAMPLING, max_model_len=64, memory=0.3, dtype=dtype)
    rounds = [one_round(gen, model, plain, 1, rank, world)]
    sgd_step(model)
    sgd_step(plain)
    rounds.append(one_round(gen, model, plain, 2, rank, world))
    stale = gen.complete(model, [PROMPTS[0]], sample_keys(7, 2, [0], [0], "cpu"), 2)  # same version: no push
    rounds[-1]["same_version_same_tokens"] = stale[0].ids == rounds[-1]["completions"].get("0", stale[0].ids)
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, rounds)
        merged = []
        for r in range(len(rounds)):
            merged.append({
                "completions": {k: v for p in parts for k, v in p[r]["completions"].items()},
                "truncated": {k: v for p in parts for k, v in p[r]["truncated"].items()},
                "gap": max(p[r]["gap"] for p in parts),
                "repeat": all(p[r]["repeat"] for p in parts),
            })  # fmt: skip
        merged[-1]["same_version_same_tokens"] = rounds[-1]["same_version_same_tokens"]
        rounds = merged
    gen.close()
    if rank == 0:
        print("RESULT " + json.dumps(rounds), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
