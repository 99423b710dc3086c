"""Shared test helpers: real multi-process runs on CPU (gloo), tiny model, small corpus."""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _keep_deepspeed_unimported() -> None:
    """Tests that save_pretrained in the worker (the Hub sources, DPO folders) would each worker import DeepSpeed
    (~3 s) through accelerate's unwrap; what a run imports it for, it still gets (lazy_deepspeed)."""
    from anygpu.runtime import lazy_deepspeed

    lazy_deepspeed.unwrap_without_importing_deepspeed()


_keep_deepspeed_unimported()

# The tiny preset on 1 MB of the standard-library corpus, fp32, 32 evaluation blocks: seconds per run.
TINY = [
    "--config_name",
    "tiny",
    "--max_corpus_mb",
    "1",
    "--block_size",
    "64",
    "--global_batch_size",
    "8",
    "--logging_steps",
    "1",
    "--eval_steps",
    "0",
    "--disable_tqdm",
    "true",
    "--report_to",
    "none",
    "--warmup_steps",
    "2",
    "--learning_rate",
    "3e-3",
    "--eval_on_start",
    "false",
    "--max_eval_samples",  # of the 256 held-out blocks: the final evaluation was a third of a run's compute
    "32",
]


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory) -> Path:
    """One data/tokenizer cache for the whole session, so only the first run tokenises."""
    cache = Path(os.environ.get("ANYGPU_TEST_CACHE") or tmp_path_factory.mktemp("anygpu-cache"))
    os.environ["ANYGPU_CACHE"] = str(cache)
    return cache


# Blank, not removed: a removed variable shows every GPU, and an empty HIP_VISIBLE_DEVICES is read as unset,
# so only all three empty keep a test that means CPU on the CPU of a CUDA or ROCm machine.
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}
_GPU_TEST: list[bool] = [False]  # the running test is marked gpu: its processes see the GPUs


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Before the test's fixtures (module-scoped ones start runs too): whether its processes may see the GPUs."""
    _GPU_TEST[0] = item.get_closest_marker("gpu") is not None


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if not _GPU_TEST[0]:
        e.update(HIDE_GPUS)
    # The suite starts ~200 interpreters: the first to import a module set-up did not byte-compile writes
    # its byte-code for the rest, also where the environment says not to.
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    return e


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def innermost_frames(text: str, frames: int = 8) -> str:
    """Each thread's innermost `frames` frames from faulthandler's dumps in `text` (most recent call first), where a
    hang waits: the tail of a long output keeps only the last process's outermost frames."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith(("Current thread 0x", "Thread 0x")):
            out += [line, *lines[i + 1 : i + 1 + frames], ""]
    return "\n".join(out)


def abort_with_stacks(pids: list[int]) -> None:
    """SIGABRT to each (those with faulthandler on print every thread's Python stack), then SIGKILL to what is left."""
    for signum in (signal.SIGABRT, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        time.sleep(2)


def outputs(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """What each process printed (stdout, stderr folded in), read from all of them at once: one left unread
    while another is waited on could fill its pipe and block, and with it a job they run together.

    Past `timeout`, the failure shows each one's output with the Python stack of every process under it
    (SIGABRT, for those started with PYTHONFAULTHANDLER=1), and all of them are killed."""
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        futures = [pool.submit(p.communicate, timeout=timeout) for p in procs]
        concurrent.futures.wait(futures, timeout=timeout + 5)
        if all(f.done() and f.exception() is None for f in futures):
            return [f.result()[0] for f in futures]
        abort_with_stacks([pid for p in procs for pid in descendants(p.pid)])
        for p in procs:
            p.kill()
    logs = [p.communicate()[0] for p in procs]
    pytest.fail(
        f"still running after {timeout:.0f} s:\n"
        + "\n\n".join(
            f"--- process {i} (exit {p.returncode})\n{log[-8000:]}\n--- where each thread waited\n{innermost_frames(log)}"
            for i, (p, log) in enumerate(zip(procs, logs))
        )
    )


def run(
    cmd: list[str], timeout: float = 300, check: bool = True, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    full_env = {**env(), **(extra_env or {})}
    if Zygote.can_fork(cmd) and Zygote.can_run(full_env):
        proc = Zygote.run(cmd[1:], full_env, timeout)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


class Zygote:
    """`python SCRIPT ARGS` as a fork of tests/scripts/zygote.py, which has imported the engines (~4.5 s of CPU
    saved per process): one per pytest worker, started at first use. Only for an environment that differs from
    the zygote's in variables read at run time; anything else gets a fresh interpreter."""

    proc: subprocess.Popen | None = None
    jobs: tempfile.TemporaryDirectory | None = None  # the jobs' output and exit-code files, removed at exit
    RUN_TIME_VARIABLES = (
        "ANYGPU_TEST_",
        "ANYGPU_LEAN_LOSS_CHUNK_TOKENS",
        "ANYGPU_SIGTERM_GRACE_S",
        "ANYGPU_OOM_AGREE_S",
        "RESUME",
        "MLFLOW_TRACKING_URI",
    )

    @staticmethod
    def can_fork(cmd: list[str]) -> bool:
        """`python SCRIPT.py ARGS`, or `python -m anygpu.engines.run_<engine> ARGS` (the engines' entry modules)."""
        module = cmd[1] == "-m" and cmd[2].startswith("anygpu.engines.run_")
        return cmd[0] == sys.executable and (cmd[1].endswith(".py") or module)

    @classmethod
    def can_run(cls, full_env: dict[str, str]) -> bool:
        base = env()
        differ = {k for k in base.keys() | full_env.keys() if base.get(k) != full_env.get(k)}
        return all(k.startswith(cls.RUN_TIME_VARIABLES) for k in differ)

    @classmethod
    def _request(cls, request: dict) -> int:
        """Send one request to this worker's zygote (started at first use); the child's pid."""
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen(
                [sys.executable, "tests/scripts/zygote.py"],
                cwd=ROOT,
                env=env(),
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        cls.proc.stdin.write(json.dumps({"cwd": str(ROOT), **request}) + "\n")
        cls.proc.stdin.flush()
        return json.loads(cls.proc.stdout.readline())["pid"]

    @classmethod
    def start(cls, argv: list[str], full_env: dict[str, str]) -> ZygoteJob:
        """`python ARGV` started beside the test, as `start_job`'s Popen would be (stderr folded into stdout)."""
        if cls.jobs is None:
            cls.jobs = tempfile.TemporaryDirectory(prefix="zygote-jobs-")
        folder = Path(tempfile.mkdtemp(dir=cls.jobs.name))
        out = folder / "output"
        out.touch()
        code = folder / "code"
        pid = cls._request(
            {"argv": argv, "env": full_env, "stdout": str(out), "stderr": str(out), "code_file": str(code)}
        )
        return ZygoteJob([sys.executable, *argv], pid, out, code)

    @classmethod
    def run(cls, argv: list[str], full_env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            out.touch()
            err.touch()
            pid = cls._request({"argv": argv, "env": full_env, "stdout": str(out), "stderr": str(err)})
            ready, _, _ = select.select([cls.proc.stdout], [], [], timeout)
            if not ready:
                abort_with_stacks([pid, *descendants(pid)])  # the zygote enabled faulthandler: every fork has it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                cls.proc.stdout.readline()
                pytest.fail(
                    f"{' '.join(argv)} still running after {timeout:.0f} s (every process's Python stack below, "
                    f"from SIGABRT):\n--- stdout\n{out.read_text()[-4000:]}\n--- stderr\n{err.read_text()[-12000:]}"
                    f"\n--- where each thread waited\n{innermost_frames(err.read_text())}"
                )
            code = json.loads(cls.proc.stdout.readline())["code"]
            return subprocess.CompletedProcess([sys.executable, *argv], code, out.read_text(), err.read_text())


class ZygoteJob:
    """A job forked by the zygote and running beside the test, with the part of Popen's interface the tests use
    (pid, poll, wait, communicate, send_signal, kill, returncode); its output (stdout and stderr, in order) is read
    from a file, its exit code from the file the zygote writes when it ends (-N: killed by signal N, as Popen)."""

    def __init__(self, args: list[str], pid: int, output: Path, code: Path) -> None:
        self.args, self.pid, self._output, self._code = args, pid, output, code
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._code.exists():
            self.returncode = int(self._code.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self._output.read_text(), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_job(cmd: list[str], full_env: dict[str, str]) -> subprocess.Popen | ZygoteJob:
    """`cmd` running beside the test in a process group of its own, stdout and stderr together: forked by the
    zygote where it can be (`Zygote.can_fork`, `can_run`: ~9 s of CPU less for a warm launcher), else a Popen."""
    if Zygote.can_fork(cmd) and Zygote.can_run(full_env):
        return Zygote.start(cmd[1:], full_env)
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


# torchrun / accelerate launch with ranks forked from a launcher that has imported the engines (~4 s of CPU
# saved per rank): for tests of what the ranks compute. Tests of the launchers themselves run the real commands.
WARM = [sys.executable, "tests/scripts/warm_launch.py"]


def torchrun_cmd(nproc: int, script: str, args: list[str]) -> list[str]:
    """`torchrun --standalone --nproc-per-node=N script args` with its ranks forked (tests/scripts/warm_launch.py):
    torchrun's own agent (signal forwarding, restarts, failure report), each rank sparing a fresh import."""
    return [*WARM, "torchrun", "--standalone", f"--nproc-per-node={nproc}", script, *args]


def torchrun(nproc: int, script: str, args: list[str], **kw) -> subprocess.CompletedProcess:
    """`torchrun_cmd`, run to its end."""
    return run(torchrun_cmd(nproc, script, args), **kw)


def accelerate_launch(config: str, nproc: int, script: str, args: list[str], **kw) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes N script args`, ranks
    forked (tests/scripts/warm_launch.py)."""
    return run(
        [
            *WARM,
            "accelerate",
            "launch",
            "--config_file",
            f"accelerate_configs/{config}.yaml",
            "--num_processes",
            str(nproc),
            script,
            *args,
        ],
        **kw,
    )


def python(script: str, args: list[str], **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, script, *args], **kw)


def fsdp_runs(nproc: int, runs: list[list[str]], **kw) -> list[str]:
    """Several FSDP2-engine runs in one launch (tests/scripts/fsdp_runs.py: plain python for one rank,
    torchrun for more): one process start-up for all of them. Returns each run's part of stdout."""
    args = [a for r in runs for a in (":::", *r)][1:]
    proc = (
        python("tests/scripts/fsdp_runs.py", args, **kw)
        if nproc == 1
        else torchrun(nproc, "tests/scripts/fsdp_runs.py", args, **kw)
    )
    parts = re.split(r"^=== run \d+ ===$", proc.stdout, flags=re.MULTILINE)[1:]
    assert len(parts) == len(runs), proc.stdout[-3000:]
    return parts


def hf_runs(nproc: int, runs: list[list[str]], config: str = "ddp", **kw) -> list[str]:
    """Several HF-engine runs in one `accelerate launch` (accelerate_configs/<config>.yaml) of tests/scripts/hf_runs.py."""
    args = [a for r in runs for a in (":::", *r)][1:]
    proc = accelerate_launch(config, nproc, "tests/scripts/hf_runs.py", args, **kw)
    parts = re.split(r"^=== run \d+ ===$", proc.stdout, flags=re.MULTILINE)[1:]
    assert len(parts) == len(runs), proc.stdout[-3000:]
    return parts


def shared_runs(tmp_path_factory, name: str, launch: Callable[[Path], dict[str, str]]) -> tuple[Path, dict[str, str]]:
    """`launch(root)` once per pytest session, read by every test file that needs it, also across pytest-xdist
    workers (a lock in the session's temporary folder): (root, each run's stdout by the name launch gave it).
    Start-up costs more than a tiny run: several test files read the runs of a few launches."""
    base = tmp_path_factory.getbasetemp()
    top = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: <session>/popen-gwN
    root, stdouts = top / f"shared-{name}", top / f"shared-{name}.json"
    with open(top / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stdouts.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a failed attempt left
            root.mkdir()
            stdouts.write_text(json.dumps(launch(root)))
    return root, json.loads(stdouts.read_text())


# The lean loss cut into 48-token chunks (a tiny micro-batch of 512 tokens: 11 of them, the last one short)
LEAN_CHUNKS = {"ANYGPU_LEAN_LOSS_CHUNK_TOKENS": "48"}


def prompt_completion_file(path: Path, count: int = 400, longest: int = 23) -> Path:
    """Prompt-completion rows of 1 to `longest` words a prompt (several to a packed row)."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(path, "w") as f:
        for i in range(count):
            prompt = " ".join(words[(i + j) % len(words)] for j in range(1 + i % longest)) + " =>"
            f.write(json.dumps({"prompt": prompt, "completion": f" {words[i % len(words)]} {i % 7}"}) + "\n")
    return path


def records(output_dir: Path) -> list[dict]:
    """Every record of metrics.jsonl."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> dict[int, float]:
    """step → training loss from metrics.jsonl."""
    out = {}
    for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def assert_close(a: dict[int, float], b: dict[int, float], rel: float, steps=None) -> None:
    steps = sorted(steps if steps is not None else a)
    assert steps and all(s in a and s in b for s in steps), f"missing steps: {steps} vs {sorted(a)} / {sorted(b)}"
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in steps)
    assert worst <= rel, "losses differ: " + ", ".join(f"{s}: {a[s]:.7f} vs {b[s]:.7f}" for s in steps)


# The files that take longest (`pytest --durations=0` on 2 cores, summed per file), longest first: handed out
# first, so no worker starts one of them near the end while the others idle.
LONGEST_FILES = (  # by their measured time on the 2-core machine, 3 workers, 2026-11-26 (--durations)
    "test_launch.py",
    "test_faults.py",
    "test_crash_exits.py",
    "test_grpo_vllm.py",  # measured alone on 2 cores (2026-11-28): 209 s, one worker
    "test_model_families.py",
    "test_wheel.py",
    "test_fsdp_engine.py",
    "test_fp8.py",
    "test_conformance_qwen3_moe.py",
    "test_conformance_llama.py",
    "test_conformance_qwen2.py",
    "test_sft.py",
    "test_hf_deepspeed.py",
    "test_dpo.py",
    "test_expert_parallel.py",
    "test_memory_scaling.py",
    "test_verify.py",
    "test_preempt.py",
    "test_cli.py",
    "test_interactive_launch.py",
    "test_demo.py",
    "test_doctor.py",
    "test_lean_loss.py",
    "test_fast_paths.py",
    "test_context_parallel.py",
    "test_gpu_lease.py",
    "test_mixture_runs.py",
)


def file_order(path: Path, slow_files: set[Path]) -> tuple[bool, int]:
    """The longest files first, then the other files that start training processes, the quick ones last."""
    longest = LONGEST_FILES.index(path.name) if path.name in LONGEST_FILES else len(LONGEST_FILES)
    return path not in slow_files, longest


def pytest_report_teststatus(report, config):
    """ANYGPU_INSTANT_FAILURES=1 (the GPU lease's part 3): a failure's report written when it happens, not at the
    session's end, which a lease's time limit cuts off (the lease of 2026-11-27 lost every failure's reason so)."""
    if os.environ.get("ANYGPU_INSTANT_FAILURES") == "1" and report.failed:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n--- {report.nodeid} failed in {report.when}:\n{report.longreprtext[-8000:]}")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): one worker per core for the quick tier (`-m "not slow"`, CPU-bound: a third
    worker on 2 cores made it 133 s instead of 119), half as many again for the whole suite, whose launcher and
    fault tests wait much of their time (a rendezvous, a grace period, a timeout they provoke): on 2 cores 3
    workers took 821 s where 2 took 930 (docs/tests.md). At most 8: each worker's tests start up to 4 processes."""
    cores = len(os.sched_getaffinity(0))
    quick = "not slow" in (config.getoption("markexpr", "") or "")
    return max(1, min(8, cores if quick else cores + cores // 2))


def pytest_collection_modifyitems(config, items) -> None:
    """Files in `file_order`: xdist hands out whole files (--dist loadfile, --no-loadscope-reorder) in this
    order, so the last minute of the run is quick files filling every worker rather than one long file
    keeping one worker busy while the others idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: file_order(item.path, slow_files))  # stable: test order kept within a file
