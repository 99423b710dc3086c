"""Context parallelism (`--cp C`) in the FSDP2 engine: each sequence split over C ranks, Ulysses attention.

Real gloo runs, three launches once per module: 4 ranks as dp_shard 2 × cp 2 (packed text, saving a
checkpoint at step 2) and as dp_replicate 2 × cp 2 (HSDP; chat data with packing), 2 ranks as cp 2 (packed text; GPT-2 shapes with residual,
embedding and attention dropout; Qwen2-MoE shapes with the router loss, on chat data) and the 4-rank
checkpoint resumed as dp_shard 2 × cp 1, and 1 rank (the references, and the checkpoint resumed on one
rank). The tiny preset is GQA (4 heads, 2 KV heads): each CP rank gets one KV head under cp 2; under cp 4 (4 ranks,
packed text and packed chat) its 2 KV heads cannot be split, so each rank's queries attend to the gathered keys and
values. Losses and grad norms against one rank ≤ 1e-5. The refusals and the plan need no processes (quick tier)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from conftest import TINY, fsdp_runs, records, torchrun
from test_hsdp import assert_refused_on_four_ranks
from test_sft import sentence

from anygpu.engines.hf.engine import main as hf_main
from anygpu.runtime.mesh import MeshShape, resolve

STEPS = ["--max_steps", "3", "--export_final", "false", "--max_eval_samples", "8"]
CP = ["--dp_shard", "2", "--cp", "2"]
GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 4,
    "n_positions": 128,
    "vocab_size": 400,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
}
MOE = {  # 4 experts, top 2, a shared expert, router loss 0.1
    "model_type": "qwen2_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
    "vocab_size": 400,
}


def _chat(path) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(120):
            msgs = []
            for _ in range(rng.randint(1, 3)):
                msgs += [
                    {"role": "user", "content": sentence(rng, 1, 12)},
                    {"role": "assistant", "content": sentence(rng, 1, 20)},
                ]
            f.write(json.dumps({"messages": msgs}) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    chat = root / "chat.jsonl"
    _chat(chat)
    for name, config in (("gpt2", GPT2), ("moe", MOE)):
        (root / f"{name}.json").write_text(json.dumps(config))
    text = [*TINY, *STEPS]
    small = [*TINY, *STEPS, "--vocab_size", "400", "--block_size", "128"]
    chat_args = [*small, "--train_file", str(chat)]
    gpt2_args = [*small, "--config_name", str(root / "gpt2.json")]
    moe_args = [*chat_args, "--config_name", str(root / "moe.json")]
    names = (
        "text1",
        "text4",
        "chat1",
        "chat4",
        "gpt2_1",
        "gpt2_2",
        "moe1",
        "moe2",
        "text2",
        "r2",
        "r1",
        "kv4",
        "kvchat4",
    )
    d = {name: root / name for name in names}
    out = {}
    out["text4"], out["chat4"], out["kv4"], out["kvchat4"] = fsdp_runs(
        4,
        [
            [*text, *CP, "--save_steps", "2", "--output_dir", str(d["text4"])],
            [*chat_args, "--dp_replicate", "2", "--cp", "2", "--output_dir", str(d["chat4"])],  # HSDP × CP
            [*text, "--cp", "4", "--output_dir", str(d["kv4"])],  # 2 KV heads over 4 ranks: gathered
            [*chat_args, "--cp", "4", "--output_dir", str(d["kvchat4"])],
        ],
    )
    for name in ("r2", "r1"):  # the run as it stood after step 2, resumed elsewhere
        shutil.copytree(d["text4"] / "checkpoint-2", d[name] / "checkpoint-2")
    resume = ["--resume_from_checkpoint", "latest"]
    out["text2"], out["gpt2_2"], out["moe2"], out["r2"] = fsdp_runs(
        2,
        [
            [*text, "--cp", "2", "--output_dir", str(d["text2"])],
            [*gpt2_args, "--cp", "2", "--output_dir", str(d["gpt2_2"])],
            [*moe_args, "--cp", "2", "--output_dir", str(d["moe2"])],
            [*text, "--dp_shard", "2", *resume, "--output_dir", str(d["r2"])],
        ],
    )
    out["text1"], out["chat1"], out["gpt2_1"], out["moe1"], out["r1"] = fsdp_runs(
        1,
        [
            [*text, "--output_dir", str(d["text1"])],
            [*chat_args, "--output_dir", str(d["chat1"])],
            [*gpt2_args, "--output_dir", str(d["gpt2_1"])],
            [*moe_args, "--output_dir", str(d["moe1"])],
            [*text, *resume, "--output_dir", str(d["r1"])],
        ],
    )
    return d, out


def _curve(run_dir) -> dict[int, tuple[float, ...]]:
    """step → (loss, grad norm) and, at the end, the evaluation's loss (also split over the CP group)."""
    curve = {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir) if "loss" in r}
    evals = [r for r in records(run_dir) if "eval_loss" in r]
    return {**curve, "eval": (evals[-1]["eval_loss"],)} if evals else curve


def _assert_same(a, b, steps=None) -> None:
    ca, cb = _curve(a), _curve(b)
    steps = steps or list(ca)
    assert "eval" in steps or len(steps) == 1, ca  # whole runs: their final evaluations are compared too
    assert steps and all(s in cb for s in steps), (ca, cb)
    for s in steps:
        for x, y in zip(ca[s], cb[s]):
            assert abs(x - y) <= 1e-5 * abs(x), f"step {s}: {ca[s]} vs {cb[s]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "one, split",
    [
        ("text1", "text4"),
        ("text1", "text2"),
        ("chat1", "chat4"),
        ("gpt2_1", "gpt2_2"),
        ("moe1", "moe2"),
        ("text1", "kv4"),
        ("chat1", "kvchat4"),
    ],
)
def test_split_sequences_follow_the_one_rank_curve(runs, one, split):
    """dp_shard 2 × cp 2, dp_replicate 2 × cp 2 (chat) and cp 2 against 1 rank: the same losses and grad norms
    (and final evaluation), on packed text and packed chat
    rows (their own position restarts), GPT-2 with its dropout keyed per position, MoE with its router loss."""
    d, out = runs
    _assert_same(d[one], d[split])
    if split == "text4":
        assert "mesh 1 × 2 × 2 (dp_replicate × dp_shard × cp): each sequence split into 2 parts" in out["text4"]
        assert "global batch 8 = 4 per device × 2 devices × 1 accumulation step" in out["text4"]
    if split == "chat4":
        assert "mesh 2 × 1 × 2 (dp_replicate × dp_shard × cp): each sequence split into 2 parts" in out["chat4"]
        assert "HSDP, state sharded over the 2 ranks (dp_shard × cp) of each of 2 replica groups" in out["chat4"]
    if split == "gpt2_2":
        assert "masks keyed by (seed, step, sample, call site)" in out["gpt2_2"]


@pytest.mark.slow
def test_a_cp_checkpoint_resumes_on_another_mesh(runs):
    """checkpoint-2 of dp_shard 2 × cp 2 resumed as dp_shard 2 × cp 1 and on one rank: step 3 as uninterrupted."""
    d, out = runs
    state = json.loads((d["text4"] / "checkpoint-2" / "trainer_state.json").read_text())
    assert (state["world_size"], state["dp_shard"], state["cp"]) == (4, 2, 2)
    for name in ("r2", "r1"):
        _assert_same(d["text4"], d[name], steps=[3])
    assert "mesh was 1 × 2 × 2, now 1 × 2" in out["r2"]
    assert "mesh was 1 × 2 × 2, now 1 × 1" in out["r1"]


@pytest.mark.parametrize(
    "replicate, shard, cp, world, per_node, expected",
    [
        (None, None, 2, 4, 4, (1, 2, 2)),  # one node: shard over the rest
        (None, None, 2, 16, 8, (2, 4, 2)),  # two nodes of 8: CP within a node, replicas across nodes
        (None, 2, 2, 4, 4, (1, 2, 2)),
        (2, None, 2, 8, 8, (2, 2, 2)),
        (None, None, 4, 4, 4, (1, 1, 4)),
    ],
)
def test_the_mesh_with_context_parallelism(replicate, shard, cp, world, per_node, expected):
    shape = resolve(replicate, shard, world, per_node, cp)
    assert shape == MeshShape(*expected)
    assert shape.world_size == world and shape.data_parallel == world // cp
    assert [shape.data_rank(r) for r in range(cp)] == [0] * cp  # a CP group reads the same sequences


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--cp", "3"], "--cp 3 does not divide the world size 4 (--dp_replicate × --dp_shard × --cp must equal it): "),
        (
            ["--cp", "2", "--dp_shard", "4"],
            "--dp_shard 4 does not divide the world size 4 / --cp 2 (--dp_replicate × --dp_shard must equal it)",
        ),
        (["--cp", "2", "--block_size", "65"], "--cp 2 does not divide --block_size 65"),
        (["--cp", "0"], "--cp 0 must be a finite number ≥ 1"),
    ],
    ids=["world", "mesh", "block", "zero"],
)
def test_a_split_that_does_not_fit_is_refused_before_any_process_group(extra, expected, capsys, tmp_path, monkeypatch):
    assert_refused_on_four_ranks(extra, expected, capsys, tmp_path, monkeypatch)


def test_the_hf_engine_names_the_engine_that_has_context_parallelism(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        hf_main([*TINY, "--cp", "2", "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--cp 2: context parallelism is the FSDP2 engine's" in err


def test_what_the_split_cannot_keep_is_refused_in_one_line():
    """Sliding-window layers narrower than the block (their masks are not built here): refused, naming --cp; a
    window as wide as the block is the causal mask (Mistral's default 4096 under a shorter block)."""
    from transformers import AutoConfig

    from anygpu.errors import UsageError
    from anygpu.runtime import context_parallel

    sliding = AutoConfig.for_model("mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=32)
    with pytest.raises(UsageError, match="^--cp 2: mistral has sliding-window"):
        context_parallel.check(sliding, 64, 2)
    context_parallel.check(sliding, 32, 2)
    context_parallel.check(AutoConfig.for_model("mistral", num_attention_heads=4, num_key_value_heads=2), 512, 2)
    with pytest.raises(UsageError, match="^--cp 2: gemma2 has sliding-window layers narrower"):
        context_parallel.check(AutoConfig.for_model("gemma2", sliding_window=16, num_attention_heads=4), 64, 2)
    gqa = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    context_parallel.check(gqa, 64, 2)
    context_parallel.check(gqa, 64, 4)  # 2 KV heads over 4 ranks: the keys and values are gathered
    with pytest.raises(UsageError, match="^--cp 4 does not divide the model's 4 attention and 2 key/value heads.*"):
        context_parallel.check(gqa, 64, 4, "flash_attention_2")  # its causal mask cannot take the gathered keys


def test_a_split_that_would_change_the_curve_or_crash_is_refused():
    """Phi-3's longrope picks its short or long factors from the longest position a forward sees: each part of a
    split row sees its own (a curve 2.7e-4 off one rank's at step 2); within its original length both pick the
    same. Selective checkpointing crashed on the gathered keys' causal bias (heads that C does not divide)."""
    from transformers import AutoConfig

    from anygpu.errors import UsageError
    from anygpu.runtime import context_parallel

    factors = dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    phi3 = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                                original_max_position_embeddings=16, rope_scaling={"type": "longrope", **factors})  # fmt: skip
    with pytest.raises(UsageError, match="^--cp 2: phi3's longrope rotary embedding .* a --block_size of at most 16"):
        context_parallel.check(phi3, 32, 2)
    context_parallel.check(phi3, 16, 2)
    gathered = AutoConfig.for_model("llama", hidden_size=96, num_attention_heads=3, num_key_value_heads=1)
    context_parallel.check(gathered, 64, 2)
    with pytest.raises(UsageError, match="^--cp 2 with --gradient_checkpointing_policy selective: .* full"):
        context_parallel.check(gathered, 64, 2, selective=True)
    context_parallel.check(AutoConfig.for_model("llama", num_attention_heads=4), 64, 2, selective=True)


def test_plan_counts_a_ranks_part_of_the_sequence_and_recommends_a_split():
    """`anygpu plan`: activations of block_size / C tokens per GPU (plus the lean loss's one chunk of logits, the same
    whatever the tokens); at a block that fits only with offload (Llama-3 8B, 128k tokens, 8 × 80 GB) the smallest C
    that fits without it is recommended."""
    from anygpu.planning import memory_plan
    from anygpu.tools import plan as plan_tool

    shapes, _, _ = plan_tool.load_shapes(None, "llama-8b")
    machine = memory_plan.Machine(8, 80 << 30)
    acts = {
        c: memory_plan.row_for(shapes, machine, "fsdp2", "bf16", True, False, 1, 131072, cp=c).per_gpu_bytes
        for c in (1, 2, 4)
    }
    a = {c: acts[c]["activations"] for c in acts}
    assert a[1] - a[2] == pytest.approx(2 * (a[2] - a[4]), rel=0.01)  # the per-token part halves with each doubling
    assert 0 <= 2 * a[2] - a[1] < 0.05 * a[1]  # what does not: a small constant
    assert acts[2]["parameters"] == acts[1]["parameters"]  # states are sharded over every GPU either way
    unsplit = memory_plan.make_plan(shapes, machine, 131072, 8)
    assert unsplit.recommended.strategy.endswith("offload") and unsplit.cp_advice[0] == 2
    split = memory_plan.make_plan(shapes, machine, 131072, 8, cp=2)
    assert split.recommended.strategy == "fsdp2" and split.gradient_accumulation_steps == 2  # G 8 over 4 ranks
    assert (
        split.recommended.accelerate_config == "run_fsdp_standalone.py --cp 2 --bf16 true --gradient_checkpointing true"
    )


@pytest.mark.slow
def test_flash_attentions_varlen_path_under_a_split():
    """Packed rows under flash attention (the CPU stand-in of test_flash_attention.py, with transformers' own
    packed-row test): the Ulysses wrapper flattens the whole rows for it; loss and gradient norm as one process.
    The real kernel on GPUs: benchmarks/gpu_matrix.sh's context-parallelism rows."""
    proc = torchrun(2, "tests/scripts/cp_flash.py", [])
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOSSES"))
    whole, split, split_norm, whole_norm = map(float, line.split()[1:])
    assert split == pytest.approx(whole, rel=1e-6) and split_norm == pytest.approx(whole_norm, rel=1e-5), line


def test_gathered_keys_over_raw_text_need_no_mask(monkeypatch):
    """Heads C does not divide, raw-text rows under sdpa: each rank's queries against the gathered keys and values
    give the rows of whole-sequence causal attention (GQA, 3 ranks, float64), and no (T/C × T) mask is built: the
    keys past the rank's last query are dropped and the rest go under sdpa's lower-right causal bias."""
    import torch
    import torch.nn.functional as F

    from anygpu.runtime import context_parallel as cpm

    torch.manual_seed(0)
    b, heads, kv_heads, T, C, d = 2, 4, 2, 96, 3, 16
    q, k, v = (torch.randn(b, n, T, d, dtype=torch.float64) for n in (heads, kv_heads, kv_heads))
    whole = F.scaled_dot_product_attention(q, *(x.repeat_interleave(2, 1) for x in (k, v)), is_causal=True)
    gathered = {}  # a rank's local keys / values → the whole sequence's, as the all-gather returns them
    monkeypatch.setattr(cpm._GatherSequence, "apply", staticmethod(lambda x, group, cp, index: gathered[id(x)]))
    monkeypatch.setattr(cpm, "_causal_rows", lambda *a: pytest.fail("a dense causal mask was built"))
    part = T // C
    for i in range(C):
        rows = slice(i * part, (i + 1) * part)
        local_k, local_v = k[:, :, rows], v[:, :, rows]
        gathered.update({id(local_k): k, id(local_v): v})
        split = cpm._Split(None, C, "sdpa", None, torch.arange(T).expand(b, T), index=i, heads_split=False)
        out, _ = cpm._gathered_attention(None, split, q[:, :, rows], local_k, local_v, dropout=0.0, scaling=None)
        assert torch.allclose(out, whole[:, :, rows].transpose(1, 2), atol=1e-12)


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_the_gathered_path_builds_only_its_ranks_rows_of_the_models_mask(base):
    """Heads C does not divide: each rank builds the (T/C × T) rows of the mask transformers builds for the whole
    rows — packed samples (positions restarting), padded rows, one sample a row — equal to those rows of it, and
    none where sdpa takes the causal path; never the (T × T) mask, 16 GiB per layer call at 128k tokens."""
    import torch
    from transformers import AutoConfig

    from anygpu.runtime import context_parallel as cpm

    config = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = base
    model = type("M", (), {"config": config})()
    b, T = 2, 24
    packed = torch.tensor([list(range(10)) + list(range(8)) + list(range(6)), list(range(5)) + list(range(19))])
    padding = torch.ones(b, T, dtype=torch.long)
    padding[0, 20:], padding[1, 11:] = 0, 0
    cases = {
        "packed": {"position_ids": packed},
        "padded": {"position_ids": torch.arange(T).expand(b, T), "attention_mask": padding},
        "one sample a row": {"position_ids": torch.arange(T).expand(b, T)},
    }
    for name, rows in cases.items():
        rows = {"input_ids": torch.zeros(b, T, dtype=torch.long), **rows}
        whole = cpm._full_mask(model, rows, torch.float32)
        for C in (2, 3):
            part = T // C
            for index in range(C):
                got = cpm._rows_mask(rows, cpm.CPGroup(None, C, index), base, torch.float32)
                if whole is None:
                    assert got is None and base == "sdpa", name
                    continue
                assert got.shape == (b, 1, part, T), name
                assert torch.equal(got, whole[..., index * part : (index + 1) * part, :].expand_as(got)), (
                    name,
                    C,
                    index,
                )
    assert (
        cpm._full_mask(model, {"input_ids": torch.zeros(b, T, dtype=torch.long), **cases["packed"]}, torch.float32)
        is not None
    )
