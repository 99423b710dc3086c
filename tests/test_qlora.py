"""QLoRA (`--use_peft true --load_in_4bit true`, the FSDP2 engine; torchao's NF4 under FSDP2).

Slow (one 2-rank launch, one 1-rank launch of several runs): the same losses on 1 and 2 ranks and a 2-rank checkpoint
resumed on 1 rank (1e-5), within a few percent of LoRA over the same base in fp32, the 4-bit bytes rank 0 holds
(measured by the engine) as the plan counts them, `final/` an adapter, and the merged model evaluating exactly as the
trained one did (the merge is over the dequantised base). Slow too (one launch of each more): --bf16 true on one rank
(FSDP2 over a one-rank shard group) over two Hub folders, bf16 and fp32 of other shapes, as on 2 ranks. Quick: the
format's sharding independence, its byte count against torchao's tensors, the plan, the merge's base and every refusal.

The base: a Llama with hidden 128 and MLP 256 (attention weights of 128 × 128, one 64 × 256 scale block: 4-bit but
not split over 2 ranks, so kept whole on each; MLP weights split), weights drawn at std 0.25 so that its loss (10.7,
uniform is 6.9) moves with the weights: a wrong dequantisation would show.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY, fsdp_runs, losses, records
from test_lora import build_base

from anygpu.config import nf4
from anygpu.errors import UsageError

SCRIPT = "run_fsdp_standalone.py"
ARGS = [a for a in TINY if a not in ("--config_name", "tiny")] + [
    "--max_steps", "3", "--max_eval_samples", "16", "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8",
    "--lora_dropout", "0.1", "--lora_target_modules", "all-linear", "--learning_rate", "1e-2", "--eval_steps", "3",
    "--eval_on_start", "true",
]  # fmt: skip
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 4, "initializer_range": 0.25}


def qlora_base(folder: Path) -> None:
    """test_lora's base folder (tokenizer, chat template) with the shapes and weights above."""
    import transformers

    plain = transformers.LlamaConfig
    transformers.LlamaConfig = lambda **kw: plain(**{**kw, **SHAPE})
    try:
        build_base(folder)
    finally:
        transformers.LlamaConfig = plain


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("qbase")
    qlora_base(base)
    out = {name: tmp_path_factory.mktemp(name) for name in ("one", "two", "lora", "merged")}
    q = [*ARGS, "--model_name_or_path", str(base), "--load_in_4bit", "true"]
    stdout = {}
    (stdout["two"],) = fsdp_runs(2, [[*q, "--output_dir", str(out["two"]), "--save_steps", "2", "--stop_at_step", "2"]])
    stdout["one"], stdout["resumed"], stdout["lora"], stdout["merged"] = fsdp_runs(
        1,
        [
            [*q, "--output_dir", str(out["one"]), "--merge_lora", "true"],
            [*q, "--output_dir", str(out["two"]), "--resume_from_checkpoint", "latest"],
            [*ARGS, "--model_name_or_path", str(base), "--output_dir", str(out["lora"])],
            # the merged model's step-0 evaluation on the same rows (a full fine-tune that stops before training)
            [
                *ARGS,
                "--model_name_or_path",
                str(out["one"] / "final-merged"),
                "--use_peft",
                "false",
                "--output_dir",
                str(out["merged"]),
                "--max_steps",
                "1",
                "--export_final",
                "false",
            ],
        ],  # fmt: skip
    )
    return {"base": base, "out": out, "stdout": stdout}


def eval_losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records(output_dir) if "eval_loss" in r}


@pytest.mark.slow
def test_two_ranks_and_a_resume_on_one_follow_one_ranks_curve(runs):
    one, two = losses(runs["out"]["one"]), losses(runs["out"]["two"])
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert "was 2 ranks, now 1" in runs["stdout"]["resumed"]
    for step in one:  # steps 1-2: 2 ranks; step 3: resumed on 1 rank from the 2-rank checkpoint
        assert abs(one[step] - two[step]) <= 1e-5 * abs(one[step]), (one, two)
    assert eval_losses(runs["out"]["one"]) == pytest.approx(eval_losses(runs["out"]["two"]), rel=1e-5)


@pytest.mark.slow
def test_near_lora_over_the_unquantised_base(runs):
    qlora, lora = eval_losses(runs["out"]["one"]), eval_losses(runs["out"]["lora"])
    assert sorted(qlora) == sorted(lora) == [0, 3]
    for step in lora:  # 4-bit weights, yet within 3% (measured 0.1%); not equal: the base really is quantised
        assert abs(qlora[step] - lora[step]) <= 0.03 * lora[step], (qlora, lora)
        assert qlora[step] != lora[step]
    assert lora[0] > 9, lora  # far above uniform (6.9): the loss depends on the weights


@pytest.mark.slow
def test_rank_bytes_are_the_plans_and_the_banner_says_them(runs):
    from anygpu.tools import plan as plan_tool

    def said(stdout: str) -> tuple[int, float, float]:
        m = re.search(r"QLoRA: (\d+) linear weights in 4-bit NF4 .*?: ([\d.]+) MiB instead of [\d.]+ MiB in float32, "
                      r"([\d.]+) MiB of them on this rank", stdout)  # fmt: skip
        assert m, stdout[-3000:]
        return int(m[1]), float(m[2]), float(m[3])

    shapes, _, _ = plan_tool.load_shapes(str(runs["base"]), None, 4, ("all-linear",), load_in_4bit=True)
    four = [p for p in shapes.params if p.four_bit]
    assert len(four) == 14  # 2 layers × (q, k, v, o, gate, up, down); lm_head stays fp32
    count, whole, rank0 = said(runs["stdout"]["two"])
    planned = sum(nf4.nbytes(nf4.held_elements(p.shape, 2), 4) for p in four) / 2**20
    assert count == 14 and abs(rank0 - planned) < 1e-3, (rank0, planned)
    assert abs(whole - sum(nf4.nbytes(p.numel, 4) for p in four) / 2**20) < 1e-3
    assert rank0 < 0.75 * whole  # the MLP's weights split, the attention's (one scale block) whole on each rank
    _, whole1, rank1 = said(runs["stdout"]["one"])
    assert whole1 == rank1 == whole


@pytest.mark.slow
def test_final_is_an_adapter_and_the_merge_evaluates_as_the_run_did(runs):
    final = runs["out"]["one"] / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(runs["base"])
    assert not list(final.glob("model*.safetensors"))
    assert "merged over the base dequantised from its 4-bit NF4 weights" in runs["stdout"]["one"]
    trained, merged = eval_losses(runs["out"]["one"]), eval_losses(runs["out"]["merged"])
    assert merged[0] == pytest.approx(trained[3], rel=1e-5), (trained, merged)


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> dict:
    """--bf16 true (FSDP2's mixed precision: FSDP2 even on one rank) over two Hub folders unlike in dtype and shape
    (hub_sources.NF4_SOURCES): both on one rank with LoRA over the bf16 one beside them, the bf16 one on 2 ranks too,
    and the fp32 one in fp32 on 2 ranks as 2 replicas of one (HSDP: shard groups of one rank). Output folders and
    stdouts by run name."""
    from hub_sources import NF4_SOURCES, build

    folders = build(tmp_path_factory.mktemp("hub"), NF4_SOURCES)
    out = {name: tmp_path_factory.mktemp(name) for name in ("bf16", "fp32", "bf16_lora", "bf16_two", "hsdp")}

    def job(source: str, run: str, *extra: str, four_bit: str = "true") -> list[str]:
        where = ["--model_name_or_path", str(folders[f"llama_nf4_{source}"]), "--output_dir", str(out[run])]
        return [*ARGS, *where, "--load_in_4bit", four_bit, *extra]

    bf16 = ("--bf16", "true")
    one = fsdp_runs(1, [job("bf16", "bf16", *bf16), job("fp32", "fp32", *bf16),
                        job("bf16", "bf16_lora", *bf16, four_bit="false")])  # fmt: skip
    two = fsdp_runs(2, [job("bf16", "bf16_two", *bf16), job("fp32", "hsdp", "--dp_replicate", "2")])
    return {"out": out, "stdout": dict(zip(("bf16", "fp32", "bf16_lora", "bf16_two", "hsdp"), one + two))}


@pytest.mark.slow
def test_one_rank_in_bf16_trains_as_two_ranks_do(bf16_runs):
    """On one rank FSDP2 skips the all-gather and rebuilds a parameter from its first all-gather input alone, not
    NF4's three: there every 4-bit weight stays out of FSDP2 (as on 2 ranks those whose rows do not split), whatever
    the folder's dtype and shape. The curve is 2 ranks', whose split 4-bit weights FSDP2 gathers, and near LoRA's."""
    out, stdout = bf16_runs["out"], bf16_runs["stdout"]
    assert "QLoRA: 10 linear weights in 4-bit NF4" in stdout["bf16"] and "in bfloat16" in stdout["bf16"]
    for run in ("fp32", "hsdp"):
        assert "QLoRA: 6 linear weights in 4-bit NF4" in stdout[run], stdout[run][-3000:]
    assert "mesh 2 × 1 (dp_replicate × dp_shard)" in stdout["hsdp"]
    one, two = losses(out["bf16"]), losses(out["bf16_two"])
    assert sorted(one) == sorted(two) == sorted(losses(out["fp32"])) == sorted(losses(out["hsdp"])) == [1, 2, 3]
    # bf16 matmuls over 4 rows a rank, not 8, sum in another order (measured: 1e-7 at step 1, 2e-5 at step 3)
    assert one == pytest.approx(two, rel=1e-4), (one, two)
    qlora, lora = eval_losses(out["bf16"]), eval_losses(out["bf16_lora"])
    assert qlora == pytest.approx(lora, rel=0.03) and qlora != lora, (qlora, lora)  # really 4-bit, and close
    for run in ("bf16", "fp32", "hsdp"):  # the adapter learns over the 4-bit base
        evals = eval_losses(out[run])
        assert evals[3] < evals[0], (run, evals)


def test_quantised_rows_do_not_depend_on_the_sharding():
    """A weight quantised whole then split by rows holds, on each rank, exactly the rows of the whole's
    dequantisation; quantising a rank's rows alone would not (the nested scales are about the whole tensor's mean)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    whole = to_nf4(weight, nf4.BLOCK, nf4.SCALER_BLOCK)
    assert nf4.splits((256, 128), 2) and not nf4.splits((128, 128), 2) and not nf4.splits((256, 128), 3)
    for rank, part in enumerate(torch.chunk(whole, 2, dim=0)):
        rows = slice(128 * rank, 128 * (rank + 1))
        assert torch.equal(part.get_original_weight(), whole.get_original_weight()[rows])
        assert not torch.equal(to_nf4(weight[rows], 64, 256).get_original_weight(), part.get_original_weight())


def test_counted_bytes_are_torchaos_tensors():
    from anygpu.model import qlora

    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for shape, dtype in (((512, 256), torch.float32), ((256, 384), torch.bfloat16)):
        whole = to_nf4(torch.randn(shape).to(dtype), nf4.BLOCK, nf4.SCALER_BLOCK)
        assert qlora.local_bytes(whole) == nf4.nbytes(whole.numel(), dtype.itemsize)
        half = torch.chunk(whole, 2, dim=0)[1]
        assert qlora.local_bytes(half) == nf4.nbytes(nf4.held_elements(shape, 2), dtype.itemsize)
        assert qlora.local_bytes(whole) < 0.27 * whole.numel() * 2  # ~0.52 bytes a weight, a quarter of bf16


def test_the_merge_goes_over_the_base_the_run_computed_with():
    """`dequantise_base` changes exactly the weights a run holds in 4 bits, to their dequantised values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from anygpu.model import qlora

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, num_hidden_layers=1, num_attention_heads=4, **SHAPE))
    before = {n: p.clone() for n, p in model.named_parameters()}
    qlora.dequantise_base(model, torch.bfloat16)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    linear = {f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    assert changed == linear  # not the embedding, the norms, nor lm_head (512 × 128: 4-bit-able, kept as peers keep it)
    w = before["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, qlora.dequantised(w, torch.bfloat16).float())


def test_the_plan_counts_a_4bit_base():
    """Llama-3-8B on one 16 GB GPU: LoRA over its bf16 base (16 GB) cannot fit without offload; over the 4-bit base
    (every linear weight but lm_head, ~0.52 bytes each) it fits on the GPU, with the FSDP2 engine."""
    from dataclasses import replace

    from anygpu.planning import memory_plan
    from anygpu.tools import plan as plan_tool

    qlora, _, _ = plan_tool.load_shapes(None, "llama-8b", 16, (), load_in_4bit=True)
    four = [p for p in qlora.params if p.four_bit]
    assert 0.85 * qlora.num_params < sum(p.numel for p in four) < qlora.num_params  # not lm_head nor the embedding
    assert all(not p.trainable and len(p.shape) == 2 for p in four) and len(four) == 32 * 7
    lora = replace(qlora, params=tuple(replace(p, four_bit=False) for p in qlora.params))
    machine = memory_plan.Machine(1, 16 << 30)
    plans = {
        name: memory_plan.make_plan(s, machine, 2048, 8, lora=True) for name, s in (("lora", lora), ("qlora", qlora))
    }
    rec = plans["qlora"].recommended
    assert rec is not None and rec.strategy == "fsdp2" and not rec.cpu_bytes, rec
    assert {r.strategy for r in plans["qlora"].rows} == {"fsdp2"}  # the FSDP2 engine's, no offload
    assert plans["lora"].recommended is None or plans["lora"].recommended.cpu_bytes
    four_gib = rec.per_gpu_bytes["parameters"]
    assert four_gib < 0.4 * memory_plan.model_state_bytes(lora, "fsdp2", "bf16", 1)[0]["parameters"]
    # host RAM: the FSDP2 engine reads one tensor at a time (not the 32 GB fp32 model), and exports the adapter
    assert rec.host_bytes["loading"] == 4 * max(p.numel for p in qlora.params)
    assert rec.host_bytes["exporting"] == 4 * qlora.num_trainable and rec.host_bytes["merging"] == 4 * qlora.num_params


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--use_peft", "false"], "--load_in_4bit true trains a LoRA adapter over a 4-bit base (QLoRA): add --use_peft true"),
        (["--bnb_4bit_quant_type", "fp4"], "--bnb_4bit_quant_type 'fp4' is not offered: use nf4"),
    ],
)  # fmt: skip
def test_arguments_that_cannot_work_are_refused(extra, expected, tmp_path):
    from anygpu.config.args import parse_args

    with pytest.raises(UsageError, match=re.escape(expected)):
        parse_args([*TINY, "--model_name_or_path", str(tmp_path), "--use_peft", "true", "--load_in_4bit", "true", *extra,
                    "--output_dir", "/tmp/unused"])  # fmt: skip


@pytest.mark.parametrize(
    "engine, extra, expected",
    [
        ("hf", [], "--load_in_4bit true (QLoRA) is the FSDP2 engine's"),
        ("fsdp", ["--fp8", "rowwise"], "--load_in_4bit true with --fp8 rowwise"),
        ("fsdp", ["--cpu_offload", "true"], "--load_in_4bit true with --cpu_offload true"),
    ],
)
def test_levers_that_cannot_hold_a_4bit_base_are_refused(engine, extra, expected, tmp_path):
    from anygpu.config.args import parse_args
    from anygpu.engines.trunk import startup

    model_args, _, train_args = parse_args(
        [
            *TINY,
            "--model_name_or_path",
            str(tmp_path),
            "--use_peft",
            "true",
            "--load_in_4bit",
            "true",
            *extra,
            "--output_dir",
            "/tmp/unused",
        ]  # fmt: skip
    )
    with pytest.raises(UsageError, match=re.escape(expected)):
        startup.check_4bit(model_args, train_args, engine)


def test_a_model_with_nothing_to_quantise_is_refused():
    """test_lora's base (hidden 32: no linear weight of a whole 64 × 256 block) under --load_in_4bit."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from anygpu.config.args import ModelArguments
    from anygpu.model import lora, modeling, qlora

    config = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = modeling.build_meta_model(config, ModelArguments())
    model = lora.wrap(model, SimpleNamespace(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                             lora_target_modules=None, lora_modules_to_save=None))  # fmt: skip
    with pytest.raises(UsageError, match="--load_in_4bit true: llama has no frozen nn.Linear weight"):
        qlora.apply(model, True)


@pytest.mark.slow  # three 8B meta models (~8 s): no process is started
def test_a_lora_plan_that_needs_offload_says_a_4bit_base_fits(capsys):
    from anygpu.tools import plan as plan_tool

    args = ["--config_name", "llama-8b", "--gpu_memory_gb", "16", "--num_gpus", "1", "--block_size", "2048",
            "--global_batch_size", "8", "--finetune", "lora"]  # fmt: skip
    assert plan_tool.main(args) == 0
    out = capsys.readouterr().out
    assert "recommendation: fsdp2_offload" in out or "nothing fits" in out, out
    assert "or without offload, the base in 4 bits (QLoRA): --use_peft true --load_in_4bit true with fsdp2" in out, out


def test_the_banner_says_a_moes_routed_experts_stay_unquantised():
    """NF4 takes linear layers: a MoE's routed experts (3-D weights, most of its parameters) keep their dtype, which
    the QLoRA line says rather than letting the 4-bit figures stand for the whole base."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from anygpu.model import lora, qlora

    from hub_sources import WIDE_MOE

    config = AutoConfig.for_model(**WIDE_MOE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    args = SimpleNamespace(
        use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=None, lora_modules_to_save=None
    )
    model = qlora.apply(lora.wrap(model, args), True)
    experts = 2 * 4 * 3 * 128 * 64
    assert f"the routed experts of 2 MoE layers ({experts / 1e6:.1f}M parameters" in qlora.note(model)
