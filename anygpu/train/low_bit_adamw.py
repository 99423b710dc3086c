"""AdamW whose moments are stored in 8 or 4 bits (`--optim adamw_torch_8bit` / `adamw_torch_4bit`), or in bf16
(`--optim adamw_anyprecision --optim_args momentum_dtype=bfloat16,variance_dtype=bfloat16`), for plain tensors and
FSDP2's DTensors alike. bf16 moments are tensors like the parameter (elementwise: any sharding keeps them), updated in
fp32 and stored rounded to nearest; the step uses the fp32 values, as the low-bit ones do.

The quantisation is torchao's (its dynamic maps, block-wise absmax scales, its quantisers), the step torchao's
AdamW's: both moments are dequantised to fp32, updated, requantised, and the step uses the fp32 values. Two things
differ from torchao's optimizer classes, which is why this is not `torchao.optim.AdamW8bit`:
- torchao blocks the flattened *local shard* and decides from it whether to quantise, so a parameter's state (and
  the curve) changes with the world size, and a shard whose size its block does not divide stays fp32. Here blocks
  lie within rows (`anygpu.config.optimizers.row_block`) and FSDP2 shards whole rows: every rank quantises what one
  process would, bit for bit.
- The state is plain tensors (uint8 codes, fp32 scales; a parameter's rows on dim 0, sharded like it), so
  torch.distributed.checkpoint saves it and reshards it onto another world size exactly, as it does AdamW's.
"""

from __future__ import annotations

import math
from itertools import chain

import torch
from torch import Tensor

from torchao.optim.quant_utils import quantize_4bit_with_qmap, quantize_8bit_with_qmap

from anygpu.config.optimizers import BF16, LOW_BIT, row_block

MOMENTS = ("exp_avg", "exp_avg_sq")
CODES, SCALE = "_codes", "_scale"
# Rows updated together: bounds the step's fp32 working copies (a 128k-vocabulary embedding's shard would otherwise
# need six fp32 copies of itself at once).
CHUNK_ELEMENTS = 1 << 24


def _qmap(bits: int, signed: bool, device: torch.device) -> Tensor:
    """torchao's quantisation map (256 or 16 values, sorted) on `device`."""
    if bits == 8:
        from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned
    else:
        from torchao.optim.subclass_4bit import get_qmap_signed, get_qmap_unsigned
    return torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned(), dtype=torch.float32, device=device)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like_rows(p: Tensor, local: Tensor) -> Tensor:
    """`local` (this rank's rows of a state tensor) as a tensor placed like `p`: a DTensor with p's mesh and
    placements where p is one, whose global dim 0 is p's."""
    if not hasattr(p, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    shape = (p.shape[0], *local.shape[1:])
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    out = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)
    return out.to(local.device)  # --cpu_offload: from_local moved it to the mesh's device


def _rows_sharded(p: Tensor) -> bool:
    """Whether every placement of `p` keeps whole rows on a rank (dim-0 shards or replicas)."""
    if not hasattr(p, "placements"):
        return True
    return all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in p.placements)


class LowBitAdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam with block-quantised moments (torch.optim.AdamW's update, in fp32)."""

    def __init__(self, params, optim: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.optim, self.bits = optim, 16 if optim == BF16 else LOW_BIT[optim]
        self._maps: dict[tuple[bool, torch.device], Tensor] = {}

    def _map(self, signed: bool, device: torch.device) -> Tensor:
        key = (signed, device)
        if key not in self._maps:
            self._maps[key] = _qmap(self.bits, signed, device)
        return self._maps[key]

    def _init_state(self, p: Tensor) -> dict:
        local = _local(p)
        block = row_block(tuple(p.shape), self.optim) if _rows_sharded(p) else None
        state: dict = {"step": torch.tensor(0.0)}
        if self.bits == 16:
            for name in MOMENTS:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format, dtype=torch.bfloat16)
            return state
        if block is None:
            for name in MOMENTS:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format, dtype=torch.float32)
            return state
        rows, row = local.shape[0], math.prod(p.shape[1:])  # this rank's rows, each as long as the parameter's
        for name in MOMENTS:
            codes = torch.zeros(rows, row * self.bits // 8, dtype=torch.uint8, device=local.device)
            scale = torch.zeros(rows, row // block, dtype=torch.float32, device=local.device)
            state[name + CODES], state[name + SCALE] = _like_rows(p, codes), _like_rows(p, scale)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                self._update(p, state, group)
        return loss

    def _update(self, p: Tensor, state: dict, group: dict) -> None:
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        size = lr / (1 - beta1**step)
        bc2_sqrt = math.sqrt(1 - beta2**step)
        param, grad = _local(p), _local(p.grad)
        if "exp_avg" in state and state["exp_avg"].dtype == torch.bfloat16:
            self._update_bf16(param, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), group, size, bc2_sqrt)
            return
        if "exp_avg" in state:  # fp32 moments: torch.optim.AdamW's single-tensor update
            m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            param.mul_(1 - lr * wd)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            param.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-size)
            return
        if param.numel() == 0:  # a rank past the last row (more ranks than rows)
            return
        rows = max(1, CHUNK_ELEMENTS // param[0].numel())
        for r in range(0, param.shape[0], rows):
            cut = slice(r, r + rows)
            # each moment's rows as stored: (codes, scales, quantisation map); the first moment is signed
            m_rows, v_rows = (
                (_local(state[n + CODES])[cut], _local(state[n + SCALE])[cut], self._map(n == "exp_avg", param.device))
                for n in MOMENTS
            )
            p32, g32 = param[cut].float().flatten(1), grad[cut].float().flatten(1)  # (rows, row elements)
            m = self._dequantize(*m_rows).lerp_(g32, 1 - beta1)
            v = self._dequantize(*v_rows).lerp_(g32.square(), 1 - beta2)  # torchao's form of v·β2 + g²·(1-β2)
            self._quantize_into(m, *m_rows)
            self._quantize_into(v, *v_rows)
            p32.mul_(1 - lr * wd).addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-size)
            param[cut].copy_(p32.view_as(param[cut]))

    @staticmethod
    def _update_bf16(param: Tensor, grad: Tensor, m: Tensor, v: Tensor, group: dict, size: float, bc2: float) -> None:
        """bf16 moments: each chunk's moments updated in fp32 (torch.optim.AdamW's formula), stored rounded to bf16;
        the step from the fp32 values."""
        beta1, beta2 = group["betas"]
        flat = [t.view(-1) for t in (param, grad, m, v)]
        for start in range(0, flat[0].numel(), CHUNK_ELEMENTS):
            p_, g_, m_, v_ = (t[start : start + CHUNK_ELEMENTS] for t in flat)
            g32 = g_.float()
            m32 = m_.float().lerp_(g32, 1 - beta1)
            v32 = v_.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            m_.copy_(m32)
            v_.copy_(v32)
            p_.mul_(1 - group["lr"] * group["weight_decay"]).addcdiv_(
                m32, (v32.sqrt() / bc2).add_(group["eps"]), value=-size
            )

    def _dequantize(self, codes: Tensor, scale: Tensor, qmap: Tensor) -> Tensor:
        """fp32 values of rows stored as (codes, scale): (rows, row elements)."""
        if self.bits == 4:
            codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1)
        values = qmap[codes.int()].view(scale.numel(), -1) * scale.reshape(-1, 1)
        return values.view(scale.shape[0], -1)

    def _quantize_into(self, values: Tensor, codes: Tensor, scale: Tensor, qmap: Tensor) -> None:
        blocks = values.view(scale.numel(), -1)
        absmax = blocks.abs().amax(-1).clip(1e-12)
        quantise = quantize_8bit_with_qmap if self.bits == 8 else quantize_4bit_with_qmap
        q = quantise(blocks / absmax.view(-1, 1), qmap).view(scale.shape[0], -1)
        if self.bits == 4:
            q = (q[:, ::2] << 4) | q[:, 1::2]
        codes.copy_(q)
        scale.copy_(absmax.view_as(scale))

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that the codes stay uint8 and bf16 moments bf16 (torch casts every non-step state to the
        parameter's dtype)."""
        own = lambda k, v: k.endswith(CODES) or getattr(v, "dtype", None) == torch.bfloat16  # noqa: E731
        codes = {i: {k: v for k, v in s.items() if own(k, v)} for i, s in state_dict["state"].items()}
        rest = {i: {k: v for k, v in s.items() if not own(k, v)} for i, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for i, p in zip(saved, params):
            for key, value in codes.get(i, {}).items():
                self.state[p][key] = value.to(device=_local(p).device)
