"""torchrun or `accelerate launch` whose ranks are forks of a process that has already imported the engines.

    warm_launch.py torchrun [TORCHRUN OPTIONS] SCRIPT|-m MODULE [ARGS]
    warm_launch.py accelerate launch [ACCELERATE OPTIONS] SCRIPT|-m MODULE [ARGS]

A training process spends ~4 s of CPU importing torch, transformers and the engines before its first step,
and the suite starts ~100 ranks on 2 cores. Here the launcher imports them once; then torchrun's own agent
(torch.distributed.run: rendezvous, the ranks' environment, restarts, failure reports) starts each rank
the way its `--run-path --start-method fork` options do: a forked process that runs SCRIPT (or, given -m, MODULE)
as `__main__`.
The ranks are real processes talking gloo; only `exec` is skipped. Tests of the launchers themselves
(signals, restarts, exit codes, torchrun's failure report) use the real `torchrun`/`accelerate` commands.
Where a GPU is visible it execs the real launcher instead: a forked rank cannot use CUDA once its parent has
initialized it, and the launchers' own checks do (the GPU tests' every rank failed so on 2026-11-27).
"""

import atexit
import faulthandler
import os
import runpy
import signal
import sys
import traceback

import anygpu

faulthandler.enable(all_threads=True)  # its forked ranks inherit it: stacks on SIGABRT from a timed-out test
anygpu.set_offline_defaults()
anygpu.quiet_library_warnings()

import torch  # noqa: E402
import torch.distributed.run as distrib_run  # noqa: E402

import anygpu.engines.fsdp  # noqa: E402,F401  (the imports every rank would otherwise repeat)
import anygpu.engines.hf.engine  # noqa: E402,F401
import matplotlib  # noqa: E402  (loss.png at every run's end: 0.6 s of a tiny run's 2.1 s, imported here once)
import transformers.loss.loss_utils  # noqa: E402,F401  (what transformers imports lazily in every run: ~3 s of CPU,
from transformers import LlamaForCausalLM  # noqa: E402,F401  torch._dynamo, torchao and scipy among it; the
from transformers.models.llama import configuration_llama  # noqa: E402,F401  tiny preset is a Llama)
import torch.distributed.checkpoint  # noqa: E402,F401  (the checkpoints: 1 s, imported when the first is written)
import transformers.trainer  # noqa: E402,F401  (the HF engine's Trainer, and the peft it imports: 0.4 s)
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402

get_checkpoint_conversion_mapping("llama")  # transformers builds its table of every family at first use (0.5 s)

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402,F401

_config_from_args = distrib_run.config_from_args
REAL_LAUNCHERS = {"torchrun": "torch.distributed.run", "accelerate": "accelerate.commands.accelerate_cli"}


def as_a_fresh_interpreter(script: str, argv, module: bool = False) -> None:
    """What `python -u SCRIPT ARGV` (or `python -u -m MODULE ARGV`) sets up that a fork does not: default signal
    handlers (the agent's are inherited), argv, and the script's folder (for a module, the current one) first on
    sys.path."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [script, *argv]  # a module's: run_module puts its file here, as `python -m` does
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(script))


def run_argv(argv: list[str]) -> int:
    """`python ARGV` (SCRIPT ARGS or -m MODULE ARGS) in this process, as a fresh interpreter would run it; its exit
    code."""
    module = argv[0] == "-m"
    script, *args = argv[1:] if module else argv
    as_a_fresh_interpreter(script, args, module)
    return run_script(script, module)


def run_script(script: str, module: bool = False) -> int:
    """SCRIPT (or MODULE) as `__main__`; its exit code as the interpreter would make it."""
    if module:
        return exit_code(lambda: runpy.run_module(script, run_name="__main__", alter_sys=True))
    return exit_code(lambda: runpy.run_path(script, run_name="__main__"))


def exit_code(call) -> int:
    """Run call(); its exit code as the interpreter would make it (SystemExit's code, 1 for an exception)."""
    try:
        call()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def finish(code: int) -> None:
    """End as the interpreter does: exit handlers (a forked multiprocessing child skips them: it ends in
    os._exit), flushed output, the exit code."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank(script: str, *argv: str, module: bool = False) -> None:
    """One rank: SCRIPT (or MODULE) as `__main__`, ending as the interpreter would (exit handlers, exit code)."""
    as_a_fresh_interpreter(script, argv, module)
    code = run_script(script, module)
    if code:
        finish(code)  # the agent reads a failed rank from its exit code, as from an exec'd one
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def run_module_rank(module: str, *argv: str) -> None:
    """One rank of `-m MODULE`, which --run-path alone would take for a file name."""
    run_rank(module, *argv, module=True)


def _forking_config(args):
    module = bool(args.module)  # torchrun's -m, or accelerate's (it passes its own on to torchrun's arguments)
    args.run_path, args.start_method = True, "fork"
    config, _, cmd_args = _config_from_args(args)  # cmd_args: the script or module, then its arguments
    return config, run_module_rank if module else run_rank, cmd_args


def launch(command: str, rest: list[str]) -> None:
    """`torchrun REST` or `accelerate REST` (e.g. `launch ...`) in this process, its ranks forked from it."""
    if command in REAL_LAUNCHERS and torch.cuda.is_available():
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", REAL_LAUNCHERS[command], *rest])
    distrib_run.config_from_args = _forking_config  # torchrun's and accelerate's path alike
    if command == "torchrun":
        sys.argv = ["torchrun", *rest]
        distrib_run.main()
    elif command == "accelerate":
        from accelerate.commands.accelerate_cli import main

        sys.argv = ["accelerate", *rest]
        main()
    else:
        sys.exit(f"warm_launch.py: unknown launcher {command!r} (valid: torchrun, accelerate)")


if __name__ == "__main__":
    launch(sys.argv[1], sys.argv[2:])
