"""--ep E (expert parallelism, the FSDP2 engine): the experts of every MoE layer split over E ranks, tokens sent to
them with all-to-all. Three families from Hub-layout folders (Qwen3-MoE with its router loss on, Mixtral in bf16
files of 20 KB, OLMoE) keep the 1-rank curve (every step's loss, gradient norm and the evaluation, 1e-5) with E = 2
on 2 ranks (one copy of each expert), with --cp 2, on 4 ranks (two copies, FSDP2 over them) and under HSDP 2 × 2; a
checkpoint written under E = 2 on 2 ranks resumes under E = 4 on 4; the export is the 1-rank run's, in the source's
own layout; a rank reads only its experts of the Hub files. Four launches."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY, fsdp_runs, records
from dpo_data import write_kinds
from hub_sources import build

ARGS = [a for a in TINY if a not in ("--config_name", "tiny")] + ["--max_eval_samples", "8", "--export_final", "false"]
FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
# the attention adapted, the experts frozen (and split); an lr that moves the adapter visibly in 3 steps
LORA = ["--use_peft", "true", "--lora_target_modules", "q_proj,k_proj,v_proj,o_proj", "--learning_rate", "1e-2"]


def job(source: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [*ARGS, "--model_name_or_path", str(source), "--max_steps", str(steps), "--output_dir", str(out), *extra]


QLORA = ("--use_peft", "true", "--load_in_4bit", "true", "--learning_rate", "1e-2")


def wide_source(source: Path, folder: Path) -> Path:
    """A Qwen3-MoE folder of hidden size 128 (its attention's weights whole NF4 blocks), with `source`'s tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hub_sources import WIDE_MOE

    config = AutoConfig.for_model(**WIDE_MOE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


def dpo_job(source: Path, files: dict, out: Path, *extra: str) -> list[str]:
    """--objective dpo on preference pairs (TRL's explicit-prompt format), 3 steps at a learning rate that moves."""
    train, validation = files["plain"]
    return [
        *("--model_name_or_path", str(source), "--objective", "dpo", "--train_file", str(train)),
        *("--validation_file", str(validation), "--block_size", "64", "--global_batch_size", "12"),
        *("--max_steps", "3", "--logging_steps", "1", "--eval_steps", "0", "--report_to", "none"),
        *(
            "--disable_tqdm",
            "true",
            "--warmup_steps",
            "0",
            "--learning_rate",
            "2e-2",
            "--lr_scheduler_type",
            "constant",
        ),
        *("--export_final", "false", "--output_dir", str(out), *extra),
    ]


@pytest.fixture(scope="module")
def ep(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ep")
    src = build(root, FAMILIES)
    (root / "pairs").mkdir()
    pairs = write_kinds(root / "pairs", train=24, validation=8)
    wide = wide_source(src["qwen3_moe"], root / "wide")  # linear weights in whole NF4 blocks, for QLoRA
    config = src["qwen3_moe"] / "config.json"  # the router's load-balancing loss in the training loss
    config.write_text(json.dumps({**json.loads(config.read_text()), "output_router_logits": True,
                                  "router_aux_loss_coef": 0.05}))  # fmt: skip
    runs = "q1 m1 o1 q2 m2 o2 q4 qc qh l1 l2 qe me qt f1 f2 qo d1 d2 d3 n1 n2"
    out = {name: root / name for name in runs.split()}
    said = {}
    one = fsdp_runs(
        1,
        [
            job(src["qwen3_moe"], out["q1"], 4, "--export_final", "true"),
            job(src["mixtral"], out["m1"], 3),
            job(src["olmoe"], out["o1"], 3),
            job(src["qwen3_moe"], out["l1"], 3, *LORA, "--export_final", "true"),
            job(src["qwen3_moe"], out["qe"], 4, "--experts_implementation", "eager"),  # the loop, not grouped_mm
            job(src["qwen3_moe"], out["f1"], 3, "--fp8", "rowwise"),
            dpo_job(src["qwen3_moe"], pairs, out["d1"]),
            job(wide, out["n1"], 3, *QLORA),
        ],
    )
    # E = 2 on 2 ranks: one copy of each expert; Qwen3-MoE with activation checkpointing, stopped after step 2
    two = fsdp_runs(
        2,
        [
            job(src["qwen3_moe"], out["q2"], 4, "--ep", "2", "--gradient_checkpointing", "true", "--save_steps", "2",
                "--stop_at_step", "2"),
            job(src["mixtral"], out["m2"], 3, "--ep", "2"),
            job(src["olmoe"], out["o2"], 3, "--ep", "2"),
            job(src["qwen3_moe"], out["qc"], 4, "--ep", "2", "--cp", "2"),  # each sequence split over the 2 ranks too
            job(src["qwen3_moe"], out["l2"], 3, "--ep", "2", *LORA, "--export_final", "true"),
            job(src["mixtral"], out["me"], 3, "--ep", "2", "--experts_implementation", "eager"),
            # compiled layers around the dispatch (its data-dependent all-to-all is a graph break): 2 steps, no eval
            job(src["qwen3_moe"], out["qt"], 4, "--ep", "2", "--torch_compile", "true", "--stop_at_step", "2",
                "--eval_on_start", "false"),
            # FP8 linear layers outside the experts; the shards in host memory; DPO, its reference's table computed
            # by an expert-parallel copy, and that copy at every step
            job(src["qwen3_moe"], out["f2"], 3, "--ep", "2", "--fp8", "rowwise"),
            job(src["qwen3_moe"], out["qo"], 4, "--ep", "2", "--cpu_offload", "true"),
            dpo_job(src["qwen3_moe"], pairs, out["d2"], "--ep", "2"),
            dpo_job(src["qwen3_moe"], pairs, out["d3"], "--ep", "2", "--precompute_ref_log_probs", "false"),
            job(wide, out["n2"], 3, *QLORA, "--ep", "2"),  # the attention in 4 bits, the experts frozen and split
        ],
    )  # fmt: skip
    # 4 ranks: E = 2 (two copies of each expert, FSDP2 over them), exported; then the E = 2 run resumed under E = 4
    four = fsdp_runs(
        4,
        [
            job(src["qwen3_moe"], out["q4"], 4, "--ep", "2", "--export_final", "true"),
            job(src["qwen3_moe"], out["q2"], 4, "--ep", "4", "--resume_from_checkpoint", "latest"),
            job(src["qwen3_moe"], out["qh"], 4, "--ep", "2", "--dp_replicate", "2", "--dp_shard", "2"),  # HSDP
        ],
    )
    said.update(q1=one[0], qe=one[4], q2=two[0], qt=two[6], q4=four[0], q2r=four[1])
    return {"out": out, "said": said, "src": src}


def assert_same(got: list[dict], ref: list[dict], what: str) -> None:
    keys = ("loss", "grad_norm", "eval_loss")
    index = {(r["step"], "eval_loss" in r): r for r in ref}
    assert {(r["step"], "eval_loss" in r) for r in got} == set(index), what
    for rec in got:
        other = index[(rec["step"], "eval_loss" in rec)]
        for key in (k for k in keys if k in rec):
            assert abs(rec[key] - other[key]) <= 1e-5 * abs(other[key]), (what, rec["step"], key, rec, other)


@pytest.mark.slow
@pytest.mark.parametrize(
    "run,ref,what",
    [
        ("q2", "q1", "Qwen3-MoE, E = 2 on 2 ranks to step 2, resumed under E = 4 on 4 ranks"),
        ("q4", "q1", "Qwen3-MoE, E = 2 on 4 ranks (two copies of each expert)"),
        ("m2", "m1", "Mixtral (bf16 files), E = 2 on 2 ranks"),
        ("o2", "o1", "OLMoE, E = 2 on 2 ranks"),
        ("qc", "q1", "Qwen3-MoE, E = 2 and --cp 2 on 2 ranks"),
        # the experts' gradients once came out halved here (FSDP2's all-reduce across replica groups averages): the
        # losses hid it (AdamW's step barely depends on the gradient's scale), the gradient norm did not
        ("qh", "q1", "Qwen3-MoE, E = 2 under HSDP 2 × 2"),
        ("l2", "l1", "Qwen3-MoE with a LoRA adapter on the attention, E = 2 on 2 ranks"),
        # the experts computed by the family's per-expert loop instead of one grouped GEMM: the same numbers
        ("qe", "q1", "Qwen3-MoE, --experts_implementation eager on 1 rank"),
        ("me", "m1", "Mixtral (bf16 files), --experts_implementation eager, E = 2 on 2 ranks"),
        ("f2", "f1", "Qwen3-MoE, --fp8 rowwise (the attention's linear layers), E = 2 on 2 ranks"),
        ("qo", "q1", "Qwen3-MoE, --cpu_offload, E = 2 on 2 ranks"),
        ("d2", "d1", "Qwen3-MoE, --objective dpo (the reference's log-probs computed first), E = 2 on 2 ranks"),
        ("d3", "d1", "Qwen3-MoE, --objective dpo (a frozen reference copy at every step), E = 2 on 2 ranks"),
        ("n2", "n1", "Qwen3-MoE, QLoRA (--load_in_4bit), E = 2 on 2 ranks"),
    ],
)
def test_the_same_curve_as_one_rank(ep, run, ref, what):
    assert_same(records(ep["out"][run]), records(ep["out"][ref]), what)


@pytest.mark.slow
def test_compiled_layers_under_ep_keep_the_curve(ep):
    """--torch_compile with --ep 2: inductor's layers, the dispatch between their graphs; steps 1-2 within 1e-4 of
    the eager 1-rank run (the dense engine's compile test holds inductor to that), compiled once (no recompilation)."""
    got, ref = records(ep["out"]["qt"]), {r["step"]: r for r in records(ep["out"]["q1"]) if "loss" in r}
    assert [r["step"] for r in got if "loss" in r] == [1, 2], got
    for rec in (r for r in got if "loss" in r):
        for key in ("loss", "grad_norm"):
            assert abs(rec[key] - ref[rec["step"]][key]) <= 1e-4 * abs(ref[rec["step"]][key]), (key, rec, ref)
    assert "torch.compile:" in ep["said"]["qt"] and "recompil" not in ep["said"]["qt"], ep["said"]["qt"][-3000:]


@pytest.mark.slow
def test_the_router_loss_is_in_the_curve_and_the_banner_names_the_expert_mesh(ep):
    import torch

    from anygpu.model import moe

    with torch.device("meta"):
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ep["src"]["qwen3_moe"]))
    assert moe.aux_loss_coef(model) == 0.05  # the equal curves above include the router's loss
    said = ep["said"]
    assert "experts: 4 in each of 2 MoE layers split over 2 ranks (--ep 2), 2 per rank" in said["q2"], said["q2"]
    assert "one copy" in said["q2"] and "FSDP2-sharded over its 2 copies" in said["q4"], said["q4"]
    assert "resumed from" in said["q2r"] and "at step 2 (was 2 ranks, now 4" in said["q2r"], said["q2r"][-3000:]
    assert "split over 4 ranks (--ep 4), 1 per rank" in said["q2r"]
    assert "experts compute: grouped_mm (one grouped GEMM over all experts" in said["q1"], said["q1"]
    assert "experts compute: eager (the family's per-expert loop" in said["qe"], said["qe"]


@pytest.mark.slow
def test_the_export_is_the_one_rank_models_in_the_sources_layout(ep):
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    one, four, source = (
        tensors(p) for p in (ep["out"]["q1"] / "final", ep["out"]["q4"] / "final", ep["src"]["qwen3_moe"])
    )
    assert sorted(four) == sorted(one) == sorted(source)  # one tensor per expert, as the source has them
    for name, value in one.items():
        assert four[name].shape == value.shape and four[name].allclose(value, rtol=1e-5, atol=1e-6), name


@pytest.mark.slow
def test_the_adapter_under_ep_is_the_one_rank_adapter(ep):
    from safetensors.torch import load_file

    one, two = (load_file(ep["out"][run] / "final" / "adapter_model.safetensors") for run in ("l1", "l2"))
    assert sorted(two) == sorted(one) and any(".q_proj.lora_B." in name for name in one), sorted(one)
    for name, value in one.items():
        assert value.abs().sum() > 0 and two[name].allclose(value, rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
def test_each_rank_reads_only_its_experts(ep, tmp_path):
    """Mixtral's Hub files (one tensor per expert, bf16, 20 KB shards) into E = 2 on 2 ranks, with and without a LoRA
    adapter: each rank reads the elements of its two experts only, half of the expert weights, and its half of the
    rest (FSDP2's rows)."""
    from conftest import torchrun
    from safetensors import safe_open

    source = ep["src"]["mixtral"]
    totals = {"experts": 0, "other": 0}
    for f in source.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                totals["experts" if ".experts." in key else "other"] += math.prod(st.get_slice(key).get_shape())
    runs = [job(source, tmp_path / "full", 1, "--ep", "2"), job(source, tmp_path / "lora", 1, "--ep", "2", *LORA)]
    proc = torchrun(2, "tests/scripts/ep_read_elements.py", [*runs[0], ":::", *runs[1]])
    lines = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("READ ")]
    assert len(lines) == 2, proc.stdout[-3000:]
    for every, what in zip(lines, ("full", "LoRA")):
        assert [r["experts"] for r in every] == [totals["experts"] // 2] * 2, (what, every, totals)
        assert [r["other"] for r in every] == [totals["other"] // 2] * 2, (what, every, totals)  # sizes split evenly


# ---------------------------------------------------------------------- refusals (quick)
def meta_model(model_type: str, **config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hub_sources import SOURCES

    data = {**SOURCES[model_type][0], **config} if model_type in SOURCES else {"model_type": model_type, **config}
    data = dict(data)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(data.pop("model_type"), **data))


@pytest.mark.parametrize(
    "model_type,ep,shape,message",
    [
        ("qwen3_moe", 3, (1, 6), "--ep 3 does not divide the 4 experts of qwen3_moe: use one of [1, 2]"),
        (
            "mixtral",
            4,
            (1, 2),
            "--ep 4 does not divide the 2 ranks of a shard group (dp_shard × cp): use one of [1, 2]",
        ),
        ("llama", 2, (1, 2), "--ep 2: llama has no experts to split"),
    ],
)
def test_an_expert_split_that_cannot_work_is_refused(model_type, ep, shape, message):
    from hub_sources import SMALL

    from anygpu.errors import UsageError
    from anygpu.runtime import expert_parallel
    from anygpu.runtime.mesh import MeshShape

    model = meta_model(model_type, **({} if model_type != "llama" else SMALL))
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        expert_parallel.check(model, ep, MeshShape(*shape))
    expert_parallel.check(model, 1, MeshShape(*shape))  # --ep 1: nothing to check


def test_ep_with_the_hf_engine_is_refused():
    from anygpu.config.args import parse_args
    from anygpu.engines.trunk import startup
    from anygpu.errors import UsageError

    t = parse_args(["--config_name", "tiny", "--ep", "2"])[2]
    with pytest.raises(UsageError, match="--ep 2: expert parallelism is the FSDP2 engine's"):
        startup.check_ep(t, "hf")
    startup.check_ep(t, "fsdp")


def lora_args(**kw) -> SimpleNamespace:
    fields = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_modules_to_save=None)
    return SimpleNamespace(**{**fields, **kw})


def test_lora_on_the_experts_weights_is_refused_under_ep_and_an_attention_adapter_is_not():
    """peft adapts a MoE's 3-D expert weights when the targets map onto them (all-linear): under --ep that adapter
    would not be split, so it is refused by name; an adapter outside the experts passes, with --ep 1 too."""
    from anygpu.errors import UsageError
    from anygpu.model import lora
    from anygpu.runtime import expert_parallel
    from anygpu.runtime.mesh import MeshShape

    experts = lora.wrap(meta_model("qwen3_moe"), lora_args(lora_target_modules=["all-linear"]))
    with pytest.raises(UsageError, match=r"--ep 2 with LoRA on the experts' own weights \(down_proj, gate_up_proj;"):
        expert_parallel.check(experts, 2, MeshShape(1, 2))
    expert_parallel.check(experts, 1, MeshShape(1, 2))
    attention = lora.wrap(meta_model("qwen3_moe"), lora_args(lora_target_modules=["q_proj", "v_proj"]))
    expert_parallel.check(attention, 2, MeshShape(1, 2))
    with pytest.raises(UsageError, match="adapt the attention \\(--lora_target_modules k_proj,o_proj,q_proj,v_proj\\)"):
        expert_parallel.check(experts, 2, MeshShape(1, 2))
    assert "parameters down_proj" in lora.trainable_line(experts)  # the banner names the adapted expert weights


def test_an_experts_implementation_is_refused_for_a_dense_model_or_by_an_unknown_name():
    from anygpu.config.args import parse_args
    from anygpu.errors import UsageError
    from anygpu.model import modeling

    model_args = parse_args(["--config_name", "tiny", "--experts_implementation", "eager"])[0]
    with pytest.raises(UsageError, match="--experts_implementation eager: llama has no experts module"):
        modeling.resolve_config(model_args)
    with pytest.raises(UsageError, match="--experts_implementation 'grouped' is unknown: use grouped_mm, eager"):
        parse_args(["--config_name", "tiny", "--experts_implementation", "grouped"])


def test_lora_dropout_where_peft_adapts_the_experts_is_refused_by_name():
    from anygpu.errors import UsageError
    from anygpu.model import lora

    args = lora_args(lora_target_modules=["all-linear"], lora_dropout=0.05)
    with pytest.raises(
        UsageError,
        match="--lora_dropout 0.05 with --lora_target_modules all-linear on mixtral: .* use --lora_dropout 0",
    ):
        lora.wrap(meta_model("mixtral"), args)


@pytest.mark.parametrize("objective", [["dpo"], ["grpo", "--reward_funcs", "accuracy"]])
def test_the_default_lora_dropout_adapts_the_experts_where_the_objective_turns_dropout_off(objective):
    """DPO and GRPO run without dropout (TRL's disable_dropout): the default --lora_dropout 0.05 is then no reason to
    refuse peft's adapter on the experts' own weights; the adapter is built without dropout (SFT still refuses)."""
    import torch

    from anygpu.config.args import parse_args
    from anygpu.engines import fsdp
    from anygpu.errors import UsageError
    from anygpu.model import lora

    argv = ["--model_name_or_path", "base", "--use_peft", "true", "--lora_target_modules", "all-linear"]
    model_args, _, train_args = parse_args([*argv, "--objective", *objective])[:3]
    wrapped = fsdp.adapted(meta_model("mixtral"), model_args, train_args)
    assert "parameters down_proj" in lora.trainable_line(wrapped)  # the experts' own weights adapted
    assert not [n for n, m in wrapped.named_modules() if isinstance(m, torch.nn.Dropout) and m.p]
    model_args, _, train_args = parse_args(argv)[:3]
    with pytest.raises(UsageError, match="--lora_dropout 0.05 with --lora_target_modules all-linear on mixtral"):
        fsdp.adapted(meta_model("mixtral"), model_args, train_args)


def test_the_plan_counts_the_experts_and_what_ep_gathers(tmp_path, capsys):
    """`anygpu plan` on a MoE config: the experts line; --ep 4 of 8 GPUs gathers a quarter of each layer's experts,
    names the all-to-all per step and leaves only the FSDP2 engine's rows; a dense model with --ep is refused."""
    from hub_sources import SOURCES

    from anygpu.planning import memory_plan
    from anygpu.tools import plan

    config = tmp_path / "moe.json"
    data = dict(SOURCES["qwen3_moe"][0], num_experts=8, hidden_size=256, moe_intermediate_size=128)
    config.write_text(json.dumps(data))
    common = ["--config_name", str(config), "--gpu", "h100", "--num_gpus", "8", "--block_size", "128"]
    assert plan.main(common) == 0
    out = capsys.readouterr().out
    assert "experts: 8 in each of 2 MoE layers (top 2)" in out and "--ep 8 (E divides the experts" in out, out
    shapes = plan.load_shapes(None, str(config))[0]
    experts = 8 * 3 * 256 * 128  # gate_up (2 × 128 × 256) and down (256 × 128) per expert
    assert shapes.layer_expert_numel == experts and shapes.num_experts == 8 and shapes.moe_layers == 2
    split = memory_plan.gathered_layer_numel(dataclasses.replace(shapes, ep=4))
    assert shapes.layer_param_numel - split == experts * 3 // 4
    assert (
        memory_plan.all_to_all_bytes(dataclasses.replace(shapes, ep=4), 100, "bf16")
        == 100 * 2 * 256 * 2 * 4 * 2 * 3 // 4
    )
    full, _ = plan.plan(plan.build_parser().parse_args([*common, "--ep", "4"]))
    assert {r.strategy for r in full.rows} <= {"fsdp2", "hsdp"} and any("--ep 4: 2 per GPU" in n for n in full.notes)
    assert plan.main(["--config_name", "tiny", "--num_gpus", "8", "--gpu", "h100", "--ep", "2"]) == 2
    assert "--ep 2: llama has no experts to split" in capsys.readouterr().err
