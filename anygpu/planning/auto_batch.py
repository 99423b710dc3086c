"""`--per_device_train_batch_size auto`: the largest micro-batch that fits, the global batch unchanged.

Candidates are the divisors of the per-rank share G / W, largest first. On a GPU each candidate is
probed: one forward + backward on random tokens of the run's block size, its peak
(`torch.cuda.max_memory_allocated`) plus the optimizer state still to come checked against the
budget with a safety margin. Elsewhere (CPU, or before the model exists) the plan's estimate
(anygpu/planning/memory_plan.py) is checked against `--max_memory_per_device_gb`. Every rank must agree,
and stay in the same sequence of collectives: the budget is the smallest rank's, and after each candidate
the ranks combine their outcomes in one all-reduce (too big on one rank, out of memory included: too big
on all; an error on one rank: every rank stops). The accumulation steps follow: A = G / (m · W).

An out-of-memory *inside* the probe's sharded forward/backward (FSDP2's all-gathers and reduce-scatters) may
leave the other ranks waiting in the next collective, so it is agreed on without one: the rank asks the job's
key-value store whether every rank hit it at the same candidate within OOM_AGREE_S (then too big, agreed: the probe
goes on); if not, that rank stops the job at once with one line and exit 1, and the launcher ends the others
(`stop_alone`). Tested on CPU (gloo, a real FSDP2 model); on GPUs FSDP2's state after a half-run forward is unverified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from anygpu.config.batch import BatchPlan, plan_batch
from anygpu.errors import UsageError
from anygpu.planning import memory_plan

GIB = 2**30


@dataclass
class Probe:
    micro_batch: int
    per_rank: int
    budget_bytes: int
    how: str  # "measured" (forward + backward on the device) or "estimated" (the plan)
    tried: list[tuple[int, int, bool]] = field(default_factory=list)  # (m, bytes, fits)

    def line(self) -> str:
        tried = ", ".join(f"{m} → {b / GIB:.3f} GiB {'fits' if ok else 'too big'}" for m, b, ok in self.tried)
        return (
            f"micro-batch auto ({self.how}, budget {self.budget_bytes / GIB:.3f} GiB × "
            f"{memory_plan.SAFETY:.0%} per device): {tried}; chosen {self.micro_batch} on every rank "
            f"(divisors of the {self.per_rank} sequences per rank)"
        )


def divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def agree_min(value: int, device: torch.device) -> int:
    """The smallest value over all ranks (every rank calls this the same number of times)."""
    return -agree_max([-value], device)[0]


def agree_max(values: list[int], device: torch.device) -> list[int]:
    """Each value's largest over all ranks, in one all-reduce (every rank calls this the same number of times)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


TOO_BIG = 1 << 62  # the cost of a candidate that ran out of memory


# How long a rank that ran out of memory inside a sharded probe waits for every other rank to say the same: they
# run the same collectives in step, so a rank that has not said so within it is waiting in the probe's next one.
OOM_AGREE_S = 20.0


def oom_agree_s() -> float:
    """OOM_AGREE_S, or ANYGPU_OOM_AGREE_S where set (a device shared with other jobs may want longer)."""
    import os

    return float(os.environ.get("ANYGPU_OOM_AGREE_S", OOM_AGREE_S))


class AloneOutOfMemory(Exception):
    """This rank ran out of memory inside a sharded probe and the others did not: they wait in its collectives."""

    def __init__(self, rank: int, micro_batch: int) -> None:
        super().__init__(f"rank {rank}, micro-batch {micro_batch}")
        self.rank, self.micro_batch = rank, micro_batch


def out_of_memory_everywhere(m: int) -> None:
    """After an out-of-memory inside the probe of `m` (the model's collectives half run): return when every rank
    hit it at `m` (too big, agreed: the probe goes on), else raise AloneOutOfMemory. No collective: the job's
    key-value store, waited on for oom_agree_s() at most."""
    import torch.distributed as dist

    from anygpu.runtime import distributed

    if not distributed.same_on_every_rank("auto_batch_oom", str(m), oom_agree_s()):
        raise AloneOutOfMemory(dist.get_rank(), m)


def stop_alone(error: AloneOutOfMemory, per_rank: int) -> None:
    """Stop this process at once with one line and exit 1: the other ranks are inside a collective that will not
    complete, so nothing may wait on them (no cleanup, no collective); the launcher then ends them."""
    import os
    import sys

    from anygpu.errors import EXIT_FAILURE

    m = error.micro_batch
    smaller = [d for d in divisors_desc(per_rank) if d < m]
    advice = (
        f"pass --per_device_train_batch_size {smaller[0]} (or a smaller divisor of {per_rank}) instead of auto"
        if smaller
        else "use --gradient_checkpointing true, a shorter --block_size or more devices"
    )
    print(
        f"error: --per_device_train_batch_size auto: rank {error.rank} ran out of memory inside the sharded probe of "
        f"micro-batch {m} and the other ranks did not within {oom_agree_s():g} s (they wait in the probe's "
        f"collectives; the device may be shared with another process): {advice}. Stopping the job.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(EXIT_FAILURE)


def _try(cost: Callable[[int], int], m: int) -> tuple[int, Exception | None]:
    """`cost(m)` on this rank, never raising (but AloneOutOfMemory): a rank that leaves the probe alone would leave
    the others waiting in the next all-reduce (a hang on NCCL), so every outcome is agreed on first."""
    try:
        return cost(m), None
    except AloneOutOfMemory:
        raise
    except torch.OutOfMemoryError:
        return TOO_BIG, None  # too big here: too big everywhere, once agreed
    except Exception as error:  # re-raised once every rank knows
        return TOO_BIG, error


def choose(per_rank: int, cost: Callable[[int], int], budget_bytes: int, device: torch.device, how: str) -> Probe:
    """Largest divisor m of ``per_rank`` whose ``cost(m)`` fits ``SAFETY × budget`` on every rank. A probe that
    fails on one rank (an error other than out-of-memory) stops every rank at the same candidate."""
    probe = Probe(1, per_rank, budget_bytes, how)
    limit = budget_bytes * memory_plan.SAFETY
    for m in divisors_desc(per_rank):
        try:
            used, error = _try(cost, m)
        except AloneOutOfMemory as alone:
            stop_alone(alone, per_rank)
        too_big, failed = agree_max([int(used > limit), int(error is not None)], device)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"--per_device_train_batch_size auto: another rank's probe of micro-batch {m} failed "
                "(its error is in that rank's output); this rank stops with it"
            )
        probe.tried.append((m, used, not too_big))
        if not too_big:
            probe.micro_batch = m
            return probe
    raise UsageError(
        f"--per_device_train_batch_size auto: even 1 sequence per device needs {probe.tried[-1][1] / GIB:.3f} GiB, "
        f"above {memory_plan.SAFETY:.0%} of the {budget_bytes / GIB:.3f} GiB budget: raise --max_memory_per_device_gb, "
        "use --gradient_checkpointing true, a shorter --block_size, or more devices."
    )


def estimate_cost(
    shapes: memory_plan.Shapes,
    strategy: str,
    precision: str,
    world: int,
    block_size: int,
    checkpointing: bool | str,
    lean_loss: bool = True,
) -> Callable[[int], int]:
    """Per-device bytes the plan expects at micro-batch m (model states, activations, working copies)."""
    states = sum(memory_plan.model_state_bytes(shapes, strategy, precision, world)[0].values())
    extra = memory_plan.transient_bytes(shapes, strategy, precision, world, lean_loss)
    return lambda m: (
        states + extra + memory_plan.activation_bytes(shapes, m, block_size, precision, checkpointing, lean_loss)
    )


def measured_cost(
    model: torch.nn.Module, vocab_size: int, block_size: int, device: torch.device, optimizer_bytes: int
) -> Callable[[int], int]:
    """Peak device bytes of one forward + backward at micro-batch m, plus the optimizer state to come."""

    def cost(m: int) -> int:
        model.zero_grad(set_to_none=True)
        _reset_peak(device)
        gen = torch.Generator(device="cpu").manual_seed(m)
        ids = torch.randint(0, vocab_size, (m, block_size), generator=gen).to(device)
        try:
            from anygpu.model import lean_loss  # the loss training will use (a no-op where it is not installed)

            with lean_loss.active(model):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            used = _peak(device) + optimizer_bytes
        except torch.OutOfMemoryError:
            used = TOO_BIG  # caught here, not in `choose`, so the memory is given back below
        model.zero_grad(set_to_none=True)
        _reset_peak(device)
        if used == TOO_BIG:
            out_of_memory_everywhere(m)  # mid-collective: agreed through the store, or this rank stops the job
        return used

    return cost


def _reset_peak(device: torch.device) -> None:
    """Give the cached memory back and start a new peak (a CPU has no peak to read: the tests' probes)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def budget(max_memory_per_device_gb: float | None, device: torch.device) -> int:
    """The smaller of the given budget and the device's memory; the given one alone on CPU."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    given = int(max_memory_per_device_gb * GIB) if max_memory_per_device_gb else None
    if given is None and total is None:
        raise UsageError(
            "--per_device_train_batch_size auto on CPU needs --max_memory_per_device_gb (the memory a "
            "process may use, e.g. 8): there is no GPU memory to probe."
        )
    return min(x for x in (given, total) if x is not None)


def resolve(
    plan: BatchPlan,
    shapes: memory_plan.Shapes,
    strategy: str,
    precision: str,
    block_size: int,
    checkpointing: bool | str,
    max_memory_per_device_gb: float | None,
    device: torch.device,
    model: torch.nn.Module | None = None,
    shard_size: int | None = None,
    lean_loss: bool = True,
) -> tuple[BatchPlan, Probe]:
    """The batch plan with the chosen micro-batch (G and W unchanged) and the probe's report. `shard_size`: the
    ranks the state is sharded over when fewer than W (HSDP's dp_shard)."""
    per_rank = plan.global_batch_size // plan.world_size
    # every rank measures against the same budget: the smallest device's (one agreement, before any probe)
    limit = agree_min(budget(max_memory_per_device_gb, device), device)
    shards = shard_size or plan.world_size
    if model is not None and device.type == "cuda":
        states = memory_plan.model_state_bytes(shapes, strategy, precision, shards)[0]
        cost, how = measured_cost(model, shapes.vocab_size, block_size, device, states["optimizer"]), "measured"
    else:
        cost, how = (
            estimate_cost(shapes, strategy, precision, shards, block_size, checkpointing, lean_loss),
            "estimated",
        )
    probe = choose(per_rank, cost, limit, device, how)
    return plan_batch(plan.global_batch_size, plan.world_size, probe.micro_batch), probe


def checkpointing_of(train_args) -> bool | str:
    """The run's activation checkpointing as the memory plan counts it: False, True (full) or selective."""
    if not train_args.gradient_checkpointing:
        return False
    return memory_plan.SELECTIVE if train_args.gradient_checkpointing_policy == "selective" else True


def apply(
    prep,
    model_args,
    train_args,
    device: torch.device,
    strategy: str,
    model: torch.nn.Module | None = None,
    shard_size: int | None = None,
    lean: bool | None = None,
) -> Probe:
    """Choose the micro-batch for a prepared run and put it into ``prep.plan``; return the probe. `lean`: whether
    the lean loss runs (the engine knows: a strategy or a family may keep the model's own; default --lean_loss)."""
    from anygpu.model import lora, modeling

    # the model the engines train: with --use_peft the frozen base keeps only its weights (no gradients, no AdamW)
    meta = lora.wrap(modeling.build_meta_model(prep.config, model_args), model_args, train_args.dropout_off)
    shapes = memory_plan.shapes_from_model(meta, prep.config)
    precision = "bf16" if (train_args.bf16 or train_args.fp16) else "fp32"
    prep.plan, probe = resolve(
        prep.plan,
        shapes,
        strategy,
        precision,
        prep.block_size,
        checkpointing_of(train_args),
        train_args.max_memory_per_device_gb,
        device,
        model,
        shard_size,
        lean_loss=train_args.lean_loss if lean is None else lean,
    )
    return probe
