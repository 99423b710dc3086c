"""Hub checkpoints in and out, in one process (the multi-rank runs are in test_model_families.py): the native
engine's loader fills a model exactly as `from_pretrained` does for every layout transformers loads (per-expert
MoE tensors fused on load, Mixtral's renamed router, bf16 storage in several files with an index), and the export
writes the source's own names, layout and dtype back, loadable with no missing or unexpected key."""

import json
from pathlib import Path

import pytest
from hub_sources import MOE, SOURCES, attention, build, tensors


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return build(tmp_path_factory.mktemp("hub"))


def native(folder: Path, name: str):
    """The native engine's model (meta → CPU, tied, buffers kept) filled by its loader, one process."""
    from transformers import AutoConfig

    from anygpu.config.args import ModelArguments
    from anygpu.model import modeling

    model = modeling.build_meta_model(
        AutoConfig.from_pretrained(folder), ModelArguments(attn_implementation=attention(name))
    )
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.to_empty(device="cpu")
    model.tie_weights()
    modeling.restore_buffers(model, buffers)
    modeling.load_pretrained_weights(model, str(folder))
    return model


def export(model, folder: Path, out: Path, dtype=None) -> Path:
    from anygpu.checkpoint import export as exporter
    from anygpu.engines.trunk.finish import export_dtype

    dtype = dtype or export_dtype("auto", str(folder), bf16=False)
    return exporter.export_safetensors(model, model.config, None, out, 0, dtype, "20KB")


@pytest.fixture(scope="module")
def finals(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("finals")
    return {name: export(native(folder, name), folder, root / name) for name, folder in sources.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES)
def test_loaded_weights_equal_from_pretrained(sources, name):
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(sources[name], dtype=torch.float32, attn_implementation=attention(name))
    ours, theirs = native(sources[name], name).state_dict(), ref.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == torch.float32 and torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES)
def test_export_is_the_source_layout_and_dtype(sources, finals, name):
    """final/ has the source's keys (experts one tensor each), the source's bits (nothing trained), and loads
    with no missing, unexpected or mismatched key."""
    import torch
    from transformers import AutoModelForCausalLM

    source, final = tensors(sources[name]), tensors(finals[name])
    assert sorted(final) == sorted(source)
    for key, value in source.items():
        assert final[key].dtype == value.dtype and torch.equal(final[key], value), key
    _, info = AutoModelForCausalLM.from_pretrained(
        finals[name], output_loading_info=True, attn_implementation=attention(name)
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    if name in MOE and name != "gpt_oss":  # gpt-oss stores its experts fused
        assert any(".experts.0." in key for key in final)


@pytest.mark.slow
def test_export_loads_back_and_exports_the_same_bits(finals, tmp_path):
    import torch

    again = tensors(export(native(finals["mixtral"], "mixtral"), finals["mixtral"], tmp_path / "again"))
    first = tensors(finals["mixtral"])
    assert sorted(again) == sorted(first) and all(torch.equal(again[k], first[k]) for k in first)


@pytest.mark.slow
def test_bf16_source_exports_bf16_in_shards_at_half_the_fp32_size(sources, finals, tmp_path):
    import torch

    final = finals["llama_bf16"]
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several files, as --save_max_shard_size 20KB asks
    assert {t.dtype for t in tensors(final).values()} == {torch.bfloat16}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert "lm_head.weight" not in tensors(final)  # tied to the embedding: stored once, as in the source
    fp32 = export(native(sources["llama_bf16"], "llama_bf16"), sources["llama_bf16"], tmp_path / "fp32", torch.float32)

    def size(folder: Path) -> int:
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))

    assert 0.49 < size(final) / size(fp32) < 0.51


@pytest.mark.slow
def test_missing_weights_are_one_line(sources, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from anygpu.errors import UsageError

    folder = tmp_path / "partial"
    shutil.copytree(sources["olmoe"], folder)
    kept = {k: v for k, v in tensors(folder).items() if ".layers.1." not in k}
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UsageError) as e:
        native(folder, "olmoe")
    assert str(e.value).startswith(f"--model_name_or_path {folder}: weights missing for ['model.layers.1.")
    assert "\n" not in str(e.value)
