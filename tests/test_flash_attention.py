"""Flash attention: refused up front where it cannot run, and given packed rows it recognises as packed."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TINY

from anygpu.engines.fsdp import main as fsdp_main
from anygpu.engines.hf.engine import main as hf_main

ENGINES = {"fsdp": fsdp_main, "hf": hf_main}


def refused(main, argv: list[str], capsys) -> str:
    """The one-line refusal (exit 2), before any process group exists."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not dist.is_initialized()
    return err


@pytest.mark.parametrize("engine", ["fsdp", "hf"])
@pytest.mark.parametrize("version", ["2", "3"])
def test_flash_attention_in_fp32_is_refused_naming_the_precision(engine, version, capsys, tmp_path):
    err = refused(
        ENGINES[engine],
        [*TINY, "--attn_implementation", f"flash_attention_{version}", "--output_dir", str(tmp_path)],
        capsys,
    )
    assert f"--attn_implementation flash_attention_{version}" in err and "--bf16" in err and "sdpa" in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("engine", ["fsdp", "hf"])
def test_flash_attention_without_the_package_is_refused_naming_the_fix(engine, capsys, tmp_path):
    """Here (CPU, no flash-attn): one line naming the package to install or sdpa, not a traceback from a rank."""
    argv = [*TINY, "--attn_implementation", "flash_attention_2", "--bf16", "true", "--output_dir", str(tmp_path)]
    err = refused(ENGINES[engine], argv, capsys)
    assert "--attn_implementation flash_attention_2" in err and "flash-attn" in err and "sdpa" in err, err


# ---------------------------------------------------------------------- packed rows under flash attention
def flash_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kw):
    """Flash attention as transformers drives it, on CPU: one causal attention per packed sample where
    transformers' own test (`_is_packed_sequence`) recognises the rows as packed (the varlen path), else
    causal over each whole row (what flash_attn_func does without a mask)."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    heads, length = query.shape[1], query.shape[2]
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))

    def causal(a: int, b: int):
        return F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling
        )

    if _is_packed_sequence(position_ids, query.shape[0]):
        starts = [*(position_ids[0] == 0).nonzero().flatten().tolist(), length]
        out = torch.cat([causal(a, b) for a, b in zip(starts, starts[1:])], dim=2)
    else:
        out = causal(0, length)
    return out.transpose(1, 2).contiguous(), None


def packed_rows() -> dict[str, list]:
    """Three packed rows of two samples each (the last one short: padded in a micro-batch); every sample's
    first label is -100, as `formats.encode_split` makes them."""
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for r, lengths in enumerate([(5, 7), (9, 3), (6, 2)]):
        ids, labels, pos = [], [], []
        for s, n in enumerate(lengths):
            sample = [(97 * r + 31 * s + 7 * i) % 8000 + 3 for i in range(n)]
            ids += sample
            labels += [-100, *sample[1:]]
            pos += list(range(n))
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["position_ids"].append(pos)
    return rows


def test_packed_rows_under_flash_attention_give_the_sdpa_losses(monkeypatch):
    """The native engine's step and the evaluation (both engines') on micro-batches of 3 packed rows: under
    flash attention the model must see them as packed (one flattened row), or each sample attends to the
    samples before it in its row; the losses equal sdpa's, where the position ids confine attention anyway."""
    from datasets import Dataset
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from anygpu.config.args import ModelArguments
    from anygpu.data.collate import Collator
    from anygpu.data.loader import StepCollate
    from anygpu.engines import fsdp
    from anygpu.engines.trunk.evaluator import evaluate
    from anygpu.model import modeling
    from anygpu.runtime.distributed import DistInfo

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", flash_stand_in)
    args = ModelArguments(config_name="tiny")
    model = modeling.build_full_model(modeling.resolve_config(args), args, seed=0)
    modeling.flatten_packed_rows(model)  # both engines install it where they build the model
    rows, collator, cpu = packed_rows(), Collator(0, packed=True), torch.device("cpu")
    step = StepCollate(collator)((0, [[0, 1, 2]], [rows]))
    prep = types.SimpleNamespace(plan=types.SimpleNamespace(global_batch_size=3))
    info = DistInfo(0, 0, 1, cpu)
    dataset = Dataset.from_dict(rows)
    got = {}
    for attention in ("sdpa", "flash_attention_2"):
        model.config._attn_implementation = attention
        got[attention] = (
            float(fsdp.train_step(model, prep, 0, info, step)),
            evaluate(model, dataset, collator, 3, 0, 1, cpu),
        )
    assert got["flash_attention_2"] == pytest.approx(got["sdpa"], rel=1e-5), got


def test_the_flattened_row_is_one_transformers_recognises_as_packed():
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    from anygpu.data.collate import Collator
    from anygpu.model.modeling import flattened

    batch = Collator(0, packed=True).collate(packed_rows())
    assert not _is_packed_sequence(batch["position_ids"], batch["input_ids"].shape[0])  # 3 rows: not recognised
    flat = flattened(batch)
    assert flat["input_ids"].shape == flat["labels"].shape == flat["position_ids"].shape == (1, 3 * 12)
    assert _is_packed_sequence(flat["position_ids"], flat["input_ids"].shape[0])
    assert torch.equal(flat["labels"].reshape(3, 12), batch["labels"])  # the same targets, row after row


def test_keyed_dropout_draws_each_samples_mask_in_a_flattened_row_too():
    """LoRA's dropout (on by default) under flash attention sees (1, m·T, ·): each row's part gets the mask it
    gets in the (m, T, ·) layout, keyed by its sample, not one mask keyed by the first sample."""
    from anygpu.model import dropout

    state = dropout._Keyed(seed=0, step=3, samples=[10, 11, 12])
    rows = dropout._masks(state, "layers.0/forward:1", torch.ones(3, 12, 8), 0.5)
    flat = dropout._masks(state, "layers.0/forward:1", torch.ones(1, 36, 8), 0.5)
    assert torch.equal(flat.reshape(3, 12, 8), rows)
