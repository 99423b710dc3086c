"""The lean loss: the token cross-entropy from the final hidden states, a chunk of tokens at a time.

The model's own loss computes the logits of every token, (tokens × vocabulary), upcasts them to fp32
and keeps them (and their gradient) for the backward: at a 128k-256k vocabulary the largest tensors
of a step. Here the output projection (`lm_head`, whatever wraps it: tied weights, a LoRA adapter, a
module to save, FSDP2's unsharded parameter) runs on `chunk_bytes` worth of tokens at a time (fp32 logits of
128 MiB on a CPU, 1 GiB on a GPU), and each chunk's gradients (to its hidden states and to the head's
parameters) are taken at once, while its logits exist (Liger's fused linear cross-entropy does the same on
GPUs): at most one chunk of fp32 logits exists at any moment, and none is recomputed (`_ChunkedCrossEntropy`
says why).

How it enters the model's forward (the same in both engines, so FSDP2/DDP hooks see a normal forward):
under `active(model)` the `lm_head` records its input and returns empty logits (…, 0); the model then
calls its `loss_function` (labels given), which is ours: it shifts the labels as transformers does,
applies the family's logit soft-capping or scaling per chunk, and returns the token-loss sum over
`num_items_in_batch` (the global batch's target-token count), the same normalisation as the model's
own `ForCausalLMLoss`. A MoE router loss is still added by the model on top. Outside `active` the model
is untouched (full logits, its own loss), e.g. for exports or generation. Under `log_probs` the same hook gives
the labels' per-token log-probs instead (preference training's sequence sums: `model.sequence_log_probs`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from anygpu.errors import UsageError
from anygpu.runtime.blocks import hf_model


IGNORE_INDEX = -100
CHUNK_BYTES = 128 << 20  # fp32 logits of one chunk on a CPU: 261 tokens at a 128k vocabulary
# On a GPU each chunk sums the head's (vocabulary × hidden) gradient into an fp32 buffer: ~5 bytes of memory traffic
# per weight, 2.6 GB at 128k × 4096, which an H100 moves in ~1.6 ms, as long as ~200 tokens' matmuls take. At
# 128 MiB chunks the H100 lease measured the lean loss at 0.71x the model's own tokens/s (docs/lean-loss.md); 1 GiB
# chunks (2,092 tokens at 128k) make that sum ~8% of the head's time; at 8192 tokens the step still holds ~7 GiB
# less than with the model's own loss (10.2 GiB less at 128 MiB, measured).
GPU_CHUNK_BYTES = 1 << 30
CHUNK_TOKENS_ENV = "ANYGPU_LEAN_LOSS_CHUNK_TOKENS"  # tokens per chunk instead (tuning; the tests' many small chunks)


def chunk_bytes(device_type: str) -> int:
    """The fp32 logits of one chunk on this kind of device (`GPU_CHUNK_BYTES` on CUDA and ROCm, else `CHUNK_BYTES`)."""
    return GPU_CHUNK_BYTES if device_type == "cuda" else CHUNK_BYTES


def chunk_rows(vocab_size: int, device_type: str = "cpu") -> int:
    """Tokens per chunk: `chunk_bytes(device_type)` of fp32 logits, or $ANYGPU_LEAN_LOSS_CHUNK_TOKENS."""
    given = os.environ.get(CHUNK_TOKENS_ENV)
    if given:
        if not given.isdigit() or int(given) < 1:
            raise UsageError(f"{CHUNK_TOKENS_ENV}={given!r}: give a positive number of tokens, e.g. 256")
        return int(given)
    return max(1, chunk_bytes(device_type) // (4 * vocab_size))


def _softcap(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    cap = model.config.final_logit_softcapping
    return (lambda x: torch.tanh(x / cap) * cap) if cap is not None else (lambda x: x)


def _multiply(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    scale = model.logit_scale
    return lambda x: x * scale


def _divide(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    scale = model.config.logits_scaling
    return lambda x: x / scale


def _identity(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x


# Families that change the logits between the output projection and `self.loss_function`, and how
# (tests/test_lean_loss.py checks each against the model's own loss).
POST: dict[str, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    "gemma2": _softcap,
    "gemma3_text": _softcap,  # final_logit_softcapping
    "cohere": _multiply,
    "cohere2": _multiply,  # logit_scale
    "granite": _divide,
    "granitemoe": _divide,
    "granitemoeshared": _divide,  # logits_scaling
}


def _straight_to_the_loss(base: nn.Module) -> bool:
    """Whether the model's forward hands the output projection's result to `self.loss_function` untouched:
    `logits = self.lm_head(hidden_states[...])`, then (blank lines, comments, `loss = None`, `if labels is not
    None:`) `loss = self.loss_function(logits, ...)`, read from the class's source. Any family that does so
    (most of transformers') gets the same loss from the chunks; one that scales, caps or reshapes does not match."""
    head = base.get_output_embeddings()
    name = next((n for n, m in base.named_children() if m is head), None)
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    if name is None:
        return False
    call = r"(?:[^()\n]|\([^()\n]*\))*"  # arguments with at most one level of parentheses
    filler = r"(?:[ \t]*(?:#[^\n]*)?\n|[ \t]*loss = None[ \t]*\n|[ \t]*if labels is not None:[ \t]*\n)*"
    pattern = (
        rf"\n[ \t]*(\w+) = self\.{re.escape(name)}\({call}\)(?:\.contiguous\(\))?[ \t]*\n{filler}"
        rf"[ \t]*loss = self\.loss_function\(\s*(?:logits\s*=\s*)?\1\s*[,)]"
    )
    return re.search(pattern, source) is not None


def _post(base: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the family does to the logits before its loss (None: something the lean loss cannot repeat)."""
    model_type = getattr(base.config, "model_type", None)
    if model_type in POST:
        return POST[model_type](base)
    return _identity(base) if _straight_to_the_loss(base) else None


@dataclass
class _Lean:
    """What one model's lean loss needs: the head's own forward, the family's logit post-processing."""

    head_forward: Callable[[torch.Tensor], torch.Tensor]
    post: Callable[[torch.Tensor], torch.Tensor]
    active: bool = False
    hidden: torch.Tensor | None = None
    per_token: bool = False  # under `log_probs`: the labels' per-token log-probs, kept in `log_probs`
    log_probs: torch.Tensor | None = None


def _state(model: nn.Module) -> _Lean | None:
    return getattr(hf_model(model), "_anygpu_lean", None)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the lean loss cannot serve this model (None: it can)."""
    base = hf_model(model)
    if base.get_output_embeddings() is None:
        return f"{type(base).__name__} has no output projection"
    if _post(base) is None:
        return (
            f"{type(base).__name__}'s forward changes the logits before its loss_function in a way it does not "
            f"repeat (or does not call self.loss_function)"
        )
    return None


def install(model: nn.Module, enabled: bool, off_reason: str | None = None) -> str:
    """Route the model's token cross-entropy through the lean loss (under `active`); returns the banner line,
    also kept for `note`."""
    line = _install(model, enabled, off_reason)
    hf_model(model)._anygpu_lean_note = line
    return line


def note(model: nn.Module) -> str | None:
    """The banner line of `install` (None if it was never called)."""
    return getattr(hf_model(model), "_anygpu_lean_note", None)


def _install(model: nn.Module, enabled: bool, off_reason: str | None) -> str:
    if not enabled:
        return "loss: the model's own (full logits; --lean_loss false)"
    reason = off_reason or unsupported_reason(model)
    if reason is not None:
        return f"loss: the model's own (full logits): lean loss off, {reason}"
    base = hf_model(model)
    head = base.get_output_embeddings()
    state = _Lean(head_forward=head.forward, post=_post(base))

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        if not state.active:
            return state.head_forward(hidden)
        state.hidden = hidden  # the loss_function below consumes it; no logits are computed here
        return hidden.new_empty(*hidden.shape[:-1], 0)

    def loss_function(
        logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX, shift_labels=None, **kwargs
    ):
        hidden, state.hidden = state.hidden, None
        if hidden is None:  # not under `active`: the model's own loss
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
        if shift_labels is None:  # position t predicts token t+1, as transformers shifts them
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        if state.per_token:  # the caller reads the log-probs; the loss, 0, only ties them to the model's output
            state.log_probs = token_log_probs(hidden, shift_labels, state.head_forward, state.post, vocab_size)
            return state.log_probs.sum() * 0.0
        total, count = token_loss_sum(
            hidden, shift_labels, head, state.head_forward, state.post, vocab_size, ignore_index
        )
        if num_items_in_batch is None:
            return total / count
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    head.forward = capture  # an instance attribute: the module's class (FSDP2 swaps it) is left alone
    base.loss_function = loss_function  # PreTrainedModel's setter: this model's loss, not the family's
    base._anygpu_lean = state
    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # where the engines train
    size = f"{chunk_rows(base.config.vocab_size, device_type)} tokens"
    size += (
        f" (${CHUNK_TOKENS_ENV})"
        if os.environ.get(CHUNK_TOKENS_ENV)
        else f" ({chunk_bytes(device_type) >> 20} MiB of fp32 logits)"
    )
    return f"loss: lean (chunked cross-entropy, {size} at a time; --lean_loss false: the model's own)"


def is_installed(model: nn.Module) -> bool:
    return _state(model) is not None


@contextlib.contextmanager
def active(model: nn.Module) -> Iterator[None]:
    """Forward passes with labels inside compute the lean loss (a no-op where it is not installed)."""
    state = _state(model)
    if state is None:
        yield
        return
    state.active = True
    try:
        yield
    finally:
        state.active, state.hidden = False, None


@contextlib.contextmanager
def log_probs(model: nn.Module) -> Iterator[Callable[[], torch.Tensor]]:
    """Forward passes with labels inside compute the labels' per-token log-probs instead of the loss; the yielded
    function returns those of the last forward (flattened, 0 where a label is -100). The model must have the lean
    loss installed (`is_installed`)."""
    state = _state(model)
    state.active, state.per_token, state.log_probs = True, True, None
    try:
        yield lambda: state.log_probs
    finally:
        state.active, state.per_token, state.hidden, state.log_probs = False, False, None, None


def _chunk_log_probs(hidden: torch.Tensor, labels: torch.Tensor, head_forward, post) -> torch.Tensor:
    logits = post(head_forward(hidden).float())
    return -F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def token_log_probs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head_forward: Callable[[torch.Tensor], torch.Tensor],
    post: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> torch.Tensor:
    """The log-probability of each already shifted label (…) under hidden (…, H), flattened, in fp32 (0 where the
    label is -100), from `chunk_rows` tokens' logits at a time. The log-probs feed a loss that is not a plain sum of
    them (DPO's), so the chunk's gradients cannot be taken in the forward as `_ChunkedCrossEntropy` takes them: each
    chunk is checkpointed instead, its logits recomputed in the backward (the head's FLOPs once more), never kept."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    rows = chunk_rows(vocab_size, hidden.device.type)
    pieces = []
    for s in range(0, hidden.shape[0], rows):
        h, y = hidden[s : s + rows], labels[s : s + rows]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_log_probs, h, y, head_forward, post, use_reentrant=False))
        else:
            pieces.append(_chunk_log_probs(h, y, head_forward, post))
    return torch.cat(pieces)


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, head_forward, post, ignore_index: int) -> torch.Tensor:
    logits = post(head_forward(hidden).float())  # the model's own order: project, upcast, soft-cap or scale
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The token-loss sum, its gradients computed chunk by chunk in the forward (no logits kept, none recomputed).

    The loss is a scalar that the backward only scales, so each chunk's gradient (to its hidden rows and to
    the head's parameters) can be taken while its logits exist: the backward multiplies by the incoming
    gradient. This costs the model's own FLOPs (recomputing the logits in the backward would add a third of
    the head's: 0.67× the tokens/s at a 128k vocabulary on CPU) and keeps the head's gradient (fp32) and the
    hidden states' gradient from the forward to the backward instead of the logits. A plain `nn.Linear`
    head accumulates its weight gradient inside the matmul (addmm); any other head (LoRA, a module to
    save) goes through autograd per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, labels, head, head_forward, post, ignore_index, rows, *params):
        need_hidden, need = ctx.needs_input_grad[0], dict(zip(map(id, params), ctx.needs_input_grad[7:]))
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grads: dict[int, torch.Tensor] = {}  # id(param) → fp32 gradient, summed over the chunks
        linear = type(head) is nn.Linear and not torch.is_autocast_enabled(hidden.device.type)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start : start + rows], labels[start : start + rows]
            if linear:
                loss, grad_h = _linear_chunk(h, y, head, post, ignore_index, need, grads)
            else:
                loss, grad_h = _module_chunk(h, y, head_forward, post, ignore_index, need_hidden, params, need, grads)
            if need_hidden:
                grad_hidden[start : start + rows] = grad_h
            total += loss
        out = [grads[id(p)].to(p.dtype) if id(p) in grads else None for p in params]
        ctx.save_for_backward(grad_hidden, *out)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, *grad_params = ctx.saved_tensors
        # In place: these gradients are ours alone (a copy would hold the head's gradient twice at the backward's start)
        scale = lambda g: None if g is None else g.mul_(grad_total.to(g.dtype))  # noqa: E731
        return (scale(grad_hidden), None, None, None, None, None, None, *map(scale, grad_params))


def _accumulate(grads: dict[int, torch.Tensor], param: torch.Tensor, grad: torch.Tensor) -> None:
    if id(param) in grads:
        grads[id(param)] += grad
    else:
        grads[id(param)] = grad.float()


def _linear_chunk(
    h, y, head: nn.Linear, post, ignore_index: int, need: dict[int, bool], grads: dict[int, torch.Tensor]
):
    """One chunk through a plain linear head: (loss, gradient to h); the weight's gradient summed into `grads`."""
    weight, bias = head.weight, head.bias
    logits = F.linear(h, weight, bias).float().requires_grad_()  # computed without a graph: a leaf
    with torch.enable_grad():  # autograd is off inside Function.forward
        loss = F.cross_entropy(post(logits), y, ignore_index=ignore_index, reduction="sum")
        (grad_logits,) = torch.autograd.grad(loss, logits)
    g = grad_logits.to(weight.dtype)
    if need.get(id(weight)):
        if id(weight) in grads and weight.dtype == torch.float32:
            grads[id(weight)].addmm_(g.t(), h)  # summed inside the matmul: no extra pass over the weight
        else:
            _accumulate(grads, weight, g.t() @ h)
    if bias is not None and need.get(id(bias)):
        _accumulate(grads, bias, g.sum(0))
    return loss.detach(), g @ weight


def _module_chunk(
    h,
    y,
    head_forward,
    post,
    ignore_index: int,
    need_hidden: bool,
    params,
    need: dict[int, bool],
    grads: dict[int, torch.Tensor],
):
    """One chunk through any head (its own forward, under autograd): (loss, gradient to h or None)."""
    h = h.detach().requires_grad_(need_hidden)
    wanted = [p for p in params if need[id(p)]]
    with torch.enable_grad():
        loss = _chunk_loss(h, y, head_forward, post, ignore_index)
        got = list(torch.autograd.grad(loss, [h] * need_hidden + wanted)) if need_hidden or wanted else []
    grad_h = got.pop(0) if need_hidden else None
    for p, g in zip(wanted, got):
        _accumulate(grads, p, g)
    return loss.detach(), grad_h


def token_loss_sum(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    head_forward: Callable[[torch.Tensor], torch.Tensor],
    post: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the token losses, number of target tokens) of hidden (…, H) against already shifted labels (…),
    computing `chunk_bytes` of fp32 logits at a time; `head_forward` is `head`'s own forward."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    rows = chunk_rows(vocab_size, hidden.device.type)
    count = (labels != ignore_index).sum()
    if not torch.is_grad_enabled():  # evaluation: the chunks' losses alone
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], rows):
            total += _chunk_loss(hidden[s : s + rows], labels[s : s + rows], head_forward, post, ignore_index)
        return total, count
    # The head's parameters as they are now (FSDP2: the unsharded ones of this forward), so their gradients
    # reach them through autograd as the model's own loss would send them.
    params = [p for p in head.parameters() if p.requires_grad]
    return _ChunkedCrossEntropy.apply(hidden, labels, head, head_forward, post, ignore_index, rows, *params), count
