"""`anygpu plan`: the planned model-state bytes per rank equal what a real FSDP2 run holds, its JSON
has the documented rows, and the recommendation fits. Activations are estimates: their check against
`torch.cuda.max_memory_allocated` needs a GPU (pending here)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess

import pytest
from conftest import TINY, python, torchrun

from anygpu.planning import memory_plan
from anygpu.tools import cli
from anygpu.tools import plan as plan_tool

STATES = ("parameters", "gradients", "optimizer")


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory):
    """A small pretrained model folder for the LoRA runs, and its shapes with r = 4 adapters on every linear."""
    from test_lora import build_base

    base = tmp_path_factory.mktemp("lora-base")
    build_base(base)
    shapes, _, _ = plan_tool.load_shapes(str(base), None, 4, ("all-linear",))
    return base, shapes


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory):
    """A tiny Mixtral (4 experts, top 2, router loss on) with the tiny preset's dimensions."""
    path = tmp_path_factory.mktemp("moe") / "moe.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 8192,
                "max_position_embeddings": 512,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "output_router_logits": True,
                "router_aux_loss_coef": 0.02,
                "tie_word_embeddings": False,
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def measured(lora_base, moe_config, tmp_path_factory):
    """Per-rank bytes of parameters, gradients and optimizer state of real FSDP2 runs: the tiny and default
    presets and a tiny MoE (fp32, full), and LoRA over the base in fp32 and bf16, all in one launch per world
    size (plain python for one rank); on 2 ranks also tiny as HSDP 2 × 1 (two replicas, nothing sharded)."""
    out = {}
    args = [a for a in TINY if a not in ("--config_name", "tiny")]
    lora = [
        *args,
        "--model_name_or_path",
        str(lora_base[0]),
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        "--lora_target_modules",
        "all-linear",
    ]
    for nproc in (1, 2):
        groups = [
            f"tiny,default,{moe_config}",
            *args,
            "--output_dir",
            str(tmp_path_factory.mktemp(f"states{nproc}")),
            ":::",
            "pretrained",
            *lora,
            "--output_dir",
            str(tmp_path_factory.mktemp(f"lora-states{nproc}")),
            ":::",
            "pretrained",
            *lora,
            "--bf16",
            "true",
            "--output_dir",
            str(tmp_path_factory.mktemp(f"lora-bf16-{nproc}")),
        ]
        groups += [":::", "tiny:accumulation", *args, "--per_device_train_batch_size", "1"]
        groups += ["--output_dir", str(tmp_path_factory.mktemp(f"accumulation{nproc}"))]
        if nproc == 2:
            groups += [
                ":::",
                "tiny:hsdp",
                *args,
                "--dp_replicate",
                "2",
                "--output_dir",
                str(tmp_path_factory.mktemp("hsdp")),
            ]
        proc = (
            python("tests/scripts/state_bytes.py", groups)
            if nproc == 1
            else torchrun(nproc, "tests/scripts/state_bytes.py", groups)
        )
        for line in proc.stdout.splitlines():
            if line.startswith("BYTES "):
                _, preset, data = line.split(" ", 2)
                out[preset, nproc] = json.loads(data)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "default"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_planned_model_states_equal_the_sharded_tensors(measured, preset, nproc):
    shapes, _, _ = plan_tool.load_shapes(None, preset)
    for rank, real in enumerate(measured[preset, nproc]):
        assert real["vocab_size"] == shapes.vocab_size
        planned, cpu = memory_plan.model_state_bytes(shapes, "fsdp2", "fp32", nproc, rank)
        assert cpu == 0
        for key in STATES:
            assert abs(planned[key] - real[key]) <= 0.01 * real[key], (preset, nproc, rank, key, planned, real)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_planned_gradients_hold_with_gradient_accumulation(measured, nproc):
    """8 / nproc accumulation steps: after every micro-batch's backward a rank holds the gradient bytes the plan
    counts and no more (no accumulation buffer: FSDP2 reduce-scatters each micro-batch into the sharded gradient)."""
    shapes, _, _ = plan_tool.load_shapes(None, "tiny")
    for rank, real in enumerate(measured["tiny:accumulation", nproc]):
        assert real["micro_batches"] == 8 // nproc
        planned, _ = memory_plan.model_state_bytes(shapes, "fsdp2", "fp32", nproc, rank)
        assert abs(planned["gradients"] - real["gradients_held"]) <= 0.01 * planned["gradients"], (rank, planned, real)


@pytest.mark.slow
def test_planned_hsdp_states_are_divided_by_the_shard_group(measured):
    """HSDP 2 × 1 on 2 ranks: each rank holds a whole replica (S = 1), as the plan's hsdp rows count, not half."""
    shapes, _, _ = plan_tool.load_shapes(None, "tiny")
    for real in measured["tiny:hsdp", 2]:
        planned, _ = memory_plan.model_state_bytes(shapes, "hsdp", "fp32", 1)
        for key in STATES:
            assert abs(planned[key] - real[key]) <= 0.01 * real[key], (key, planned, real)
        assert real["parameters"] > 1.9 * measured["tiny", 2][0]["parameters"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_lora_states_equal_the_sharded_tensors(measured, lora_base, precision):
    """LoRA: the frozen base's parameters (in bf16 under --bf16), and gradients and AdamW state of the adapter
    only, as planned."""
    shapes = lora_base[1]
    assert 0 < shapes.num_trainable < sum(p.numel for p in shapes.params) / 10
    for nproc in (1, 2):
        real = measured["pretrained" + ("+bf16" if precision == "bf16" else ""), nproc]
        for rank, m in enumerate(real):
            planned, _ = memory_plan.model_state_bytes(shapes, "fsdp2", precision, nproc, rank)
            for key in STATES:
                assert abs(planned[key] - m[key]) <= 0.01 * m[key], (nproc, rank, key, planned, m)


@pytest.mark.slow
def test_planned_moe_states_equal_the_sharded_tensors(measured, moe_config):
    """MoE: every expert's parameters, gradients and AdamW state, as planned."""
    shapes, _, _ = plan_tool.load_shapes(None, str(moe_config))
    for nproc in (1, 2):
        for rank, m in enumerate(measured["moe", nproc]):
            assert m["vocab_size"] == shapes.vocab_size
            planned, _ = memory_plan.model_state_bytes(shapes, "fsdp2", "fp32", nproc, rank)
            for key in STATES:
                assert abs(planned[key] - m[key]) <= 0.01 * m[key], (nproc, rank, key, planned, m)


def test_states_shard_by_n_and_sum_to_16_bytes_per_parameter():
    shapes, _, _ = plan_tool.load_shapes(None, "default")
    n = shapes.num_params
    for precision in ("fp32", "bf16"):
        for strategy in ("ddp", "zero3", "fsdp2"):
            one, _ = memory_plan.model_state_bytes(shapes, strategy, precision, 1)
            assert sum(one.values()) == 16 * n
        eight = sum(memory_plan.model_state_bytes(shapes, "zero3", precision, 8)[0].values())
        assert abs(eight - 16 * n / 8) <= 16 * 8  # padding only
        ddp8 = sum(memory_plan.model_state_bytes(shapes, "ddp", precision, 8)[0].values())
        assert ddp8 == 16 * n  # DDP replicates everything
    states, cpu = memory_plan.model_state_bytes(shapes, "zero3_offload", "bf16", 4)
    assert sum(states.values()) == 0 and cpu > 0


def test_activations_grow_with_batch_and_shrink_with_checkpointing():
    shapes, _, _ = plan_tool.load_shapes(None, "llama-1b")
    one = memory_plan.activation_bytes(shapes, 1, 2048, "bf16", False, lean_loss=False)
    assert memory_plan.activation_bytes(shapes, 2, 2048, "bf16", False, lean_loss=False) == 2 * one
    assert memory_plan.activation_bytes(shapes, 1, 2048, "bf16", True, lean_loss=False) < one / 1.5
    assert memory_plan.activation_bytes(shapes, 1, 2048, "fp32", False, lean_loss=False) > one


def test_the_lean_loss_holds_one_chunk_of_logits_not_all():
    """The engines' default: per token the hidden states' gradient instead of (dtype + 2 fp32) logits, plus one
    chunk's logits; at a 128k vocabulary and 8 × 4096 tokens that is gigabytes less."""
    from anygpu.model import lean_loss

    assert memory_plan.LEAN_CHUNK_BYTES == lean_loss.GPU_CHUNK_BYTES
    shapes, _, _ = plan_tool.load_shapes(None, "llama-1b")
    shapes = dataclasses.replace(shapes, vocab_size=128256)
    own = memory_plan.activation_bytes(shapes, 8, 4096, "bf16", True, lean_loss=False)
    lean = memory_plan.activation_bytes(shapes, 8, 4096, "bf16", True)
    tokens, v, h = 8 * 4096, 128256, shapes.hidden_size
    chunk = memory_plan.LEAN_CHUNK_BYTES // (4 * v)
    assert own - lean == tokens * (v * 10 - 2 * h) - chunk * v * 10
    assert own - lean > 10 * 2**30


def run_plan(*args: str) -> subprocess.CompletedProcess:
    """`anygpu plan ARGS` in this process (the CLI's own entry point; imports already paid)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["plan", *args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def plan_json():
    proc = run_plan(
        "--config_name",
        "llama-8b",
        "--block_size",
        "4096",
        "--global_batch_size",
        "64",
        "--num_gpus",
        "8",
        "--gpu_memory_gb",
        "80",
        "--gpu_name",
        "H100",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_json_rows_cover_every_variant(plan_json):
    rows = plan_json["rows"]
    keys = {(r["strategy"], r["precision"], r["activation_checkpointing"], r["lora"]) for r in rows}
    assert keys == {
        (s, p, c, lo)
        for s in memory_plan.STRATEGIES
        for p in ("fp32", "bf16")
        for c in (False, True, "selective")
        for lo in (False, True)
        if c != "selective" or s == "fsdp2"  # selective checkpointing is the FSDP2 engine's
    }
    for r in rows:
        assert set(r["per_gpu_bytes"]) >= {"parameters", "gradients", "optimizer", "activations"}
        assert isinstance(r["fits"], bool)
    by = {(r["strategy"], r["precision"], r["activation_checkpointing"], r["lora"]): r for r in rows}
    # an 8B model does not fit DDP on 80 GB (16 bytes/parameter = 128 GB), but fits sharded over 8
    assert not by["ddp", "bf16", False, False]["fits"] and by["fsdp2", "bf16", True, False]["fits"]


def test_recommendation_fits_and_keeps_the_global_batch(plan_json):
    rec = plan_json["recommended"]["full"]
    assert rec["fits"] and rec["strategy"] != "ddp"
    assert rec["micro_batch"] * 8 * rec["gradient_accumulation_steps"] == 64
    assert rec["step_seconds"] > 0 and rec["mfu"] == 0.4
    assert rec["total_bytes"] <= 0.9 * 80 * 2**30


def test_table_and_bad_input():
    proc = run_plan(
        "--config_name", "tiny", "--num_gpus", "2", "--gpu_memory_gb", "16", "--block_size", "64", "--table"
    )
    assert proc.returncode == 0, proc.stderr
    assert "recommendation: ddp" in proc.stdout and "estimate" in proc.stdout
    bad = run_plan("--config_name", "tiny", "--num_gpus", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--num_gpus 0" in bad.stderr


def test_no_gpu_here_and_none_given(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no smi tool, and torch here is a CPU build
    proc = run_plan("--config_name", "tiny", "--block_size", "64")
    assert proc.returncode == 0, proc.stderr
    assert "0 GPU(s)" in proc.stdout and "--gpu NAME" in proc.stdout and "--gpu_memory_gb" in proc.stdout
    assert not any(line.endswith(" no") for line in proc.stdout.splitlines())  # no table of rows that fit nowhere


@pytest.mark.parametrize("extra", [("--objective", "dpo"), ("--cp", "2")])
def test_runners_up_are_strategies_the_job_can_use(extra):
    """--objective dpo trains under DDP, ZeRO-2, ZeRO-3, FSDP2 and HSDP, not under offload; --cp under the FSDP2 engine's
    FSDP2: the runners-up list none of the others."""
    args = ("--config_name", "llama-1b", "--block_size", "4096", "--gpu", "h100", "--dp_shard", "4", *extra)
    out = run_plan(*args).stdout
    assert "recommendation: " in out, out
    others = out.split("runners-up")[1].splitlines()[1:-1] if "runners-up" in out else []
    allowed = {"ddp", "zero2", "zero3", "fsdp2", "hsdp"} if "dpo" in extra else {"fsdp2"}
    assert {line.split()[0] for line in others} <= allowed, out


def test_plan_for_a_named_gpu_is_compact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_plan("--config_name", "llama-1b", "--block_size", "2048", "--gpu", "h100")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "8 GPU(s) × 79.60 GiB NVIDIA H100 80GB HBM3 (--gpu h100; 8 assumed" in out
    assert "recommendation: " in out and " per device × 8 devices × " in out and "GiB of 79.60 GiB per GPU" in out
    assert "runners-up" in out and len(out.splitlines()) <= 12
    assert not any(line.endswith((" yes", " no")) for line in out.splitlines())  # no table's "fits" column
    assert list(tmp_path.iterdir()) == []  # a tool that writes nothing creates no folder
    bad = run_plan("--config_name", "tiny", "--gpu", "h10")
    assert bad.returncode == 2 and "--gpu h10 is not in anygpu's table (did you mean h100?)" in bad.stderr


def test_host_memory_to_load_follows_how_each_engine_builds_the_model(monkeypatch):
    """Node 0's host RAM to load llama-8b on 8 GPUs (fp32): a whole model per process where every process builds it
    (DDP, ZeRO-2), one where rank 0 alone builds it or reads the files (accelerate's FSDP2: the other ranks build it
    on meta; ZeRO-3: partitioned as built), one tensor per process in the native engine; the export one model."""
    from types import SimpleNamespace

    from anygpu.engines.hf import construct
    from anygpu.engines.hf import strategy as hf_strategy

    shapes, _, _ = plan_tool.load_shapes(None, "llama-8b")
    whole = 4 * shapes.num_params
    host = {s: memory_plan.host_bytes(shapes, s, 8) for s in (*memory_plan.STRATEGIES, memory_plan.HSDP)}
    assert host["ddp"]["loading"] == host["zero2"]["loading"] == 8 * whole
    assert host["fsdp2"]["loading"] == host["zero3"]["loading"] == whole
    assert host[memory_plan.HSDP]["loading"] == 8 * 4 * 128256 * 4096  # the embedding, in every process
    assert all(h["exporting"] == whole for h in host.values())
    # what the HF engine builds on each rank, as the plan counts it
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")  # the shipped FSDP configs' setting
    fsdp = hf_strategy.Plan(hf_strategy.Request("fsdp", 8, fsdp_version=2), "fsdp", False, None)
    assert [construct.kind(fsdp, None, r) for r in (0, 1, 7)] == [construct.FULL, construct.META, construct.META]
    zero3 = hf_strategy.Plan(hf_strategy.Request("deepspeed", 8, zero_stage=3), "deepspeed", False, "gloo")
    flag = lambda on: SimpleNamespace(is_zero3_init_enabled=lambda: on)  # noqa: E731
    assert construct.kind(zero3, flag(True), 3) == construct.ZERO3
    assert construct.kind(zero3, flag(False), 3) == construct.FULL  # zero3_init_flag: false: the old way
    ddp = hf_strategy.Plan(hf_strategy.Request("ddp", 8), "ddp", False, "gloo")
    assert construct.kind(ddp, None, 1) == construct.FULL


def sdpa_masks(position_ids):
    """The attention masks sdpa receives in a tiny Llama's forward over rows with these positions."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        use_cache=False,
    )  # no cache, as in training: transformers looks for packed rows only then
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        seen.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros_like(position_ids), position_ids=position_ids)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return seen


def test_the_packed_rows_mask_is_the_one_transformers_builds():
    """Rows packing two samples each (positions restarting): sdpa gets a boolean (rows × 1 × T × T) mask at each
    layer, as `attention_mask_bytes` counts its boolean part (the compute-dtype copy is sdpa's, per call); rows of
    one sample get none (sdpa's causal path), which the plan counts as 0."""
    import torch

    t, rows = 64, 2
    packed = torch.cat([torch.arange(40), torch.arange(24)]).repeat(rows, 1)
    masks = sdpa_masks(packed)
    assert len(masks) == 2 and all(m is not None and m.dtype == torch.bool for m in masks)
    shapes = dataclasses.replace(plan_tool.load_shapes(None, "tiny")[0], dense_mask=True)
    assert masks[0].numel() == memory_plan.attention_mask_bytes(shapes, rows, t, "bf16") // 3  # bool of bool + bf16
    assert all(m is None for m in sdpa_masks(torch.arange(t).repeat(rows, 1)))
    assert memory_plan.attention_mask_bytes(dataclasses.replace(shapes, dense_mask=False), rows, t, "bf16") == 0
    # under --cp C: Ulysses (C divides the heads) takes the whole rows' mask; the gathered path a rank's T/C rows
    whole = memory_plan.attention_mask_bytes(shapes, rows, t, "bf16")
    heads = shapes.num_kv_heads
    assert memory_plan.attention_mask_bytes(shapes, rows, t, "bf16", cp=heads) == whole
    gathered = 2 * heads  # more ranks than KV heads: the keys and values are gathered
    assert memory_plan.attention_mask_bytes(shapes, rows, t, "bf16", cp=gathered) == whole // gathered


def test_packed_rows_at_128k_count_their_mask_and_the_plan_says_what_avoids_it():
    """Llama-3-8B, 128k-token packed rows, 8 H100s, --cp 8: the dense mask (16 GiB boolean + 32 GiB bf16 per
    sequence, every rank the whole row's) is counted under sdpa, nothing fits, and the plan names what fits without
    it; under flash attention, or the kernel left out (varlen for packed rows on NVIDIA GPUs, as the engines), no
    mask is counted and --cp 8 fits; on AMD GPUs the default keeps sdpa's mask."""
    args = ["--config_name", "llama-8b", "--block_size", "131072", "--global_batch_size", "8", "--gpu", "h100"]
    args += ["--num_gpus", "8", "--cp", "8", "--packing", "true"]
    masked = json.loads(run_plan(*args, "--attn_implementation", "sdpa", "--json").stdout)
    assert all(r["per_gpu_bytes"]["attention_mask"] == 48 * 2**30 for r in masked["rows"] if r["precision"] == "bf16")
    assert masked["recommended"]["full"] is None
    (note,) = masked["notes"]["full"]
    assert "dense 131072 × 131072 mask" in note and "--cp 8" in note and "varlen_attention" in note, note
    for kernel in (("--attn_implementation", "flash_attention_2"), ()):  # named; left out: varlen, as the engines
        flash = json.loads(run_plan(*args, *kernel, "--json").stdout)
        assert all("attention_mask" not in r["per_gpu_bytes"] for r in flash["rows"]), kernel
        assert flash["recommended"]["full"]["fits"] and flash["notes"]["full"] == [], kernel
    mi300x = json.loads(run_plan(*["mi300x" if a == "h100" else a for a in args], "--json").stdout)
    assert any("attention_mask" in r["per_gpu_bytes"] for r in mi300x["rows"])  # AMD: sdpa's mask, unmeasured varlen


def test_70b_on_8_h100_gets_a_native_offload_run_with_its_host_memory_and_cost():
    """Llama-3-70B shapes, block 4096, 8×H100: the plan recommends the FSDP2 engine with --cpu_offload, the host
    memory per node its offloaded state takes (16 bytes per parameter over the node's GPUs) and the CPU optimizer
    step in the step time; a node that cannot hold it gets no offload row, and two such nodes with the model
    sharded over both (--dp_shard 16) do."""
    base = ["--config_name", "llama-70b", "--block_size", "4096", "--global_batch_size", "64", "--gpu", "h100"]
    proc = run_plan(*base, "--num_gpus", "8", "--host_memory_gb", "2048")
    assert proc.returncode == 0, proc.stderr
    assert (
        "recommendation: fsdp2_offload" in proc.stdout and "--cpu_offload true (run_fsdp_standalone.py)" in proc.stdout
    )
    shapes, _, _ = plan_tool.load_shapes(None, "llama-70b")
    per_node = 16 * shapes.num_params / 2**30
    assert f"host RAM per node for the offloaded state: {per_node:.2f} GiB" in proc.stdout, proc.stdout
    assert "the node has 2048.00 GiB" in proc.stdout and "of it offload's (the CPU optimizer step" in proc.stdout

    from anygpu.train import metrics

    _, config, matmul_weights = plan_tool.load_shapes(None, "llama-70b")
    fpt = metrics.flops_per_token(config, matmul_weights, 4096)

    def result(gpus: int, nodes: int, host_gib: int) -> memory_plan.PlanResult:  # the CLI's plan, shapes built once
        machine = plan_tool.detect_machine(gpus, None, None, "h100", nodes, host_gib)
        dp_shard = gpus // nodes if nodes > 1 else None
        return memory_plan.make_plan(shapes, machine, 4096, 64, flops_per_token=fpt, dp_shard=dp_shard)

    one = result(8, 1, 2048)
    assert one.recommended.host_bytes["offloaded"] == 8 * one.recommended.cpu_bytes
    assert 0 < one.offload_seconds < one.step_seconds
    small = "\n".join(plan_tool.recommendation(result(8, 1, 1024)))
    assert f"offload needs {per_node:.2f} GiB of host memory per node and the node has 1024.00 GiB" in small
    two = "\n".join(plan_tool.recommendation(result(16, 2, 1024)))
    assert "--cpu_offload true --dp_shard 16" in two and f"{per_node / 2:.2f} GiB" in two, two


# --objective grpo: a step trains micro-batches of completions; a round generates each GPU's G/W completions at once
# from the whole model gathered in the compute dtype, beside the sharded state.
GRPO_8B = ["--config_name", "llama-8b", "--gpu", "h100", "--num_gpus", "8", "--objective", "grpo"]


def grpo_shapes(preset: str, global_batch: int = 256, prompt: int = 512, completion: int = 512, beta: float = 0.0):
    shapes, _, _ = plan_tool.load_shapes(None, preset)
    generation = memory_plan.Generation(global_batch, prompt, completion, 8, beta)
    return dataclasses.replace(shapes, generation=generation, reference=beta > 0)


def test_grpo_kv_cache_of_a_known_shape():
    """Llama-3-8B (32 layers, 8 KV heads of 128): K and V are 2 × 32 × 8 × 128 × 2 bytes = 128 KiB a token in bf16;
    32 completions of 512 + 512 tokens hold 4 GiB, twice that in fp32."""
    shapes = grpo_shapes("llama-8b")
    assert (shapes.num_layers, shapes.num_kv_heads, shapes.head_dim) == (32, 8, 128)
    assert memory_plan.kv_cache_bytes(shapes, 1, 1, "bf16") == 2 * 32 * 8 * 128 * 2 == 128 * 2**10
    assert memory_plan.kv_cache_bytes(shapes, 32, 1024, "bf16") == 4 * 2**30
    assert memory_plan.kv_cache_bytes(shapes, 32, 1024, "fp32") == 8 * 2**30
    machine = memory_plan.Machine(8, 80 * 2**30)
    row = memory_plan.row_for(shapes, machine, "fsdp2", "bf16", True, False, 1, 1024)
    assert row.generation_bytes["kv_cache"] == 4 * 2**30  # 256 completions over 8 GPUs: 32 each, in one batch


def test_grpo_generation_holds_the_gathered_model_beside_the_sharded_state():
    """A round's generation peak: the sharded parameters and AdamW state (no gradients: freed at each step's end),
    the whole model gathered in bf16 (2 bytes a parameter, on every GPU), the KV cache and the working tensors; a
    row's total is the larger of that and its training step; no gathered copy where FSDP2 does not shard (one rank,
    fp32)."""
    shapes = grpo_shapes("llama-8b")
    machine = memory_plan.Machine(8, 80 * 2**30)
    row = memory_plan.row_for(shapes, machine, "fsdp2", "bf16", True, False, 1, 1024)
    gen, b = row.generation_bytes, row.per_gpu_bytes
    assert gen["gathered"] == 2 * shapes.num_params
    assert row.generation_peak == b["parameters"] + b["optimizer"] + b["reserved"] + sum(gen.values())
    assert row.total == max(row.training_peak, row.generation_peak) == row.generation_peak
    assert row.training_peak == sum(b.values())
    one = memory_plan.Machine(1, 80 * 2**30)
    assert memory_plan.row_for(shapes, one, "fsdp2", "bf16", True, False, 1, 1024).generation_bytes["gathered"] > 0
    assert memory_plan.row_for(shapes, one, "fsdp2", "fp32", True, False, 1, 1024).generation_bytes["gathered"] == 0
    # the training rows keep the completion's logits only (513 positions, the dtype's and three fp32 copies)
    plain = dataclasses.replace(shapes, generation=None)
    body = memory_plan.activation_bytes(plain, 1, 1024, "bf16", True, lean_loss=False)
    logits = 1024 * shapes.vocab_size * (2 + 4 + 4)  # the lm objective's: every position, no lean loss
    assert memory_plan.activation_bytes(shapes, 1, 1024, "bf16", True) == body - logits + 513 * shapes.vocab_size * 14


def grpo_plan(*args: str) -> tuple[memory_plan.PlanResult, memory_plan.PlanResult]:
    parser = plan_tool.build_parser()
    parsed = parser.parse_args([*GRPO_8B, *args])
    assert plan_tool.check_args(parsed) is None
    return plan_tool.plan(parsed)


def test_grpo_beta_adds_a_reference_but_not_to_lora():
    """--beta > 0: a frozen reference in bf16 sharded like the policy (2 bytes a parameter over the GPUs), counted in
    the training and the generation peaks; LoRA's reference is its base (nothing more); --beta 0: none. Only the
    FSDP2 engine's strategies are planned."""
    full, lora = grpo_plan("--beta", "0.04", "--global_batch_size", "256")
    shapes = full.shapes
    for row in full.rows:
        assert row.strategy == "fsdp2"
        expected = memory_plan.reference_bytes(shapes, "fsdp2", row.precision, 8)
        assert row.per_gpu_bytes["reference"] == expected > 0
        assert row.generation_peak - sum(row.generation_bytes.values()) == sum(
            row.per_gpu_bytes[k] for k in ("parameters", "optimizer", "reference", "reserved")
        )
    bf16 = next(r for r in full.rows if r.precision == "bf16")
    assert abs(bf16.per_gpu_bytes["reference"] - 2 * shapes.num_params / 8) < 2 * 2**20
    assert all("reference" not in r.per_gpu_bytes for r in lora.rows)
    none, _ = grpo_plan("--global_batch_size", "256")
    assert all("reference" not in r.per_gpu_bytes for r in none.rows)
    assert all(a.total < b.total for a, b in zip(none.rows, full.rows))


def test_grpo_8b_fits_8_h100_and_70b_does_not():
    """8 × H100: Llama-3-8B fits (16 GB of gathered bf16 weights, 15 GiB of sharded state, 4 GiB of KV cache for 32
    completions); Llama-3-70B does not: its gathered bf16 weights alone are 141 GB, more than a GPU, so no batch,
    length or GPU count helps; the plan says so and shows the generation peak."""
    eight = run_plan(*GRPO_8B, "--global_batch_size", "256", "--json")
    assert eight.returncode == 0, eight.stderr
    data = json.loads(eight.stdout)
    rec = data["recommended"]["full"]
    assert rec["fits"] and rec["strategy"] == "fsdp2" and rec["total_bytes"] <= 0.9 * 79.6 * 2**30
    assert data["grpo"]["gathered_model_bytes_bf16"] == 2 * data["model"]["parameters"] < 17e9
    assert data["grpo"]["completions_per_gpu"] == 32
    # by hand: states 16 bytes a parameter over 8, the gradients freed, the gathered copy, the cache
    n = data["model"]["parameters"]
    gen = rec["generation_bytes"]
    assert gen["gathered"] + gen["kv_cache"] == 2 * n + 4 * 2**30
    assert abs(rec["generation_peak_bytes"] - (12 * n / 8 + 2 * n + 4 * 2**30 + gen["working"] + 2**30)) < 2**24
    text = run_plan(*GRPO_8B, "--global_batch_size", "256").stdout
    assert "generation peak ≈ " in text and "the model gathered in bf16 14.96" in text, text
    args = [a if a != "llama-8b" else "llama-70b" for a in GRPO_8B]
    big = run_plan(*args, "--global_batch_size", "256")
    assert big.returncode == 0, big.stderr
    assert "recommendation: nothing fits a GRPO step" in big.stdout
    assert "model gathered for generation (131.42 GiB" in big.stdout and "more GPUs cannot help" in big.stdout
    assert "LoRA does not fit either" in big.stdout, big.stdout
    shapes, _, _ = plan_tool.load_shapes(None, "llama-70b")
    assert 2 * shapes.num_params > 140e9 > 0.9 * 79.6 * 2**30


def test_grpo_when_the_cache_does_not_fit_the_plan_names_a_batch_and_a_length_that_do():
    """8B, 1024 completions of 512 + 4096 tokens on 8 GPUs: 128 per GPU at once do not fit; the global batch and the
    completion length the plan offers instead each fit when planned."""
    import re

    full, _ = grpo_plan("--global_batch_size", "1024", "--max_completion_length", "4096")
    assert full.recommended is None
    advice = "\n".join(full.notes)
    batch = int(re.search(r"--global_batch_size (\d+) or less", advice).group(1))
    length = int(re.search(r"--max_completion_length, (\d+) or less", advice).group(1))
    assert 0 < batch < 1024 and batch % 8 == 0 and 0 < length < 4096, advice
    fits_batch, _ = grpo_plan("--global_batch_size", str(batch), "--max_completion_length", "4096")
    fits_length, _ = grpo_plan("--global_batch_size", "1024", "--max_completion_length", str(length))
    assert fits_batch.recommended is not None and fits_length.recommended is not None
    over, _ = grpo_plan("--global_batch_size", str(batch + 8), "--max_completion_length", "4096")
    assert over.recommended is None  # the largest that fits: one completion more per GPU does not


def test_grpo_with_vllm_counts_the_engines_share_throughout_and_no_gathered_copy():
    """--use_vllm: each GPU's engine holds --vllm_gpu_memory_utilization of it through training too (in the total,
    beside the training step), and the policy gathers nothing; 8B fits 8 × H100 at TRL's 0.3, not at 0.1 (the bf16
    weights, 15 GiB, do not fit 8 GiB: the plan names the share that would); 70B does not fit any share (its 131 GiB of
    bf16 weights exceed a GPU)."""
    import re

    vllm, _ = grpo_plan("--global_batch_size", "256", "--use_vllm", "true")
    own, _ = grpo_plan("--global_batch_size", "256")
    share = int(0.3 * vllm.machine.gpu_memory_bytes)
    for row, base in zip(vllm.rows, own.rows):
        assert row.per_gpu_bytes["vllm"] == share and row.generation_bytes == {} and row.generation_peak == 0
        assert row.total == base.training_peak + share
    assert vllm.recommended is not None and vllm.recommended.total <= 0.9 * vllm.machine.gpu_memory_bytes
    text = run_plan(*GRPO_8B, "--global_batch_size", "256", "--use_vllm", "true").stdout
    assert "by its vLLM engine, which holds 0.3 of the GPU (23.88 GiB) throughout: the model in bf16 (14.96" in text
    assert "the vLLM engine's share 23.88 (held throughout; no gathered copy)" in text, text
    small, _ = grpo_plan("--global_batch_size", "256", "--use_vllm", "true", "--vllm_gpu_memory_utilization", "0.1")
    assert small.recommended is None
    needed = float(re.search(r"--vllm_gpu_memory_utilization (\d\.\d+) or more", "\n".join(small.notes)).group(1))
    assert 0.1 < needed < 0.3
    enough, _ = grpo_plan(
        "--global_batch_size", "256", "--use_vllm", "true", "--vllm_gpu_memory_utilization", str(needed)
    )
    assert enough.recommended is not None
    args = [a if a != "llama-8b" else "llama-70b" for a in GRPO_8B]
    big = run_plan(*args, "--global_batch_size", "256", "--use_vllm", "true")
    assert "nothing fits" in big.stdout and "the model's bf16 weights (131.42 GiB) exceed" in big.stdout, big.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--objective", "grpo", "--num_generations", "1"], "--num_generations 1 must be at least 2"),
        (["--use_vllm", "true"], "--use_vllm true is --objective grpo's"),
        (
            ["--objective", "grpo", "--use_vllm", "true", "--vllm_gpu_memory_utilization", "1"],
            "--vllm_gpu_memory_utilization 1.0 must be in (0, 1)",
        ),
        (["--objective", "grpo", "--max_completion_length", "0"], "--max_completion_length 0 must be at least 1"),
        (["--objective", "grpo", "--global_batch_size", "12"], "--global_batch_size 12 completions is not whole"),
        (
            ["--objective", "grpo", "--global_batch_size", "8", "--num_generations", "4", "--num_gpus", "3"],
            "groups of --num_generations 4 split over 3 GPUs: pass a multiple of 12, e.g. 12",
        ),
        (["--objective", "grpo", "--beta", "-1"], "--beta -1.0 cannot be negative"),
        (["--objective", "grpo", "--block_size", "512"], "--block_size 512 with --objective grpo: a row is a prompt"),
        (["--objective", "grpo", "--cp", "2", "--num_gpus", "2"], "--cp 2 with --objective grpo"),
        (["--objective", "grpo", "--packing", "true"], "--packing true with --objective grpo"),
        (["--max_prompt_length", "64"], "--max_prompt_length is --objective grpo's: add --objective grpo"),
        (["--beta", "0.1"], "--beta is a preference or RL objective's"),
    ],
)
def test_grpo_bad_values_are_refused_in_one_line(args, says):
    proc = run_plan("--config_name", "tiny", *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


def test_grpo_rows_are_the_fsdp2_engines_alone():
    """Two nodes: fsdp2 and hsdp rows only (no DDP, DeepSpeed or offload), each run with the native engine."""
    full, lora = grpo_plan("--num_nodes", "2", "--num_gpus", "16", "--global_batch_size", "256")
    assert {r.strategy for r in full.rows + lora.rows} == {"fsdp2", "hsdp"}
    assert all(r.accelerate_config.startswith("run_fsdp_standalone.py") for r in full.rows + lora.rows)


def test_a_block_past_the_models_positions_is_refused_and_none_given_is_the_engines_default():
    """The engines refuse a --block_size above the model's positions (tiny: 512): the plan did not (a DDP
    recommendation for a run that cannot start), and without --block_size it planned 1024 where the engines take
    the model's 512."""
    refused = run_plan("--config_name", "tiny", "--block_size", "999999", "--gpu", "H100", "--num_gpus", "8")
    assert (
        refused.returncode == 2 and "--block_size 999999 is above the model's maximum positions (512)" in refused.stderr
    )
    default = run_plan("--config_name", "tiny", "--gpu", "H100", "--num_gpus", "8", "--json")
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout)["block_size"] == 512


@pytest.mark.parametrize("name, example", [("lora_r", 16), ("global_batch_size", 64), ("block_size", 4096)])
def test_a_non_positive_number_gets_an_example_of_its_own_kind(name, example):
    proc = run_plan("--config_name", "tiny", f"--{name}", "0")
    assert proc.returncode == 2 and f"--{name} 0 must be a positive whole number, e.g. {example}\n" in proc.stderr
