"""Model families beyond Llama: each trains to the same loss on 1 and 2 ranks (FSDP2 engine), exports a
model that Hugging Face loads, and starts from its own family's initial weights, equal in both engines.
Hub checkpoints (MoE families as `save_pretrained` writes them, a bf16 Llama in several files) load into the
shards of 1 and 2 ranks bit for bit, train to the HF engine's losses, and come back in their own layout and dtype."""

import json
from pathlib import Path

import pytest
from conftest import TINY, hf_runs, losses, python, torchrun
from hub_sources import MOE, build, tensors
from hub_sources import SMALL as HUB_SMALL

SMALL = {**HUB_SMALL, "vocab_size": 128}
# Tiny shapes of each family; dropout as each family ships it (GPT-2 0.1 everywhere, OPT 0.1).
FAMILIES = {
    "llama": dict(model_type="llama", **SMALL),
    "qwen2": dict(model_type="qwen2", **SMALL, tie_word_embeddings=True),
    "gemma": dict(model_type="gemma", **SMALL, head_dim=8),
    "mistral": dict(model_type="mistral", **SMALL, sliding_window=32),
    "phi3": dict(model_type="phi3", **SMALL),
    "gpt_neox": dict(
        model_type="gpt_neox",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    ),
    "opt": dict(
        model_type="opt",
        vocab_size=128,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
    ),
    "gpt2": dict(model_type="gpt2", vocab_size=128, n_embd=32, n_layer=4, n_head=4, n_positions=128),
    # MoE with its router loss in the training loss
    "mixtral": dict(
        model_type="mixtral",
        **SMALL,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
    ),
}
for _data in FAMILIES.values():  # special tokens inside the tiny vocabulary (training refits them to its tokenizer)
    _data.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARGS = [*TINY, "--max_steps", "3", "--max_eval_samples", "2", "--save_total_limit", "1"]
# the Hub sources the engines train: the MoE families (Mixtral's stored in bf16 over several files; gpt-oss, which has
# no sdpa kernel, on the eager attention the default becomes for it); tests/test_hub_checkpoints.py loads and exports
# them, and the bf16 Llama, in one process.
TRAINED = list(MOE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """Every family on 1 and 2 ranks: one launch per world size (plain python for one rank, torchrun for two)."""
    cfg = tmp_path_factory.mktemp("configs")
    paths = []
    for name, data in FAMILIES.items():
        (cfg / f"{name}.json").write_text(json.dumps(data))
        paths.append(str(cfg / f"{name}.json"))
    paths += [str(p) for p in sources(tmp_path_factory).values()]
    out = {}
    for n in (1, 2):
        out[n] = tmp_path_factory.mktemp(f"families-ws{n}")
        export = ["--export_final", str(n == 2).lower()]  # the 2-rank run's export is the one loaded
        args = [str(out[n]), *paths, "--", *ARGS, *export]
        if n == 1:
            python("tests/scripts/families.py", args, timeout=600)
        else:
            torchrun(n, "tests/scripts/families.py", args, timeout=600)
    return out


_SOURCES: dict[str, Path] = {}


def sources(tmp_path_factory) -> dict[str, Path]:
    """The Hub sources the runs train, written once."""
    if not _SOURCES:
        _SOURCES.update(build(tmp_path_factory.mktemp("hub"), TRAINED))
    return _SOURCES


def _config(name: str):
    from transformers import AutoConfig

    data = dict(FAMILIES[name])
    return AutoConfig.for_model(data.pop("model_type"), **data)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_world_size_invariance(runs, name):
    one, two = losses(runs[1] / name / "run"), losses(runs[2] / name / "run")
    assert sorted(one) == [1, 2, 3]
    for s in one:
        assert abs(one[s] - two[s]) <= 1e-5 * abs(one[s]), (name, one, two)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_export_loads(runs, name):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = runs[2] / name / "run" / "final"
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert model.config.model_type == FAMILIES[name]["model_type"]
    tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok("def main():\n    return 0\n")["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss) and out.loss.item() < 9.1  # below ln(8192): it learnt something


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "gemma", "opt"])
def test_initial_weights_follow_the_family(runs, name):
    """Constant tensors (norms, biases) equal from_config's; random ones have its standard deviation."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ours = load_file(runs[2] / name / "init" / "model.safetensors")
    torch.manual_seed(0)
    ref = dict(AutoModelForCausalLM.from_config(_config(name)).named_parameters())
    for key, value in ours.items():
        expected = ref[key].detach()
        if expected.numel() == 1 or expected.std() == 0:
            assert torch.equal(value, expected), key
        else:
            assert abs(value.std() / expected.std() - 1) < 0.1, (key, value.std(), expected.std())
    if name == "gpt2":  # the scaled residual projections are what a generic scheme misses
        std = ours["transformer.h.0.attn.c_proj.weight"].std().item()
        assert abs(std / (0.02 / (2 * 4) ** 0.5) - 1) < 0.1
    if name == "gemma":  # zero-centred norms (the layer computes 1 + weight)
        assert not ours["model.norm.weight"].any()


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_engines_and_world_sizes_start_equal(runs, name):
    """The FSDP2 engine on 1 and 2 ranks and the HF engine's unsharded model start from the same weights."""
    import torch
    from safetensors.torch import load_file

    from anygpu.checkpoint import export
    from anygpu.config.args import ModelArguments
    from anygpu.model import modeling

    one = load_file(runs[1] / name / "init" / "model.safetensors")
    two = load_file(runs[2] / name / "init" / "model.safetensors")
    model = modeling.build_full_model(_config(name), ModelArguments(), 42)
    params = {k: v.detach() for k, v in model.named_parameters()}  # a tied weight once, as the export stores it
    hf = export.hub_layout(model, params)  # in the export's layout (Mixtral: one tensor per expert)
    assert sorted(one) == sorted(two) == sorted(hf)
    for key in one:
        assert torch.equal(one[key], two[key]) and torch.equal(one[key], hf[key]), key


@pytest.mark.slow
def test_hf_engine_matches_with_dropout(runs, tmp_path):
    """OPT as shipped (dropout 0.1): the HF engine on one process follows the FSDP2 engine's 2-rank curve,
    so both engines start from the same weights and draw the same masks. (GPT-2 would do too, but Trainer
    counts its target tokens including position 0 until the HF engine counts them itself.) One process:
    plain python, as `accelerate launch --num_processes 1` would exec it, without the launcher's start-up."""

    config = runs[2].parent / "hf-opt.json"
    config.write_text(json.dumps(FAMILIES["opt"]))
    proc = python(
        "run_hf_standalone.py",
        [*ARGS, "--config_name", str(config), "--output_dir", str(tmp_path), "--export_final", "false"],
    )
    assert "masks keyed by (seed, step, sample, call site)" in proc.stdout
    hf, fsdp = losses(tmp_path), losses(runs[2] / "opt" / "run")
    assert sorted(hf) == [1, 2, 3]
    for s in hf:
        assert abs(hf[s] - fsdp[s]) <= 1e-4 * abs(fsdp[s]), (hf, fsdp)


@pytest.fixture(scope="module")
def hf_pretrained(runs, tmp_path_factory) -> Path:
    """The HF engine on one process over each trained Hub source: one launch for all (Mixtral's exported)."""
    root = tmp_path_factory.mktemp("hf-hub")
    plain = [a for a in ARGS if a not in ("--config_name", "tiny")]
    hf_runs(
        1,
        [
            [*plain, "--model_name_or_path", str(_SOURCES[n]), "--output_dir", str(root / n), "--export_final", export]
            for n in TRAINED
            for export in [str(n == "mixtral").lower()]  # one export: the trunk's code, as the native engine's
        ]
        + [  # Mixtral stopped at step 2, then resumed from its checkpoint
            [
                *plain,
                "--model_name_or_path",
                str(_SOURCES["mixtral"]),
                "--output_dir",
                str(root / "mixtral-resumed"),
                "--export_final",
                "false",
                "--save_steps",
                "1",
                *extra,
            ]
            for extra in (["--stop_at_step", "2"], ["--resume_from_checkpoint", "latest"])
        ],  # fmt: skip
        timeout=600,
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_hub_checkpoint_loads_into_shards_bit_for_bit(runs, name):
    """What the native engine loaded on 1 and on 2 ranks (experts and rows split between them, read from the
    files shard by shard), exported in the default layout and dtype, is the source, key for key and bit for bit."""
    import torch

    source = tensors(_SOURCES[name])
    for n in (1, 2):
        loaded = tensors(runs[n] / _SOURCES[name].name / "init")
        assert sorted(loaded) == sorted(source), n
        for key, value in source.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), (n, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_each_rank_reads_only_its_shards(runs, name):
    """On 2 ranks each rank materialises about half of the checkpoint (its rows, its experts), not all of it."""
    whole = json.loads((runs[1] / _SOURCES[name].name / "read-rank0.json").read_text())["elements"]
    assert whole == sum(v.numel() for v in tensors(_SOURCES[name]).values())
    for rank in (0, 1):
        part = json.loads((runs[2] / _SOURCES[name].name / f"read-rank{rank}.json").read_text())["elements"]
        assert 0.45 * whole < part < 0.55 * whole, (rank, part, whole)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_hub_checkpoint_trains_as_the_hf_engine(runs, hf_pretrained, name):
    run = _SOURCES[name].name
    one, two, hf = losses(runs[1] / run / "run"), losses(runs[2] / run / "run"), losses(hf_pretrained / name)
    assert sorted(one) == sorted(hf) == [1, 2, 3]
    for s in one:
        assert abs(one[s] - two[s]) <= 1e-5 * abs(one[s]), (name, one, two)
        assert abs(one[s] - hf[s]) <= 1e-4 * abs(one[s]), (name, one, hf)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_hub_checkpoint_exports_in_its_own_layout(runs, name):
    """The trained 2-rank run's final/: the source's keys (MoE experts one tensor each), its dtype, and
    from_pretrained finds no missing, unexpected or mismatched key."""
    from transformers import AutoModelForCausalLM

    final_dir = runs[2] / _SOURCES[name].name / "run" / "final"
    source, final = tensors(_SOURCES[name]), tensors(final_dir)
    assert sorted(final) == sorted(source)
    assert {v.dtype for v in final.values()} == {v.dtype for v in source.values()}
    _, info = AutoModelForCausalLM.from_pretrained(final_dir, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    if name != "gpt_oss":  # gpt-oss stores its experts fused on the Hub; the others one tensor per expert
        assert any(".experts.0." in key for key in final)


@pytest.mark.slow
def test_hf_engine_resumes_a_moe_with_its_trained_experts(hf_pretrained):
    """The HF engine's checkpoint of Mixtral (experts fused in transformers 5) resumes to the uninterrupted run's
    step 3: Trainer's checkpoint held them one tensor per expert and reloaded them as missing keys, so the resumed
    experts were the starting ones (3e-3 apart at step 3)."""
    straight, resumed = losses(hf_pretrained / "mixtral"), losses(hf_pretrained / "mixtral-resumed")
    assert sorted(resumed) == [1, 2, 3]
    assert abs(resumed[3] - straight[3]) <= 1e-6 * abs(straight[3]), (straight, resumed)


@pytest.mark.slow
def test_hf_engine_exports_the_same_layout(runs, hf_pretrained):
    """The HF engine's final/ of the bf16 Mixtral: the same keys and dtype as the native engine's and the source's."""
    import torch

    hf, ours = (
        tensors(hf_pretrained / "mixtral" / "final"),
        tensors(runs[2] / _SOURCES["mixtral"].name / "run" / "final"),
    )
    assert sorted(hf) == sorted(ours) == sorted(tensors(_SOURCES["mixtral"]))
    assert {v.dtype for v in hf.values()} == {v.dtype for v in ours.values()} == {torch.bfloat16}


def test_the_default_attention_fits_a_family_without_sdpa(tmp_path):
    """gpt-oss has no sdpa kernel: the default sdpa becomes eager (as transformers' own default); a family with sdpa
    keeps it, and a kernel asked for by name is kept."""
    from transformers import AutoConfig

    from anygpu.config.args import ModelArguments
    from anygpu.model import modeling

    for model_type, asked, expected in [
        ("gpt_oss", "sdpa", "eager"),
        ("llama", "sdpa", "sdpa"),
        ("llama", "eager", "eager"),
    ]:
        folder = tmp_path / model_type
        AutoConfig.for_model(model_type).save_pretrained(folder)
        args = ModelArguments(config_name=str(folder), attn_implementation=asked)
        modeling.resolve_config(args)
        assert args.attn_implementation == expected, (model_type, asked)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_a_family_without_sdpa_starts_from_scratch(tmp_path, model_type):
    """Gemma 2 (softcapped scores) and gpt-oss (attention sinks) have no sdpa kernel: a model trained from scratch is
    built and initialised (the family's own initial weights come from a scratch copy) on eager, and runs."""
    import torch
    from transformers import AutoConfig

    from anygpu.config.args import ModelArguments
    from anygpu.model import modeling

    shapes = {"gemma2": dict(head_dim=8), "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8)}
    AutoConfig.for_model(model_type, **SMALL, **shapes[model_type]).save_pretrained(tmp_path)
    args = ModelArguments(config_name=str(tmp_path))
    config = modeling.resolve_config(args)
    model = modeling.build_full_model(config, args, seed=0)
    assert model.config._attn_implementation == "eager"
    logits = model(torch.tensor([[1, 5, 9, 33]])).logits
    assert logits.shape == (1, 4, 128) and torch.isfinite(logits).all()
