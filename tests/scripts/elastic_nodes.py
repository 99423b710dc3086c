"""Several torchrun agents ("nodes") forked from one process that has imported the engines, started and
ended at a test's command: the elastic tests' two (or three) nodes on one machine.

Each node is torchrun's own agent (`torch.distributed.run` with the options the launcher's dry run printed:
the elastic c10d rendezvous, restarts, the ranks' environment) whose ranks are forks, as in warm_launch.py;
only the ~4.5 s import of each agent and of each rank (and of every restarted rank) is saved.

Protocol: one JSON request per line on stdin, {"argv": [torchrun's arguments], "env": {...}, "cwd", "log"};
each answer is one line on stdout: {"pid": N} when the node starts (its own session: a test kills it with
its ranks by the group), {"pid": N, "code": C} when it ends.
"""

import json
import os
import select
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warm_launch  # noqa: E402  (imports the engines)


def node(request: dict) -> int:
    os.setsid()
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    warm_launch.as_a_fresh_interpreter("torchrun", request["argv"])
    warm_launch.distrib_run.config_from_args = warm_launch._forking_config
    try:
        warm_launch.distrib_run.main(request["argv"])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    running: set[int] = set()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.1)
        if ready:
            line = sys.stdin.readline()
            if not line:
                break
            pid = os.fork()
            if pid == 0:
                try:
                    warm_launch.finish(node(json.loads(line)))
                finally:
                    os._exit(70)
            running.add(pid)
            answers.write(json.dumps({"pid": pid}) + "\n")
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                answers.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
