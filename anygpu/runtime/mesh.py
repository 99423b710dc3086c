"""The device mesh of the FSDP2 engine: R replica groups × S shards (HSDP; R = 1 is plain FSDP2) × C
context-parallel ranks (each sequence split into C parts; C = 1: none), W = R·S·C.

Rank r sits at (r // (S·C), (r // C) % S, r % C), torchtitan's order: the C ranks of a CP group are
consecutive (they exchange activations in every attention layer, so they sit closest), then the S·C ranks
of a replica group, which with the default S·C = processes per node is one node, so only the gradient
all-reduce of each shard crosses nodes. FSDP2 shards over the flattened S·C (parameters are not repeated
per CP rank) and replicates over R. The data is split over the D = R·S data-parallel ranks (data rank
r // C reads its G/D sequences, the C ranks of its CP group the same ones), so the mesh changes where the
state lives and how gradients travel, never the math.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

from anygpu.errors import UsageError

DIM_NAMES = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int
    dp_shard: int
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def data_parallel(self) -> int:
        """D = R·S: the ranks that read different sequences (the batch math's devices)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """The ranks FSDP2 shards over: S·C."""
        return self.dp_shard * self.cp

    def data_rank(self, rank: int) -> int:
        """The rank's place in the D grid: the C ranks of a CP group read the same sequences."""
        return rank // self.cp

    def cp_rank(self, rank: int) -> int:
        """Which of its sequences' C parts the rank holds."""
        return rank % self.cp

    @property
    def is_hsdp(self) -> bool:
        return self.dp_replicate > 1

    def banner(self, sharded: bool = True) -> str:
        """The start-up line, e.g. `mesh 2 × 4 (dp_replicate × dp_shard): …`."""
        if self.cp > 1:
            return self._cp_banner()
        head = f"mesh {self.dp_replicate} × {self.dp_shard} (dp_replicate × dp_shard): "
        if not sharded:
            return head + "one process, nothing to shard"
        if not self.is_hsdp:
            return head + f"FSDP2, parameters, gradients and optimizer state sharded over all {self.dp_shard} ranks"
        if self.dp_shard == 1:
            return head + f"HSDP, {self.dp_replicate} whole replicas (nothing sharded), gradients averaged across them"
        return (
            head + f"HSDP, state sharded over the {self.dp_shard} ranks of each of {self.dp_replicate} replica "
            f"groups, gradients averaged across the groups"
        )

    def _cp_banner(self) -> str:
        head = f"mesh {self.dp_replicate} × {self.dp_shard} × {self.cp} (dp_replicate × dp_shard × cp): "
        split = f"each sequence split into {self.cp} parts (Ulysses attention), "
        batch = f"; the global batch's devices are the {self.data_parallel} data-parallel ranks"
        if not self.is_hsdp:
            return head + split + f"FSDP2 state sharded over all {self.shard_group} ranks (dp_shard × cp)" + batch
        return (
            head + split + f"HSDP, state sharded over the {self.shard_group} ranks (dp_shard × cp) of each of "
            f"{self.dp_replicate} replica groups, gradients averaged across the groups" + batch
        )

    def describe(self) -> str:
        """`R × S` or `R × S × C` (dp_replicate × dp_shard × cp), for the resume line."""
        return f"{self.dp_replicate} × {self.dp_shard}" + (f" × {self.cp}" if self.cp > 1 else "")


def local_world_size_from_env() -> int:
    """Processes per node, as torchrun (and accelerate) set it; 1 for plain python."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def _pairs(world_size: int) -> str:
    return ", ".join(f"{world_size // s} × {s}" for s in range(1, world_size + 1) if world_size % s == 0)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve(
    dp_replicate: int | None, dp_shard: int | None, world_size: int, local_world_size: int, cp: int = 1
) -> MeshShape:
    """R × S × C from what was given; C parts of each sequence on consecutive ranks, then by default S shards
    within a node and R replicas across nodes, over the W / C data-parallel ranks."""
    if world_size % cp:
        raise UsageError(
            f"--cp {cp} does not divide the world size {world_size} (--dp_replicate × --dp_shard × --cp must "
            f"equal it): use one of {_divisors(world_size)}."
        )
    size = f"the world size {world_size}" if cp == 1 else f"the world size {world_size} / --cp {cp}"
    shape = _resolve_dp(dp_replicate, dp_shard, world_size // cp, max(1, local_world_size // cp), size)
    return MeshShape(shape.dp_replicate, shape.dp_shard, cp)


def _resolve_dp(
    dp_replicate: int | None, dp_shard: int | None, world_size: int, local_world_size: int, size: str
) -> MeshShape:
    """R × S over the `world_size` data-parallel ranks (`size` names that number in a refusal); the default shards within a node and replicates across nodes."""
    if dp_replicate is None and dp_shard is None:
        several_nodes = 1 <= local_world_size < world_size and world_size % local_world_size == 0
        dp_shard = local_world_size if several_nodes else world_size
    if dp_replicate is not None and dp_shard is not None:
        if dp_replicate * dp_shard != world_size:
            raise UsageError(
                f"--dp_replicate {dp_replicate} × --dp_shard {dp_shard} = {dp_replicate * dp_shard}, not "
                f"{size}: give R × S = {world_size}, e.g. (R × S) {_pairs(world_size)}."
            )
        return MeshShape(dp_replicate, dp_shard)
    given, value = ("dp_replicate", dp_replicate) if dp_shard is None else ("dp_shard", dp_shard)
    if world_size % value:
        raise UsageError(
            f"--{given} {value} does not divide {size} (--dp_replicate × --dp_shard must equal "
            f"it): use one of (R × S) {_pairs(world_size)}."
        )
    other = world_size // value
    return MeshShape(value, other) if given == "dp_replicate" else MeshShape(other, value)


def widen(shape: MeshShape, state_bytes: Callable[[int], int], budget: int) -> tuple[MeshShape, str | None]:
    """The default mesh (one replica group per node) with its shard group widened, by whole nodes, until a rank's
    model state (`state_bytes(S·C)`) fits `budget`; at most plain FSDP2 over every rank. A node-local shard group
    holds the whole model's state on every node: 70B's 1.1 TB of fp32 weights, gradients and AdamW moments is
    141 GB per GPU on 8, which no 80 GB GPU holds, and would fail at the first optimizer step after the whole load.
    Returns the shape and a line saying why it changed (None: unchanged)."""
    if budget <= 0 or not shape.is_hsdp or state_bytes(shape.shard_group) <= budget:
        return shape, None
    d, local = shape.data_parallel, shape.dp_shard
    wider = [s for s in range(2 * local, d + 1, local) if d % s == 0]
    s = next((s for s in wider if state_bytes(s * shape.cp) <= budget), d)
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    note = (
        f"the model's state is {gib(state_bytes(shape.shard_group))} per rank sharded over one node's "
        f"{shape.shard_group} ranks, over the {gib(budget)} a rank has for it: sharded over {s * shape.cp} ranks "
        f"({gib(state_bytes(s * shape.cp))} each); --dp_replicate/--dp_shard set the mesh yourself"
    )
    return MeshShape(d // s, s, shape.cp), note


def fsdp_rows(shape: tuple[int, ...], world: int, rank: int) -> int:
    """Elements rank ``rank`` holds of a parameter split on dim 0 into ⌈d0/N⌉-row chunks (fully_shard)."""
    d0, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    chunk = -(-d0 // world)
    return max(0, min(chunk, d0 - rank * chunk)) * rest
