"""Tell transformers' masking what the rows are, instead of letting it ask the GPU.

transformers builds a forward's attention mask from what it is given, and reads device tensors back to decide how:
- position ids and no attention mask (raw-text blocks: the model makes its own 0, 1, 2 …; packed rows: the
  collator's, restarting per sample): `find_packed_sequence_indices` checks whether any row holds several samples
  with `(…).all()`;
- an attention mask (padded rows): `_ignore_causal_mask_sdpa` checks whether it masks anything (`fast_all`).
Each is a host sync in every forward, which drains the GPU's queue at every micro-batch. The engines know the
answers from the data on the CPU: the collator packs or it does not, and it gives a mask only to a micro-batch
that has padding. So `install` answers for the model's forwards: unpacked rows are not packed (sdpa's causal path,
as transformers would choose), packed rows get their sample indices computed on the device (transformers' own
computation) without the check, and a given mask has padding. Forwards without the hint (exports, the CP full-row
mask, anything outside the model's forward) keep transformers' own functions.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED, UNPACKED, PADDED = "packed", "unpacked", "padded"
_HINTS: list[str] = []  # what the rows of the forward now running are (innermost last)
_OWN: dict = {}  # transformers' own functions, once patched


def _find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
    if not _HINTS or _HINTS[-1] == PADDED:
        return _OWN["find_packed_sequence_indices"](position_ids)
    if _HINTS[-1] == UNPACKED:
        return None  # one sample per row: transformers' answer for these rows, without reading them
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # transformers' computation, no check


def _ignore_causal_mask_sdpa(padding_mask, *args, **kwargs) -> bool:
    if _HINTS and _HINTS[-1] == PADDED and padding_mask is not None:
        return False  # the mask has padding (the collator gives none otherwise): sdpa needs it
    return _OWN["_ignore_causal_mask_sdpa"](padding_mask, *args, **kwargs)


def _patch() -> None:
    from transformers import masking_utils

    for name, ours in (
        ("find_packed_sequence_indices", _find_packed_sequence_indices),
        ("_ignore_causal_mask_sdpa", _ignore_causal_mask_sdpa),
    ):
        if name not in _OWN:
            _OWN[name] = getattr(masking_utils, name)
            setattr(masking_utils, name, ours)


def _no_padding_check(input_ids, attention_mask) -> None:
    """The engines give packed rows without an attention mask on purpose (their padding is a sample of its own that
    nothing attends across and nothing trains on): transformers' check for that reads the ids back (a sync)."""


def install(model: nn.Module, packed: bool) -> None:
    """Every forward of `model` tells the masking what its rows are (`packed`: the collator's packing), and skips
    the padding check some families make on every forward (GPT-2's `warn_if_padding_and_no_attention_mask`)."""
    _patch()
    for module in model.modules():
        if hasattr(module, "warn_if_padding_and_no_attention_mask"):
            module.warn_if_padding_and_no_attention_mask = _no_padding_check

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        _HINTS.append(PADDED if kwargs.get("attention_mask") is not None else PACKED if packed else UNPACKED)

    def leave(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if _HINTS:
            _HINTS.pop()

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
