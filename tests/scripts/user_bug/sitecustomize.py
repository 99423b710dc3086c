"""A user's bug, from outside anygpu: with this folder on PYTHONPATH, ANYGPU_TEST_RAISE=MODULE:ATTR:N[:WHERE] makes
the N-th call of MODULE.ATTR (ATTR may be Class.method) in a training process raise RuntimeError("injected fault
..."), as a bug in the user's model, data or environment would. Only calls inside a rank count (LOCAL_RANK is set:
not the launcher's); WHERE narrows them further:
  grad / nograd  autograd on / off at the call (a training forward / an evaluation's)
  worker         inside a DataLoader worker (elsewhere only calls outside workers count)
  rank1          on RANK 1 only (the other ranks then wait for it in a collective)
"""

import functools
import importlib
import os

SPEC = os.environ.get("ANYGPU_TEST_RAISE")


def _counts(where: set[str]) -> bool:
    import torch

    if "LOCAL_RANK" not in os.environ:
        return False
    in_worker = torch.utils.data.get_worker_info() is not None
    if in_worker != ("worker" in where):
        return False
    if "rank1" in where and os.environ.get("RANK") != "1":
        return False
    if "grad" in where and not torch.is_grad_enabled():
        return False
    return not ("nograd" in where and torch.is_grad_enabled())


def _install(spec: str) -> None:
    module_name, attr, nth, *where = spec.split(":")
    owner = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls = getattr(owner, name), [0]

    @functools.wraps(original)
    def raising(*args, **kwargs):
        if _counts(set(where)):
            calls[0] += 1
            if calls[0] == int(nth):
                raise RuntimeError(f"injected fault: call {nth} of {module_name}.{attr} on rank {os.environ['RANK']}")
        return original(*args, **kwargs)

    setattr(owner, name, raising)


if SPEC:
    _install(SPEC)
