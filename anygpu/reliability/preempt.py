"""Preemption: SIGTERM (Slurm, Kubernetes, torchrun) or SIGUSR1 (Slurm's --signal) asks every rank to
finish its step, save a checkpoint together and exit with `errors.EXIT_PREEMPTED` (143).

- A signal again is the same request, not a harder one: Slurm's scancel and a container stop signal every process
  of the job, and each worker's launcher (torchrun, accelerate) forwards what it got, a moment or seconds later,
  up to the process's last instant (its handler is then SIG_IGN, which outlives the interpreter's own). SIGKILL
  stops at once: checkpoints are written under a temporary name and renamed when complete, so the previous one
  is never harmed.
- A dead peer: torchrun also sends SIGTERM to the survivors when a rank dies, and they are then stuck in
  a collective that will never complete. A watchdog exits them fast (75) — but only when the process has
  made no progress at all for ANYGPU_SIGTERM_GRACE_S seconds (default 20). Progress is a heartbeat bumped
  by every forward and every backward pass of a decoder layer and every step boundary; an optimizer step
  (local work: a CPU-offloaded step can take long, and it has no collective to hang in), a save or an
  export in progress holds the watchdog off, so a healthy job in a long step, an evaluation, a save or
  the export always reaches its checkpoint.
- `--save_on_preempt false` (or `--save_strategy no`): the first signal exits at once (75).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

from anygpu.errors import EXIT_NO_CHECKPOINT
from anygpu.reliability import run_guard
from anygpu.runtime import progress
from anygpu.runtime.blocks import decoder_layer_classes

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installed once per run; `requested` is the name of the first signal seen (None before)."""

    @classmethod
    def of(cls, train_args) -> Preemption:
        """As the run's arguments say: --save_strategy no saves nothing on a signal either."""
        if train_args.save_strategy == "no":
            return cls(False, "--save_strategy no")
        return cls(train_args.save_on_preempt)

    def __init__(self, save_on_preempt: bool = True, why_not: str = "--save_on_preempt false") -> None:
        self.save_on_preempt = save_on_preempt
        self.why_not = why_not  # said when a signal exits at once
        self.requested: str | None = None
        self.repeated = False  # said once that a signal came again
        self.grace_s = float(os.environ.get("ANYGPU_SIGTERM_GRACE_S", "20"))
        self.progress = progress.Progress()  # what the watchdog reads; saves and exports hold it off
        self._closed = threading.Event()
        self._hooks: list[Any] = []  # removed by close(): the optimizer step hooks are global
        self._previous = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}

    def close(self) -> None:
        """The run is over: put the previous handlers back and end the watchdog (a process that trains again,
        as the tests do, must not be ended by an old run's watchdog)."""
        self._closed.set()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if self.requested is not None:  # on its way out after a signal: its launcher's copy may still come
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def beat(self, *_: Any) -> None:
        self.progress.beat()

    def watch(self, model: Any) -> None:
        """Bump the heartbeat on every forward and backward of the model and of its decoder layers (hooks survive
        wrapping), and hold the watchdog off while any optimizer steps (global hooks: also an optimizer that a
        library builds later, as the Trainer does)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        modules = [model]
        with contextlib.suppress(Exception):  # a model that names no decoder layer still beats once per pass
            layer_types = decoder_layer_classes(model)
            modules += [m for m in model.modules() if isinstance(m, layer_types)]
        for module in modules:
            module.register_forward_pre_hook(self.beat)
            module.register_forward_hook(self._beat_in_backward)
        self._hooks += [
            register_optimizer_step_pre_hook(self.progress.hold),
            register_optimizer_step_post_hook(self.progress.release),
        ]

    def _beat_in_backward(self, module: Any, args: Any, output: Any) -> None:
        """A forward hook: beat again when the backward reaches this output (a layer's backward begins)."""
        tensor = _first_tensor(output)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(self.beat)  # returns None: the gradient passes unchanged

    def _handler(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.save_on_preempt:
            _say(f"{name}: {self.why_not}: exiting at once (exit {EXIT_NO_CHECKPOINT}); the last checkpoint is kept")
            _exit_now()
        if self.requested is not None:
            if not self.repeated:
                self.repeated = True
                _say(
                    f"{name} again: the same request (a launcher forwards what it got): still saving; SIGKILL stops at once"
                )
            return
        self.requested = name
        threading.Thread(target=self._watchdog, daemon=True, name="anygpu-preempt-watchdog").start()

    def _watchdog(self) -> None:
        seen = self.progress.beats
        while not self._closed.wait(self.grace_s):
            if self.progress.protected_depth or self.progress.beats != seen:
                seen = self.progress.beats
                continue
            # the interpreter ends the main thread before its exit handlers run: a rank leaving after an error
            # that waits there waits for a child process, not for a peer
            where = (
                "stuck in a collective (a peer rank is gone?)"
                if threading.main_thread().is_alive()
                else "stuck on its way out (its main thread has ended: a child process it waits for did not stop)"
            )
            _say(
                f"{self.requested}: no progress for {self.grace_s:.0f} s, {where}: exiting without a checkpoint "
                f"(exit {EXIT_NO_CHECKPOINT})"
            )
            _exit_now()


def _first_tensor(output: Any) -> Any:
    """The first tensor of a module's output (a tensor, a tuple, or a transformers ModelOutput), else None."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _exit_now() -> None:
    """Exit 75 at once: no exit handlers (they could wait on a collective that never ends), but the
    --output_dir lock is given back, so the resumed run does not find a stale lock."""
    run_guard.release_locks()
    os._exit(EXIT_NO_CHECKPOINT)


def _say(message: str) -> None:
    print(f"[rank {os.environ.get('RANK', '0')}] {message}", file=sys.stderr, flush=True)
