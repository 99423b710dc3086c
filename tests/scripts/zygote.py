"""A process that has imported the engines and forks one child per request to run a script (or `-m MODULE`) as
`__main__`
(the tests' one-rank runs and warm launchers: conftest.python / torchrun / accelerate_launch).

A one-rank tiny run spends ~4.5 s of its ~6.5 s of CPU importing torch, transformers and the engines; this
process pays that once per pytest worker. Each child is a fresh process as far as the run can tell: the
request's environment, folder, argv, stdout/stderr files, default signal handlers, its own process group,
the interpreter's exit (exit handlers, exit code). conftest only sends requests whose environment differs from
this process's in variables read at run time, not at import time; others start a real interpreter.

Protocol: one JSON request per line on stdin ({"argv", "env", "cwd", "stdout", "stderr"}); the answers are
`{"pid": N}` when the child starts and `{"code": C}` when it ends, on the stdout this process started with. A request
with a "code_file" is a job the test runs beside others (a Popen's): the answer is `{"pid": N}` alone, and the exit
code (as Popen's returncode: -N for a signal) is written to that file when the child ends (SIGCHLD).
"""

import faulthandler
import json
import os
import signal
import sys

faulthandler.enable(all_threads=True)  # a fork stuck past its test's timeout prints its stacks on SIGABRT (conftest)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from warm_launch import finish, run_argv  # noqa: E402  (imports the engines)


DETACHED: dict[int, str] = {}  # a running job's pid → the file its exit code goes to


def reap_detached(*_) -> None:
    """Write the exit code of every job that has ended (SIGCHLD's handler; the synchronous child is waited for in
    `serve`, and never here)."""
    for pid in list(DETACHED):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by this handler run inside the loop (a signal between two lines)
            continue
        path = DETACHED.pop(pid, None) if done else None
        if path is not None:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)


def child(request: dict) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the run's own subprocesses are its to wait for
    os.setpgrp()  # a timeout kills the child with whatever it started
    folded = request["stderr"] == request["stdout"]  # one file, in order (Popen's stderr=STDOUT)
    for fd, path, mode in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY),
        (2, None if folded else request["stderr"], os.O_WRONLY),
    ):
        os.dup2(os.open(path, mode) if path else 1, fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    finish(run_argv(request["argv"]))  # ["-m", MODULE, ARGS...]: `python -m MODULE ARGS`


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a child's stray output never lands in the answers
    signal.signal(signal.SIGCHLD, reap_detached)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                child(request)
            finally:
                os._exit(70)  # finish() exits; reaching here means the set-up itself failed
        answers.write(json.dumps({"pid": pid}) + "\n")
        if request.get("code_file"):
            DETACHED[pid] = request["code_file"]
            reap_detached()  # it may have ended before it was listed
            continue
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
