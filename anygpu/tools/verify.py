"""`anygpu verify`: train a few steps of the user's own job at several world sizes and/or engines, and
certify that they agree.

    anygpu verify --world_sizes 1,2,4 --engines fsdp,hf --resume_at 2 -- --model_name_or_path gpt2 ...
    anygpu verify --world_sizes 1,4 --cp 2,4 -- ...    # also sequences split over 2 and 4 of the 4 ranks
    anygpu verify --world_sizes 1,2 --ep 2 -- --model_name_or_path MOE ...   # also the experts split over 2 ranks

Every run is started as the vendor launcher would start it (one process per GPU, or CPU processes with
gloo where there is no GPU or with --cpu), in its own folder <output_dir>/verify/<run>. The first run is
the reference; every other run's per-step loss and grad norm (metrics.jsonl) and final exported weights
are compared with it. The largest relative difference decides: exit 0 within the tolerance, 1 beyond it
(or when a run failed), 2 for bad input. The result goes to <output_dir>/verify/result.json.

The runs are deterministic (deterministic algorithms, cuBLAS's fixed workspace, TF32 off), so two runs differ only
by what the world size or engine changes: the split of the batch and the order of the sums. How far that moves a
result depends on the precision: the default tolerance is the job's precision's (TOLERANCE), --tolerance sets one.

A GRPO job (`--objective grpo`) is compared on its `reward` and `kl` curves too, and on its completions: each run's
<run>/completions.jsonl (verify has rank 0 write every completion of the global batch at each step, unless the job
sets --num_completions_to_print) must hold the same prompts, generation indices and completions in the same order.
Sampling is keyed by (seed, round, prompt, generation index), so they are identical on any world size; a difference
fails the verification, naming the first step and completion that differ. (A floating-point near-tie between two
tokens' perturbed scores can, rarely, flip a token: the logits of the same row differ by rounding in another batch
shape.) GRPO's loss and mean reward sit near 0 by construction (a group's advantages sum to 0), where a relative
difference measures only rounding: its loss, reward and kl differences are taken relative to max(|value|, 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from anygpu.errors import EXIT_USAGE, UsageError
from anygpu.launch import launcher
from anygpu.launch.suggest import ArgumentParser
from anygpu.tools.bench import vendor_here

PREFIX = "[verify]"
JOB_OWNED = ("resume_from_checkpoint", "stop_at_step")  # verify sets these itself

# The default tolerance per precision of the job: the largest relative difference that sums in another order reach
# after a few steps. fp32: ~1e-7 per sum, 1e-5 leaves room for depth and steps. bf16 keeps 8 significant bits
# (2^-8 = 3.9e-3 per rounding): the tiny preset on CPU, 1 vs 2 ranks and engine vs engine, moved a LoRA adapter's
# weights by up to 7e-3 and the grad norm by 2e-3 in 3 steps; 5e-2 leaves room for a GPU's kernels and a deeper
# model, and still catches a global batch that follows the world size (0.3 in the grad norm). fp16 keeps 11 bits.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
# What every compared run gets: the same kernels from run to run (anygpu.runtime.hardware.configure_determinism);
# cuBLAS's deterministic workspace must be in the environment before its first call.
DETERMINISTIC_ENV = {"ANYGPU_DETERMINISTIC": "1"}
CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # kept if the caller set one
SAMPLES_FILE = "completions.jsonl"  # anygpu.train.grpo_objective.SAMPLES_FILE (not imported: it imports torch)
# --objective grpo's curves: differences relative to max(|value|, this): its loss is a sum of advantages that
# cancel within each group and its mean reward may sit at 0, so a value near 0 is rounding, not a scale
GRPO_FLOOR = 1.0
GRPO_CURVES = ("reward", "kl")  # compared besides loss and grad norm (kl where the reference logged it: β > 0)


@dataclass
class Run:
    """One training run of the comparison, and what it logged."""

    name: str
    engine: str
    world_size: int
    output_dir: str
    resumed_from: str | None = None  # a checkpoint of another run (--resume_at)
    save_at: int | None = None  # keep a checkpoint of this step for a resumed run
    cp: int = 1  # the FSDP2 engine's --cp (context parallelism)
    ep: int = 1  # the FSDP2 engine's --ep (expert parallelism)
    seconds: float | None = None
    global_batch_size: int | None = None
    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)
    reward: dict[int, float] = field(default_factory=dict)  # --objective grpo
    kl: dict[int, float] = field(default_factory=dict)  # --objective grpo with --beta > 0
    max_rel_diff: dict[str, float] = field(default_factory=dict)  # against the reference: loss, grad_norm, weights
    completions: str | None = None  # --objective grpo: "same", or where they first differ from the reference's


@dataclass
class Worst:
    """The largest relative difference of the comparison, and where it is."""

    value: float = 0.0
    quantity: str = ""  # loss, grad_norm, weights (grpo: reward, kl)
    where: str = ""  # the step, or the tensor's name
    run: str = ""


class VerifyError(Exception):
    """A run failed or left nothing to compare: the message says which and where its log is."""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="anygpu verify",
        usage="anygpu verify [options] -- <job arguments>",
        description="Train a few steps of your job at each world size and/or engine (and, with --resume_at, "
        "stop on the first world size and resume on the last), compare per-step loss, grad norm and "
        "the final weights with the first run, print a table and one verdict line, and write "
        "<output_dir>/verify/result.json. Exit 0: every relative difference within --tolerance; "
        "1: beyond it (or a run failed); 2: bad input.",
        epilog="Everything after -- is your job's arguments, as you pass them to the engine (model, data, LoRA, "
        "batch, engine options; a YAML/JSON file first is read too). verify sets --output_dir "
        "<output_dir>/verify/<run>, --max_steps, --logging_steps 1, --report_to none, --export_final true, "
        "--eval_on_start false, --eval_steps 0, --disable_tqdm true and --tf32 false itself, and runs them with "
        "deterministic algorithms (ANYGPU_DETERMINISTIC=1, CUBLAS_WORKSPACE_CONFIG). See docs/verify.md.",
    )
    p.add_argument("--world_sizes", default="1,2", help="Comma-separated process counts to compare (default 1,2).")
    p.add_argument("--engines", default="fsdp", help="Comma-separated engines: fsdp, hf or fsdp,hf (default fsdp).")
    p.add_argument(
        "--cp",
        default="",
        help="Comma-separated context-parallel degrees C to compare too (FSDP2 engine): each is one more run at "
        "the largest world size C divides, with --cp C (its sequences split over C ranks), e.g. 2,4.",
    )
    p.add_argument(
        "--ep",
        default="",
        help="Comma-separated expert-parallel degrees E to compare too (FSDP2 engine, a mixture-of-experts model): "
        "each is one more run at the largest world size E divides, with --ep E (the experts split over E ranks), "
        "e.g. 2,4.",
    )
    p.add_argument(
        "--resume_at",
        type=int,
        metavar="K",
        help="Also resume each engine's first-world-size run from its checkpoint at step K on the last "
        "world size, and compare the steps after K.",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        help="Largest relative difference allowed (default by the job's precision: 1e-5 for fp32, 5e-2 for bf16, "
        "1e-2 for fp16; the runs are deterministic and TF32 is off).",
    )
    p.add_argument("--max_steps", type=int, default=3, help="Optimizer steps per run (default 3).")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="CPU processes (gloo) even where GPUs are present, e.g. for world sizes beyond the GPUs.",
    )
    p.add_argument(
        "--compare_only",
        action="store_true",
        help="Train nothing: compare the runs an earlier verify of this job left in "
        "<output_dir>/verify (e.g. with another --tolerance).",
    )
    return p


def parse_list(flag: str, text: str, convert, valid: str) -> list:
    """`1,2,4` → [1, 2, 4] in the given order, duplicates dropped; refuse anything else."""
    try:
        items = [convert(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        items = []
    if not items:
        raise UsageError(f"{flag} {text!r}: give {valid}")
    return list(dict.fromkeys(items))


def check_cps(opts: argparse.Namespace, sizes: list[int], engines: list[str]) -> list[int]:
    """The --cp degrees to compare (each must divide one of the world sizes; FSDP2 engine only)."""
    return check_degrees("--cp", opts.cp, "C", "context parallelism", opts.world_sizes, sizes, engines)


def check_eps(opts: argparse.Namespace, sizes: list[int], engines: list[str]) -> list[int]:
    """The --ep degrees to compare (each must divide one of the world sizes; FSDP2 engine only)."""
    return check_degrees("--ep", opts.ep, "E", "expert parallelism", opts.world_sizes, sizes, engines)


def check_degrees(
    flag: str, text: str, letter: str, what: str, world_sizes: str, sizes: list[int], engines: list[str]
) -> list[int]:
    """A list of parallel degrees (`flag`'s `text`) other than 1, each dividing one of the world sizes."""
    if not text.strip():
        return []
    degrees = [d for d in parse_list(flag, text, int, "degrees such as 2,4") if d != 1]
    if degrees and "fsdp" not in engines:
        raise UsageError(f"{flag} {text}: {what} is the FSDP2 engine's: add --engines fsdp")
    for d in degrees:
        if d < 1:
            raise UsageError(f"{flag} {text}: {d} must be at least 1 (a degree such as 2)")
        if not any(w % d == 0 for w in sizes):
            raise UsageError(
                f"{flag} {text}: {d} divides none of --world_sizes {world_sizes}: give a {letter} that divides "
                f"one of them, e.g. {max(sizes)}"
            )
    return degrees


def check_options(opts: argparse.Namespace) -> tuple[list[int], list[str]]:
    """World sizes and engines from the options; UsageError for anything out of range."""
    sizes = parse_list("--world_sizes", opts.world_sizes, int, "process counts such as 1,2,4")
    if min(sizes) < 1:
        raise UsageError(f"--world_sizes {opts.world_sizes!r}: every count must be at least 1, e.g. 1,2,4")
    engines = parse_list("--engines", opts.engines, str, "fsdp, hf or fsdp,hf")
    for engine in engines:
        if engine not in launcher.ENGINES:
            raise UsageError(f"--engines {opts.engines!r}: {engine!r} is not an engine (valid: fsdp, hf or fsdp,hf)")
    if opts.max_steps < 1:
        raise UsageError(f"--max_steps {opts.max_steps}: must be at least 1, e.g. 3")
    if opts.resume_at is not None and not 1 <= opts.resume_at < opts.max_steps:
        raise UsageError(
            f"--resume_at {opts.resume_at}: must be a step before the last (valid: 1..{opts.max_steps - 1}, "
            f"or a larger --max_steps)"
        )
    if opts.tolerance is not None and not opts.tolerance > 0:
        raise UsageError(f"--tolerance {opts.tolerance}: must be positive, e.g. 1e-5")
    if len(sizes) * len(engines) < 2 and opts.resume_at is None:
        raise UsageError(
            f"--world_sizes {opts.world_sizes} --engines {opts.engines}: one run has nothing to compare "
            "with; give two world sizes (e.g. 1,2), two engines (fsdp,hf) or --resume_at K"
        )
    return sizes, engines


@dataclass(frozen=True)
class JobFacts:
    """What verify needs of the job's own arguments."""

    output_dir: str
    precision: str  # fp32, bf16 or fp16
    grpo: bool = False  # --objective grpo: its reward, kl and completions are compared too
    extra: tuple[str, ...] = ()  # what every run gets besides `job_overrides` (grpo: every completion printed)


def check_job(job: list[str], engines: list[str], sizes: list[int], cps: list[int] = ()) -> JobFacts:
    """Parse the job's arguments as the engines will (refusing bad ones now, before any process starts); return
    its output folder, its precision and, for a GRPO job, the --num_completions_to_print that has its runs write
    every completion of a global batch (the largest of the world sizes'), unless the job sets it."""
    import anygpu

    anygpu.set_offline_defaults()
    from anygpu.config.args import parse_args
    from anygpu.config.batch import plan_batch, resolve_global_batch

    extra: tuple[type, ...] = ()
    if "hf" in engines:
        from anygpu.engines.hf.engine import HFEngineArguments

        extra = (HFEngineArguments,)
    if (
        "fsdp" in engines
        and "hf" in engines
        and any(a.lstrip("-").split("=")[0] == "allow_strategy_fallback" for a in job)
    ):
        raise UsageError(
            "job argument --allow_strategy_fallback is an HF-engine option the fsdp engine refuses: "
            "drop it, or verify --engines hf alone"
        )
    parsed = parse_args(job, extra=extra)
    train = parsed[2]
    check_engines(parsed[0], train, engines)
    check_model(parsed[0], parsed[1])
    for name in JOB_OWNED:
        if getattr(train, name) is not None:
            raise UsageError(
                f"job argument --{name} {getattr(train, name)}: verify starts every run fresh and "
                f"sets it itself; drop it (see --resume_at)"
            )
    block = parsed[1].block_size
    largest = 0  # the largest global batch of the world sizes (in completions under grpo)
    for w in sizes:  # the batch split every world size will ask for (refused here, not after a minute of runs)
        if train.global_batch_tokens is not None and block is None:
            break  # the block size comes from the model: the runs check it
        g = resolve_global_batch(
            train.global_batch_size,
            train.global_batch_tokens,
            block or 1,
            train.per_device_train_batch_size,
            train.gradient_accumulation_steps,
            w,
        )
        try:
            plan_batch(g, w, train.per_device_train_batch_size, train.gradient_accumulation_steps)
        except UsageError as e:
            raise UsageError(f"world size {w}: {e}") from None
        largest = max(largest, g)
    precision = "bf16" if train.bf16 else "fp16" if train.fp16 else "fp32"
    if not train.is_grpo:
        return JobFacts(train.output_dir, precision)
    extra = () if sets(job, "num_completions_to_print") else ("--num_completions_to_print", str(largest))
    return JobFacts(train.output_dir, precision, grpo=True, extra=extra)


def check_engines(model_args, train_args, engines: list[str]) -> None:
    """Refuse, before the first run, what one of the engines would refuse at its start (a run of the other engine
    would otherwise train for nothing first)."""
    from anygpu.engines.trunk import startup

    for engine in engines:
        try:
            startup.check_levers(model_args, train_args, engine)
        except UsageError as e:
            raise UsageError(f"engine {engine}: {e}") from None


def check_model(model_args, data_args) -> None:
    """The model's config and the block it takes (a preset's name, --block_size past its positions): refused here,
    not by every run after its start."""
    from anygpu.model import modeling

    modeling.resolve_block_size(data_args.block_size, modeling.resolve_config(model_args))


def sets(job: list[str], name: str) -> bool:
    """Whether the job's arguments (its command line, or the YAML/JSON file they start with) set --`name`."""
    from anygpu.config.args import _file_to_argv

    argv = job
    if job and not job[0].startswith("-") and job[0].endswith((".yaml", ".yml", ".json")):
        argv = _file_to_argv(job[0]) + job[1:]
    return any(word.split("=")[0] == f"--{name}" for word in argv)


def job_overrides(out: Path, max_steps: int) -> list[str]:
    """What verify sets in every run (after the job's own arguments: the last value wins)."""
    return [
        "--output_dir",
        str(out),
        "--max_steps",
        str(max_steps),
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--export_final",
        "true",
        "--eval_on_start",
        "false",
        "--eval_steps",
        "0",
        "--tf32",
        "false",  # fp32 matmuls in fp32: TF32's 10-bit products would be the noise, not the world size
    ]


def plan_runs(
    root: Path,
    sizes: list[int],
    engines: list[str],
    resume_at: int | None,
    cps: list[int] = (),
    eps: list[int] = (),
) -> list[Run]:
    """Every engine at every world size (the first is the reference), the FSDP2 engine with each --cp C and each
    --ep E at the largest world size it divides, then each engine's resumed run."""
    runs = [Run(f"{e}-w{w}", e, w, str(root / f"{e}-w{w}")) for e in engines for w in sizes]
    for kind, degrees in (("cp", cps), ("ep", eps)):
        for d in degrees:
            w = max((w for w in sizes if w % d == 0), default=None)
            if w is not None:
                name = f"fsdp-w{w}-{kind}{d}"
                runs.append(Run(name, "fsdp", w, str(root / name), **{kind: d}))
    if resume_at is not None:
        first, last = sizes[0], sizes[-1]
        for e in engines:
            source = next(r for r in runs if r.name == f"{e}-w{first}")
            source.save_at = resume_at
            name = f"{e}-w{first}to{last}-at{resume_at}"
            runs.append(Run(name, e, last, str(root / name), str(Path(source.output_dir) / f"checkpoint-{resume_at}")))
    return runs


def usable_sizes(sizes: list[int], cpu: bool, vendor: str, probe) -> tuple[list[int], str]:
    """The world sizes this machine can run (at most one process per GPU), and what it runs them on."""
    flags = ["--vendor", vendor, "--engine", "fsdp", "--dry-run", *(["--cpu"] if cpu else [])]
    try:
        plan = launcher.make_plan(flags, os.environ, probe_torch=probe)
    except launcher.LaunchError as e:
        raise UsageError(str(e)) from None
    if not plan.use_gpus:
        return sizes, "CPU processes (gloo)"
    label = launcher.VENDOR_LABEL[vendor]
    kept = [w for w in sizes if w <= plan.nproc]
    if dropped := [w for w in sizes if w > plan.nproc]:
        print(
            f"{PREFIX} world size {', '.join(map(str, dropped))} skipped: {launcher.plural(plan.nproc, label + ' GPU')} "
            "here (one process per GPU); pass --cpu to compare CPU processes instead",
            file=sys.stderr,
            flush=True,
        )
    if not kept:
        raise UsageError(
            f"--world_sizes {','.join(map(str, sizes))}: only {plan.nproc} {label} GPU(s) here: "
            f"give sizes up to {plan.nproc}, or --cpu"
        )
    return kept, f"{label} GPUs"


def launch(
    run: Run, job: list[str], max_steps: int, cpu: bool, vendor: str, probe, extra: tuple[str, ...] = ()
) -> None:
    """Train one run in its own fresh folder, as the launcher would; its output goes to <run>.log. `extra`: what
    verify adds for this job (`JobFacts.extra`)."""
    out = Path(run.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    args = [*job, *job_overrides(out, max_steps), *extra]
    if run.save_at:  # the checkpoint a resumed run starts from, kept whatever the job's --save_total_limit
        args += ["--save_steps", str(run.save_at), "--save_total_limit", str(max_steps)]
    if run.resumed_from:
        args += ["--resume_from_checkpoint", run.resumed_from]
    if run.cp > 1:
        args += ["--cp", str(run.cp)]
    if run.ep > 1:
        args += ["--ep", str(run.ep)]
    flags = [
        "--vendor",
        vendor,
        "--engine",
        run.engine,
        "--nproc",
        str(run.world_size),
        "--dry-run",
        *(["--cpu"] if cpu else []),
    ]
    try:
        plan = launcher.make_plan([*flags, "--", *args], os.environ, probe_torch=probe)
    except launcher.LaunchError as e:
        raise UsageError(f"{run.name}: {e}") from None
    log = out.parent / f"{run.name}.log"
    run_env = {**plan.env, **DETERMINISTIC_ENV}
    run_env.setdefault(*CUBLAS_WORKSPACE)
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(plan.cmd, env=run_env, stdout=f, stderr=subprocess.STDOUT)
    run.seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        message = f"{run.name} failed (exit {proc.returncode}): {tail[0]} (full log: {log})"
        raise (UsageError if proc.returncode == EXIT_USAGE else VerifyError)(message)


def read_metrics(run: Run) -> None:
    """Per-step loss and grad norm from the run's metrics.jsonl (the training entries, not the evaluations)."""
    path = Path(run.output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise VerifyError(f"{run.name}: no {path} (see {Path(run.output_dir).parent / run.name}.log)")
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            run.loss[rec["step"]] = rec["loss"]
            run.grad_norm[rec["step"]] = rec.get("grad_norm", math.nan)
            run.global_batch_size = rec.get("global_batch_size")
            for name in GRPO_CURVES:  # --objective grpo's (kl only with --beta > 0)
                if name in rec:
                    getattr(run, name)[rec["step"]] = rec[name]


def earlier_seconds(root: Path, runs: list[Run]) -> None:
    """--compare_only: each run's training time from the result.json that the earlier verify wrote."""
    try:
        earlier = {r["name"]: r.get("seconds") for r in json.loads((root / "result.json").read_text())["runs"]}
    except (OSError, ValueError, KeyError, TypeError):
        return
    for run in runs:
        run.seconds = earlier.get(run.name)


def rel_diff(ref: float, other: float, floor: float = 0.0) -> float:
    """|other − ref| / max(|ref|, floor) (inf when one is NaN, or the reference is 0 and there is no floor)."""
    if math.isnan(ref) or math.isnan(other):
        return math.inf
    diff = abs(other - ref)
    scale = max(abs(ref), floor)
    return 0.0 if diff == 0 else diff / scale if scale else math.inf


def final_weights(run: Run) -> dict[str, Any]:
    """The exported final tensors (model or adapter safetensors in <run>/final)."""
    from safetensors.torch import load_file

    files = sorted((Path(run.output_dir) / "final").glob("*.safetensors"))
    if not files:
        raise VerifyError(f"{run.name}: no final/*.safetensors in {run.output_dir} (the run did not export)")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def weights_diff(ref: dict[str, Any], other: dict[str, Any]) -> tuple[float, str]:
    """The largest ‖other − ref‖ / ‖ref‖ over the tensors (a norm per tensor: elementwise ratios blow up near 0)."""
    if set(ref) != set(other):
        missing = sorted(set(ref) ^ set(other))
        return math.inf, f"tensor names differ ({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''})"
    worst, where = 0.0, ""
    for name, a in ref.items():
        a, b = a.double(), other[name].double()
        if a.shape != b.shape:
            return math.inf, f"{name} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        d = (b - a).norm().item()
        r = 0.0 if d == 0 else d / a.norm().item() if a.norm().item() else math.inf
        if r > worst or not where:
            worst, where = r, name
    return worst, where


def compare(runs: list[Run], resume_at: int | None, grpo: bool = False) -> Worst:
    """Every run against the first: steps both logged, then the final weights; the worst difference overall. A GRPO
    job's runs: also the reward and kl curves (relative to max(|value|, GRPO_FLOOR), the loss too) and the
    completions (`Run.completions`: judged apart, by `completions_verdict`)."""
    ref = runs[0]
    ref_weights = final_weights(ref)
    ref_samples = read_completions(ref) if grpo else []
    worst = Worst()
    for run in runs[1:]:
        expected = [s for s in ref.loss if s > resume_at] if run.resumed_from else list(ref.loss)
        curves = [("loss", ref.loss, run.loss), ("grad_norm", ref.grad_norm, run.grad_norm)]
        if grpo:
            curves += [(name, getattr(ref, name), getattr(run, name)) for name in GRPO_CURVES if getattr(ref, name)]
        for quantity, ref_values, values in curves:
            if missing := [s for s in expected if s not in values]:
                raise VerifyError(
                    f"{run.name}: no {quantity} logged for step(s) {missing} (see {run.output_dir}/metrics.jsonl)"
                )
            floor = GRPO_FLOOR if grpo and quantity != "grad_norm" else 0.0
            diffs = {s: curve_diff(quantity, ref_values[s], values[s], floor) for s in expected}
            step = max(diffs, key=diffs.get)
            run.max_rel_diff[quantity] = diffs[step]
            if diffs[step] > worst.value or not worst.run:
                worst = Worst(diffs[step], quantity, f"step {step}", run.name)
        value, tensor = weights_diff(ref_weights, final_weights(run))
        run.max_rel_diff["weights"] = value
        if value > worst.value:
            worst = Worst(value, "weights", tensor, run.name)
        if grpo and ref_samples:
            run.completions = completions_diff(ref_samples, read_completions(run), expected) or "same"
    return worst


def curve_diff(quantity: str, ref: float, other: float, floor: float = 0.0) -> float:
    """A step's relative difference (`rel_diff`); a GRPO mean reward that both runs logged as NaN (no completion
    had one: every reward function gave None) is no difference."""
    if quantity == "reward" and math.isnan(ref) and math.isnan(other):
        return 0.0
    return rel_diff(ref, other, floor)


def read_completions(run: Run) -> list[dict[str, Any]]:
    """A GRPO run's <run>/completions.jsonl (rank 0's record of the global batch's first completions at each logging
    step); [] where there is none (--num_completions_to_print 0)."""
    path = Path(run.output_dir) / SAMPLES_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completions_diff(ref: list[dict[str, Any]], other: list[dict[str, Any]], steps: list[int]) -> str | None:
    """Where `other`'s completions first differ from `ref`'s at `steps` (the same number at each step, each with
    the same prompt, generation index and completion, in the same order), or None where they do not. Rewards and
    advantages are not compared here: the reward curve is, within the tolerance."""
    for step in steps:
        a = [r for r in ref if r["step"] == step]
        b = [r for r in other if r["step"] == step]
        if len(a) != len(b):
            return f"step {step}: {len(b)} completions written, the reference {len(a)}"
        for i, (x, y) in enumerate(zip(a, b)):
            for key in ("prompt", "generation", "completion"):
                if x.get(key) != y.get(key):
                    return (
                        f"step {step}, completion {i} (generation {x.get('generation')} of prompt "
                        f"{excerpt(x.get('prompt'))}): {key} {excerpt(y.get(key))}, the reference {excerpt(x.get(key))}"
                    )
    return None


def excerpt(value: Any, limit: int = 48) -> str:
    """A prompt or completion (text, or messages) in one short line."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


def completions_verdict(runs: list[Run]) -> str | None:
    """A GRPO job's runs whose completions differ from the reference's: one line that fails the verification, or
    None where every run's are the same (or none were compared)."""
    differ = [r for r in runs[1:] if r.completions not in (None, "same")]
    if not differ:
        return None
    first = differ[0]
    more = f" (and {len(differ) - 1} other run{'s' * (len(differ) > 2)})" if len(differ) > 1 else ""
    return (
        f"verdict: FAIL: the completions of {first.name} differ from {runs[0].name}'s{more}: {first.completions}. "
        "Sampling is keyed by (seed, round, prompt, generation index), so they should be identical on any world "
        "size; rarely, a floating-point near-tie between two tokens' perturbed scores flips one (docs/grpo.md)"
    )


def hints(runs: list[Run]) -> list[str]:
    """Why runs that should agree could not: a global batch that follows the world size."""
    batches = {r.name: r.global_batch_size for r in runs}
    if len(set(batches.values())) > 1:
        shown = ", ".join(f"{g} ({n})" for n, g in batches.items())
        return [
            f"the global batch differs between runs: {shown}; it follows the world size when only "
            "--per_device_train_batch_size is given: pass --global_batch_size to fix it"
        ]
    return []


def grpo_rounding_hint(runs: list[Run], tolerance: float) -> list[str]:
    """A GRPO job whose runs agree on their first common step and on every completion, and differ after it: rounding
    that Adam's first steps amplify (a group's gradients cancel down to rounding errors), not the math."""
    if any(r.completions != "same" for r in runs[1:]):
        return []
    first = []
    for r in runs[1:]:
        steps = sorted(set(r.grad_norm) & set(runs[0].grad_norm))
        if not steps:
            return []
        first.append(rel_diff(runs[0].grad_norm[steps[0]], r.grad_norm[steps[0]]))
    if max(first) > tolerance:
        return []
    return [
        f"every run's first step agrees (grad norm within {fmt(max(first))}) and its completions are the same: what "
        "differs after it is rounding, which a GRPO step amplifies (a group's gradients cancel down to rounding errors "
        "whose sign follows the order of the sums, and Adam's first steps move each weight by about the learning rate "
        "whatever its gradient's size); see docs/grpo.md#verify"
    ]


def weights_only_hint(runs: list[Run], worst: Worst, tolerance: float) -> list[str]:
    """Runs whose loss and grad norm agree on every step, differing in one weight alone: most likely a weight whose
    gradient is rounding alone (an attention key bias: softmax ignores a shift of a query's scores), which Adam moves
    by about the learning rate a step in the direction the rounding's sign gives."""
    curves = [r.max_rel_diff.get(q, 0.0) for r in runs[1:] for q in ("loss", "grad_norm")]
    if worst.quantity != "weights" or not curves or max(curves) > tolerance / 10:
        return []
    return [
        f"the loss and grad norm agree on every step (within {fmt(max(curves))}); only the weights differ, most in "
        f"{worst.where}. A weight whose true gradient is 0 (an attention key bias: softmax ignores it) has a "
        "gradient of rounding alone, whose sign follows the order of the sums, and Adam moves it by about the learning "
        "rate a step: if that is such a weight, the runs agree; see docs/verify.md#tolerance"
    ]


def fmt(x: float | None) -> str:
    return "—" if x is None else "inf" if math.isinf(x) else f"{x:.2e}"


def table(runs: list[Run]) -> str:
    """Per-step loss of every run, then each run's largest relative difference from the reference."""
    width = max(12, *(len(r.name) for r in runs)) + 2
    steps = sorted({s for r in runs for s in r.loss})
    lines = [f"{'step':>5}" + "".join(f"{r.name:>{width}}" for r in runs) + "   (loss)"]
    for s in steps:
        lines.append(f"{s:>5}" + "".join(f"{r.loss[s]:>{width}.7f}" if s in r.loss else f"{'':>{width}}" for r in runs))
    lines.append("")
    # a GRPO job's runs: its reward and kl curves, and whether its completions are the reference's
    quantities = ["loss", "grad_norm", "weights"] + [q for q in GRPO_CURVES if any(q in r.max_rel_diff for r in runs)]
    grpo = any(r.completions is not None for r in runs)
    heads = {"grad_norm": "grad norm"}
    lines.append(
        f"{'run':<{width}}{'world':>6}{'engine':>7}{'seconds':>9}"
        + "".join(f"{heads.get(q, q):>11}" for q in quantities)
        + f"{'completions':>13}" * grpo
        + "   (largest relative difference from the first run)"
    )
    for i, r in enumerate(runs):
        d = r.max_rel_diff
        secs = f"{r.seconds:.1f}" if r.seconds is not None else "—"
        cells = ["reference"] + [""] * (len(quantities) - 1) if i == 0 else [fmt(d.get(q)) for q in quantities]
        same = "" if i == 0 else "same" if r.completions == "same" else "DIFFER" if r.completions else "—"
        lines.append(
            f"{r.name:<{width}}{r.world_size:>6}{r.engine:>7}{secs:>9}"
            + "".join(f"{c:>11}" for c in cells)
            + f"{same:>13}" * grpo
        )
    return "\n".join(ln.rstrip() for ln in lines) + "\n"


def verdict(worst: Worst, tolerance: float, source: str) -> str:
    """One line: PASS or FAIL, the largest difference and where, the tolerance and where it came from."""
    what = "grad norm" if worst.quantity == "grad_norm" else worst.quantity
    place = f"{what}, {worst.where}, {worst.run}"
    judged = f"the tolerance {tolerance:g} ({source}; deterministic algorithms, TF32 off)"
    if worst.value <= tolerance:
        return f"verdict: PASS: largest relative difference {fmt(worst.value)} ({place}) is within {judged}"
    return f"verdict: FAIL: largest relative difference {fmt(worst.value)} ({place}) exceeds {judged}"


def finite(value: Any) -> Any:
    """Strict JSON: an infinite or NaN difference (a NaN loss, a zero reference) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def write_result(
    root: Path,
    opts: argparse.Namespace,
    job: list[str],
    runs: list[Run],
    worst: Worst | None,
    passed: bool,
    precision: str,
    error: str = "",
) -> Path:
    """<output_dir>/verify/result.json, written whole under a temporary name, then renamed."""
    result = {
        "passed": passed,
        "tolerance": tolerance_of(opts, precision)[0],
        "tolerance_from": tolerance_of(opts, precision)[1],
        "precision": precision,
        "deterministic": True,  # deterministic algorithms, CUBLAS_WORKSPACE_CONFIG, --tf32 false
        "max_steps": opts.max_steps,
        "resume_at": opts.resume_at,
        "job_args": job,
        "reference": runs[0].name if runs else None,
        "largest_relative_difference": asdict(worst) if worst else None,
        "error": error or None,
        "runs": [asdict(r) for r in runs],
    }
    path = root / "result.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(result), indent=2, allow_nan=False))
    os.replace(tmp, path)
    return path


def tolerance_of(opts: argparse.Namespace, precision: str) -> tuple[float, str]:
    """The tolerance of the verdict and where it comes from: --tolerance, else the job's precision's default."""
    if opts.tolerance is not None:
        return opts.tolerance, "--tolerance"
    return TOLERANCE[precision], f"the {precision} default"


def refuse(message: str) -> None:
    hint = "the job's own arguments go after --" if message.startswith("unknown option") else "see anygpu verify --help"
    raise UsageError(f"{message} ({hint})")


@dataclass
class Job:
    """One verify, checked: its options, the job's own arguments, the runs and where they run."""

    opts: argparse.Namespace
    job: list[str]
    root: Path
    runs: list
    where: str
    vendor: str
    probe: object
    precision: str  # the job's: fp32, bf16 or fp16
    grpo: bool = False  # --objective grpo: reward, kl and completions compared too
    extra: tuple[str, ...] = ()  # what verify adds to every run of this job (`JobFacts.extra`)


def parse(argv: list[str]) -> Job:
    """The options and the job, refused (UsageError) before anything runs."""
    mine, job = launcher.split_argv(argv)
    parser = build_parser()
    parser.error = refuse  # one line and exit 2, as for every other bad input
    opts = parser.parse_args(mine)
    sizes, engines = check_options(opts)
    cps = check_cps(opts, sizes, engines)
    eps = check_eps(opts, sizes, engines)
    facts = check_job(job, engines, sizes, cps)
    root = Path(facts.output_dir) / "verify"
    vendor = vendor_here()
    probe = launcher.once(launcher.torch_probe)
    where = ""
    if not opts.compare_only:
        sizes, where = usable_sizes(sizes, opts.cpu, vendor, probe)
    runs = plan_runs(root, sizes, engines, opts.resume_at, cps, eps)
    if len(runs) < 2:
        raise UsageError(
            f"--world_sizes {opts.world_sizes}: only world size {sizes[0]} can run here, which leaves "
            "nothing to compare; pass --cpu to compare CPU processes, or add --engines fsdp,hf"
        )
    if opts.compare_only and (
        missing := [r.name for r in runs if not (Path(r.output_dir) / "metrics.jsonl").is_file()]
    ):
        raise UsageError(
            f"--compare_only: no earlier run {', '.join(missing)} in {root}: run verify without "
            "--compare_only first (with the same --world_sizes, --engines and --resume_at)"
        )
    return Job(opts, job, root, runs, where, vendor, probe, facts.precision, facts.grpo, facts.extra)


def run_all(v: Job) -> None:
    """Train every run of the comparison, one after another, saying which and how long."""
    runs = v.runs
    print(
        f"{PREFIX} {len(runs)} runs of {v.opts.max_steps} steps on {v.where}, in {v.root}", file=sys.stderr, flush=True
    )
    for i, run in enumerate(runs, 1):
        processes = launcher.plural(run.world_size, "process")
        resumed = f", resumed from {run.resumed_from}" if run.resumed_from else ""
        print(
            f"{PREFIX} {i}/{len(runs)} {run.name}: {run.engine} engine, {processes}{resumed} …",
            file=sys.stderr,
            flush=True,
        )
        launch(run, v.job, v.opts.max_steps, v.opts.cpu, v.vendor, v.probe, v.extra)
        print(f"{PREFIX} {i}/{len(runs)} {run.name}: done in {run.seconds:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        v = parse(list(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"anygpu verify: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    opts, runs = v.opts, v.runs
    v.root.mkdir(parents=True, exist_ok=True)
    worst = None
    try:
        if opts.compare_only:
            earlier_seconds(v.root, runs)
        else:
            run_all(v)
        for run in runs:
            read_metrics(run)
        worst = compare(runs, opts.resume_at, v.grpo)
    except (UsageError, VerifyError) as e:
        write_result(v.root, opts, v.job, runs, worst, False, v.precision, str(e))
        print(f"anygpu verify: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UsageError) else 1
    tolerance, source = tolerance_of(opts, v.precision)
    differ = completions_verdict(runs)
    passed = worst.value <= tolerance and differ is None
    sys.stdout.write(table(runs))
    explained = hints(runs) + grpo_rounding_hint(runs, tolerance) * v.grpo + weights_only_hint(runs, worst, tolerance)
    for line in explained if not passed else []:
        print(f"hint: {line}")
    if v.grpo and all(r.completions is None for r in runs[1:]):
        print("note: the completions were not compared: the job writes none (--num_completions_to_print 0)")
    same = "; every run's completions are the reference's" if any(r.completions == "same" for r in runs) else ""
    print(differ or verdict(worst, tolerance, source) + same)
    print(f"result: {write_result(v.root, opts, v.job, runs, worst, passed, v.precision)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
