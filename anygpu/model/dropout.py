"""Dropout masks that are a function of (seed, step, sample, call site): the same whatever the world size.

torch's dropout draws from the device's generator, whose stream differs per rank and per micro-batch
split: a model with dropout (GPT-2 and OPT as shipped) would then follow another loss curve on
another number of ranks. While `keys(model, step, samples)` is active (one micro-batch's forward
and backward), every dropout call (`nn.Dropout` modules and the functional dropout transformers'
layers call) draws each sample's mask from its own generator, seeded by

    (seed, step, the sample's index in the data set, the call site).

The call site is the innermost decoder layer (or, outside the layers, the model itself) whose code
made the call (its name in the model) and the model's code lines from there to the dropout call, read
from the Python stack (torch's `Module.__call__` frames left out: their lines depend on the hooks a
wrapper adds). One dropout module called from two places gets two masks (Phi's `resid_dropout`, on the
attention and on the MLP output of a layer); activation checkpointing recomputes whole decoder layers,
running the same code, so it draws exactly the masks of the first pass. (A layer that calls dropout
twice from the same line, in a loop, would reuse one mask; no transformers model does.) Attention
dropout inside a fused kernel (sdpa's `dropout_p`, flash attention) cannot be keyed: a model whose
config asks for attention dropout runs eager attention, whose dropout is a plain call (`note` says so).
The masks come from the device's own generator type: identical across world sizes on the same kind
of device (CPU or one GPU vendor), not between a CPU and a GPU.

Under context parallelism (`--cp C`, `part` = (C, this rank's index in its CP group)) a rank holds part
i of each sequence: it draws each sample's mask for the whole sequence (dim 1 of a batch-major sample,
dim 0 of OPT's flattened rows) and keeps part i, so a position gets the mask it gets unsplit. Attention
weights inside the split attention are [b, H/C, T, T] with head group i on rank i: dim 1 again, the same
rule keeps the heads' masks; the Ulysses wrapper's own frame is left out of the call site.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import nn

from anygpu.errors import UsageError
from anygpu.runtime import context_parallel
from anygpu.runtime.blocks import decoder_layers

logger = logging.getLogger(__name__)
_MODULE_CALL_FILE = nn.Module.__call__.__code__.co_filename  # torch/nn/modules/module.py
_SKIPPED_FILES = (_MODULE_CALL_FILE, context_parallel.__file__)  # hooks' lines; the CP attention wrapper

_ATTENTION_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
_IGNORED = ("classifier_dropout", "summary_first_dropout", "summary_last_dropout", "layerdrop")
ATTR = "_anygpu_keyed_dropout"


def dropout_rates(config) -> dict[str, float]:
    """The config's non-zero dropout probabilities (classifier heads and layer drop left out)."""
    out = {}
    for key, value in config.to_dict().items():
        if (
            ("dropout" in key or "pdrop" in key)
            and key not in _IGNORED
            and isinstance(value, (int, float))
            and value > 0
        ):
            out[key] = float(value)
    return out


@dataclass
class _Keyed:
    seed: int
    step: int = -1
    samples: Sequence[int] = ()
    part: tuple[int, int] = (1, 0)  # context parallelism: (parts of each sequence, the one this rank holds)
    names: dict[int, str] = field(default_factory=dict)  # id(module) → its name in the model
    stops: set[int] = field(default_factory=set)  # ids of the decoder layers and the model: where a call site starts
    warned: bool = False
    note: str = ""


def install(model: nn.Module, seed: int, off: bool = False) -> str | None:
    """Key the model's dropout (before sharding; a no-op without dropout), or switch it `off`. Returns a banner
    note or None."""
    if off:
        return disable(model)
    rates = dropout_rates(model.config)
    for name, module in model.named_modules():  # dropout modules the config does not list (a LoRA adapter's)
        if isinstance(module, nn.Dropout) and module.p > 0 and "lora_dropout" in name:
            rates["lora_dropout"] = module.p
    if not rates:
        return None
    state = _Keyed(seed, names={id(m): name for name, m in model.named_modules()}, stops={id(model)})
    try:
        state.stops |= {id(m) for m in decoder_layers(model)}
    except UsageError:  # no decoder layer class named: call sites start at the model
        pass
    object.__setattr__(model, ATTR, state)  # not a submodule, not a parameter
    note = (
        "dropout: "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(rates.items()))
        + "; masks keyed by (seed, step, sample, call site): the same on any number of ranks"
    )
    if any(k in rates for k in _ATTENTION_KEYS) and model.config._attn_implementation != "eager":
        # sdpa/flash draw their attention-dropout masks inside the kernel, from the rank's own stream.
        model.set_attn_implementation("eager")
        note += "; attention dropout needs eager attention (fused kernels cannot key their masks)"
    state.note = note
    return note


OFF_ATTR = "_anygpu_dropout_off"
RATE_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p")  # rates attention modules pass on


def disable(model: nn.Module) -> str | None:
    """No dropout at all, as TRL's preference trainers do by default (`disable_dropout`): every dropout module at
    p = 0 and the rates attention modules hand to their kernels at 0, so the policy and its reference are the same
    function at the start and a pair's log-probs do not depend on a random mask. The config is left as it is (the
    exported model keeps its own). Returns a banner note when the config had dropout."""
    rates = dropout_rates(model.config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name in RATE_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    if not rates:
        return None
    note = f"dropout: off ({', '.join(f'{k} {v:g}' for k, v in sorted(rates.items()))} in the config; as TRL's disable_dropout)"
    object.__setattr__(model, OFF_ATTR, note)
    return note


def note(model: nn.Module) -> str | None:
    """The banner line of a model whose dropout is keyed or off, else None."""
    state = getattr(model, ATTR, None)
    return state.note if state is not None else getattr(model, OFF_ATTR, None)


def _call_site(state: _Keyed) -> str:
    """The innermost decoder layer (or the model) on the Python stack and the code lines from it to the dropout call."""
    frame, lines = sys._getframe(2), []
    while frame is not None:
        if frame.f_code.co_filename not in _SKIPPED_FILES:
            lines.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in state.stops:
            return f"{state.names[id(owner)]}/{'/'.join(lines)}"
        frame = frame.f_back
    return "/".join(lines[:8])


def _seed(*parts) -> int:
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


@contextlib.contextmanager
def keys(model: nn.Module, step: int, samples: Sequence[int], part: tuple[int, int] = (1, 0)) -> Iterator[None]:
    """Around one micro-batch's forward and backward: its rows are `samples` (data set indices) of `step`;
    `part`: (C, i) when the rank holds part i of C of each sequence (context parallelism)."""
    state = getattr(model, ATTR, None)
    if state is None:
        yield
        return
    original = torch.nn.functional.dropout
    state.step, state.samples, state.part = step, list(samples), part

    def keyed_dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or p == 0.0:
            return original(input, p, training, inplace)
        if p == 1.0:
            return input * 0.0
        return input * _masks(state, _call_site(state), input, p)

    torch.nn.functional.dropout = keyed_dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


def _masks(state: _Keyed, site: str, input: torch.Tensor, p: float) -> torch.Tensor:
    """Scaled keep-masks, one per sample, each from its own seeded generator.

    Rows are batch-major: dim 0 is the batch, or the batch flattened with the sequence (OPT's MLP
    sees (batch·seq, hidden)); either way sample i owns the i-th of len(samples) equal slices of dim 0.
    A packed micro-batch flattened into one row for flash attention (`modeling.flatten_packed_rows`,
    (1, batch·seq, …)) is the same memory: sample i owns the i-th slice of dim 1.
    """
    rows, samples = (input.shape[0] if input.dim() > 0 else 0), state.samples
    if rows == 1 and len(samples) > 1 and input.dim() > 1 and input.shape[1] % len(samples) == 0:
        shape = (1, input.shape[1] // len(samples), *input.shape[2:])
    elif rows == 0 or rows % len(samples):  # not batch-major: one mask for the micro-batch, keyed by its first sample
        if not state.warned:
            logger.warning("dropout at %s on a tensor of shape %s: not keyed per sample", site, tuple(input.shape))
            state.warned = True
        samples, shape = samples[:1], input.shape
    else:
        shape = (rows // len(samples), *input.shape[1:])
    gen = torch.Generator(device=input.device)
    masks = []
    for sample in samples:
        gen.manual_seed(_seed(state.seed, state.step, sample, site))
        masks.append(_draw(gen, shape, state.part, input.device) >= p)
    return torch.cat(masks).reshape(input.shape).to(input.dtype) / (1.0 - p)


def _draw(gen: torch.Generator, shape: tuple[int, ...], part: tuple[int, int], device) -> torch.Tensor:
    """Uniform draws of one sample's `shape`; under context parallelism those of the whole sequence, cut to
    this rank's part (the sequence is dim 1 of a batch-major sample, dim 0 of a flattened one)."""
    parts, index = part
    if parts == 1:
        return torch.rand(shape, generator=gen, device=device)
    dim = 1 if len(shape) >= 3 else 0
    whole = (*shape[:dim], shape[dim] * parts, *shape[dim + 1 :])
    return torch.rand(whole, generator=gen, device=device).narrow(dim, index * shape[dim], shape[dim])


class SampleQueue:
    """A batch sampler that remembers what it yielded, so the training step that consumes a batch
    (in the same order, later) knows its data set indices (Trainer's loop hides them)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.pending: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        for idx in self.sampler:
            self.pending.append(list(idx))
            yield idx

    def __len__(self) -> int:
        return len(self.sampler)

    def pop(self) -> list[int]:
        return self.pending.popleft()
