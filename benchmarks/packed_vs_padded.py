"""Tokens/s of packed rows (several samples per row, attention confined to each) against padded rows (one
sample per row, padded to the longest of its micro-batch), on the same chat samples.

One process. A synthetic chat data set with a realistic spread of lengths (1 to 4 turns, a few to ~100
words per message) goes through anygpu's pipeline twice (`--packing true` / `--packing false`); both
loops train the same model from the same weights over the same samples: forward/backward per
micro-batch of `--per_device` rows, AdamW step per global batch. Tokens/s counts real (non-padding)
tokens; the padding share is the padding positions over all positions computed. Rounds alternate.

    .venv/bin/python benchmarks/packed_vs_padded.py [--config_name tiny] [--block_size 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anygpu  # noqa: E402

anygpu.set_offline_defaults()


from anygpu.config.args import parse_args  # noqa: E402
from anygpu.data.prepare import prepare  # noqa: E402
from anygpu.model import modeling  # noqa: E402
from anygpu.runtime import distributed
from anygpu.train import optim
from _scratch import scratch_folder

WORDS = (
    "the a sky is blue green model data token batch train loss rank step layer weight attention sample "
    "packed padded row length chat user assistant answer question why how what when"
).split()


def write_chat(path: Path, num: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text() -> str:  # mostly short messages, a few long ones: the usual shape of chat data
        return " ".join(rng.choice(WORDS) for _ in range(int(rng.paretovariate(1.2) * 6) % 120 + 2))

    with path.open("w") as f:
        for _ in range(num):
            msgs = []
            for _ in range(rng.randint(1, 4)):
                msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def epoch(model, opt, prep, per_device: int) -> tuple[int, int, float]:
    """One pass over every row in order: (real tokens, positions computed, seconds)."""
    ds, rows, G = prep.datasets["train"], len(prep.datasets["train"]), prep.plan.global_batch_size
    real = positions = 0
    start = time.perf_counter()
    for g in range(0, rows - G + 1, G):
        micro = [list(range(i, i + per_device)) for i in range(g, g + G, per_device)]
        batches = [prep.collator.read(ds, idx) for idx in micro]
        n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for b in batches:
            model(**b, num_items_in_batch=n).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for idx in micro:
            lengths = [len(x) for x in ds[idx]["input_ids"]]
            real += sum(lengths)
            positions += max(lengths) * len(lengths)
    return real, positions, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default="tiny")
    p.add_argument("--block_size", default="512")
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--global_batch_size", default="8")
    p.add_argument("--per_device", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tmp = Path(scratch_folder("anygpu-bench-chat-"))
    write_chat(tmp / "chat.jsonl", a.samples)
    info = distributed.init_distributed()
    runs = {}
    for packing in ("true", "false"):
        model_args, data_args, train_args = parse_args(
            [
                "--config_name",
                a.config_name,
                "--block_size",
                a.block_size,
                "--global_batch_size",
                a.global_batch_size,
                "--per_device_train_batch_size",
                str(a.per_device),
                "--train_file",
                str(tmp / "chat.jsonl"),
                "--vocab_size",
                "1000",
                "--packing",
                packing,
                "--output_dir",
                str(tmp / "out"),
            ]
        )
        prep = prepare(model_args, data_args, train_args, info)
        model = modeling.build_full_model(prep.config, model_args, train_args.seed).to(info.device)
        runs[packing] = (prep, model, optim.build_optimizer(model, train_args, info.device))
        print(f"packing {packing}: {len(prep.datasets['train'])} rows; " + "; ".join(prep.data_lines))
    results: dict[str, list[tuple[int, int, float]]] = {"true": [], "false": []}
    for _ in range(a.rounds):
        for packing, (prep, model, opt) in runs.items():
            results[packing].append(epoch(model, opt, prep, a.per_device))
    tps = {k: statistics.median(r / s for r, _, s in v) for k, v in results.items()}
    pad = {k: 1 - v[0][0] / v[0][1] for k, v in results.items()}
    rounds = [(t[0] / t[2]) / (f[0] / f[2]) for t, f in zip(results["true"], results["false"])]
    print(
        f"tokens/s   packed {tps['true']:,.0f}   padded {tps['false']:,.0f}   packed/padded {tps['true'] / tps['false']:.2f}× "
        f"(rounds: {', '.join(f'{r:.2f}' for r in rounds)})"
    )
    print(f"padding    packed {pad['true']:.1%}   padded {pad['false']:.1%}")
    distributed.destroy()


if __name__ == "__main__":
    main()
