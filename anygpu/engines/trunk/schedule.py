"""When a run logs, evaluates, saves and stops: one rule for both engines.

Steps are optimizer steps, 1-based wherever a user or a file sees them (docs/concepts.md): step s trains
on global batch s - 1 of the epoch order, `metrics.jsonl`'s step s is the record after s steps, and
`checkpoint-s/` holds the state after s steps (a resumed run trains step s + 1 next). Step 0 is before
training (the evaluation of `--eval_on_start`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Schedule:
    start_step: int  # the steps already done (0, or the resumed checkpoint's step)
    end_step: int  # the last step of this run: --stop_at_step, or the end of the schedule
    total_steps: int  # the schedule's length (the learning-rate schedule spans it)
    logging_steps: int
    eval_steps: int | None = None
    save_steps: int | None = None
    eval_on_start: bool = False
    export_final: bool = True
    saves: bool = True  # --save_strategy steps; no: no checkpoint at all

    @classmethod
    def of(cls, train_args, start_step: int, total_steps: int) -> Schedule:
        """The schedule of a run from its arguments (`TrainArguments`), resumed at `start_step`."""
        end_step = min(total_steps, train_args.stop_at_step or total_steps)
        return cls(
            start_step,
            end_step,
            total_steps,
            train_args.logging_steps,
            train_args.eval_steps,
            train_args.save_steps,
            train_args.eval_on_start,
            train_args.export_final,
            train_args.save_strategy != "no",
        )

    def steps(self) -> range:
        """The steps this run trains, 1-based."""
        return range(self.start_step + 1, self.end_step + 1)

    @property
    def trains(self) -> bool:
        return self.end_step > self.start_step

    @property
    def evaluates_first(self) -> bool:
        """--eval_on_start: an evaluation at step 0, before the first step (not on resume)."""
        return self.eval_on_start and self.start_step == 0

    def should_log(self, step: int) -> bool:
        """Every --logging_steps, and the run's last step."""
        return step % self.logging_steps == 0 or step == self.end_step

    def should_eval(self, step: int) -> bool:
        """Every --eval_steps, and once at the end of the schedule (not at a --stop_at_step before it)."""
        return bool(self.eval_steps and step % self.eval_steps == 0) or step == self.total_steps

    def should_save(self, step: int) -> bool:
        """Every --save_steps, and the run's last step (a stopped run resumes from it); never with --save_strategy no."""
        return self.saves and (bool(self.save_steps and step % self.save_steps == 0) or step == self.end_step)

    def is_last(self, step: int) -> bool:
        return step >= self.end_step

    @property
    def exports(self) -> bool:
        """The final model is written when the run reaches the end of the schedule (--export_final)."""
        return self.export_final and self.end_step == self.total_steps


@dataclass
class SaveClock:
    """--save_every_minutes: a checkpoint is due once `minutes` have passed since training started or the last
    checkpoint. Only rank 0's clock is read (`due(is_main)`); the engines agree on its answer in the collective
    their step boundary already holds (`distributed.any_ranks`), so every rank saves at the same step."""

    minutes: float = 0
    since: float = field(default_factory=lambda: time.monotonic())

    def due(self, is_main: bool) -> bool:
        return bool(self.minutes) and is_main and time.monotonic() - self.since >= self.minutes * 60

    def saved(self) -> None:
        """A checkpoint was written (by step, by time, or on preemption): the next one is `minutes` from now."""
        self.since = time.monotonic()
