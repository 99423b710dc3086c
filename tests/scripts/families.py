"""Under torchrun: for each config (or pretrained folder) given, export the FSDP2 engine's initial (or loaded)
weights in the export's default dtype and layout, then train it.

One process launch for every model family (start-up costs more than a tiny run). Usage:
    families.py OUT_ROOT CONFIG.json [CONFIG.json ...] -- [engine args]
A folder is trained from its weights (--model_name_or_path) with its own config and tokenizer; each rank writes
how many checkpoint elements it read to OUT_ROOT/<stem>/read-rank<R>.json.
Each family writes OUT_ROOT/<config stem>/init (initial weights) and a normal run folder OUT_ROOT/<stem>/run.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import anygpu

anygpu.set_offline_defaults()

from anygpu.checkpoint import export
from anygpu.config.args import parse_args  # noqa: E402
from anygpu.engines import fsdp as fsdp_engine  # noqa: E402
from anygpu.data.collate import Collator
from anygpu.engines.trunk import finish
from anygpu.model import hub_weights, modeling
from anygpu.runtime import distributed


def without_config(args: list[str]) -> list[str]:
    """The engine arguments without --config_name (a pretrained folder brings its own config)."""
    i = args.index("--config_name") if "--config_name" in args else None
    return args if i is None else args[:i] + args[i + 2 :]


def count_reads() -> dict[str, int]:
    """Count the checkpoint elements this rank materialises while loading (what each deferred read returns)."""
    reads = {"elements": 0}
    real = hub_weights._reader

    def reader(*args):
        read = real(*args)

        def counted():
            tensor = read()
            reads["elements"] += 0 if tensor is None else tensor.numel()
            return tensor

        return counted

    hub_weights._reader = reader
    return reads


split = sys.argv.index("--")
root, configs, engine_args = Path(sys.argv[1]), sys.argv[2:split], sys.argv[split + 1 :]
distributed.init_distributed()  # one process group for all families: the runs leave it open
reads = count_reads()
for config_path in configs:
    pretrained = Path(config_path).is_dir()  # a folder save_pretrained wrote: loaded, not initialised
    out = root / Path(config_path).stem
    model_args, data_args, train_args = parse_args(
        [*engine_args, "--config_name", config_path, "--output_dir", str(out / "run")]
        if not pretrained
        else [*without_config(engine_args), "--model_name_or_path", config_path, "--output_dir", str(out / "run")]
    )
    info = distributed.init_distributed()
    config = modeling.resolve_config(model_args)
    prep = SimpleNamespace(config=config, from_scratch=not pretrained, collator=Collator(pad_token_id=0))  # raw text
    reads["elements"] = 0
    initial = fsdp_engine.build_model(prep, model_args, train_args, info)
    if pretrained:  # what this rank read of the checkpoint: its shards' elements, not the whole model's
        out.mkdir(parents=True, exist_ok=True)
        (out / f"read-rank{info.rank}.json").write_text(json.dumps(reads))
    dtype = finish.export_dtype("auto", model_args.model_name_or_path, train_args.bf16)
    export.export_safetensors(initial, config, None, out / "init", info.rank, dtype)
    del initial
    fsdp_engine.run(model_args, data_args, train_args)
distributed.destroy()
