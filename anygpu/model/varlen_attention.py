"""`--attn_implementation varlen_attention`: packed samples attended to through torch's own variable-length
attention (`torch.nn.attention.varlen.varlen_attn`, flash attention's varlen kernel inside torch), with no flash-attn
package and no (T × T) mask.

Registered under that name with transformers' attention and mask interfaces, so every family that calls its
attention through `ALL_ATTENTION_FUNCTIONS` takes it. A packed micro-batch reaches it as one flattened row with the
samples' boundaries computed on the CPU by the collator (`collate.varlen_kwargs`, flash attention's keyword names;
`modeling.flatten_packed_rows` flattens the rows as for flash attention): the kernel then skips every masked block
and no forward reads the device back. Rows without packing attend causally through sdpa's kernels (the same call
`--attn_implementation sdpa` makes); padded rows (a mask) go to sdpa with transformers' dense mask, as under sdpa.
On a CPU, where torch has no varlen kernel, the packed path computes the same attention with sdpa over each
sample's block of a block-diagonal mask: the same losses, for tests and for CPU runs.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
import torch.nn.functional as F
from torch import nn

NAME = "varlen_attention"
_SEGMENTS: list = []  # (a weak reference to the position ids, their boundaries): one per forward, reused by each layer


def chosen_by_default(model_args, train_args, config, device) -> bool:
    """Whether packed rows take this kernel although --attn_implementation was left out (sdpa's default): on an
    NVIDIA GPU in bf16/fp16 with torch's varlen kernel, not compiled (unmeasured there), for a family without what
    the kernel lacks (score softcapping, attention dropout), and with context parallelism only where it splits the
    heads (the gathered path needs a mask). The family's use of transformers' attention interface is the caller's check."""
    from anygpu.config.attention import varlen_kernel_available
    from anygpu.runtime import context_parallel, hardware

    if getattr(model_args, "attention_chosen", True) or model_args.attn_implementation != "sdpa":
        return False
    if not hardware.on_nvidia_gpu(device):
        return False
    if not (train_args.bf16 or getattr(train_args, "fp16", False)):
        return False
    if getattr(train_args, "torch_compile", False):
        return False  # compiled over the kernel's varying offsets: not yet run on a GPU (name it to try)
    if not varlen_kernel_available():
        return False
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "attention_dropout", 0.0):
        return False
    cp = getattr(train_args, "cp", 1)
    return cp == 1 or context_parallel.splits_heads(config, cp)


def check_family(config) -> None:
    """Refuse, before any work, a family whose attention needs what the kernel lacks: score softcapping (Gemma 2),
    attention sinks and other families without an sdpa path (gpt-oss)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from anygpu.errors import UsageError

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if getattr(config, "attn_logit_softcapping", None):
        lacks = "softcaps its attention scores"
    elif model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        lacks = "has no sdpa attention (attention sinks or another term beside the scores)"
    else:
        return
    raise UsageError(
        f"--attn_implementation {NAME}: {config.model_type} {lacks}, which torch's varlen kernel cannot compute: "
        "use --attn_implementation eager."
    )


def register() -> None:
    """Make the name known to transformers (idempotent): its attention function and its mask function."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)


def mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for rows without padding (packed rows' boundaries come as offsets); sdpa's for padded rows."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, T, D), key and value (B, H_kv, T, D) → (B, T, H, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"--attn_implementation {NAME}: this model's attention needs {unsupported}, which torch's varlen "
                "kernel has no argument for: use --attn_implementation sdpa or eager."
            )
    b, h, t, d = query.shape
    window = kwargs.get("sliding_window")  # the families that have one pass it (Mistral, Qwen2, Gemma 2/3 …)
    bounds = None if attention_mask is not None else _boundaries(kwargs)
    if bounds is None and attention_mask is None and window is not None and window < t:
        bounds = torch.arange(b + 1, dtype=torch.int32) * t, t  # one sample a row, its window applied here
    if bounds is None:  # a mask (padding, generation) or one sample per row: sdpa's own path, as under sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if dropout:
        raise ValueError(f"--attn_implementation {NAME} has no attention dropout: use --attn_implementation eager.")
    cu, longest = bounds
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[-1]) for x in (query, key, value))
    run = _varlen if q.is_cuda else _blockwise
    out = run(q, k, v, cu.to(q.device, torch.int32), longest, scaling, window if window and window < longest else None)
    return out.reshape(b, t, h, value.shape[-1]), None


def _boundaries(kwargs: dict) -> tuple[torch.Tensor, int] | None:
    """The samples' cumulative offsets over the flattened rows and the longest sample: the collator's
    (`cu_seq_lens_q`, `max_length_q`), else from restarting position ids (context parallelism's full rows);
    None where every row is one sample."""
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None:
        return kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    positions = kwargs.get("position_ids")
    if positions is None:
        return None
    entry = _SEGMENTS[0] if _SEGMENTS else None  # read once: DataParallel's replicas run in threads of their own
    if entry is not None and entry[0]() is positions and entry[1] == positions._version:
        return entry[2]
    found = segments(positions)
    _SEGMENTS[:] = [(weakref.ref(positions), positions._version, found)]
    return found


def segments(positions: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cumulative offsets, longest) of the samples in rows of position ids (a sample starts where the position
    does not follow the previous one, and at each row's start), or None if no row holds more than one."""
    first = positions[:, :1] - 1
    starts = torch.diff(positions, prepend=first, dim=-1) != 1
    starts[:, 0] = True
    flat = starts.reshape(-1)
    if int(flat.sum()) == positions.shape[0]:
        return None
    offsets = torch.cat([torch.nonzero(flat).reshape(-1), flat.new_tensor([flat.numel()], dtype=torch.long)])
    return offsets.to(torch.int32), int((offsets[1:] - offsets[:-1]).max())


def _varlen(q, k, v, cu: torch.Tensor, longest: int, scale: float | None, window: int | None) -> torch.Tensor:
    """torch's varlen kernel (flash attention), causal, under either of its signatures (torch 2.9-2.10: is_causal;
    later: window_size and enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _kernel_parameters()
    extra: dict = {"scale": scale} if "scale" in params else {}
    if "is_causal" in params:
        extra["is_causal"] = True
    if "window_size" in params:  # (left, right): (-1, 0) causal; (W - 1, 0) transformers' window of W keys
        extra["window_size"] = (-1 if window is None else window - 1, 0)
    elif window is not None or "is_causal" not in params:
        raise ValueError(
            f"--attn_implementation {NAME}: this torch's varlen kernel has no causal window: upgrade torch, or use "
            "--attn_implementation sdpa."
        )
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu, cu, longest, longest, **extra)


@functools.cache
def _kernel_parameters() -> frozenset[str]:
    """The varlen kernel's keyword names, read once (it runs in every layer of every forward)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _blockwise(q, k, v, cu: torch.Tensor, longest: int, scale: float | None, window: int | None) -> torch.Tensor:
    """The same attention without the kernel (a CPU): sdpa under the samples' block-diagonal causal mask."""
    n = q.shape[0]
    sample = torch.zeros(n, dtype=torch.long, device=q.device)
    sample[cu[1:-1].long()] = 1
    sample = sample.cumsum(0)
    i = torch.arange(n, device=q.device)
    allowed = (sample[:, None] == sample[None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.squeeze(0).transpose(0, 1)
