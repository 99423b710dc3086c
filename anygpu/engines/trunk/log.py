"""The run's log, one for both engines: per-step tokens and throughput, the train and eval records
(`metrics.jsonl`, the --report_to trackers, the console line) and the progress bar. Only rank 0 writes."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from anygpu.train import metrics

logger = logging.getLogger("anygpu")


class RunLog:
    def __init__(
        self,
        prep,
        train_args,
        schedule,
        world_size: int,
        device: torch.device,
        is_main: bool,
        flops: metrics.Flops,
        peak_flops: float | None,
        resumed: bool,
        tokens=None,
    ) -> None:
        """`world_size`: the data-parallel devices (processes, or GPUs under DataParallel); `resumed`: records
        past `schedule.start_step` in metrics.jsonl and the trackers are dropped (they are redone); `tokens`: what
        counts a step's tokens where the objective makes the rows (default: the data's `metrics.StepTokens`)."""
        self.prep, self.schedule, self.world_size, self.device = prep, schedule, world_size, device
        self.is_main, self.flops, self.peak = is_main, flops, peak_flops
        self.writer = metrics.MetricsWriter(
            train_args.output_dir, is_main, train_args.report_to, schedule.start_step if resumed else None
        )
        self.tokens = tokens or metrics.StepTokens(
            prep.datasets["train"], prep.order, prep.block_size, getattr(prep, "collator", None)
        )
        self.window = metrics.ThroughputWindow()
        self.disable_bar = train_args.disable_tqdm or not is_main
        self.bar: tqdm | None = None
        self.mark = time.perf_counter()  # the end of the last step or record: what follows until the next is a pause
        self.last: dict[str, Any] = {}

    def open_bar(self) -> None:
        self.bar = tqdm(
            total=self.schedule.end_step,
            initial=self.schedule.start_step,
            disable=self.disable_bar,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        self.window.reset()
        self.mark = time.perf_counter()  # the window starts here: nothing before it is a pause inside it

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def step_done(self, step: int, pause_follows: bool = False) -> None:
        """Step `step` (1-based) is done: its tokens join the throughput window; the bar moves. `pause_follows`:
        an evaluation or a save runs next, timed from here (`pause_since_mark`)."""
        if step == self.schedule.start_step + 1 and self.is_main:
            self._sync()  # once: the first step's time must count its finished work
            logger.info(
                "first step done %.1f s after the process started (%.1f s of CPU)", *metrics.since_process_start()
            )
        elif pause_follows:
            self._sync()  # the step's queued GPU work is training time, not part of the pause that follows
        self.window.add(*self.tokens.count(step - 1, self.prep.plan), self.tokens.squares(step - 1, self.prep.plan))
        if self.is_main and hasattr(self.prep.order, "epochs_begun"):  # a mixture: say when a source runs out
            for name, epoch in self.prep.order.epochs_begun(step):
                logger.info("source %s: every block drawn once; step %d begins its epoch %d", name, step, epoch)
        self.mark = time.perf_counter()
        if self.bar is not None:
            self.bar.update(1)

    def train(
        self, step: int, loss: float, learning_rate: float, grad_norm: float, extra: dict[str, float] | None = None
    ) -> None:
        """The train record of step `step`: its own global-batch loss (and the objective's metrics, `extra`),
        throughput since the last record."""
        self._sync()  # tokens/s must count finished work
        rec = {
            "step": step,
            "loss": loss,
            "learning_rate": learning_rate,
            "grad_norm": grad_norm,
            **(extra or {}),
            **self.window.record(self.tokens.padded),
        }
        tps = rec["tokens_per_second"]
        rec.update(
            {
                "tokens_per_second_per_device": tps / self.world_size,
                "world_size": self.world_size,
                "global_batch_size": self.prep.plan.global_batch_size,
                "epoch": step / self.prep.order.steps_per_epoch,
            }
        )
        if hasattr(self.prep.order, "drawn"):  # a mixture: the samples each source has given so far
            rec.update({f"samples/{name}": n for name, n in self.prep.order.drawn(step).items()})
        if self.peak:  # attention counted over each sample's own length (packed rows), not the whole block
            rec["mfu"] = self.window.flops_per_second(self.flops) / (self.peak * self.world_size)
        if (mem := metrics.max_memory_gb(self.device)) is not None:
            rec["max_memory_allocated_gb"] = mem
        self._write(rec)
        self.window.reset()
        self.mark = time.perf_counter()

    def eval(self, step: int, values: dict[str, float], perplexity: bool = True) -> None:
        """The eval record: `values` (`eval_loss`, a mixture's `eval_loss/<name>` per source, or --objective dpo's
        eval_ metrics), and the loss's perplexity (`perplexity`: the language-model objective's)."""
        more = {"perplexity": metrics.perplexity(values["eval_loss"])} if perplexity else {}
        self._write({"step": step, **values, **more})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside (an evaluation, a save) out of tokens/s."""
        self._sync()  # the GPU work queued before the pause is training: it finishes before the pause's clock starts
        with metrics.paused(self.window):
            yield

    def pause_since_mark(self) -> None:
        """What ran since the last step or record was not training (Trainer's evaluations and saves, which
        run between its hooks): leave it out of tokens/s."""
        now = time.perf_counter()
        self.window.pause(now - self.mark)
        self.mark = now

    def close(self, failed: bool = False) -> None:
        """The bar and the trackers (`failed`: an MLflow or W&B run ends as failed); a second call does nothing."""
        self.close_bar()
        self.writer.close(failed)

    def _write(self, rec: dict[str, Any]) -> None:
        self.writer.write(rec)
        if self.is_main:
            tqdm.write(metrics.format_line(rec, self.prep.total_steps))
        self.last = {**self.last, **rec}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
