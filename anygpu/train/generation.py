"""Sampling GRPO's completions: each a function of (seed, round, prompt index, generation index) and the weights.

A completion's randomness is not drawn from a generator (whose stream depends on the rank, the batch and the
order of the calls) but hashed: its row key is `sample_keys(seed, round, prompt, generation)`, and the noise for
its t-th token (t = 0 for the first completion token) and vocabulary entry v is `keyed_uniform(key, t, v)`,
splitmix64 in exact int64 arithmetic (the same bits on CPU and CUDA). The sampler (`KeyedSampler`) applies
Hugging Face's own temperature, top-k and top-p warpers (the same tokens survive as under TRL's
`do_sample=True`), then adds Gumbel noise −log(−log u): the argmax of the result is an exact draw from
softmax(filtered logits / T) (Gumbel-max), so HF's greedy `generate` with this one logits processor samples, with
its KV cache, left padding and every model family's cache (sliding windows, MoE, PEFT-wrapped models alike).
Which rank generates a completion, beside which other prompts, at which row, on how many ranks: none of it
changes the noise. What can still differ is floating point: the same row in another batch shape may get logits
a rounding error apart, which changes a token only where two Gumbel-perturbed scores tie to that precision.

`gathered(model)` keeps an FSDP2 model's parameters all-gathered for a whole generation round: one all-gather
per unit, not one per unit per token, and no collective inside a forward, so ranks that stop after different
numbers of tokens (or have no prompt at all) never wait for each other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from anygpu.model import moe
from anygpu.runtime.parallel import is_sharded
from anygpu.train.rollout import micro_batches

_MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants
_UNIFORM_BITS = 23  # (k + 0.5) / 2^23 and 1 − 2^-24 are exact in float32: u is never 0 or 1
_GATHERED = "_anygpu_gathered"


def _int64(x: int) -> int:
    """`x` mod 2^64 as the int64 with the same bits."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 bits (torch's >> on int64 is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, a bijection of 64-bit words (int64 multiplication wraps: arithmetic mod 2^64)."""
    z = (z ^ _shr(z, 30)) * _int64(_M1)
    z = (z ^ _shr(z, 27)) * _int64(_M2)
    return z ^ _shr(z, 31)


def _absorb(state: torch.Tensor, part: torch.Tensor | int) -> torch.Tensor:
    """The state with one more number hashed in (injective in `part` for a given state)."""
    if isinstance(part, int):
        part = torch.tensor(_int64(part), dtype=torch.int64, device=state.device)
    return _mix(state ^ _mix(part + _int64(_GOLDEN)))


def sample_keys(
    seed: int, round: int, prompt_index: Sequence[int], generation_index: Sequence[int], device: torch.device | str
) -> torch.Tensor:
    """(B,) int64: each row's key, a hash of (seed, round, its prompt's global index, its generation index)."""
    prompts = torch.as_tensor(prompt_index, dtype=torch.int64, device=device)
    generations = torch.as_tensor(generation_index, dtype=torch.int64, device=device)
    if prompts.shape != generations.shape or prompts.dim() != 1:
        raise ValueError(f"one generation index per prompt index: got {len(prompts)} and {len(generations)}")
    state = _absorb(torch.full_like(prompts, _int64(seed)), round)
    return _absorb(_absorb(state, prompts), generations)


def keyed_uniform(keys: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """(B, V) float32 in (0, 1): entry (b, v) a hash of (keys[b], position, v) alone, so a row's values do not
    depend on the batch it sits in, its place there, or the device."""
    row = _absorb(keys, position)  # (B,) one splitmix64 stream per (key, position)
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _int64(_GOLDEN)
    bits = _shr(_mix(row[:, None] + counters), 64 - _UNIFORM_BITS)  # the stream's v-th output, its top bits
    return (bits.to(torch.float32) + 0.5) * 2.0**-_UNIFORM_BITS


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled (TRL's GRPOConfig meanings; top_k 0 and top_p 1 are off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"not a valid sampling: {self}")


class KeyedSampler(LogitsProcessor):
    """HF's temperature, top-k and top-p warpers, then Gumbel noise keyed by (row key, token index): the argmax
    of what it returns is a sample from softmax(filtered logits / T)."""

    def __init__(self, sampling: Sampling, keys: torch.Tensor, prompt_width: int) -> None:
        self.keys, self.prompt_width = keys, prompt_width
        self.warpers = LogitsProcessorList()  # HF's order (`GenerationMixin._get_logits_processor`)
        if sampling.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) float32 scores: filtered, with row b's Gumbel noise for its token number t added."""
        t = input_ids.shape[1] - self.prompt_width  # HF keeps every row to the end, in its order: t is the same
        scores = self.warpers(input_ids, scores.float())
        u = keyed_uniform(self.keys.to(scores.device), t, scores.shape[-1])
        return scores - torch.log(-torch.log(u))  # filtered tokens stay −inf


@dataclass(frozen=True)
class Completion:
    """The sampled tokens (with the EOS it stopped on, nothing after it); truncated: max_new_tokens, no EOS."""

    ids: list[int]
    truncated: bool
    logps: list[float] | None = None  # the sampler's log-probs of `ids` (vLLM's, after its temperature and filters)


def generate(model: nn.Module, prompts: list[list[int]], keys: torch.Tensor, sampling: Sampling) -> list[Completion]:
    """One completion per prompt, row i sampled with keys[i]: all rows at once, left-padded, with a KV cache,
    in eval mode (the model's mode restored after). No prompt: no forward, no collective."""
    if len(keys) != len(prompts):
        raise ValueError(f"one key per prompt: got {len(keys)} keys for {len(prompts)} prompts")
    if not prompts:
        return []
    if min(map(len, prompts)) == 0:
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), sampling.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompts):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    config = GenerationConfig(
        do_sample=False,  # greedy over the Gumbel-perturbed scores: HF adds no warper of its own
        num_beams=1,
        max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=0,
        eos_token_id=list(sampling.eos_token_ids) or None,
        pad_token_id=sampling.pad_token_id,
        use_cache=True,
    )
    sampler = KeyedSampler(sampling, keys.to(device), width)
    training = model.training
    model.eval()  # no dropout
    try:
        with torch.no_grad(), _only_config(model):
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                synced_gpus=_forward_communicates(model),
                **moe.eval_kwargs(model),  # no load-balancing loss over a cached step's logits
            )
    finally:
        model.train(training)
    return [_completion(row, sampling) for row in out[:, width:].tolist()]


class PolicyGenerator:
    """The policy's own generation (GRPOObjective's generator interface): its weights gathered once for the call,
    rows batched with a KV cache, `batch_size` prompts at a time."""

    line = "batched with a KV cache from weights gathered once a round"  # the banner's

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def complete(
        self, model: nn.Module, prompts: list[list[int]], keys: torch.Tensor, version: int, batch_size: int = 0
    ) -> list[Completion]:
        """One completion per prompt (keys[i] for prompts[i]); `version` unused: the policy is its own weights.
        A collective: every rank calls it, also one without prompts."""
        done: list[Completion] = []
        with gathered(model):
            for part in micro_batches(len(prompts), batch_size or max(len(prompts), 1)):
                done += generate(model, prompts[part.start : part.stop], keys[part.start : part.stop], self.sampling)
        return done

    def close(self) -> None:
        pass


def _completion(row: list[int], sampling: Sampling) -> Completion:
    """A generated row cut after its first EOS (HF pads a finished row while others go on)."""
    ends = [i for i, token in enumerate(row) if token in sampling.eos_token_ids]
    if ends:
        return Completion(row[: ends[0] + 1], truncated=False)
    assert len(row) == sampling.max_new_tokens, "HF stopped a row before max_new_tokens without an EOS"
    return Completion(row, truncated=True)


@contextlib.contextmanager
def _only_config(model: nn.Module) -> Iterator[None]:
    """The model's own generation config set aside for the call: HF fills every field a call leaves None from it
    (a Hub model's sampling defaults, repetition penalty, forced or suppressed tokens), each a processor of its
    own. PEFT's `generate` copies the same object back into the base model."""
    hf = next(m for m in model.modules() if isinstance(m, GenerationMixin))
    saved = hf.generation_config
    hf.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf.generation_config = saved


def _forward_communicates(model: nn.Module) -> bool:
    """Whether a forward runs collectives: an FSDP2 model outside `gathered` (one all-gather per unit per token)
    or DeepSpeed ZeRO-3. Then HF's synced_gpus keeps every rank stepping until all are done (and every rank must
    call with a prompt); `gathered` spares both."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() or (is_sharded(model) and not getattr(model, _GATHERED, False))


def param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list in torch 2.12 and later (`_fsdp_param_groups`), one optional group
    before (`_fsdp_param_group`, torch 2.11: the lease's GPU image)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 unit's parameters all-gathered once and kept for the block, then resharded (a plain model:
    nothing). Collective: every rank enters it, with prompts or without."""
    if not is_sharded(model):
        yield
        return
    # The root drops its reshard-after-forward at its first forward (FSDPState._lazy_init): settle it first, so
    # that the setting saved below is the one training runs with.
    model._get_fsdp_state()._lazy_init()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    states = list({id(s): s for s in (m._get_fsdp_state() for m in units)}.values())  # one per fully_shard call
    saved = [(s._auto_reshard_after_forward, [g.post_forward_mesh_info for g in param_groups(s)]) for s in states]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)  # each forward's post-hook keeps them
            unit.unshard()
        setattr(model, _GATHERED, True)
        yield
    finally:
        setattr(model, _GATHERED, False)
        for unit in units:
            unit.reshard()
        for state, (auto, infos) in zip(states, saved):
            state._auto_reshard_after_forward = auto
            for group, info in zip(param_groups(state), infos):
                group.post_forward_mesh_info = info
