"""The fast paths change no result: one process trains unsharded with FSDP2's losses, checkpoints
cross between plain tensors (1 rank) and DTensors (2 ranks), resume stays exact with the step
DataLoader and with asynchronous saves, a run killed mid-save resumes from the previous checkpoint,
and SIGTERM at any moment of a background save loses neither that checkpoint nor the preemption one."""

import json
import re

import pytest
from conftest import TINY, assert_close, losses, python, torchrun

pytestmark = pytest.mark.slow
SCRIPT = "run_fsdp_standalone.py"
TEN = [*TINY, "--max_steps", "10", "--export_final", "false"]


def test_one_rank_unsharded_has_fsdp2_losses(tmp_path):
    # 4 micro-batches of 2 per step: accumulation without FSDP's gradient-sync switch
    proc = python(
        "tests/scripts/one_rank_paths.py",
        [*TINY, "--max_steps", "4", "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path)],
    )
    got = json.loads(proc.stdout.split("LOSSES ", 1)[1].splitlines()[0])
    assert len(got["plain"]) == 4 and got["plain"][-1] < got["plain"][0]
    for a, b in zip(got["plain"], got["fsdp"]):
        assert abs(a - b) <= 1e-6 * abs(b), got


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory) -> dict:
    """2 ranks with background saves at steps 3, 6, 9; 1 rank resumed from that async checkpoint-6
    (DTensors → plain tensors); 1 rank killed during checkpoint-6's background write, resumed on 2
    (plain tensors → DTensors). The 1-rank runs read their batches in a DataLoader worker where a core is spare."""
    base, resumed, crashed = (tmp_path_factory.mktemp(n) for n in ("async2", "from6", "crash"))
    saves = ["--save_steps", "3", "--save_total_limit", "10", "--async_save", "true"]
    torchrun(2, SCRIPT, [*TEN, *saves, "--output_dir", str(base)])
    # one rank: plain python (a one-rank group of its own), no torchrun agent process
    python(SCRIPT, [*TEN, "--output_dir", str(resumed), "--resume_from_checkpoint", str(base / "checkpoint-6")])
    crash = python("tests/scripts/crash_in_async_write.py", [*TEN, *saves, "--output_dir", str(crashed)], check=False)
    left = sorted(p.name for p in crashed.iterdir() if "checkpoint" in p.name)
    # counts the checksums each rank computes: the resume checkpoint is verified once, by rank 0
    after = torchrun(
        2,
        "tests/scripts/count_hashes.py",
        [*TEN, *saves, "--output_dir", str(crashed), "--resume_from_checkpoint", "latest"],
    )
    return {"base": base, "resumed": resumed, "crashed": crashed, "crash": crash, "left": left, "after": after}


def test_async_checkpoints_are_complete_and_resume_exactly(async_runs):
    base = async_runs["base"]
    assert [p.name for p in sorted(base.glob("checkpoint-*"))] == [
        "checkpoint-10",
        "checkpoint-3",
        "checkpoint-6",
        "checkpoint-9",
    ]
    assert all((base / f"checkpoint-{s}" / "trainer_state.json").exists() for s in (3, 6, 9, 10))
    assert not list(base.glob(".checkpoint-*"))
    resumed = losses(async_runs["resumed"])
    assert sorted(resumed) == list(range(7, 11))
    assert_close(losses(base), resumed, rel=1e-5, steps=range(7, 11))


def test_a_run_killed_mid_write_resumes_from_the_previous_checkpoint(async_runs):
    assert async_runs["crash"].returncode != 0 and "CRASH during the background write" in async_runs["crash"].stdout
    assert async_runs["left"] == [".checkpoint-6.tmp", "checkpoint-3"]  # the half-written one never counts
    out = async_runs["after"].stdout
    assert "checkpoint-3 at step 3 (was 1 ranks, now 2; mesh was 1 × 1, now 1 × 2)" in out
    files = len(json.loads((async_runs["crashed"] / "checkpoint-3" / "manifest.json").read_text())["files"])
    hashed = dict(re.findall(r"^HASHED rank (\d): checkpoint-3 (\d+)$", out, re.M))
    assert hashed == {"0": str(files), "1": "0"}, out[-2000:]
    got = losses(async_runs["crashed"])
    assert sorted(got) == list(range(1, 11))  # steps 4-6 of the killed run replaced, not repeated
    assert_close(losses(async_runs["base"]), got, rel=1e-5)


MOMENTS = ["write-start", "mid-shard", "metadata", "commit"]


def test_sigterm_at_any_moment_of_a_background_save_loses_nothing(tmp_path):
    """SIGTERM while checkpoint-4 is written in the background, at four moments of the write (one process,
    one run per moment), each followed by a stall longer than the 1 s grace: the run waits for the write,
    commits checkpoint-4, saves the preemption checkpoint and exits 143; then the first run resumes."""
    from anygpu.checkpoint import manifest, store

    args = [
        *TINY,
        "--max_steps",
        "8",
        "--save_steps",
        "2",
        "--save_total_limit",
        "10",
        "--async_save",
        "true",
        "--export_final",
        "false",
        "--output_dir",
        str(tmp_path),
    ]
    proc = python(
        "tests/scripts/sigterm_in_async_save.py",
        [",".join(MOMENTS), *args],
        check=False,
        extra_env={"ANYGPU_SIGTERM_GRACE_S": "1", "RESUME": "1"},
    )
    out = proc.stdout
    assert proc.returncode == 0 and "stuck in a collective" not in proc.stderr, (out[-2000:], proc.stderr[-3000:])
    segments = dict(zip(MOMENTS, out.split("RESULT ")))  # each run's lines end with its RESULT line
    for moment in MOMENTS:
        assert f"RESULT {moment} 143" in out, out[-3000:]
        said = re.findall(r"SIGTERM: saving checkpoint-(\d+) before exiting", segments[moment])
        assert len(said) == 1 and int(said[0]) > 4, segments[moment][-2000:]
        run = tmp_path / moment
        assert not list(run.glob(".checkpoint-*"))  # nothing half-written left
        saved = store.checkpoints(run)
        assert all(manifest.problem(c) is None for c in saved), [manifest.problem(c) for c in saved]
        # the write under way when SIGTERM came completed, and the preemption checkpoint followed it
        assert {2, 4, int(said[0])} <= {store.step_of(c) for c in saved}, saved
        if moment == MOMENTS[0]:  # that run resumed from its preemption checkpoint and finished
            assert f"resumed from {run / f'checkpoint-{said[0]}'} at step {said[0]}" in out, out[-2000:]
            assert sorted(losses(run)) == list(range(1, 9))
        else:
            assert max(store.step_of(c) for c in saved) == int(said[0])
