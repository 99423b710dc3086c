"""An anygpu tool (`verify`, `bench`) whose training runs are forks of this process, which has imported the engines.

    warm_tool.py TOOL [ARGS]      (as `python -m anygpu.tools.cli TOOL [ARGS]`)

verify and bench start each run with `subprocess.run(<the launcher's exact command>)`: plain python, torchrun
(`-m torch.distributed.run`) or `accelerate launch` (`-m accelerate.commands.launch`), each paying ~4 s of CPU per
process to import torch, transformers and the engines. Here that command runs in a fork of this process instead:
the same arguments and environment, its output to the same files, torchrun's own agent forking the ranks
(tests/scripts/warm_launch.py). The tool's command line, its plan, its comparisons and its report are the tool's own;
the runs are real processes talking gloo; only `exec` is skipped. Run by conftest.python in a pytest worker's zygote,
the tool itself starts without imports too. Any other command goes to the real `subprocess.run`.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from warm_launch import as_a_fresh_interpreter, exit_code, finish, launch, run_argv  # noqa: E402  (imports the engines)

_real_run = subprocess.run
LAUNCHERS = {
    ("-m", "torch.distributed.run"): ["torchrun"],
    ("-m", "accelerate.commands.launch"): ["accelerate", "launch"],
}


def _in_child(cmd: list[str], env: dict, out_fd: int, err_fd: int) -> None:
    """Become `cmd` (a python command line) without exec: its environment, output files and `__main__`."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.environ.clear()
    os.environ.update(env)
    launcher = LAUNCHERS.get(tuple(cmd[1:3]))
    if launcher:
        as_a_fresh_interpreter(cmd[2], [], module=True)
        code = exit_code(lambda: launch(launcher[0], [*launcher[1:], *cmd[3:]]))
    else:
        code = run_argv(cmd[1:])
    finish(code)


def forked_run(cmd, *args, **kwargs):
    """subprocess.run for a python command line as a fork of this process (stdout/stderr: files, STDOUT or
    capture_output); anything else, the real subprocess.run."""
    simple = isinstance(cmd, list) and cmd and cmd[0] == sys.executable and not args
    allowed = {"env", "stdout", "stderr", "capture_output", "text"}
    if not simple or set(kwargs) - allowed:
        return _real_run(cmd, *args, **kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        capture = kwargs.get("capture_output", False)
        out = open(Path(tmp) / "out", "w+b") if capture else kwargs.get("stdout")
        err = open(Path(tmp) / "err", "w+b") if capture else kwargs.get("stderr")
        out_fd = out.fileno() if out is not None else 1
        err_fd = out_fd if err is subprocess.STDOUT else (err.fileno() if err is not None else 2)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _in_child(list(cmd), dict(kwargs.get("env") or os.environ), out_fd, err_fd)
            finally:
                os._exit(70)  # finish() exits; reaching here means the set-up itself failed
        _, status = os.waitpid(pid, 0)
        stdout = stderr = None
        if capture:
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            if kwargs.get("text"):
                stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
            out.close()
            err.close()
    return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(status), stdout, stderr)


if __name__ == "__main__":
    from anygpu.tools import cli

    subprocess.run = forked_run  # the tools call subprocess.run(plan.cmd, ...)
    sys.exit(cli.main(sys.argv[1:]))
