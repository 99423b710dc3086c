"""--report_to: the trackers that get metrics.jsonl's scalars, for both engines.

`resolve` reads and checks the names (both engines call it before any GPU work); `Trackers` opens
them on the main rank and logs every record to each with its step, through each library's own
client. TensorBoard writes through torch's `SummaryWriter`, whose `purge_step` on resume hides the
events of the steps that are redone, so the curves never show two branches.

Not accelerate's tracking classes: their logging needs accelerate's `PartialState`, which the
FSDP2 engine does not create (it owns its process group).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from anygpu.errors import UsageError

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")
# tensorboard is a core requirement; the others are extras of pyproject.toml
INSTALL = {
    "tensorboard": "pip install tensorboard",
    "mlflow": "pip install 'anygpu[mlflow]'",
    "wandb": "pip install 'anygpu[wandb]'",
    "trackio": "pip install 'anygpu[trackio]'",
}
EVAL_KEYS = ("eval_loss", "perplexity")


def installed(name: str) -> bool:
    """Whether the tracker's library can be imported (mlflow-skinny provides `mlflow` too)."""
    return importlib.util.find_spec(name) is not None


def resolve(report_to: list[str] | str) -> list[str]:
    """The trackers --report_to names: words or comma-separated lists; 'all' (every installed one, as Trainer's); 'none'."""
    items = [report_to] if isinstance(report_to, str) else report_to
    words = [w.strip() for item in items for w in str(item).split(",") if w.strip()]
    valid = (*TRACKERS, "all", "none")
    for word in words:
        if word not in valid:
            raise UsageError(
                f"--report_to {word!r} is unknown: use {', '.join(valid)} "
                "(several comma-separated, e.g. --report_to tensorboard,mlflow)."
            )
    if "none" in words and len(set(words)) > 1:
        raise UsageError(
            f"--report_to {','.join(words)}: 'none' turns every tracker off; give it alone, or leave it out."
        )
    if "all" in words:
        return [name for name in TRACKERS if installed(name)]
    chosen = [name for name in TRACKERS if name in words]
    for name in chosen:
        if not installed(name):
            raise UsageError(f"--report_to {name} needs the {name} package: {INSTALL[name]} (or leave {name} out).")
    return chosen


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as tracker scalars: `train/<key>`, or `eval/<key>` for the evaluation's keys."""
    return {
        ("eval/" if key in EVAL_KEYS else "train/") + key: value
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def mlflow_uri(output_dir: str) -> str:
    """MLFLOW_TRACKING_URI when set, else a file store in <output_dir>/mlruns (no server needed)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(output_dir).resolve() / "mlruns").as_uri()
    if uri.startswith("file:") or "://" not in uri:
        # MLflow 3 refuses file stores (it prefers a database, which mlflow-skinny cannot open) unless told
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


class TensorBoard:
    """torch's SummaryWriter in <output_dir>/runs; on resume `purge_step` hides the events of the redone steps."""

    name = "tensorboard"

    def __init__(self, output_dir: str, run_name: str, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard drops, from the older event files, every event at or after purge_step
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(Path(output_dir) / "runs"), purge_step=purge)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crash keeps every logged step

    def finish(self, failed: bool) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run per launch; MLFLOW_EXPERIMENT_NAME and MLFLOW_RUN_ID are honoured as MLflow does."""

    name = "mlflow"

    def __init__(self, output_dir: str, run_name: str, resume_step: int | None) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(mlflow_uri(output_dir))
        if not (os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID")):
            mlflow.set_experiment("anygpu")
        self.run = mlflow.start_run(run_name=run_name)

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def finish(self, failed: bool) -> None:
        self.mlflow.end_run("FAILED" if failed else "FINISHED")


class WandB:
    """A W&B run in project WANDB_PROJECT (default anygpu); WANDB_MODE=offline works without a network."""

    name = "wandb"

    def __init__(self, output_dir: str, run_name: str, resume_step: int | None) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "anygpu"), name=run_name)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackio:
    """A Trackio run in project TRACKIO_PROJECT (default anygpu), stored locally unless TRACKIO_SPACE_ID is set."""

    name = "trackio"

    def __init__(self, output_dir: str, run_name: str, resume_step: int | None) -> None:
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "anygpu"), name=run_name)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, failed: bool) -> None:
        self.run.finish()


CLASSES = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB, "trackio": Trackio}


class Trackers:
    """The --report_to trackers of the main rank; `log` sends each record to every one with its step."""

    def __init__(self, names: list[str], output_dir: str, resume_step: int | None = None) -> None:
        self.trackers: list[Any] = []
        try:
            for name in names:
                self.trackers.append(CLASSES[name](output_dir, Path(output_dir).resolve().name, resume_step))
        except BaseException:
            self.close(failed=True)
            raise

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        for tracker in self.trackers:
            tracker.log(values, step=record["step"])

    def close(self, failed: bool = False) -> None:
        """Finish every tracker (MLflow and W&B runs are marked failed when `failed`); a second call does nothing."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.finish(failed)
            except Exception as e:  # one tracker's failure must not hide the run's own error or skip the others
                logger.warning("closing the %s tracker failed: %s", tracker.name, e)
