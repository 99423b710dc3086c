"""--report_to: both engines accept and refuse the same values, and the trackers get metrics.jsonl's scalars."""

import json
import shutil
import sys

import numpy as np
import pytest
from conftest import TINY, python, records

from anygpu.engines.fsdp import main as fsdp_main
from anygpu.engines.hf.engine import main as hf_main
from anygpu.train import trackers

SCRIPT = "run_fsdp_standalone.py"


def refusal(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    return err


@pytest.mark.parametrize("main", [fsdp_main, hf_main], ids=["fsdp", "hf"])
def test_an_unknown_tracker_is_refused_by_both_engines(main, capsys, tmp_path):
    err = refusal(main, [*TINY, "--report_to", "tensorboard,foo", "--output_dir", str(tmp_path)], capsys)
    assert "--report_to 'foo' is unknown" in err and "tensorboard, mlflow, wandb, trackio, all, none" in err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("main", [fsdp_main, hf_main], ids=["fsdp", "hf"])
def test_a_tracker_without_its_library_names_the_extra(main, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # find_spec answers None: as if not installed
    err = refusal(main, [*TINY, "--report_to", "mlflow", "--output_dir", str(tmp_path)], capsys)
    assert "--report_to mlflow needs the mlflow package: pip install 'anygpu[mlflow]'" in err


def test_resolve():
    assert trackers.resolve(["none"]) == [] and trackers.resolve([]) == []
    assert (
        trackers.resolve(["mlflow,tensorboard"])
        == trackers.resolve(["tensorboard", "mlflow"])
        == ["tensorboard", "mlflow"]
    )
    assert "tensorboard" in trackers.resolve("all")
    with pytest.raises(ValueError, match="'none' turns every tracker off"):
        trackers.resolve(["none,tensorboard"])
    assert trackers.scalars({"step": 3, "loss": 2.5, "world_size": 2, "eval_loss": 1.0}) == {
        "train/loss": 2.5,
        "train/world_size": 2,
        "eval/eval_loss": 1.0,
    }


# ---------------------------------------------------------------------- real runs
def per_step(recs: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in recs if key in r]


def tensorboard(out, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "runs"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def float32(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """TensorBoard keeps scalars as float32."""
    return [(s, float(np.float32(v))) for s, v in pairs]


def have_mlflow() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlflow") is not None


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """6 steps in plain python, eval every 3, a checkpoint every 2 (the newest 2 kept), to TensorBoard and an
    MLflow file store: stopped after step 5 with checkpoint-5 lost (as if killed before saving it), then
    resumed from checkpoint-4, so step 5 is logged twice. Without mlflow installed: TensorBoard only."""
    out, store = tmp_path_factory.mktemp("trackers"), tmp_path_factory.mktemp("mlflow")
    uri = store.resolve().as_uri()
    args = [
        *TINY,
        "--max_steps",
        "6",
        "--eval_steps",
        "3",
        "--save_steps",
        "2",
        "--save_total_limit",
        "2",
        "--report_to",
        "tensorboard,mlflow" if have_mlflow() else "tensorboard",
        "--output_dir",
        str(out),
        "--export_final",
        "false",
    ]
    python(SCRIPT, [*args, "--stop_at_step", "5"], extra_env={"MLFLOW_TRACKING_URI": uri})
    first = {
        "records": records(out),
        "tb_loss": tensorboard(out, "train/loss"),
        "tb_eval": tensorboard(out, "eval/eval_loss"),
        "checkpoints": sorted(p.name for p in out.glob("checkpoint-*")),
    }
    shutil.rmtree(out / "checkpoint-5")
    python(SCRIPT, [*args, "--resume_from_checkpoint", "latest"], extra_env={"MLFLOW_TRACKING_URI": uri})
    return {"out": out, "uri": uri, "first": first}


def mlflow_runs(uri: str, monkeypatch) -> list:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores only when told
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("anygpu")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    return [
        {
            key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in ("train/loss", "eval/eval_loss", "train/learning_rate", "train/tokens_per_second")
        }
        | {"status": run.info.status}
        for run in runs
    ]


@pytest.mark.slow
def test_tensorboard_and_mlflow_get_the_losses_of_metrics_jsonl(resumed, monkeypatch):
    pytest.importorskip("mlflow")
    first = resumed["first"]
    assert [s for s, _ in per_step(first["records"], "loss")] == [1, 2, 3, 4, 5]
    assert first["tb_loss"] == float32(per_step(first["records"], "loss"))
    assert first["tb_eval"] == float32(per_step(first["records"], "eval_loss")) and first["tb_eval"][0][0] == 3
    one, two = mlflow_runs(resumed["uri"], monkeypatch)  # one MLflow run per launch
    assert one["status"] == two["status"] == "FINISHED"
    for key in ("loss", "eval_loss", "learning_rate", "tokens_per_second"):
        tag = ("eval/" if key == "eval_loss" else "train/") + key
        assert one[tag] == per_step(first["records"], key)  # float64 there: exactly equal
        assert two[tag] == [(s, v) for s, v in per_step(records(resumed["out"]), key) if s > 4]


@pytest.mark.slow
def test_a_resumed_run_has_one_tensorboard_value_per_step(resumed):
    out, recs = resumed["out"], records(resumed["out"])
    assert [s for s, _ in per_step(recs, "loss")] == [1, 2, 3, 4, 5, 6]  # metrics.jsonl cut back to 4, then 5, 6
    assert tensorboard(out, "train/loss") == float32(per_step(recs, "loss"))  # step 5 of the first launch purged
    assert tensorboard(out, "eval/eval_loss") == float32(per_step(recs, "eval_loss"))
    assert [s for s, _ in tensorboard(out, "train/grad_norm")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_plain_python_and_checkpoint_limit(resumed):
    """The fixture's plain-python run: --save_total_limit 2 keeps the newest two across the resume, metrics.jsonl
    records carry the documented keys, and TensorBoard events and loss.png are written."""
    out = resumed["out"]
    assert resumed["first"]["checkpoints"] == ["checkpoint-4", "checkpoint-5"]  # checkpoint-2 rotated away
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-2])
    for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "world_size", "global_batch_size"):
        assert key in rec, rec
    assert list((out / "runs").glob("events.out.tfevents.*"))
    assert (out / "loss.png").stat().st_size > 1000
