"""Elastic jobs without training (quick tier): an elastic start continues what --output_dir holds, the lock of a
worker of an earlier round on another node is taken over (a live one on this host never is), the line each
membership change prints, and --save_every_minutes' clock. The real elastic runs are in test_elastic.py."""

from __future__ import annotations

import json
import os
import socket

import pytest
from test_checkpoint_safety import args, claim, fake_checkpoint, names

from anygpu.engines.trunk import schedule
from anygpu.errors import UsageError
from anygpu.reliability import elastic, run_guard


@pytest.fixture
def elastic_job(monkeypatch):
    """A worker of an elastic job's first round (restart count 0, as on a node that joins later)."""
    monkeypatch.setenv("ANYGPU_ELASTIC", "1:2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")


def test_an_elastic_start_resumes_the_newest_checkpoint_without_being_asked(tmp_path, elastic_job):
    """After a membership change torchrun restarts the workers with an unchanged restart count: without
    ANYGPU_ELASTIC a restarted rank 0 would refuse the job's own --output_dir as 'already holds a run'."""
    for step in (2, 4):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    assert claim(tmp_path).resume.name == "checkpoint-4"
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"] and (tmp_path / "metrics.jsonl").exists()


def test_an_elastic_start_with_no_checkpoint_starts_fresh(tmp_path, elastic_job, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # killed before its first checkpoint
    assert claim(tmp_path).resume is None and not (tmp_path / "metrics.jsonl").exists()
    monkeypatch.delenv("ANYGPU_ELASTIC")  # the same folder outside an elastic job: refused as before
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(UsageError, match="already holds a run"):
        claim(tmp_path)


def test_a_lock_of_an_earlier_round_on_another_node_is_taken_over(tmp_path, elastic_job, capsys):
    lock = tmp_path / run_guard.LOCK
    lock.write_text(json.dumps({"host": "lost-node", "pid": 4242, "job": "job-7"}))
    claim(tmp_path)
    assert "of process 4242 on lost-node, a worker of an earlier round of this torchrun job" in capsys.readouterr().err
    # another job's lock on another host, and a live holder on this host (even of this job), are never taken
    for holder in ({"host": "other", "pid": 1, "job": "job-8"}, {"host": socket.gethostname(), "pid": os.getppid()}):
        lock.write_text(json.dumps({**holder, "job": holder.get("job", "job-7")}))
        with pytest.raises(UsageError, match="is in use by another run"):
            run_guard.claim_output_dir(args(tmp_path), rank=0)
        run_guard.release_locks()


def test_each_membership_change_is_one_line(tmp_path, elastic_job, monkeypatch):
    out = str(tmp_path)
    assert elastic.event_line(out, ["a (agent 1)", "b (agent 2)"], 16, None) is None  # the job's first start
    line = elastic.event_line(out, ["a (agent 1)"], 8, 40)
    assert line == (
        "elastic: node b (agent 2) left; now 1 node, 8 ranks (was 2 nodes, 16 ranks); resuming from checkpoint-40"
    )
    line = elastic.event_line(out, ["a (agent 1)", "c (agent 3)"], 16, 46)
    assert line.startswith("elastic: node c (agent 3) joined; now 2 nodes, 16 ranks (was 1 node, 8 ranks)")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")  # another job in the same folder: nothing to compare
    assert elastic.event_line(out, ["a (agent 1)"], 8, 46) is None
    monkeypatch.delenv("ANYGPU_ELASTIC")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert not elastic.applies() and elastic.nodes() == []  # a job that cannot restart gathers nothing


def test_the_save_clock_is_rank_0s(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(schedule.time, "monotonic", lambda: now[0])
    clock = schedule.SaveClock(minutes=2)
    now[0] += 119
    assert not clock.due(is_main=True)
    now[0] += 1
    assert clock.due(is_main=True) and not clock.due(is_main=False)  # the others learn it in the boundary's collective
    clock.saved()
    assert not clock.due(is_main=True)
    assert not schedule.SaveClock(minutes=0).due(is_main=True)  # off
