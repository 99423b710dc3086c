"""The lean loss against the model's own: peak memory and tokens/s of a training step, as ratios, per vocabulary.

A Llama-shaped model (small body, the vocabulary under test) and one batch of `--tokens` tokens. Memory: a
fresh process per loss runs one forward + backward; its peak is the process's peak RSS on CPU (everything:
interpreter, model, gradients, activations, logits; VmHWM, reset after the model is built) or
`torch.cuda.max_memory_allocated` on a GPU, and the step's own part above what the process held before it. Speed: both losses in this process, stepped in
alternating rounds on the same batch (machine noise hits both alike), median time per step.

    .venv/bin/python benchmarks/lean_loss.py [--vocab 32768 131072 262144] [--tokens 2048] [--hidden 256]
                                             [--layers 2] [--rounds 3] [--memory_only] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from anygpu.model import lean_loss  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(args, vocab: int, lean: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.tokens,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if args.bf16 else torch.float32).to(DEVICE)
    lean_loss.install(model, lean)
    return model.train()


def batch(vocab: int, tokens: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """One forward + backward with the engines' normalisation (a token count given)."""
    with lean_loss.active(model):
        loss = model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=torch.tensor(ids.numel())).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def _status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_now() -> int:
    """The process's resident memory now (bytes)."""
    kib = _status_kib("VmRSS")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if kib is None else kib * 1024


def reset_rss_peak() -> None:
    """Start the peak RSS afresh (Linux: `5` into clear_refs resets VmHWM), so the step's peak excludes set-up's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def rss_peak() -> int:
    """The process's peak resident memory (bytes) since the last reset (since its start where none is possible)."""
    kib = _status_kib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if kib is None else kib * 1024


def child(args) -> None:
    """One loss, one step, in this fresh process: its peak memory (JSON on stdout)."""
    vocab = args.vocab[0]
    model, ids = build(args, vocab, args.child == "lean"), batch(vocab, args.tokens)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = rss_now()
        reset_rss_peak()
    step(model, ids)
    peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else rss_peak()
    print(json.dumps({"peak": peak, "step": peak - before}))


def peak_memory(args, vocab: int, loss: str) -> dict[str, int]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        loss,
        "--vocab",
        str(vocab),
        "--tokens",
        str(args.tokens),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        *(["--bf16"] if args.bf16 else []),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def speed(args, vocab: int) -> float:
    """tokens/s of the lean loss over the model's own (same weights, same batch, alternating rounds)."""
    own = build(args, vocab, False)
    lean = copy.deepcopy(own)
    lean_loss.install(lean, True)
    ids = batch(vocab, args.tokens)
    times: dict[str, list[float]] = {"own": [], "lean": []}
    for model in (own, lean):
        step(model, ids)  # warm-up
    for _ in range(args.rounds):
        for name, model in (("own", own), ("lean", lean)):
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, ids)
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["own"]) / statistics.median(times["lean"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072, 262144])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (one sequence)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="timed steps per loss")
    p.add_argument("--bf16", action="store_true", help="bf16 weights (GPU)")
    p.add_argument("--memory_only", action="store_true", help="skip the tokens/s rounds")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    p.add_argument("--child", choices=("own", "lean"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)  # one core per measurement: the ratio, not the machine's load
    if args.child:
        return child(args)
    where = torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "CPU, 1 thread"
    kind = "max_memory_allocated" if DEVICE.type == "cuda" else "peak RSS of the process"
    print(
        f"{where}; Llama body hidden {args.hidden} × {args.layers} layers, {args.tokens} tokens per step; "
        f"memory: {kind} (whole process / the step's own part)"
    )
    print("| vocab | own peak (MiB) | lean peak (MiB) | peak ratio | step ratio | tokens/s ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for vocab in args.vocab:
        own, lean = peak_memory(args, vocab, "own"), peak_memory(args, vocab, "lean")
        row = {
            "vocab": vocab,
            "own_peak_mib": own["peak"] / 2**20,
            "lean_peak_mib": lean["peak"] / 2**20,
            "peak_memory_ratio": lean["peak"] / own["peak"],
            "step_memory_ratio": lean["step"] / max(own["step"], 1),
            "tokens_per_second_ratio": None if args.memory_only else speed(args, vocab),
        }
        rows.append(row)
        tps = "—" if row["tokens_per_second_ratio"] is None else f"{row['tokens_per_second_ratio']:.3f}"
        print(
            f"| {vocab:,} | {row['own_peak_mib']:,.0f} | {row['lean_peak_mib']:,.0f} | {row['peak_memory_ratio']:.2f} "
            f"| {row['step_memory_ratio']:.2f} | {tps} |",
            flush=True,
        )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
