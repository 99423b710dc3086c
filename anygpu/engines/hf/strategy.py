"""Which parallel strategy the launcher asked the HF engine for, and whether it is the one that runs.

`accelerate launch` tells the script what its config file asked for only through environment
variables (ACCELERATE_USE_FSDP, ACCELERATE_USE_DEEPSPEED, …) and `torchrun` through WORLD_SIZE.
Accelerate then quietly drops what the machine cannot do: FSDP on CPU becomes plain multi-process
data parallel. This module reads the request, decides how to honour it on this machine before any
process group exists, and afterwards compares the request with what accelerate actually built, so
the engine never trains with another strategy than the one asked for without saying so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from anygpu.engines.trunk.state import HF_STATE_FILE
from anygpu.errors import UsageError

FSDP_ON_CPU = (
    "the accelerate config asks for FSDP, but accelerate cannot run FSDP on CPU: it would silently "
    "train plain data parallel (DDP) instead. On a machine without a GPU use one of\n"
    "  accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes N run_hf_standalone.py ...   (DDP over gloo)\n"
    "  accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes N run_hf_standalone.py ...   "
    "(DeepSpeed ZeRO-3: sharded like FSDP, runs on CPU)\n"
    "  torchrun --standalone --nproc-per-node N run_fsdp_standalone.py ...   (the native FSDP2 engine, which runs FSDP2 on CPU)\n"
    "or pass --allow_strategy_fallback true to train DDP with this config (the banner then says so)."
)


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Request:
    """What the launcher asked for: 'single', 'ddp', 'dataparallel', 'fsdp' or 'deepspeed'."""

    kind: str
    num_processes: int
    zero_stage: int | None = None
    fsdp_version: int | None = None

    def describe(self) -> str:
        if self.kind == "deepspeed":
            return f"DeepSpeed ZeRO-{self.zero_stage}"
        if self.kind == "fsdp":
            return f"FSDP{self.fsdp_version or 1} (accelerate)"
        return {"single": "one process", "ddp": "DDP", "dataparallel": "DataParallel"}[self.kind]


def requested(env: Mapping[str, str] | None = None, num_gpus: int | None = None) -> Request:
    """The strategy the launcher's environment asks for (before any process group exists)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        return Request("deepspeed", world, zero_stage=_zero_stage(env))
    if _flag(env, "ACCELERATE_USE_FSDP"):
        version = env.get("FSDP_VERSION", "1")
        return Request("fsdp", world, fsdp_version=int(version) if version.isdigit() else None)
    if world > 1:
        return Request("ddp", world)
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Plain `python` (no launcher) on a host with several GPUs: Trainer drives them all from one
    # process with nn.DataParallel.
    if "LOCAL_RANK" not in env and num_gpus > 1:
        return Request("dataparallel", 1)
    return Request("single", world)


def _zero_stage(env: Mapping[str, str]) -> int | None:
    """The ZeRO stage accelerate runs: its config's `zero_stage`, else the `deepspeed_config_file`'s (accelerate then
    passes the file alone; a missing stage is DeepSpeed's default, 0), else 2; None where neither is a number."""
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if stage is None and path:
        try:
            stage = str(json.loads(Path(path).read_text()).get("zero_optimization", {}).get("stage", 0))
        except (OSError, ValueError, AttributeError):
            return None  # accelerate reads the same file next and says what is wrong with it
    stage = "2" if stage is None else stage
    return int(stage) if stage.isdigit() else None


@dataclass(frozen=True)
class Plan:
    """How the engine honours a request on this machine."""

    request: Request
    kind: str  # the strategy that will run
    use_cpu: bool  # TrainingArguments.use_cpu: accelerate's CPU path (MULTI_CPU over gloo)
    ddp_backend: str | None  # TrainingArguments.ddp_backend
    fallback_note: str | None = None  # set when the strategy that runs is not the one requested
    env_overrides: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        n = self.request.num_processes
        run = Request(self.kind, n, self.request.zero_stage, self.request.fsdp_version).describe()
        where = f"{n} processes" if n > 1 else "1 process"
        if self.kind == "dataparallel":
            where = "one process driving every visible GPU"
        backend = f", {self.ddp_backend}" if self.ddp_backend and n > 1 else ""
        text = f"strategy: {run} over {where}{backend}" if self.kind != "single" else "strategy: one process"
        if self.fallback_note:
            text += f" (FALLBACK: {self.fallback_note})"
        return text


def plan(request: Request, on_cpu: bool, allow_fallback: bool) -> Plan:
    """Decide how to run `request`; raise ValueError when this machine cannot and no fallback was allowed."""
    if not on_cpu:
        return Plan(request, request.kind, use_cpu=False, ddp_backend=None)
    if request.kind == "fsdp":
        if not allow_fallback:
            raise UsageError(FSDP_ON_CPU)
        kind = "ddp" if request.num_processes > 1 else "single"
        note = "FSDP was requested; accelerate cannot run FSDP on CPU, so this trains DDP (--allow_strategy_fallback)"
        # Accelerate must not half-configure FSDP: the CPU path is plain multi-process data parallel.
        return Plan(
            request,
            kind,
            use_cpu=True,
            ddp_backend="gloo" if kind == "ddp" else None,
            fallback_note=note,
            env_overrides=(("ACCELERATE_USE_FSDP", "false"),),
        )
    if request.kind == "deepspeed":
        # Accelerate's CPU switch (use_cpu) would drop DeepSpeed; DeepSpeed's own CPU accelerator
        # runs ZeRO over gloo when the backend is named (without it accelerate finds no backend on
        # a CPU-only host and every process trains alone with a world size of 1).
        return Plan(request, "deepspeed", use_cpu=False, ddp_backend="gloo")
    # One process needs no process group (naming a backend would make accelerate look for one).
    return Plan(request, request.kind, use_cpu=True, ddp_backend="gloo" if request.num_processes > 1 else None)


def check_in_effect(p: Plan, distributed_type: str, num_processes: int, fsdp_version: int | None = None) -> None:
    """Compare the plan with what accelerate built; raise ValueError on any difference.

    `distributed_type` is accelerate's DistributedType name (e.g. 'MULTI_CPU', 'FSDP', 'DEEPSPEED').
    """
    expected_world = p.request.num_processes
    if num_processes != expected_world:
        raise UsageError(
            f"the launcher started {expected_world} processes but accelerate sees a world of {num_processes}: "
            f"each process would train alone on its own data. Launch with accelerate launch or torchrun, "
            f"and on a CPU-only host use the configs in accelerate_configs/."
        )
    ok = {
        "deepspeed": distributed_type == "DEEPSPEED",
        "fsdp": distributed_type == "FSDP"
        and (p.request.fsdp_version is None or fsdp_version == p.request.fsdp_version),
        "ddp": distributed_type.startswith("MULTI_"),
        # one process started by a launcher is accelerate's MULTI_* type with a world of 1
        "single": distributed_type == "NO" or distributed_type.startswith("MULTI_"),
        "dataparallel": distributed_type == "NO",
    }[p.kind]
    if not ok:
        raise UsageError(
            f"asked for {p.request.describe()} but accelerate set up {distributed_type}"
            + (f" (FSDP version {fsdp_version})" if distributed_type == "FSDP" else "")
            + ": refusing to train with another strategy than the one requested. Check the accelerate config "
            "and the machine (see docs/engines.md, CPU fallback rules), or pass --allow_strategy_fallback true where a fallback exists."
        )


def apply_env(p: Plan) -> None:
    for key, value in p.env_overrides:
        os.environ[key] = value


def check_resume_world(resume: Path | None, plan: Plan) -> None:
    """Refuse, before starting anything, a checkpoint of another strategy family, or a ZeRO checkpoint
    (partitioned per process) on another number of processes. DDP-family checkpoints (one process,
    DDP, DataParallel) hold whole tensors and load on any world size."""
    file = Path(resume) / HF_STATE_FILE if resume is not None else None
    state = json.loads(file.read_text()) if file is not None and file.exists() else None
    if state is None:
        return
    family = {"deepspeed": "DeepSpeed", "fsdp": "FSDP"}
    was, now = family.get(state.get("strategy"), "DDP"), family.get(plan.kind, "DDP")
    if was != now:
        raise UsageError(
            f"--resume_from_checkpoint {resume}: a {was} checkpoint cannot be resumed with {now} (their model and "
            f"optimizer files differ): launch with the config the run started with."
        )
    if plan.kind == "deepspeed" and state["world_size"] != plan.request.num_processes:
        raise UsageError(
            f"--resume_from_checkpoint {resume}: DeepSpeed ZeRO partitions its checkpoints over {state['world_size']} "
            f"processes; resume with --num_processes {state['world_size']} (or convert the checkpoint with DeepSpeed's "
            "ds_to_universal.py), or use the DDP config, whose checkpoints load on any number of processes."
        )


def shards_parameters(plan: Plan) -> bool:
    """FSDP or ZeRO-3: before Trainer wraps the model, rank 0 alone holds it (FSDP2's efficient loading) or every
    rank a partition (zero.Init), so nothing can run its forward until then."""
    return plan.kind == "fsdp" or (plan.kind == "deepspeed" and (plan.request.zero_stage or 2) >= 3)


def lean_loss_off_reason(plan: Plan) -> str | None:
    """Strategies the lean loss stays off under: it calls lm_head per chunk, outside the module hooks they rely on."""
    if plan.kind == "dataparallel":
        return "DataParallel's replicas would call the first GPU's lm_head"
    if plan.kind == "deepspeed" and (plan.request.zero_stage or 2) >= 3:
        return "ZeRO-3 gathers lm_head's weight only for the module's own forward"
    return None


def plan_strategy(plan: Plan, ds_plugin) -> str:
    """The memory plan's name for the strategy that runs (anygpu/planning/memory_plan.py)."""
    if plan.kind == "fsdp":
        return "fsdp2"
    if plan.kind == "deepspeed":
        stage = 3 if (plan.request.zero_stage or 2) >= 3 else 2
        offload = ds_plugin is not None and ds_plugin.offload_optimizer_device in ("cpu", "nvme")
        return f"zero{stage}" + ("_offload" if offload else "")
    return "ddp"
