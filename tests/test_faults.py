"""Fault injection on real runs of the FSDP2 engine (gloo on CPU): SIGTERM during an evaluation and at
a random step, SIGKILL during a checkpoint write, damaged checkpoints, a changed resume, two nodes that disagree. Every interrupted run must end with the
uninterrupted run's losses (1e-5). One reference run serves every comparison."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    ROOT,
    TINY,
    WARM,
    assert_close,
    descendants,
    env,
    losses,
    outputs,
    python,
    start_job,
    torchrun,
    torchrun_cmd,
)

pytestmark = pytest.mark.slow
SCRIPT = "run_fsdp_standalone.py"
# 15 steps, checkpoints every 5, evaluations every 4 (4, 8, 12 and the end).
RUN = [
    *TINY,
    "--max_steps",
    "15",
    "--save_steps",
    "5",
    "--eval_steps",
    "4",
    "--max_eval_samples",
    "32",
    "--export_final",
    "false",
]


def evals(output_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r}


def steps_logged(output_dir: Path) -> list[int]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(ln)["step"] for ln in path.read_text().splitlines() if '"loss"' in ln] if path.exists() else []


def start(cmd: list[str], **extra: str):
    """A job in its own process group (so a test can SIGKILL all of it), forked by the zygote where it can be."""
    return start_job(cmd, {**env(), **extra})


def wait_until(condition, timeout: float = 240, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run: one process, this one (the global batch makes losses independent of the ranks;
    the engine makes a one-rank group as under plain python), so no second start-up of torch is paid."""
    from anygpu.engines.fsdp import main

    out = tmp_path_factory.mktemp("reference")
    main([*RUN, "--output_dir", str(out)])
    assert sorted(losses(out)) == list(range(1, 16)) and sorted(evals(out)) == [4, 8, 12, 15]
    return out


def test_sigterm_during_an_evaluation_resumes_exactly(reference, tmp_path):
    """Rank 0 gets SIGTERM as the evaluation at step 4 starts (grace 1 s, far less than the evaluation): both ranks
    finish it, save checkpoint-4 and exit 143; auto resumes there (one process: the global batch) and finishes with
    the uninterrupted losses and evaluations. A worker killed under the launcher's --max-restarts, restarted and
    resumed by itself: tests/test_elastic.py (the engine) and tests/test_launch.py (the launcher's flag)."""
    args = [*RUN, "--output_dir", str(tmp_path), "--resume_from_checkpoint", "auto"]
    proc = start(torchrun_cmd(2, SCRIPT, args), ANYGPU_TEST_SIGTERM_AT="eval:4", ANYGPU_SIGTERM_GRACE_S="1")
    out, _ = proc.communicate(timeout=300)
    assert "SIGTERM: saving checkpoint-4 before exiting (exit 143)" in out, out[-3000:]
    assert "exitcode  : 143" in out and "stuck in a collective" not in out
    assert [c.name for c in tmp_path.glob("checkpoint-*")] == ["checkpoint-4"]
    assert evals(tmp_path) == pytest.approx({4: evals(reference)[4]}, rel=1e-5)  # the evaluation completed

    said = python(SCRIPT, args).stdout
    assert "resumed from" in said and "at step 4" in said, said[-3000:]
    assert sorted(losses(tmp_path)) == list(range(1, 16))
    assert_close(losses(reference), losses(tmp_path), rel=1e-5)
    assert evals(tmp_path) == pytest.approx(evals(reference), rel=1e-5)


@pytest.mark.parametrize("signalled", ["torchrun alone", "every process"])
def test_sigterm_ends_the_job_with_the_workers_143_and_their_checkpoint(tmp_path, signalled):
    """The launchers' torchrun (`anygpu.reliability.torchrun`), signalled alone as Kubernetes signals a container's
    first process: it forwards the signal, the workers save and exit 143, and so does it (torchrun itself ends with
    exit 1 and a SignalException traceback). Signalled with every process, as Slurm's scancel does: each worker gets
    the SIGTERM and, a moment later, the copy torchrun forwards, which is the same request, not a second one (before:
    exit 75 and no checkpoint at all). Either way, the checkpoint of the step the workers were in."""
    args = [*RUN, "--max_steps", "400", "--save_steps", "1000", "--output_dir", str(tmp_path)]
    launcher = [sys.executable, "-m", "anygpu.reliability.torchrun", "--standalone", "--nproc-per-node=2", SCRIPT]
    proc = subprocess.Popen([*launcher, *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: len(steps_logged(tmp_path)) >= 2, what="two logged steps")
        if signalled == "every process":  # the workers, then (as a busy node delivers it) torchrun, which forwards
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.3)
        os.kill(proc.pid, signal.SIGTERM)  # torchrun, not its process group
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    saved = [c.name for c in tmp_path.glob("checkpoint-*")]
    assert proc.returncode == 143 and "Traceback" not in out, out[-3000:]
    assert len(saved) == 1 and f"SIGTERM: saving {saved[0]} before exiting (exit 143)" in out, out[-3000:]
    assert "the workers exited [143]: exit 143" in out


def test_sigkill_during_a_checkpoint_write_then_sigterm_at_a_random_step(reference, tmp_path, tmp_path_factory, capsys):
    """SIGKILL while checkpoint-10 is being written: latest resumes checkpoint-5. Then SIGTERM at a random
    step: a checkpoint of that step. auto finishes the run: the losses are the uninterrupted ones.
    The SIGTERM checkpoint also loads with a changed --max_steps under --allow_changed_args (in a copy)."""
    args = [*RUN, "--output_dir", str(tmp_path)]
    proc = start(torchrun_cmd(2, SCRIPT, args), ANYGPU_TEST_SLOW_SAVE="10:120")
    wait_until(
        lambda: len(list(tmp_path.glob(".checkpoint-10.tmp/rng/*.pt"))) == 2 or proc.poll() is not None,
        what="the write of checkpoint-10",
    )
    for pid in [proc.pid, *descendants(proc.pid)]:  # the agent and its workers (in sessions of their own) at once
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert [c.name for c in tmp_path.glob("checkpoint-*")] == ["checkpoint-5"]

    resumed = [*args, "--resume_from_checkpoint", "latest"]
    before = (tmp_path / "args.json").stat().st_mtime_ns
    proc = start(torchrun_cmd(2, SCRIPT, resumed))
    # seeded, so a failure replays: ANYGPU_TEST_SEED picks another step (6-9) on purpose
    stop_after = random.Random(int(os.environ.get("ANYGPU_TEST_SEED", "0"))).randint(6, 9)
    # args.json is rewritten once the resume has cut metrics.jsonl back to step 5
    wait_until(lambda: (tmp_path / "args.json").stat().st_mtime_ns != before or proc.poll() is not None, what="resume")
    wait_until(lambda: len(steps_logged(tmp_path)) >= stop_after or proc.poll() is not None, what=f"step {stop_after}")
    proc.send_signal(signal.SIGTERM)  # torchrun alone (its forked ranks share its process group)
    out, _ = proc.communicate(timeout=300)
    assert "at step 5" in out, out[-3000:]
    saved = [c.name for c in tmp_path.glob("checkpoint-*")]
    step = max(int(n.split("-")[1]) for n in saved)
    assert f"SIGTERM: saving checkpoint-{step}" in out and step >= stop_after, (saved, stop_after, out[-2000:])
    # the SIGTERM (to torchrun alone: it forwards it to both ranks) adds one complete checkpoint, nothing half-written
    periodic = {int(n.split("-")[1]) for n in saved} - {step}  # --save_steps 5's, the newest two kept
    assert periodic and all(s % 5 == 0 and s < step for s in periodic), saved
    assert not list(tmp_path.glob(".checkpoint-*"))  # the SIGKILLed write's leftovers are gone too

    # it loads and goes on from exactly there, with a shorter --max_steps: another schedule (in a copy of the run)
    from anygpu.engines.fsdp import main

    changed = tmp_path_factory.mktemp("changed") / "run"
    shutil.copytree(tmp_path, changed)
    capsys.readouterr()
    main(
        [
            *args[:-2],
            "--output_dir",
            str(changed),
            "--max_steps",
            str(step + 2),
            "--resume_from_checkpoint",
            "latest",
            "--allow_changed_args",
            "true",
        ]
    )
    said = "".join(capsys.readouterr())
    assert f"at step {step}" in said and "resuming with changed training math: --max_steps" in said, said[-3000:]
    assert max(losses(changed)) == step + 2

    python(SCRIPT, [*args, "--resume_from_checkpoint", "auto"])
    assert sorted(losses(tmp_path)) == list(range(1, 16))
    assert_close(losses(reference), losses(tmp_path), rel=1e-5)


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_checkpoint_is_skipped_by_latest_and_refused_by_path(reference, tmp_path, damage, capsys):
    from anygpu.engines.fsdp import main

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shard = out / "checkpoint-15" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    shard.write_bytes(
        bytes(data[:-100]) if damage == "truncated" else bytes(data[:50]) + bytes([data[50] ^ 1]) + bytes(data[51:])
    )
    args = [*RUN, "--output_dir", str(out)]
    with pytest.raises(SystemExit) as e:
        main([*args, "--resume_from_checkpoint", str(out / "checkpoint-15")])
    assert e.value.code == 2 and f"{shard}" in capsys.readouterr().err
    if damage == "flipped":  # once is enough: latest trains steps 11-15 again from checkpoint-10
        main([*args, "--resume_from_checkpoint", "latest"])
        err = capsys.readouterr().err
        assert f"skipping checkpoint-15: {shard}" in err
        assert_close(losses(reference), losses(out), rel=1e-5)
        assert (out / "abandoned").exists() and manifest_ok(out / "checkpoint-15")


def manifest_ok(path: Path) -> bool:
    from anygpu.checkpoint import manifest

    return manifest.problem(path) is None


@pytest.mark.parametrize(
    "change,expected",
    [
        (["--block_size", "32"], "block size: 64 → 32 (from --block_size 64 → 32)"),
        (["--seed", "7"], "--seed: 42 → 7"),
        (["--max_train_samples", "500"], "training samples: "),
        (["--max_corpus_mb", "0.9"], "(from --max_corpus_mb 1.0 → 0.9)"),
        (["--vocab_size", "4000"], "tokenizer fingerprint"),
        (["--max_steps", "20"], "--max_steps: 15 → 20"),
        (["--learning_rate", "1e-3"], "--learning_rate: 0.003 → 0.001"),
        (["--truncation_mode", "drop"], "--truncation_mode: 'keep_start' → 'drop'"),
    ],
)
def test_a_resume_that_changes_the_training_math_is_refused(reference, tmp_path, change, expected, capsys):
    from anygpu.engines.fsdp import main

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "latest", *change])
    err = capsys.readouterr().err
    assert e.value.code == 2 and expected in err and "--allow_changed_args true" in err, err


def test_a_model_change_and_the_other_engines_checkpoint_get_a_message(reference, tmp_path, capsys):
    from anygpu.engines.fsdp import main

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    cfg = tmp_path / "wider.json"
    cfg.write_text(
        (ROOT / "anygpu" / "config" / "presets" / "tiny.json")
        .read_text()
        .replace('"intermediate_size": ', '"intermediate_size": 1')
    )
    with pytest.raises(SystemExit):
        main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "latest", "--config_name", str(cfg)])
    assert "model config intermediate_size" in capsys.readouterr().err
    (out / "checkpoint-15" / "anygpu_state.json").write_text("{}")  # what the HF engine's checkpoints hold
    m = json.loads((out / "checkpoint-15" / "manifest.json").read_text())
    m["engine"] = "hf"
    (out / "checkpoint-15" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit):
        main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-15")])
    assert "a checkpoint of run_hf_standalone.py" in capsys.readouterr().err


def test_two_nodes_with_different_arguments_stop_within_seconds(tmp_path):
    """Two torchrun agents (two 'nodes' of one process each) started with different --learning_rate."""
    port = str(_free_port())
    procs = []
    for node, lr in ((0, "1e-3"), (1, "2e-3")):
        cmd = [
            *WARM,
            "torchrun",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            SCRIPT,
            *TINY,
            "--max_steps",
            "50",
            "--learning_rate",
            lr,
            "--output_dir",
            str(tmp_path),
        ]
        procs.append(start(cmd))
    outs = outputs(procs, timeout=120)
    # outputs' 120 s bound (start-up on a loaded 2-core machine included) is what "within seconds" means here: the
    # alternative is the first collective waiting out --ddp_timeout's 30 minutes, or 50 steps trained
    assert all(p.returncode != 0 for p in procs)
    text = "\n".join(outs)
    assert "rank 1 on host" in text and "learning_rate = '0.002' there, '0.001' on rank 0" in text, text[-3000:]
    assert not steps_logged(tmp_path)  # no training step was taken


def _private_mounts_work() -> bool:
    """Whether this machine lets us give a process a mount namespace of its own (root, unshare)."""
    import shutil as sh

    if not sh.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def test_two_nodes_without_a_shared_output_dir_are_refused(tmp_path):
    """Node 1 sees another filesystem at --output_dir (a tmpfs in a mount namespace of its own), as a
    node without the shared mount would: the job stops at start-up, naming the rank that is blind."""
    if not _private_mounts_work():
        pytest.skip("needs unshare -m (root) to give one 'node' its own filesystem")
    port = str(_free_port())
    procs = []
    for node in (0, 1):
        cmd = [
            *WARM,
            "torchrun",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            SCRIPT,
            *TINY,
            "--max_steps",
            "50",
            "--output_dir",
            str(tmp_path),
        ]
        if node == 1:
            cmd = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs "{tmp_path}" && exec "$@"', "sh", *cmd]
        procs.append(start(cmd))
    outs = outputs(procs, timeout=120)
    assert all(p.returncode != 0 for p in procs)  # within outputs' 120 s, not --ddp_timeout's 30 minutes
    text = "\n".join(outs)
    assert f"--output_dir {tmp_path} is not shared: rank(s) 1" in text and "filesystem every node mounts" in text, text[
        -3000:
    ]
    assert not steps_logged(tmp_path)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hf_engine_sigterm_during_an_evaluation_resumes_exactly(tmp_path):
    """The HF Trainer engine: SIGTERM as the evaluation at step 4 starts (rank 0 only); both processes
    finish it, save checkpoint-4 and exit 143; auto resumes on one process with the uninterrupted losses."""
    hf = "run_hf_standalone.py"
    args = [*TINY, "--max_steps", "8", "--eval_steps", "4", "--max_eval_samples", "32", "--export_final", "false"]
    python(hf, [*args, "--output_dir", str(tmp_path / "ref")])
    out = tmp_path / "run"
    cmd = [
        *WARM,  # accelerate's own launch, ranks forked
        "accelerate",
        "launch",
        "--config_file",
        "accelerate_configs/ddp.yaml",
        "--num_processes",
        "2",
        hf,
        *args,
        "--output_dir",
        str(out),
    ]
    proc = start(cmd, ANYGPU_TEST_SIGTERM_AT="eval:4", ANYGPU_SIGTERM_GRACE_S="1")
    log, _ = proc.communicate(timeout=300)
    assert "SIGTERM: saved checkpoint-4, exiting (exit 143)" in log, log[-3000:]
    assert [c.name for c in out.glob("checkpoint-*")] == ["checkpoint-4"] and (
        out / "checkpoint-4" / "manifest.json"
    ).exists()
    python(hf, [*args, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert sorted(losses(out)) == list(range(1, 9))
    assert_close(losses(tmp_path / "ref"), losses(out), rel=1e-5)
    assert evals(out) == pytest.approx(evals(tmp_path / "ref"), rel=1e-5)


CONNECT = r"""
import sys, time, torch.distributed as dist
from anygpu.reliability import run_guard
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(20)  # a rank that never reaches the first collective
else:
    try:
        run_guard.check_connectivity(timeout_s=3)
    except RuntimeError as e:
        print("CHECK:", str(e).splitlines()[0], flush=True)
        raise SystemExit(3)  # torchrun then ends the sleeping rank at once
"""


def test_the_connectivity_check_names_the_backend_and_the_missing_rank(tmp_path):
    script = tmp_path / "connect.py"
    script.write_text(CONNECT)
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script)],
        cwd=ROOT,
        env={**env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("CHECK:")), proc.stdout + proc.stderr[-2000:])
    assert "connectivity check failed (backend gloo, 2 ranks, 3 s)" in line and "1" in line.split("):", 1)[1], line


def test_a_final_export_longer_than_the_collective_timeout_ends_the_run(tmp_path):
    """Rank 0 writes the final model for longer than --ddp_timeout (a 70B export outlasts the 30 min default);
    the other rank waits for it without that limit, and the run ends with its model written (exit 0)."""
    args = [*TINY, "--max_steps", "2", "--ddp_timeout", "8", "--export_final", "true", "--output_dir", str(tmp_path)]
    proc = torchrun(2, SCRIPT, args, check=False, extra_env={"ANYGPU_TEST_SLOW_EXPORT": "16"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert (tmp_path / "final" / "config.json").is_file() and "final model:" in proc.stdout


def test_a_signal_to_every_process_of_the_step_spares_the_loader_workers(tmp_path):
    """Slurm signals every process of a job step, DataLoader workers included (one per rank here, the default
    where a core is spare). With a preemption save longer than the grace period (1 s), the run still saves the
    step's checkpoint and exits 143: a worker neither runs the rank's handler and watchdog nor dies of it."""
    args = [*TINY, "--max_steps", "300", "--save_steps", "1000", "--output_dir", str(tmp_path)]
    proc = start([str(BIN / "python"), SCRIPT, *args], ANYGPU_SIGTERM_GRACE_S="1", ANYGPU_TEST_SLOW_SAVE="any:4")
    wait_until(lambda: len(steps_logged(tmp_path)) >= 2 or proc.poll() is not None, what="step 2")
    workers = descendants(proc.pid)
    assert proc.poll() is None and len(workers) == 1, (workers, "no loader worker: this test needs 2 cores")
    for pid in [proc.pid, *workers]:
        os.kill(pid, signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "DataLoader worker" not in out, out[-3000:]
    step = max(steps_logged(tmp_path))
    assert f"SIGUSR1: saving checkpoint-{step}" in out and (tmp_path / f"checkpoint-{step}").is_dir(), out[-3000:]
