"""Context parallelism (`--cp C`): each sequence split into C contiguous parts over the C ranks of a CP group,
attention over the whole sequence by Ulysses' all-to-all over heads (DeepSpeed-Ulysses; TRL and axolotl do
the same).

The C ranks of a group read the same sequences (the loader's data rank is rank // C). Per micro-batch,
`split` cuts each rank's part out of the full rows: input_ids and the global position_ids (so RoPE and
the restarts of packed samples are the full sequence's), and the labels shifted *before* the cut
(`shift_labels`, which transformers' loss and the lean loss take as they are): the last token of a part
predicts the first of the next. It also builds, from the full rows, the attention mask the model would
have built for them (transformers' own `create_causal_mask`: causal, packed samples, padding), and
switches the model's attention to `anygpu_cp` for the forward and backward of the micro-batch. That
function is registered in transformers' attention interface, so every family whose attention calls the
interface goes through it:

    q, k, v [b, H, T/C, d] --all-to-all--> [b, H/C, T, d] --the model's own kernel (sdpa, eager, flash)-->
    out [b, T, H/C, d] --all-to-all--> [b, T/C, H, d]

Head group j (q heads [j·H/C, (j+1)·H/C), KV heads [j·Hkv/C, …)) goes to rank j: with C dividing the KV
heads, each q head keeps its own KV head (GQA). Where C does not divide the heads, each rank's queries (every
head) attend to the keys and values of the whole sequence, all-gathered (`_gathered_attention`). The all-to-all is an autograd function whose backward is
the same exchange of the gradients, so each rank's backward of its part's loss reaches the q, k, v of the
other ranks' tokens. The mask the model builds from its local T/C positions is not used (the registered
name has no mask function, so transformers skips building one).

A rank's activations are those of T/C tokens, except inside the attention kernel (the full T for H/C heads:
sdpa's and flash's memory is linear in T, eager's is quadratic). The loss is unchanged: every part's token
losses over the global batch's target count (each token counted once: the CP group shares one count).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from anygpu.config.attention import OFFSETS
from anygpu.errors import UsageError

ATTENTION = "anygpu_cp"
# what the model computed from this rank's rows alone (flash's varlen path): rebuilt from the full rows, or unused
LOCAL_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")
IGNORE_INDEX = -100


def check(config, block_size: int, cp: int, attention: str = "sdpa", selective: bool = False) -> None:
    """Refuse what --cp C cannot split (before any process group): one line each. `selective`: selective activation
    checkpointing is on."""
    if cp == 1:
        return
    _check_rope(config, block_size, cp)
    if block_size % cp:
        raise UsageError(
            f"--cp {cp} does not divide --block_size {block_size} (each sequence is cut into {cp} equal parts): "
            f"use a --block_size that is a multiple of {cp}, e.g. {max(1, block_size // cp) * cp}."
        )
    heads, kv_heads = head_counts(config)
    # flash's causal mask is the top-left one; flex would take the gathered path's dense rows mask as a score bias
    if not splits_heads(config, cp) and (attention in OFFSETS or attention == "flex_attention"):
        raise UsageError(
            f"--cp {cp} does not divide the model's {heads} attention and {kv_heads} key/value heads, so each rank "
            f"gathers the whole sequence's keys and values, which --attn_implementation {attention} cannot take "
            f"with its causal mask: use --attn_implementation sdpa, or --cp {_largest(heads, kv_heads, cp)}."
        )
    if selective and not splits_heads(config, cp):  # its dispatch mode rejects the gathered path's CausalBias tensor
        raise UsageError(
            f"--cp {cp} with --gradient_checkpointing_policy selective: the model's {heads} attention and {kv_heads} "
            "key/value heads are not split, so each rank gathers the keys and values, which selective checkpointing "
            f"cannot recompute: use --gradient_checkpointing_policy full, or --cp {_largest(heads, kv_heads, cp)}."
        )
    layer_types = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    # a window as wide as the block hides no token of a row: its mask is the causal one, which the split builds
    narrow = (window is not None and window < block_size) or ("sliding_attention" in layer_types and window is None)
    if layer_types - {"full_attention", "sliding_attention"} or narrow:
        wider = f", or a --block_size of at most {window}" if window and window > 1 else ""
        raise UsageError(
            f"--cp {cp}: {config.model_type} has sliding-window layers narrower than --block_size {block_size} "
            f"(window {window}) or other non-causal-mask layers, whose masks this context parallelism does not "
            f"build: use --cp 1{wider}."
        )


def _check_rope(config, block_size: int, cp: int) -> None:
    """A rotary embedding that picks its factors from the longest position a forward sees (Phi-3's longrope) picks
    per part of a split row beyond its original length: the curve would change with --cp."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", 0)
    if rope.get("rope_type", rope.get("type")) == "longrope" and original and block_size > original:
        raise UsageError(
            f"--cp {cp}: {config.model_type}'s longrope rotary embedding picks its factors from the longest position "
            f"each forward sees, which differs between the parts of a split row beyond {original} positions: use "
            f"--cp 1, or a --block_size of at most {original}."
        )


def head_counts(config) -> tuple[int, int]:
    """(attention heads, key/value heads) of the model's config."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 0
    return heads, getattr(config, "num_key_value_heads", None) or heads


def splits_heads(config, cp: int) -> bool:
    """Whether C divides the attention and key/value heads (Ulysses); else each rank gathers the keys and values."""
    heads, kv_heads = head_counts(config)
    return heads % cp == 0 and kv_heads % cp == 0


def _largest(heads: int, kv_heads: int, cp: int) -> int:
    return max(d for d in range(1, cp + 1) if heads % d == 0 and kv_heads % d == 0)


@dataclass(frozen=True)
class CPGroup:
    """This rank's CP group: `size` C consecutive ranks, this rank's `index` among them (the part it holds)."""

    group: Any = None
    size: int = 1
    index: int = 0
    compute_dtype: torch.dtype = torch.float32  # the forward's (the full-sequence mask's dtype)

    @property
    def part(self) -> tuple[int, int]:
        return (self.size, self.index)


NONE = CPGroup()


def new_group(cp: int, compute_dtype: torch.dtype = torch.float32) -> CPGroup:
    """The CP group of this rank: C consecutive ranks (every rank takes part in creating every group)."""
    if cp == 1:
        return NONE
    group, _ = dist.new_subgroups(group_size=cp)
    return CPGroup(group, cp, dist.get_rank(group), compute_dtype)


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal chunks along dim 0 ([C, …] in, [C, …] out: chunk j goes to rank j, slot i of the
    result came from rank i); the backward exchanges the gradients the same way (it is its own inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous like x (empty_like keeps a transposed input's strides)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherSequence(torch.autograd.Function):
    """[b, h, T/C, d] of every rank of the group → [b, h, T, d] in rank order; the backward sums the gradients of
    the whole sequence over the group (every rank's queries used every rank's keys) and keeps this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, cp: int, index: int) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.index = group, cp, index
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.cp, dim=2)[ctx.index].contiguous(), None, None, None


def seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, H, T/C, d] (this rank's tokens, every head) → [b, H/C, T, d] (every token, this rank's heads)."""
    b, h, t, d = x.shape
    chunks = x.reshape(b, cp, h // cp, t, d).transpose(0, 1)  # [C, b, H/C, t, d]: chunk j to rank j
    got = _AllToAll.apply(chunks, group)  # [C, b, H/C, t, d]: slot i is rank i's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The kernel's output [b, T, H/C, d] → [b, T/C, H, d] (this rank's tokens, every head)."""
    b, T, hc, d = x.shape
    chunks = x.reshape(b, cp, T // cp, hc, d).transpose(0, 1)  # [C, b, t, H/C, d]: token part j to rank j
    got = _AllToAll.apply(chunks, group)  # slot i: head group i of my tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, T // cp, cp * hc, d)


@dataclass
class _Split:
    group: Any
    cp: int
    base: str  # the model's own attention implementation
    mask: torch.Tensor | None  # the full rows' mask as the model would build it (None: sdpa's is_causal)
    position_ids: torch.Tensor  # the full rows' positions [b, T]
    calls: int = 0  # attention calls that went through the wrapper
    index: int = 0  # this rank's part of the rows
    heads_split: bool = True  # Ulysses; else this rank's queries attend to the gathered keys and values


_ACTIVE: list[_Split] = []  # the split of the micro-batch whose forward/backward runs (one at a time)


def _kernel(module: nn.Module, base: str):
    """The model's own attention function for `base` (eager: its modeling module's eager_attention_forward)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if base == "eager":
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(base, eager)


def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Ulysses around the model's own kernel (registered as `anygpu_cp`; see the module docstring)."""
    split = _ACTIVE[-1]
    split.calls += 1
    if not split.heads_split:
        return _gathered_attention(module, split, query, key, value, **kwargs)
    q, k, v = (seq_to_heads(x, split.group, split.cp) for x in (query, key, value))
    for name in LOCAL_ROW_KWARGS:
        kwargs.pop(name, None)  # the local rows' (flash's varlen path): rebuilt from the full rows below
    kernel, mask = _kernel(module, split.base), split.mask
    if split.base in OFFSETS and mask is None and q.shape[0] > 1:
        # packed rows: flash attention confines attention to samples for one flattened row only
        b, hc, T, d = q.shape
        flat = [x.transpose(0, 1).reshape(1, x.shape[1], b * T, d) for x in (q, k, v)]
        out, _ = kernel(module, *flat, None, position_ids=split.position_ids.reshape(1, -1), **kwargs)
        out = out.reshape(b, T, hc, d)
    else:
        extra = {"position_ids": split.position_ids} if split.base in OFFSETS else {}
        out, _ = kernel(module, q, k, v, mask, **extra, **kwargs)
    return heads_to_seq(out, split.group, split.cp), None


def _gathered_attention(module: nn.Module, split: _Split, query, key, value, **kwargs):
    """Heads that C does not divide: this rank's T/C queries (every head) against the whole sequence's keys and
    values, gathered over the group (all-gather context parallelism, as in Llama 3's long-context training), under
    this rank's rows of the full rows' mask (`_rows_mask`; causal by global position where the model builds none)."""
    for name in LOCAL_ROW_KWARGS:
        kwargs.pop(name, None)
    k, v = (_GatherSequence.apply(x, split.group, split.cp, split.index) for x in (key, value))
    part = query.shape[2]
    rows = slice(split.index * part, (split.index + 1) * part)
    if split.mask is None and split.base == "sdpa":
        return _causal_sdpa(query, k, v, rows, kwargs.get("dropout", 0.0), kwargs.get("scaling")), None
    mask = split.mask if split.mask is not None else _causal_rows(rows, k.shape[2], query, split.base)
    out, _ = _kernel(module, split.base)(module, query, k, v, mask, **kwargs)
    return out, None


def _causal_sdpa(query, key, value, rows: slice, dropout: float, scaling: float | None) -> torch.Tensor:
    """Raw-text rows under sdpa, as transformers' sdpa kernel computes them, without a (T/C × T) mask: the keys past
    this rank's last query are never seen, so they are dropped, and the rest go under the lower-right causal bias
    (query i, at global position rows.start + i, sees the keys up to it), which sdpa's flash and memory-efficient
    kernels take as it is. At 128k tokens over C = 3 ranks the boolean mask alone was 5.5 GB per layer call, and
    a mask keeps CUDA's sdpa off its flash kernel."""
    from torch.nn.attention.bias import causal_lower_right

    key, value = key[:, :, : rows.stop], value[:, :, : rows.stop]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # the lower-right bias's kernels take no GQA: the KV heads repeated, as transformers does
        key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    bias = causal_lower_right(query.shape[2], rows.stop)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


def _causal_rows(rows: slice, length: int, query: torch.Tensor, base: str) -> torch.Tensor:
    """[1, 1, rows, length]: query row i (global position rows.start + i) sees keys 0 … its position; boolean for
    sdpa, additive (0 or the dtype's minimum) for the eager kernel."""
    keys = torch.arange(length, device=query.device)
    allowed = (keys[None, :] <= keys[rows, None])[None, None]
    if base != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(
        ~allowed, torch.finfo(query.dtype).min
    )


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


def _full_rows(batch: dict[str, torch.Tensor], cp: int) -> dict[str, torch.Tensor]:
    """The micro-batch's rows padded to a multiple of C (padded rows' width is the micro-batch's longest),
    with positions (0, 1, … where the collator gave none) and the labels shifted before any cut."""
    ids = batch["input_ids"]
    b, T = ids.shape
    pad = -T % cp
    rows = {"input_ids": F.pad(ids, (0, pad))}
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(T, device=ids.device).expand(b, T)
    rows["position_ids"] = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(pad, device=ids.device)], dim=1)
    if batch.get("attention_mask") is not None:
        rows["attention_mask"] = F.pad(batch["attention_mask"], (0, pad))
    labels = F.pad(batch["labels"], (0, pad), value=IGNORE_INDEX)
    rows["shift_labels"] = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # position t predicts token t+1
    return rows


def _full_mask(model: nn.Module, rows: dict[str, torch.Tensor], dtype: torch.dtype):
    """The mask the model builds for the full rows with its own attention (causal, packed samples, padding)."""
    from transformers.masking_utils import create_causal_mask

    b, T = rows["input_ids"].shape
    return create_causal_mask(
        config=model.config,
        inputs_embeds=torch.empty(b, T, 0, dtype=dtype, device=rows["input_ids"].device),
        attention_mask=rows.get("attention_mask"),
        past_key_values=None,
        position_ids=rows["position_ids"],
    )


def _rows_mask(rows: dict[str, torch.Tensor], cp: CPGroup, base: str, dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's query rows of the mask `_full_mask` builds, [b, 1, T/C, T], built for those rows alone (a (T × T)
    mask on every rank was 16 GiB per layer call at 128k tokens, bool): causal, each packed sample confined to itself
    (transformers' rule: positions that do not step by one start a sample, only without an attention mask), padded
    keys masked; None where the model would build none for sdpa (one unpadded sample a row: the causal path)."""
    pos, padding = rows["position_ids"], rows.get("attention_mask")
    b, T = pos.shape
    samples = None
    if padding is None:
        steps = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
        samples = (steps != 1).cumsum(-1)
        samples = None if (samples[:, -1] == 0).all() else samples
    if samples is None and (padding is None or padding.bool().all()) and base == "sdpa":
        return None
    part = T // cp.size
    queries = torch.arange(cp.index * part, (cp.index + 1) * part, device=pos.device)
    keys = torch.arange(T, device=pos.device)
    allowed = (keys[None, None, :] <= queries[None, :, None]).expand(b, part, T)
    if samples is not None:
        allowed = allowed & (samples[:, queries, None] == samples[:, None, :])
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, :]
    allowed = allowed[:, None]
    if base != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=pos.device).masked_fill_(~allowed, torch.finfo(dtype).min)


@contextlib.contextmanager
def split(model: nn.Module, batch: dict[str, torch.Tensor], cp: CPGroup) -> Iterator[dict[str, torch.Tensor]]:
    """Around one micro-batch's forward and backward: yields this rank's part of `batch` (model kwargs:
    input_ids, position_ids, labels and shift_labels, already shifted) with the model's attention split."""
    if cp.size == 1:
        yield batch
        return
    _register()
    rows, me = _full_rows(batch, cp.size), cp.index
    config = model.config
    base = config._attn_implementation
    local = {k: _cut(rows[k], cp).contiguous() for k in ("input_ids", "position_ids", "shift_labels")}
    local["labels"] = local["shift_labels"]  # the loss runs when labels are given; it reads shift_labels
    heads = splits_heads(config, cp.size)
    # Ulysses attends over the whole rows (each rank its heads); the gathered path over this rank's query rows only
    mask = _full_mask(model, rows, cp.compute_dtype) if heads else _rows_mask(rows, cp, base, cp.compute_dtype)
    split = _Split(cp.group, cp.size, base, mask, rows["position_ids"], index=me, heads_split=heads)
    _ACTIVE.append(split)
    config._attn_implementation = ATTENTION
    try:
        yield local
    finally:
        config._attn_implementation = base
        _ACTIVE.pop()
    if split.calls == 0:  # each rank would attend within its own part only: never a silently different loss
        raise RuntimeError(
            f"--cp {cp.size}: {config.model_type}'s attention does not go through transformers' attention "
            "interface, so its sequences cannot be split; use --cp 1."
        )


def part_of(full: torch.Tensor, cp: CPGroup, pad_value: int) -> torch.Tensor:
    """This rank's part of a per-position tensor of the full rows [b, T] (padded to a multiple of C as `split`
    pads the rows: a per-position value cut the same way as the tokens it belongs to)."""
    return _cut(F.pad(full, (0, -full.shape[-1] % cp.size), value=pad_value), cp)


def _cut(rows: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """This rank's contiguous part of the last dimension of rows already padded to a multiple of C."""
    part = rows.shape[-1] // cp.size
    return rows[..., cp.index * part : (cp.index + 1) * part]


def sum_over_group(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """`x` summed over the CP group, every rank the same (autograd: each rank's `x` gets the gradient of the sum,
    summed over the group: a loss that every rank of a group computes from the sum counts C times)."""
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(x, group=cp.group)


def is_split(model: nn.Module) -> bool:
    """The model's attention is split now (the forward of a micro-batch's part runs inside `split`)."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION


def gather_tokens(x: torch.Tensor, cp: CPGroup, rows: int) -> torch.Tensor:
    """A per-token tensor of this rank's part of `rows` rows, [rows·T/C, E] → the full rows' [rows·T, E], every
    rank the same (autograd: each part's gradient, summed over the CP group, goes back to its rank)."""
    from torch.distributed.nn.functional import all_gather

    parts = all_gather(x.reshape(rows, -1, x.shape[-1]).contiguous(), group=cp.group)
    return torch.cat(parts, dim=1).reshape(-1, x.shape[-1])


def active() -> bool:
    """A micro-batch's sequences are split now (the flash-attention row flattening then leaves them alone)."""
    return bool(_ACTIVE)
