"""The vendor launchers' logic: detect the GPUs, export the environment, start the engine.

``bash run_nvidia_all.sh [options] [-- script args]`` and ``run_amd_all.sh`` call
``main(["--vendor", "nvidia"|"amd", ...])``; everything is decided here so it can be tested.
Detection and ``--dry-run`` need only the standard library; when torch is importable, its
``torch.cuda.device_count()`` under the job's final environment has the last word on the count.

What runs (ENGINE: ``-m anygpu.engines.run_fsdp`` or ``-m anygpu.engines.run_hf``, the engines' entry modules):
  one process on one node   python ENGINE args                       (no distributed wrapper)
  --engine fsdp             python -m anygpu.reliability.torchrun (torchrun) … -m anygpu.engines.run_fsdp args
  --engine hf (default)     python -m accelerate.commands.launch --config_file CFG … -m anygpu.engines.run_hf args
The engines and the accelerate configs come from the package itself, so an installed wheel launches from any
folder. The final step is ``os.execve``: the job's exit code and signals are the launcher's own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from anygpu.launch import detect as gpu_detect
from anygpu.launch import suggest, vendor_env
from anygpu.launch.detect import AMD, NVIDIA, VENDOR_LABEL, Gpu, Runner

# Everything is found from this file, so a checkout and an installed wheel launch alike, from any folder.
PACKAGE = Path(__file__).resolve().parent.parent  # this anygpu
ROOT = PACKAGE.parent  # a checkout's root (it holds the run_*_standalone.py scripts), or site-packages
CONFIG_DIR = PACKAGE / "launch" / "accelerate_configs"  # package data; a checkout's accelerate_configs/ links here
ENGINES = {"hf": "anygpu.engines.run_hf", "fsdp": "anygpu.engines.run_fsdp"}  # each started as `python -m MODULE`
CHECKOUT_SCRIPTS = {"hf": "run_hf_standalone.py", "fsdp": "run_fsdp_standalone.py"}  # the same, in a checkout's root
SCRIPT_NAME = {NVIDIA: "run_nvidia_all.sh", AMD: "run_amd_all.sh"}
DEFAULT_MASTER_PORT = 29500
PREFIX = "[anygpu]"
# torchrun's c10d rendezvous settings a user may tune (--rdzv-conf), in seconds (attempts); and is_host=true|false,
# by default true on node 0 only: false on every node when the store is hosted off the training nodes.
RDZV_CONF_KEYS = (
    "is_host",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
)
# MIN:MAX, exported for an elastic job: its workers continue the run by themselves (anygpu.checkpoint.store reads
# it as store.ELASTIC_VARIABLE; launch/ imports the standard library only, so the name is written twice)
ELASTIC_VARIABLE = "ANYGPU_ELASTIC"


class LaunchError(Exception):
    """A problem the user must fix; printed as one message, exit code 2."""


# ------------------------------------------------------------------------------- arguments


def build_parser(vendor: str | None = None) -> argparse.ArgumentParser:
    script = SCRIPT_NAME.get(vendor or "", "run_<vendor>_all.sh")
    p = suggest.ArgumentParser(  # one-line errors, 'did you mean', no abbreviations (--engin is refused)
        prog=f"bash {script}",
        usage=f"bash {script} [options] [-- training-script arguments]",
        description="Train on every GPU this job may use (visibility variables honoured), with the vendor's "
        "environment, on one node or many (NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT/RDZV_ID or "
        "Slurm's variables). No GPU: one CPU process with gloo.",
        epilog="Everything after -- goes to the training script unchanged, e.g.\n"
        f"  bash {script} --engine fsdp -- --config_name tiny --max_steps 10 --output_dir outputs/tiny\n"
        "Each exported variable keeps the value the caller set. See docs/launchers.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_job_options(p, vendor)
    _add_launch_options(p)
    return p


def _add_job_options(p: argparse.ArgumentParser, vendor: str | None) -> None:
    """What runs, and on which devices."""
    p.add_argument(
        "--vendor",
        choices=gpu_detect.VENDORS,
        required=vendor is None,
        default=vendor,
        help=argparse.SUPPRESS if vendor else "GPU vendor (the .sh scripts set it).",
    )
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="hf",
        help="hf: HF Trainer through `accelerate launch` (default); fsdp: native FSDP2 through torchrun.",
    )
    p.add_argument(
        "--accelerate-config",
        metavar="NAME|PATH",
        help="--engine hf: a config in accelerate_configs/ (ddp, fsdp, fsdp_offload, deepspeed_zero2, "
        "deepspeed_zero3, deepspeed_zero3_offload, multi_node) or a YAML path. Default: fsdp "
        "(FSDP2) for more than one GPU, ddp for one GPU or on CPU.",
    )
    p.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="Processes on this node: N of the usable GPUs (the first N), or N CPU processes "
        "when there is no GPU. Default: every usable GPU, or 1 CPU process.",
    )
    p.add_argument(
        "--gpus", metavar="LIST", help="Use these GPUs, e.g. 0,1,3: indices into the usable GPUs as listed at start-up."
    )
    p.add_argument(
        "--cpu", action="store_true", help="Train on CPU even where GPUs are present (hides them from the job)."
    )


def _add_launch_options(p: argparse.ArgumentParser) -> None:
    """How it is launched: rendezvous, restarts, another script, the network, the count, a dry run."""
    p.add_argument(
        "--master-port",
        type=int,
        metavar="PORT",
        help="Fix the rendezvous port. Default: a free port on one node; MASTER_PORT or "
        f"{DEFAULT_MASTER_PORT} on many.",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="Restart the workers up to K times after a failure (torchrun elastic); the engine "
        "resumes from its latest checkpoint.",
    )
    p.add_argument(
        "--rdzv-conf",
        metavar="K=V[,K=V]",
        default="",
        help="--engine fsdp: torchrun's rendezvous settings, e.g. last_call_timeout=10,keep_alive_interval=2 "
        f"(keys: {', '.join(RDZV_CONF_KEYS)}; seconds, whole numbers; is_host=false on every node when the "
        "store runs off the training nodes). Elastic jobs (NNODES=MIN:MAX): how long a membership change takes "
        "(docs/launchers.md#elastic-node-counts).",
    )
    p.add_argument(
        "--script",
        metavar="PATH",
        help="Run this training script instead of the engine's (same environment and launch).",
    )
    p.add_argument(
        "--ifname",
        metavar="IFACE",
        help="Network interface for NCCL/RCCL and gloo (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) "
        "when the wrong one is picked on a multi-node job.",
    )
    p.add_argument(
        "--count-from",
        choices=("auto", "smi", "torch"),
        default="auto",
        help="auto (default): the smi tools and the visibility rules, checked against torch's count "
        "when torch is importable (torch wins); smi: the smi tools only (e.g. a dry run on a "
        "login node); torch: torch's count is required.",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="Print every exported variable and the exact command, then exit 0."
    )
    p.add_argument(  # run_<vendor>_all.sh and `anygpu launch` hand it to anygpu.tools.interactive, not to main()
        "--interactive",
        action="store_true",
        help="Ask engine, accelerate config, GPUs, global batch and output folder first, with `anygpu plan`'s "
        "recommendation as each default, then launch (docs/tools.md#interactive-anygpu-launch).",
    )


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Launcher options before the first ``--``; the training script's arguments after it."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    mine, script_args = split_argv(argv)
    vendors = vendors_given(mine)
    vendor = vendors[0] if vendors else None
    parser = build_parser(vendor if vendor in gpu_detect.VENDORS else None)
    refuse_second_vendor(parser, vendors)
    args, unknown = parser.parse_known_args(mine)
    if unknown:
        parser.error(
            f"{suggest.unknown_options_message(unknown, parser)}; training-script arguments go after --, "
            f"e.g. {parser.prog} -- {' '.join(unknown)}"
        )
    return args, script_args


def refuse_second_vendor(parser: argparse.ArgumentParser, vendors: Sequence[str]) -> None:
    """The scripts pass their own --vendor first: argparse would take a later one, the launcher's checks the first."""
    if len(vendors) > 1 and vendors[0] in gpu_detect.VENDORS:
        first = vendors[0]
        other = next(v for v in gpu_detect.VENDORS if v != first)
        parser.error(
            f"--vendor given twice ({first}, then {vendors[1]}): give it once ({SCRIPT_NAME[first]} passes "
            f"--vendor {first} itself; use {SCRIPT_NAME[other]} for {VENDOR_LABEL[other]} GPUs)"
        )


def vendors_given(mine: Sequence[str]) -> list[str]:
    """Every --vendor value among the launcher's options, in order (`--vendor X` and `--vendor=X`)."""
    given = []
    for i, word in enumerate(mine):
        if word == "--vendor" and i + 1 < len(mine):
            given.append(mine[i + 1])
        elif word.startswith("--vendor="):
            given.append(word.split("=", 1)[1])
    return given


# ----------------------------------------------------------------------------------- nodes


@dataclass
class Nodes:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    rdzv_id: str = ""
    source: str = "one node"
    min_nodes: int = 0  # elastic (NNODES=MIN:MAX, Slurm's MIN_NODES): the fewest nodes the job goes on with

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes

    @property
    def spec(self) -> str:
        """torchrun's --nnodes: N, or MIN:MAX for an elastic job."""
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)


def _int_env(env: Mapping[str, str], name: str, lo: int = 0, hi: int | None = None) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a whole number") from None
    if value < lo or (hi is not None and value > hi):
        raise LaunchError(f"{name}={value} is out of range (valid: {lo}..{hi if hi is not None else 'any'})")
    return value


def first_slurm_host(nodelist: str, run: Runner = gpu_detect.run_tool) -> str:
    """The head node: first line of ``scontrol show hostnames NODELIST`` (or our own expansion)."""
    rc, out, _ = run(["scontrol", "show", "hostnames", nodelist])
    if rc == 0 and out.split():
        return out.split()[0]
    # No scontrol (e.g. inside a container): expand the first entry ourselves, as Slurm orders it: the list's
    # first name (commas inside brackets do not end it), each bracket group at its first number:
    # "gpu[003-005,9],login1" -> "gpu003", "rack[1-2]-n[3-4]" -> "rack1-n3".
    m = re.match(r"(?:[^,\[\]]|\[[^\]]*\])+", nodelist.strip())
    if not m:
        raise LaunchError(f"cannot find the head node in SLURM_JOB_NODELIST={nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda g: re.split(r"[,-]", g[1])[0], m[0])


def resolve_nodes(env: Mapping[str, str], master_port: int | None, run: Runner = gpu_detect.run_tool) -> Nodes:
    """One node, or many from NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT/RDZV_ID, or from Slurm.

    Every node must agree on the rendezvous: same MASTER_ADDR:MASTER_PORT and RDZV_ID (by default
    SLURM_JOB_ID, or derived from the address and port, so every node computes the same one).
    """
    slurm_nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if "NNODES" in env:
        min_nodes, nnodes = node_counts(env)
        if nnodes == 1:
            return Nodes(master_port=master_port)
        for name in ("NODE_RANK", "MASTER_ADDR"):
            if not env.get(name):
                raise LaunchError(
                    f"NNODES={env['NNODES']} needs {name} too (NODE_RANK 0..{nnodes - 1} on each node, "
                    "MASTER_ADDR the address of node 0, the same on every node)"
                )
        rank = _int_env(env, "NODE_RANK", 0, nnodes - 1)
        addr, source = env["MASTER_ADDR"], "NNODES/NODE_RANK/MASTER_ADDR"
        rdzv = env.get("RDZV_ID") or env.get("SLURM_JOB_ID") or ""
    elif env.get("SLURM_JOB_ID") and slurm_nodes and slurm_nodes.isdigit() and int(slurm_nodes) > 1:
        nnodes = int(slurm_nodes)
        if env.get("SLURM_LOCALID", "0") != "0":
            raise LaunchError(
                "Slurm started more than one launcher on this node (SLURM_LOCALID="
                f"{env['SLURM_LOCALID']}); start one per node: srun --ntasks-per-node=1"
            )
        if "SLURM_NODEID" not in env:
            raise LaunchError(
                f"this Slurm job has {nnodes} nodes but SLURM_NODEID is unset: start the launcher "
                "on every node with srun --ntasks-per-node=1 (see slurm/train.sbatch)"
            )
        rank = _int_env(env, "SLURM_NODEID", 0, nnodes - 1)
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist, run) if nodelist else "")
        if not addr:
            raise LaunchError("cannot find the head node: SLURM_JOB_NODELIST and MASTER_ADDR are unset")
        rdzv, source = env.get("RDZV_ID") or env["SLURM_JOB_ID"], "Slurm"
        min_nodes = _int_env(env, "MIN_NODES", 1, nnodes) if env.get("MIN_NODES") else nnodes
    else:
        return Nodes(master_port=master_port)
    port = (
        master_port
        if master_port is not None
        else (_int_env(env, "MASTER_PORT", 1, 65535) if env.get("MASTER_PORT") else DEFAULT_MASTER_PORT)
    )
    if port == 0:
        raise LaunchError("--master-port 0 (a free port) only works on one node: every node must know the port")
    return Nodes(nnodes, rank, addr, port, rdzv or f"anygpu-{addr}-{port}", source, min_nodes)


def node_counts(env: Mapping[str, str]) -> tuple[int, int]:
    """(MIN, MAX) from NNODES: N (fixed: N, N) or MIN:MAX (elastic, torchrun's notation)."""
    raw = env["NNODES"]
    if ":" not in raw:
        n = _int_env(env, "NNODES", lo=1)
        return n, n
    lo, _, hi = raw.partition(":")
    if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        raise LaunchError(
            f"NNODES={raw!r} is not a node count: give N, or MIN:MAX with 1 <= MIN <= MAX for an elastic job "
            "(e.g. NNODES=2 or NNODES=1:2)"
        )
    return int(lo), int(hi)


# ---------------------------------------------------------------------------------- torch

TORCH_PROBE = (
    "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
    "'hip': getattr(torch.version, 'hip', None), 'count': torch.cuda.device_count()}))"
)


def torch_probe(env: Mapping[str, str]) -> dict | None:
    """torch's version, build and ``torch.cuda.device_count()`` under ``env``; None without torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    p = subprocess.run([sys.executable, "-c", TORCH_PROBE], env=dict(env), capture_output=True, text=True, timeout=300)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise LaunchError(
            f"importing torch failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    return json.loads(lines[-1])


TorchProbe = Callable[[Mapping[str, str]], "dict | None"]


def once(probe: TorchProbe) -> TorchProbe:
    """torch's device count is the same for every run: probe it once (a torch import costs seconds)."""
    cache: dict[str, Any] = {}

    def probe_once(env: Mapping[str, str]):
        if "result" not in cache:
            cache["result"] = probe(env)
        return cache["result"]

    return probe_once


TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's default list plus Slurm's SIGUSR1


def torchrun_forwards_signals() -> bool:
    """Whether this torch's torchrun takes --signals-to-handle (read from its source: no torch import here)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    run_py = Path(list(spec.submodule_search_locations)[0]) / "distributed" / "run.py"
    return run_py.is_file() and "signals_to_handle" in run_py.read_text(errors="replace")


# ----------------------------------------------------------------------------------- plan


@dataclass
class Plan:
    vendor: str
    engine: str
    use_gpus: bool
    gpus: list[Gpu]
    nproc: int  # processes on this node
    nodes: Nodes
    cmd: list[str]
    env: dict[str, str]  # the full environment the command runs with
    exported: dict[str, str] = field(default_factory=dict)  # what the launcher set or changed
    kept: dict[str, str] = field(default_factory=dict)  # presets the caller had already set
    lines: list[str] = field(default_factory=list)  # what the launcher tells the user
    warnings: list[str] = field(default_factory=list)
    job: list[str] = field(default_factory=list)  # what each process runs: `-m MODULE` or SCRIPT, then its arguments

    @property
    def wrapped(self) -> bool:
        """Whether torchrun or accelerate starts the processes (else the command is `python JOB` itself)."""
        return self.cmd[1:] != self.job


def _resolve_config(name: str) -> Path:
    path = Path(name)
    yaml_name = path.suffix.lower() in (".yaml", ".yml")  # My.YAML is a YAML file too
    if yaml_name and path.is_file():
        return path.resolve()
    candidate = CONFIG_DIR / (name if yaml_name else f"{name}.yaml")
    if candidate.is_file():
        return candidate
    valid = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise LaunchError(
        f"--accelerate-config {name!r}: no such file, and no {candidate.name} in {CONFIG_DIR} "
        f"(valid names: {', '.join(valid) or 'none yet'}; or a path to a YAML file)"
    )


def _config_kind(path: Path) -> str:
    """The accelerate config's distributed_type (DEEPSPEED, FSDP, MULTI_GPU, …), read without yaml."""
    match = re.search(r"^distributed_type:\s*['\"]?(\w+)", path.read_text(), re.MULTILINE)
    return match.group(1).upper() if match else "NO"


def _parse_gpu_list(text: str, num_usable: int) -> list[int]:
    picked: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= num_usable:
            raise LaunchError(
                f"--gpus {text!r}: {item!r} is not a usable GPU (valid: indices 0..{num_usable - 1}, comma-separated)"
            )
        if int(item) in picked:
            raise LaunchError(f"--gpus {text!r}: GPU {item} is named twice")
        picked.append(int(item))
    return picked


def _pin(vendor: str, chosen: Sequence[Gpu], present: Sequence[Gpu], env: Mapping[str, str]) -> dict[str, str]:
    """The visibility variable that shows the job exactly ``chosen`` (which are all visible now)."""
    if vendor == NVIDIA:
        # MIG instances only by their MIG- ids (an index names the whole parent GPU); one list is one kind
        by_index = env.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID") == "PCI_BUS_ID" and not any(
            g.uuid.startswith("MIG-") for g in chosen
        )
        ids = [str(g.index) if by_index or not g.uuid else g.uuid for g in chosen]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
    # AMD: keep ROCR_VISIBLE_DEVICES (Slurm's choice) and index what it leaves with HIP_VISIBLE_DEVICES,
    # which the runtime prefers over CUDA_VISIBLE_DEVICES.
    base = gpu_detect.visible_gpus(AMD, present, {k: v for k, v in env.items() if k == "ROCR_VISIBLE_DEVICES"}).gpus
    return {"HIP_VISIBLE_DEVICES": ",".join(str(base.index(g)) for g in chosen)}


@dataclass
class Devices:
    """What the device step found: the GPUs present, the ones this job uses, or why it runs on CPU."""

    present: list[Gpu] = field(default_factory=list)
    chosen: list[Gpu] = field(default_factory=list)
    cpu_reason: str = ""  # non-empty: no GPU for this job, and why
    unresolved: str = ""  # visibility the smi tools could not resolve (torch must count)
    torch_info: dict | None = None

    @property
    def count(self) -> int:
        return 0 if self.cpu_reason else len(self.chosen)


def validate_args(args: argparse.Namespace) -> None:
    """Refuse contradictory or out-of-range launcher options, and a --script that is not there."""
    for flag, value, lo in (
        ("--nproc", args.nproc, 1),
        ("--max-restarts", args.max_restarts, 0),
        ("--master-port", args.master_port, 0),
    ):
        if value is not None and (value < lo or (flag == "--master-port" and value > 65535)):
            raise LaunchError(f"{flag} {value}: must be {'0..65535' if flag == '--master-port' else f'>= {lo}'}")
    if args.interactive:  # the scripts start the dialogue themselves; this module alone cannot ask
        raise LaunchError(
            f"--interactive: use bash {SCRIPT_NAME[args.vendor]} --interactive or anygpu launch --interactive"
        )
    if args.accelerate_config and args.engine != "hf":
        raise LaunchError("--accelerate-config only applies to --engine hf (the fsdp engine shards by itself)")
    if args.cpu and args.gpus:
        raise LaunchError("--gpus and --cpu exclude each other")
    if args.script and not Path(args.script).is_file():
        raise LaunchError(f"training script not found: {Path(args.script).resolve()}")
    if args.rdzv_conf and args.engine != "fsdp":
        raise LaunchError("--rdzv-conf only applies to --engine fsdp (accelerate's rendezvous is static)")
    rdzv_conf(args.rdzv_conf)


def rdzv_conf(text: str) -> list[str]:
    """--rdzv-conf's K=V items, each a known key with a whole number of seconds (or attempts)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items:
        key, _, value = item.partition("=")
        if key not in RDZV_CONF_KEYS or not (value in ("true", "false") if key == "is_host" else value.isdigit()):
            raise LaunchError(
                f"--rdzv-conf {text!r}: {item!r} is not KEY=SECONDS (is_host=true|false) with a known key (valid keys: "
                f"{', '.join(RDZV_CONF_KEYS)}; e.g. --rdzv-conf last_call_timeout=10,keep_alive_interval=2)"
            )
    return items


def check_elastic(args: argparse.Namespace, nodes: Nodes) -> None:
    """An elastic node count (MIN:MAX) needs the FSDP engine and room for restarts."""
    if not nodes.elastic:
        return
    what = f"NNODES={nodes.spec}" if nodes.source != "Slurm" else f"MIN_NODES={nodes.min_nodes} of {nodes.nnodes}"
    if args.engine != "fsdp":
        raise LaunchError(
            f"{what} (elastic) with --engine hf: accelerate launch starts the nodes with a static "
            "rendezvous that waits for every node, so a lost node would stop the job; use --engine fsdp "
            f"(torchrun's elastic c10d rendezvous), or a fixed node count (NNODES={nodes.nnodes})"
        )
    if args.max_restarts < 1:
        raise LaunchError(
            f"{what} (elastic) needs --max-restarts K >= 1: each lost node restarts the workers "
            "once (a node that joins costs none); e.g. --max-restarts 3"
        )


def detect_devices(
    args: argparse.Namespace,
    env: dict[str, str],
    exported: dict[str, str],
    lines: list[str],
    run: Runner = gpu_detect.run_tool,
) -> Devices:
    """The GPUs present (smi tools), those the visibility variables and --gpus leave; may pin ``env``."""
    if args.cpu:
        dev = Devices(cpu_reason="--cpu given")
        hide = gpu_detect.hide_all(args.vendor)
        env.update(hide)
        exported.update(hide)
    else:
        dev = _visible_devices(args, env, lines, run)
    if args.gpus is not None:
        _choose_gpus(args, dev, env, exported, lines)
    return dev


def _visible_devices(args: argparse.Namespace, env: Mapping[str, str], lines: list[str], run: Runner) -> Devices:
    """The GPUs the smi tools list and the visibility variables leave (``chosen``), or why the job runs on CPU."""
    label = VENDOR_LABEL[args.vendor]
    found = gpu_detect.probe(args.vendor, run, env)
    vis = gpu_detect.visible_gpus(args.vendor, found.gpus, env, found.migs)
    dev = Devices(present=found.gpus, chosen=vis.gpus, unresolved=vis.unresolved)
    if not dev.present:
        _refuse_other_vendor(args.vendor, found.problem, env, run)
        dev.cpu_reason = f"no {label} GPU ({found.problem})"
        return dev
    lines.append(
        f"{plural(len(dev.present), label + ' GPU')} present ({found.tool}): " + gpu_detect.summarize(dev.present)
    )
    lines += [f"{label} visibility: {n}" for n in vis.notes]
    if dev.unresolved:
        if args.count_from == "smi":
            raise LaunchError(f"{dev.unresolved}; use indices, or let torch count (--count-from auto)")
    elif not dev.chosen:
        hidden = ", ".join(f"{k}={v!r}" for k, v in vis.variables.items())
        dev.cpu_reason = f"{plural(len(dev.present), label + ' GPU')} present, but {hidden} hides all of them"
    return dev


def _refuse_other_vendor(vendor: str, problem: str, env: Mapping[str, str], run: Runner) -> None:
    """No GPU of ours: the other vendor's GPUs mean the wrong launcher, not a CPU run."""
    other = next(v for v in gpu_detect.VENDORS if v != vendor)
    theirs = gpu_detect.probe(other, run, env)
    if theirs.gpus:
        names = sorted({g.name for g in theirs.gpus if g.name}) or ["unnamed"]
        label = VENDOR_LABEL[vendor]
        raise LaunchError(
            f"this is the {label} launcher, but this machine has {len(theirs.gpus)} "
            f"{VENDOR_LABEL[other]} GPU(s) ({', '.join(names)}) and no {label} GPU ({problem}): "
            f"run `bash {SCRIPT_NAME[other]}` instead (or pass --cpu to train on the CPU)"
        )


def _choose_gpus(
    args: argparse.Namespace, dev: Devices, env: dict[str, str], exported: dict[str, str], lines: list[str]
) -> None:
    """--gpus: keep the named ones of the usable GPUs, and pin the job to them with the visibility variable."""
    if not dev.chosen:
        raise LaunchError(
            f"--gpus {args.gpus}: there is no usable {VENDOR_LABEL[args.vendor]} GPU to choose from "
            f"({dev.cpu_reason or dev.unresolved})"
        )
    picked = _parse_gpu_list(args.gpus, len(dev.chosen))
    dev.chosen = [dev.chosen[i] for i in picked]
    pin = _pin(args.vendor, dev.chosen, dev.present, env)
    env.update(pin)
    exported.update(pin)
    lines.append(f"--gpus {args.gpus}: " + ", ".join(f"{k}={v}" for k, v in pin.items()))


def apply_torch_count(
    args: argparse.Namespace,
    dev: Devices,
    env: Mapping[str, str],
    lines: list[str],
    warnings: list[str],
    probe_torch: TorchProbe = torch_probe,
    python: str = sys.executable,
) -> None:
    """torch has the last word on the count: it applies the visibility variables itself."""
    vendor = args.vendor
    label = VENDOR_LABEL[vendor]
    if not args.cpu and args.count_from != "smi":
        dev.torch_info = probe_torch(env)
        if dev.torch_info is None:
            if args.count_from == "torch" or dev.unresolved:
                raise LaunchError(
                    (dev.unresolved + ", and t" if dev.unresolved else "--count-from torch: t")
                    + f"orch is not importable by {python}"
                )
            lines.append("torch is not importable here: counted with the smi tools only")
    torch_info = dev.torch_info
    if torch_info is not None:
        build = NVIDIA if torch_info.get("cuda") else AMD if torch_info.get("hip") else None
        tcount = int(torch_info.get("count") or 0)
        expected = 0 if dev.cpu_reason else len(dev.chosen)
        unresolved = dev.unresolved
        problem = ""
        if build is None and (expected or unresolved):
            problem = (
                f"torch {torch_info['torch']} is a CPU-only build and cannot use the {label} GPU(s) "
                f"listed above: install a {'CUDA' if vendor == NVIDIA else 'ROCm'} build "
                "(bash scripts/setup.sh picks it), or pass --cpu to train on the CPU"
            )
        elif build is not None and build != vendor and (expected or unresolved or tcount):
            problem = (
                f"torch {torch_info['torch']} is built for {VENDOR_LABEL[build]}, but this is the {label} "
                f"launcher: install the matching torch (bash scripts/setup.sh), or run "
                f"`bash {SCRIPT_NAME[build]}`"
            )
        elif build == vendor and tcount == 0 and (expected or unresolved):
            problem = (
                f"torch {torch_info['torch']} sees no GPU under this environment although the smi "
                f"tools list usable {label} GPU(s) (driver too old for this torch?)"
            )
        elif build == vendor and (tcount != expected or unresolved):
            if not unresolved:
                warnings.append(
                    f"torch counts {tcount} GPU(s) where the smi tools and the visibility rules "
                    f"give {expected}: using torch's count"
                )
            dev.chosen = dev.chosen[:tcount] if len(dev.chosen) >= tcount else [Gpu(i) for i in range(tcount)]
            dev.cpu_reason = dev.unresolved = ""
        if problem:
            if not args.dry_run:
                raise LaunchError(problem)
            warnings.append(problem + " (a real run stops here)")
    if dev.unresolved:  # only reachable in a dry run whose torch could not count
        dev.cpu_reason = dev.unresolved


def processes_per_node(args: argparse.Namespace, dev: Devices, lines: list[str]) -> int:
    """Processes on this node (one per chosen GPU, or --nproc); trims ``dev.chosen`` to them."""
    label = VENDOR_LABEL[args.vendor]
    count = dev.count
    if count > 0:
        nproc = args.nproc if args.nproc is not None else count
        if args.gpus is not None and args.nproc is not None and args.nproc != count:
            raise LaunchError(f"--nproc {args.nproc} disagrees with --gpus {args.gpus} ({count} GPUs)")
        if nproc > count:
            raise LaunchError(f"--nproc {nproc}: only {count} {label} GPU(s) usable here (valid: 1..{count})")
        dev.chosen = dev.chosen[:nproc]
        lines.append(f"using {plural(nproc, label + ' GPU')}: " + gpu_detect.summarize(dev.chosen))
        return nproc
    dev.chosen = []
    return args.nproc or 1


def pin_one_process(
    args: argparse.Namespace,
    dev: Devices,
    visible: int,
    env: dict[str, str],
    exported: dict[str, str],
    lines: list[str],
) -> None:
    """One process where several GPUs are usable: show it only the first, so it computes on one GPU (the HF
    engine's plain process would otherwise take every GPU it sees through DataParallel)."""
    if dev.count != 1 or visible < 2 or args.gpus is not None:
        return
    if args.vendor == NVIDIA:
        target, source = "CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"
    else:  # HIP's list indexes what ROCR_VISIBLE_DEVICES leaves, as CUDA's does when HIP's is unset or empty
        # (HIP reads an empty HIP_VISIBLE_DEVICES as unset, as detect.visible_gpus does)
        hip_set = bool(env.get("HIP_VISIBLE_DEVICES", "").strip())
        target, source = (
            "HIP_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES" if hip_set else "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in env else "",
        )
    # the caller's list, where there is one, already names the GPUs the runtime numbers 0, 1, …: keep its first
    pin = (
        {target: env[source].split(",")[0].strip()}
        if source in env
        else _pin(args.vendor, dev.chosen, dev.present, env)
    )
    env.update(pin)
    exported.update(pin)
    lines.append(
        f"one process on {visible} usable GPUs: pinned to the first, " + ", ".join(f"{k}={v}" for k, v in pin.items())
    )


def export_environment(
    args: argparse.Namespace, dev: Devices, nproc: int, env: dict[str, str], exported: dict[str, str]
) -> dict[str, str]:
    """Apply the vendor presets (a value the caller set is kept) and --ifname; return the kept ones."""
    rocm = vendor_env.parse_rocm_version((dev.torch_info or {}).get("hip"))
    wanted = vendor_env.presets(
        args.vendor,
        use_gpus=dev.count > 0,
        nproc_per_node=nproc,
        gpu_names=[g.name for g in dev.chosen],
        rocm_version=rocm,
        restarts=args.max_restarts > 0,
    )
    try:
        preset_exported, kept = vendor_env.apply(env, wanted)
    except ValueError as e:  # a caller's value no process could read
        raise LaunchError(str(e)) from None
    exported.update(preset_exported)
    if args.ifname:
        iface = {"NCCL_SOCKET_IFNAME": args.ifname, "GLOO_SOCKET_IFNAME": args.ifname}
        env.update(iface)
        exported.update(iface)
    return kept


ORIGIN_PROBE = "import importlib.util as u; s = u.find_spec('anygpu'); print(s.origin if s else '')"


def anygpu_origin(python: str, env: Mapping[str, str]) -> Path | None:
    """The anygpu/__init__.py that ``python`` imports in this folder under ``env``, as each process of the job
    will (`python -m` puts the current folder first); None where it imports none."""
    try:
        p = subprocess.run([python, "-c", ORIGIN_PROBE], env=dict(env), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    origin = p.stdout.strip()
    return Path(origin).resolve() if p.returncode == 0 and origin else None


def job_entry(
    args: argparse.Namespace, env: Mapping[str, str], python: str, lines: list[str], warnings: list[str]
) -> list[str]:
    """What each process runs: the --script; else the engine's module (`-m anygpu.engines.run_<engine>`) where
    ``python`` imports this same anygpu (installed, or from this folder); else, in a source checkout, its
    run_<engine>_standalone.py, whose folder puts this anygpu first on the path (it need not be installed)."""
    if args.script:
        return [str(Path(args.script).resolve())]
    module = ["-m", ENGINES[args.engine]]
    origin = anygpu_origin(python, env)
    if origin == PACKAGE / "__init__.py":
        return module
    found = f"imports anygpu from {origin.parent}" if origin else "cannot import anygpu"
    script = ROOT / CHECKOUT_SCRIPTS[args.engine]
    if script.is_file():
        lines.append(f"{python} {found} here, not this launcher's {PACKAGE}: running the checkout's {script.name}")
        return [str(script)]
    warnings.append(
        f"{python} {found} here, not this launcher's {PACKAGE}: "
        + ("the job runs that one" if origin else "install anygpu there, or run from another folder")
    )
    return module


def build_command(
    args: argparse.Namespace,
    entry: Sequence[str],
    script_args: Sequence[str],
    dev: Devices,
    nproc: int,
    nodes: Nodes,
    env: dict[str, str],
    exported: dict[str, str],
    lines: list[str],
    python: str = sys.executable,
) -> list[str]:
    """The exact command: plain python, torchrun (fsdp) or accelerate launch (hf), then the job."""
    job = [*entry, *script_args]
    use_gpus = dev.count > 0
    cpu_line = f"{dev.cpu_reason}: training on the CPU, {plural(nproc, 'process')} with gloo"
    hf_config = args.engine == "hf" and args.accelerate_config
    if nodes.nnodes == 1 and nproc == 1 and args.max_restarts == 0 and not hf_config:
        lines.append(_plain_line(args.engine, use_gpus, cpu_line))
        return [python, *job]
    if args.engine == "fsdp":
        lines.append((cpu_line if not use_gpus else f"{plural(nproc, 'process')} per node") + ", torchrun")
        # torchrun, ending with its workers' 143 where a signal sent to it alone stopped them
        return [python, "-m", "anygpu.reliability.torchrun", *_torchrun_options(args, nproc, nodes), *job]
    options = _accelerate_options(args, use_gpus, nproc, nodes, env, exported, lines, cpu_line)
    return [python, "-m", "accelerate.commands.launch", *options, *job]


def _plain_line(engine: str, use_gpus: bool, cpu_line: str) -> str:
    if use_gpus:
        return "one process: plain python, no distributed launcher needed"
    return cpu_line + (
        " (plain python; accelerate's FSDP does not run on CPU)" if engine == "hf" else " (plain python)"
    )


def _torchrun_options(args: argparse.Namespace, nproc: int, nodes: Nodes) -> list[str]:
    """torchrun's options: the rendezvous, the processes, restarts, the signals it forwards."""
    options = [*_torchrun_rendezvous(nodes, rdzv_conf(args.rdzv_conf)), "--nproc-per-node", str(nproc)]
    if args.max_restarts:
        options += ["--max-restarts", str(args.max_restarts)]
    if torchrun_forwards_signals():
        # Slurm's --signal sends SIGUSR1 before preemption: forwarded, every rank saves and exits 143
        # (without it torchrun dies of the signal and its workers with it, no checkpoint).
        options += ["--signals-to-handle", TORCHRUN_SIGNALS]
    return options


def _torchrun_rendezvous(nodes: Nodes, conf: list[str]) -> list[str]:
    tuned = ["--rdzv-conf", ",".join(conf)] if conf else []
    if nodes.nnodes == 1 and nodes.master_port in (None, 0):
        return ["--standalone", "--nnodes", "1", *tuned]
    if nodes.nnodes == 1:
        port = nodes.master_port
        return [
            "--nnodes",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"localhost:{port}",
            "--rdzv-id",
            f"anygpu-{port}",
            *tuned,
        ]
    # c10d rendezvous; node 0 hosts the store (explicit, so an address that does not match
    # the host name, e.g. an IP on another interface, still works). Elastic: --nnodes MIN:MAX.
    return [
        "--nnodes",
        nodes.spec,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{nodes.master_addr}:{nodes.master_port}",
        "--rdzv-id",
        nodes.rdzv_id,
        "--rdzv-conf",
        ",".join([*([] if any(c.startswith("is_host=") for c in conf) else [_is_host(nodes)]), *conf]),
    ]


def _is_host(nodes: Nodes) -> str:
    return f"is_host={'true' if nodes.node_rank == 0 else 'false'}"


def _accelerate_options(
    args: argparse.Namespace,
    use_gpus: bool,
    nproc: int,
    nodes: Nodes,
    env: dict[str, str],
    exported: dict[str, str],
    lines: list[str],
    cpu_line: str,
) -> list[str]:
    """accelerate launch's options: the config, the processes, the rendezvous, the CPU switch, restarts."""
    if nodes.nnodes > 1 and args.max_restarts:
        raise LaunchError(
            "--max-restarts with --engine hf on several nodes: accelerate starts them with a "
            "static rendezvous, where a restart on one node cannot bring the others along; "
            "use --engine fsdp (torchrun's c10d rendezvous restarts every node), or resubmit "
            "the job (it resumes from the latest checkpoint)"
        )
    total = nproc * nodes.nnodes
    config = _accelerate_config(args, use_gpus, total, lines)
    options = ["--config_file", str(config), "--num_processes", str(total), "--num_machines", str(nodes.nnodes)]
    options += _accelerate_rendezvous(nodes)
    if not use_gpus and _config_kind(config) not in ("DEEPSPEED", "FSDP"):
        # accelerate's CPU switch would silently drop DeepSpeed (which runs on CPU by itself) and
        # hide FSDP from the engine's strategy check; DDP-like configs need it.
        if total == 1:
            options += ["--cpu"]
        else:  # --cpu would start one process; this way accelerate starts them all, on CPU
            env["ACCELERATE_USE_CPU"] = exported["ACCELERATE_USE_CPU"] = "true"
    if args.max_restarts:
        options += ["--max_restarts", str(args.max_restarts)]
    where = cpu_line if not use_gpus else f"{plural(total, 'process')} in all"
    lines.append(f"{where}, accelerate launch with {_shown(config)}")
    return options


def _accelerate_config(args: argparse.Namespace, use_gpus: bool, total: int, lines: list[str]) -> Path:
    """The config named, or fsdp for several GPUs and ddp otherwise; on CPU, a line on what a named one does."""
    requested = _resolve_config(args.accelerate_config) if args.accelerate_config else None
    if use_gpus:
        return requested or _resolve_config("fsdp" if total > 1 else "ddp")
    config = requested or _resolve_config("ddp")
    kind = _config_kind(config)
    if kind == "DEEPSPEED":
        lines.append(f"{config.name} on CPU: DeepSpeed's CPU accelerator over gloo (slow; for testing)")
    elif kind == "FSDP":
        lines.append(
            f"accelerate's FSDP does not run on CPU: the HF engine stops with {config.name} "
            "unless given --allow_strategy_fallback true (then DDP); or use --engine fsdp"
        )
    return config


def _accelerate_rendezvous(nodes: Nodes) -> list[str]:
    if nodes.nnodes == 1:
        return ["--main_process_port", str(nodes.master_port or 0)]  # 0: a free port
    # static: node ranks are NODE_RANK, and with the configs' same_network: true accelerate
    # hands torchrun MASTER_ADDR/PORT (its c10d would then look for the store on localhost).
    return [
        "--machine_rank",
        str(nodes.node_rank),
        "--main_process_ip",
        nodes.master_addr,
        "--main_process_port",
        str(nodes.master_port),
        "--rdzv_backend",
        "static",
    ]


def check_runnable(args: argparse.Namespace, plan: Plan, python: str = sys.executable) -> None:
    """The engines and the distributed launchers need torch (and accelerate); say so here
    rather than as an ImportError in every process."""
    needed = ["torch"] if (not args.script or plan.wrapped) else []
    needed += ["accelerate"] if "accelerate.commands.launch" in plan.cmd else []
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise LaunchError(
            f"{' and '.join(missing)} not importable by {python}: run `bash scripts/setup.sh` "
            "(it creates ./.venv, which the launchers use), or set PYTHON to an interpreter "
            "that has them"
        )


def make_plan(
    argv: Sequence[str],
    environ: Mapping[str, str],
    run: Runner = gpu_detect.run_tool,
    probe_torch: TorchProbe = torch_probe,
    python: str = sys.executable,
) -> Plan:
    """parse → validate → nodes → devices → torch's count → processes → environment → job → command."""
    args, script_args = parse_args(argv)
    env = dict(environ)
    exported: dict[str, str] = {}
    lines: list[str] = []
    warnings: list[str] = []
    validate_args(args)
    nodes = resolve_nodes(env, args.master_port, run)
    check_elastic(args, nodes)
    if nodes.elastic:  # the workers of a restart, or of a node that joins later, continue the run by themselves
        env[ELASTIC_VARIABLE] = exported[ELASTIC_VARIABLE] = nodes.spec
    dev = detect_devices(args, env, exported, lines, run)
    apply_torch_count(args, dev, env, lines, warnings, probe_torch, python)
    visible = dev.count
    nproc = processes_per_node(args, dev, lines)
    pin_one_process(args, dev, visible, env, exported, lines)
    kept = export_environment(args, dev, nproc, env, exported)
    entry = job_entry(args, env, python, lines, warnings)
    cmd = build_command(args, entry, script_args, dev, nproc, nodes, env, exported, lines, python)
    if nodes.nnodes > 1:
        lines.append(
            f"node {nodes.node_rank} of {nodes.spec} ({nodes.source}), rendezvous "
            f"{nodes.master_addr}:{nodes.master_port} id {nodes.rdzv_id}"
        )
    if nodes.elastic:
        lines.append(
            f"elastic: the job goes on with {nodes.min_nodes} to {nodes.nnodes} nodes; after a lost or a joining "
            "node the workers restart and resume the newest checkpoint on the new world size"
        )
    plan = Plan(
        args.vendor, args.engine, dev.count > 0, dev.chosen, nproc, nodes, cmd, env, exported, kept, lines, warnings
    )
    plan.job = [*entry, *script_args]
    if not args.dry_run:
        check_runnable(args, plan, python)
    return plan


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def render_dry_run(plan: Plan) -> str:
    """A shell-pasteable account: exported variables, kept ones, then the exact command."""
    out = [
        f"# anygpu dry run: {VENDOR_LABEL[plan.vendor]} launcher, engine {plan.engine}, "
        f"{plural(plan.nproc, 'process')} on node {plan.nodes.node_rank} of {plan.nodes.spec}"
    ]
    out += [f"# {line}" for line in plan.lines]
    out += [f"# warning: {w}" for w in plan.warnings]
    out += [f"export {k}={shlex.quote(v)}" for k, v in plan.exported.items()]
    out += [f"# kept (set by the caller): {k}={shlex.quote(v)}" for k, v in plan.kept.items()]
    out.append(shlex.join(plan.cmd))
    return "\n".join(out) + "\n"


def preflight(plan: Plan) -> int | None:
    """Run the engine's argument checks alone (ANYGPU_PREFLIGHT_ONLY=1; with the world size it will start, the
    model's config and the batch split too: seconds): its exit code
    when the job should not start (2: refused, with its one line; 0: it printed --help), else None."""
    env = {**plan.env, "ANYGPU_PREFLIGHT_ONLY": "1", "RANK": "0"}
    if not plan.nodes.elastic:  # the batch split the ranks will make, checked once here
        env["ANYGPU_PREFLIGHT_WORLD_SIZE"] = str(plan.nproc * plan.nodes.nnodes)
    rc = subprocess.run([plan.cmd[0], *plan.job], env=env).returncode
    script_args = plan.job[2:] if plan.job[0] == "-m" else plan.job[1:]
    if rc == 2 or (rc == 0 and any(w in ("-h", "--help") for w in script_args)):
        return rc
    return None  # any other failure: the real launch shows it in full


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan = make_plan(argv, os.environ)
    except LaunchError as e:
        print(f"{PREFIX} error: {e}", file=sys.stderr)
        return 2
    args, _ = parse_args(argv)
    if args.dry_run:
        sys.stdout.write(render_dry_run(plan))
        return 0
    for line in plan.lines:
        print(f"{PREFIX} {line}", file=sys.stderr)
    for w in plan.warnings:
        print(f"{PREFIX} warning: {w}", file=sys.stderr)
    if plan.exported:
        print(
            f"{PREFIX} exported: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.exported.items()),
            file=sys.stderr,
        )
    if not args.script and plan.wrapped:
        # torchrun / accelerate: a bad argument would come back once per rank plus the launcher's own wall of
        # ChildFailedError; the engine checks its arguments (no torch) in one process first: one line, exit 2.
        checked = preflight(plan)
        if checked is not None:
            return checked
    print(f"{PREFIX} exec: {shlex.join(plan.cmd)}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(plan.cmd[0], plan.cmd, plan.env)  # the job's exit code is ours from here on
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
