"""anygpu's packing (`anygpu.data.collate.pack_samples`, best-fit decreasing + `Collator`) against TRL's
`pack_dataset(strategy="bfd")` and transformers' padding-free `DataCollatorWithFlattening`.

One process, CPU only. A synthetic encoded chat-like data set (input_ids, labels; lengths drawn from a seeded
log-normal between 8 and the capacity, labels -100 on a prompt part and on position 0, as `encode` leaves them)
is packed by both. Printed per size:

- pack time: ours vs TRL bfd as TRL calls it (`Dataset.map`, batches of 1000 samples) and over the whole
  data set in one batch (`map_kwargs={"batch_size": None}`): the ratio is TRL / ours (> 1: ours faster).
  TRL gives `seq_lengths`, not `position_ids`; "TRL + pos" adds the map that makes the position ids our
  Collator reads.
- rows, fill and the padding share of micro-batches of m rows in a seeded order (the Collator pads each
  micro-batch to its longest row);
- whether TRL's rows are the same sample sets as ours;
- DataCollatorWithFlattening: one 1×L row per micro-batch (no padding); its collation time per micro-batch
  (the same tokens as m of our rows) against our Collator's, and what its rows depend on.

    .venv/bin/python benchmarks/packing_vs_trl.py [--samples 20000 200000] [--capacity 1024 2048] [--m 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from anygpu.data.collate import Collator, best_fit_decreasing, pack_samples  # noqa: E402

IGNORE = -100


def synthetic(num: int, capacity: int, seed: int = 0) -> Dataset:
    """Encoded samples: skewed lengths in [8, capacity] (median ~capacity/8), labels -100 on a prompt of 20-80%."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(capacity / 8), 0.9, num).astype(np.int64), 8, capacity)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(3, 32000, offsets[-1], dtype=np.int64)
    labels = ids.copy()
    prompt = (lengths * rng.uniform(0.2, 0.8, num)).astype(np.int64) + 1
    for start, p in zip(offsets[:-1], prompt):  # prompt positions (and position 0) are not trained on
        labels[start : start + p] = IGNORE
    col = lambda v: pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(v))  # noqa: E731
    return Dataset(pa.table({"input_ids": col(ids), "labels": col(labels)}))


def timed(fn, *args, **kw):
    start = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - start


def trl_pack(ds: Dataset, capacity: int, whole: bool) -> Dataset:
    from trl.data_utils import pack_dataset

    return pack_dataset(ds, capacity, "bfd", map_kwargs={"batch_size": None} if whole else None)


def with_positions(ds: Dataset) -> Dataset:
    """TRL's seq_lengths → the position_ids column our Collator reads (restarting per sample)."""

    def pos(batch: pa.Table) -> pa.Table:
        seq = batch["seq_lengths"].combine_chunks()
        flat = seq.flatten().to_numpy()
        starts = np.repeat(np.cumsum(flat) - flat, flat)
        values = np.arange(flat.sum(), dtype=np.int64) - starts
        row_off = np.concatenate([[0], np.cumsum(pa.compute.list_value_length(batch["input_ids"]).to_numpy())])
        return batch.drop_columns("seq_lengths").append_column(
            "position_ids", pa.LargeListArray.from_arrays(pa.array(row_off), pa.array(values))
        )

    return ds.with_format("arrow").map(pos, batched=True).with_format(None)


def padding_share(row_lengths: list[int], m: int, seed: int = 0) -> float:
    """Padding positions over all positions, micro-batches of m rows in a seeded permutation, each padded to its longest."""
    perm = torch.randperm(len(row_lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    real = total = 0
    for i in range(0, len(perm) - m + 1, m):
        ls = [row_lengths[j] for j in perm[i : i + m]]
        real, total = real + sum(ls), total + max(ls) * m
    return 1 - real / total


def trl_bins(ds: Dataset, capacity: int, whole: bool) -> list[frozenset]:
    """Sample-index sets of TRL's rows (a column of the sample's index, packed along with the tokens)."""
    lengths = [len(x) for x in ds["input_ids"]]
    sid = Dataset.from_dict({"input_ids": ds["input_ids"], "sid": [[i] * n for i, n in enumerate(lengths)]})
    out = trl_pack(sid, capacity, whole)
    bins = []
    for row, seq in zip(out["sid"], out["seq_lengths"]):
        starts = np.cumsum([0] + list(seq[:-1]))
        bins.append(frozenset(row[s] for s in starts))
    return bins


def flattening(ds: Dataset, packed: Dataset, packed_bins: list[list[int]], m: int, pad_id: int, reps: int) -> None:
    from transformers import DataCollatorWithFlattening

    flat, ours = DataCollatorWithFlattening(), Collator(pad_id, packed=True)
    perm = torch.randperm(len(packed), generator=torch.Generator().manual_seed(0)).tolist()
    micro = [perm[i : i + m] for i in range(0, min(len(perm) - m + 1, reps * m), m)]
    # the same tokens both ways: m of our packed rows, or the samples they hold as DataCollatorWithFlattening's features
    ours_in = [packed[idx] for idx in micro]
    flat_in = [
        [{"input_ids": ds[i]["input_ids"], "labels": ds[i]["labels"]} for r in idx for i in sorted(packed_bins[r])]
        for idx in micro
    ]
    t_ours = min(timed(lambda: [ours.collate(c) for c in ours_in])[1] for _ in range(3))
    t_flat = min(timed(lambda: [flat(f) for f in flat_in])[1] for _ in range(3))
    widths = [ours.collate(c)["input_ids"].shape for c in ours_in]
    L = [flat(f)["input_ids"].shape[1] for f in flat_in]
    mask_ours = sum(b * w * w for b, w in widths)
    mask_flat = sum(x * x for x in L)
    print(
        f"  DataCollatorWithFlattening, {len(micro)} micro-batches of the samples of m={m} rows: "
        f"{t_flat / len(micro) * 1e3:.2f} ms vs ours {t_ours / len(micro) * 1e3:.2f} ms per micro-batch "
        f"(flattening/ours {t_flat / t_ours:.2f}×); padding 0 vs ours (these micro-batches) "
        f"{1 - sum(L) / sum(b * w for b, w in widths):.1%}; one row of L={np.mean(L):.0f} tokens (max {max(L)}): "
        f"sdpa/eager mask elements {mask_flat / mask_ours:.1f}× ours (L² vs m·width²)"
    )


def loss_check(pad_id: int) -> None:
    """Token-loss sum, sdpa, of one sample per padded row (the reference), our packed rows, and padding-free rows of
    m samples: equal to float rounding whatever m, as transformers confines attention to each sample from the
    restarting position ids (only without a KV cache: `use_cache=False`, as the engines call the model)."""
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    ds = synthetic(32, 128, seed=1)
    ds = Dataset.from_dict(
        {
            "input_ids": [[t % 1000 for t in x] for x in ds["input_ids"]],
            "labels": [[t if t == IGNORE else t % 1000 for t in y] for y in ds["labels"]],
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
            max_position_embeddings=2048,
            attn_implementation="sdpa",
        )
    ).eval()
    samples = [{"input_ids": x, "labels": y} for x, y in zip(ds["input_ids"], ds["labels"])]
    res = {}
    with torch.no_grad():
        loss = lambda b: model(**b, num_items_in_batch=torch.tensor(1), use_cache=False).loss.item()  # noqa: E731
        res["padded, one sample per row"] = sum(loss(Collator(pad_id)(samples[i : i + 1])) for i in range(len(samples)))
        packed, col = pack_samples(ds, 256), Collator(pad_id, packed=True)
        res["ours (capacity 256, m=2)"] = sum(
            loss(col.read(packed, list(range(i, min(i + 2, len(packed)))))) for i in range(0, len(packed), 2)
        )
        for m in (2, 8, 32):
            res[f"flattening m={m}"] = sum(
                loss(DataCollatorWithFlattening()(samples[i : i + m])) for i in range(0, len(samples), m)
            )
    ref = next(iter(res.values()))
    print(
        "  token-loss sum over 32 samples (tiny Llama, sdpa): "
        + "; ".join(f"{k} {v:.4f} (rel {abs(v - ref) / ref:.1e})" for k, v in res.items())
    )


def main() -> None:
    import datasets

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, nargs="+", default=[20_000, 200_000])
    p.add_argument("--capacity", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--m", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--flatten_reps", type=int, default=200, help="micro-batches timed for the collators")
    p.add_argument("--no_loss_check", action="store_true")
    a = p.parse_args()
    datasets.disable_progress_bars()
    try:
        import trl
        import trl.data_utils  # noqa: F401  (imported before timing)
    except ImportError:
        trl = None
        print("TRL not installed: pip install trl to compare (only ours and DataCollatorWithFlattening are measured)")
    import transformers

    print(
        f"trl {trl.__version__ if trl else '-'}, transformers {transformers.__version__}, datasets {datasets.__version__}, "
        f"torch {torch.__version__}"
    )
    for cap in a.capacity:
        for n in a.samples:
            ds = synthetic(n, cap)
            lengths = [len(x) for x in ds["input_ids"]]
            tokens = sum(lengths)
            print(
                f"{n} samples, capacity {cap}: {tokens:,} tokens (mean {tokens / n:.0f}), "
                f"{sum(1 for x in ds['labels'] for t in x if t != IGNORE) if n <= 20_000 else '…'} targets"
            )
            ours, t_ours = timed(pack_samples, ds, cap)
            rl = [len(x) for x in ours["input_ids"]]
            print(
                f"  ours:           {t_ours:7.2f} s  {len(ours)} rows, fill {tokens / (len(ours) * cap):.2%}, "
                f"padding at m={a.m}: {padding_share(rl, a.m):.2%}"
            )
            bins = best_fit_decreasing(lengths, cap)
            if trl is not None:
                for whole in (False, True):
                    out, t = timed(trl_pack, ds, cap, whole)
                    _, t_pos = timed(with_positions, out)
                    rl_t = [len(x) for x in out["input_ids"]]
                    lost = tokens - sum(rl_t)
                    same = set(map(frozenset, bins)) & set(trl_bins(ds, cap, whole)) if n <= 20_000 else None
                    name = "TRL bfd (whole)" if whole else "TRL bfd (map)  "
                    print(
                        f"  {name}: {t:7.2f} s  {len(out)} rows, fill {tokens / (len(out) * cap):.2%}, "
                        f"padding at m={a.m}: {padding_share(rl_t, a.m):.2%}; TRL/ours {t / t_ours:.2f}×, "
                        f"TRL + pos {t + t_pos:.2f} s ({(t + t_pos) / t_ours:.2f}×); columns {out.column_names}; "
                        f"tokens lost {lost}"
                        + (f"; same sample sets as ours: {len(same)}/{len(bins)} rows" if same is not None else "")
                    )
            if n <= 20_000:
                flattening(ds, ours, bins, a.m, 0, a.flatten_reps)
    if not a.no_loss_check:
        loss_check(0)


if __name__ == "__main__":
    main()
