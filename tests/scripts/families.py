"""Under torchrun: for each config given, export the FSDP2 engine's initial weights, then train it.

One process launch for every model family (start-up costs more than a tiny run). Usage:
    families.py OUT_ROOT CONFIG.json [CONFIG.json ...] -- [engine args]
Each family writes OUT_ROOT/<config stem>/init (initial weights) and a normal run folder OUT_ROOT/<stem>/run.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import anygpu

anygpu.set_offline_defaults()

from anygpu.checkpoint import export
from anygpu.config.args import parse_args  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.model import modeling
from anygpu.runtime import distributed

split = sys.argv.index("--")
root, configs, engine_args = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
distributed.init_distributed()  # one process group for all families: the runs leave it open
for config_path in configs:
    out = root / Path(config_path).stem
    model_args, data_args, train_args = parse_args(
        [*engine_args, "--config_name", config_path, "--output_dir", str(out / "run")]
    )
    info = distributed.init_distributed()
    config = modeling.resolve_config(model_args)
    initial = fsdp_engine.build_model(SimpleNamespace(config=config, from_scratch=True), model_args, train_args, info)
    export.export_safetensors(initial, config, None, out / "init", info.rank)
    del initial
    fsdp_engine.run(model_args, data_args, train_args)
distributed.destroy()
