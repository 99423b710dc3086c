"""`anygpu prepare [config.yaml] [--option value ...]`: the data of a run prepared ahead of the job, with the
engines' own arguments (the same command line or config file). Raw-text files and mixtures are tokenised by
every process of this command (one per core; under torchrun, each node's share of the files) into the cache
the training job reads: it then starts at once. Other data (chat, prompt-completion, a hub data set) is
prepared as the job would prepare it. Uses no GPU."""

from __future__ import annotations

import logging
import os
import time

from anygpu.config.args import preflight

PROG = "anygpu prepare"


def main(argv: list[str]) -> int:
    preflight(argv, prog=PROG)  # --help and refusals before torch is imported
    from anygpu import errors
    from anygpu.config.args import parse_args
    from anygpu.data.prepare import check_run, prepare
    from anygpu.runtime import distributed

    start = time.monotonic()

    def body() -> None:
        model_args, data_args, train_args = parse_args(argv, prog=PROG, warn=False)
        many = int(os.environ.get("WORLD_SIZE", "1")) > 1
        info = distributed.init_distributed(train_args.ddp_timeout, cpu_only=True) if many else _one_process()
        logging.basicConfig(
            level=logging.INFO if info.is_main else logging.WARNING, format="[%(levelname)s] %(message)s"
        )
        # the batch checks of one process: the job's own world size is not known here
        prep = prepare(model_args, data_args, train_args, info, check_run(model_args, data_args, train_args, 1))
        if info.is_main:
            print("\n".join(prep.data_lines), flush=True)
            print(
                f"{PROG}: done in {time.monotonic() - start:.1f} s; a training job with the same data arguments reads "
                f"it from {data_args.data_cache_dir} and starts without tokenising.",
                flush=True,
            )
        if many:
            distributed.destroy()

    errors.run_main(body, cleanup=lambda: distributed.destroy(sync=False))
    return 0


def _one_process():
    import torch

    from anygpu.runtime.distributed import DistInfo

    return DistInfo(0, 0, 1, torch.device("cpu"))
