"""The data-parallel device mesh of the FSDP2 engine: R replica groups × S shards (HSDP; R = 1 is plain FSDP2).

Rank r sits at (r // S, r % S): the S ranks of a replica group are consecutive, so with the default S =
processes per node a group is one node, and only the gradient all-reduce of each shard crosses nodes.
The data is still split over all W = R·S ranks (rank r reads its G/W sequences), so the mesh changes
where the state lives and how gradients travel, never the math.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from anygpu.errors import UsageError

DIM_NAMES = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class MeshShape:
    dp_replicate: int
    dp_shard: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def is_hsdp(self) -> bool:
        return self.dp_replicate > 1

    def banner(self, sharded: bool = True) -> str:
        """The start-up line, e.g. `mesh 2 × 4 (dp_replicate × dp_shard): …`."""
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


def local_world_size_from_env() -> int:
    """Processes per node, as torchrun (and accelerate) set it; 1 for plain python."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def _pairs(world_size: int) -> str:
    return ", ".join(f"{world_size // s} × {s}" for s in range(1, world_size + 1) if world_size % s == 0)


def resolve(dp_replicate: int | None, dp_shard: int | None, world_size: int, local_world_size: int) -> MeshShape:
    """R × S from what was given; the default shards within a node and replicates across nodes."""
    if dp_replicate is None and dp_shard is None:
        several_nodes = 1 <= local_world_size < world_size and world_size % local_world_size == 0
        dp_shard = local_world_size if several_nodes else world_size
    if dp_replicate is not None and dp_shard is not None:
        if dp_replicate * dp_shard != world_size:
            raise UsageError(
                f"--dp_replicate {dp_replicate} × --dp_shard {dp_shard} = {dp_replicate * dp_shard}, not the world "
                f"size {world_size}: give R × S = {world_size}, e.g. (R × S) {_pairs(world_size)}."
            )
        return MeshShape(dp_replicate, dp_shard)
    given, value = ("dp_replicate", dp_replicate) if dp_shard is None else ("dp_shard", dp_shard)
    if world_size % value:
        raise UsageError(
            f"--{given} {value} does not divide the world size {world_size} (--dp_replicate × --dp_shard must equal "
            f"it): use one of (R × S) {_pairs(world_size)}."
        )
    other = world_size // value
    return MeshShape(value, other) if given == "dp_replicate" else MeshShape(other, value)
