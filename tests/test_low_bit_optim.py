"""--optim adamw_torch_8bit / adamw_torch_4bit: AdamW with torchao's block-quantised moments, whose blocks lie within
rows so that any sharding keeps the same state; --optim adamw_anyprecision with bf16 moments (HF's --optim_args). Quick: the update equals torchao's own AdamW8bit/AdamW4bit where
their blocks coincide, a split of the rows (FSDP2's shards, uneven ones too) changes nothing, the state round-trips
as uint8, the plan counts its bytes, and the refusals. Slow: real FSDP2 runs on 1 and 2 ranks (the same losses), a
2-rank checkpoint resumed on 1 rank, near full AdamW's losses, the HF engine's curve. The bytes each rank holds
against the plan: tests/test_cpu_offload.py (its 2-rank launch runs with 8-bit state, offloaded)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY, assert_close, fsdp_runs, losses, python

from anygpu.config.args import parse_args
from anygpu.config.optimizers import BF16, BF16_ARGS, row_block, state_bytes
from anygpu.errors import UsageError
from anygpu.planning import memory_plan
from anygpu.tools import plan as plan_tool
from anygpu.train.low_bit_adamw import LowBitAdamW

LOW_BIT = ("adamw_torch_8bit", "adamw_torch_4bit")
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def grads(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A gradient with very different magnitudes from block to block (the quantiser's hard case)."""
    n = torch.arange(torch.Size(shape).numel(), dtype=torch.float32)
    return (torch.sin(n * 0.37 * (step + 1)) * torch.exp(-n / 3000)).view(shape)


def train(make, weights: list[torch.Tensor], steps: int = 4) -> list[torch.Tensor]:
    """`steps` optimizer steps from `weights` (a group with weight decay, the 1-D ones without) with `grads`."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = make([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}])  # fmt: skip
    for s in range(steps):
        for p in params:
            p.grad = grads(s, tuple(p.shape))
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("optim", LOW_BIT)
def test_the_update_is_torchaos_where_its_blocks_are_rows(optim, monkeypatch):
    """Rows of 256 (8-bit) and 128 (4-bit) elements: torchao's blocks of the flattened tensor are our row blocks, and
    its AdamW8bit / AdamW4bit (run eagerly: its compiled step is the same function) gives our parameters."""
    import torchao.optim

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # torchao's per-parameter step, uncompiled
    torch.manual_seed(0)
    block = {"adamw_torch_8bit": 256, "adamw_torch_4bit": 128}[optim]
    weights = [torch.randn(48, block), torch.randn(block)]
    assert row_block((48, block), optim) == block
    theirs_cls = torchao.optim.AdamW8bit if optim.endswith("8bit") else torchao.optim.AdamW4bit
    ours = train(lambda g: LowBitAdamW(g, optim, weight_decay=0.1, **HYPER), weights)
    theirs = train(lambda g: theirs_cls(g, **HYPER), weights)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    plain = train(lambda g: torch.optim.AdamW(g, **HYPER), weights)
    assert not torch.equal(ours[0], plain[0])  # the moments really are quantised
    assert torch.equal(ours[1], plain[1])  # a 1-D (and small) tensor keeps AdamW's fp32 moments


@pytest.mark.parametrize("optim", LOW_BIT)
def test_any_split_of_the_rows_keeps_the_state_and_the_update(optim):
    """FSDP2 gives each rank whole rows, unevenly where the ranks do not divide them: rows 0-66 and 67-199 stepped by
    two optimizers match the whole tensor stepped by one: the same blocks, so the same scales and codes (up to the
    last bit of CPU float arithmetic, whose vector kernels round a few elements differently by tensor size: an
    fp32 AdamW moves too), where torchao's blocks of a flattened shard would straddle rows (96 elements each)."""
    torch.manual_seed(1)
    whole = torch.randn(200, 96)
    assert row_block(tuple(whole.shape), optim) == 32
    make = lambda p: LowBitAdamW([p], optim, weight_decay=0.1, **HYPER)  # noqa: E731
    params = [torch.nn.Parameter(t.clone()) for t in (whole, whole[:67], whole[67:])]
    opts = [make(p) for p in params]
    for s in range(4):
        g = grads(s, tuple(whole.shape))
        for p, part in zip(params, (g, g[:67], g[67:])):
            p.grad = part.clone()
        for o in opts:
            o.step()
    assert torch.allclose(torch.cat([params[1], params[2]]), params[0], rtol=0, atol=1e-6)
    states = [o.state[p] for o, p in zip(opts, params)]
    for moment in ("exp_avg", "exp_avg_sq"):
        whole_scale, split_scale = states[0][moment + "_scale"], torch.cat([st[moment + "_scale"] for st in states[1:]])
        assert whole_scale.shape == (200, 3) and torch.allclose(split_scale, whole_scale, rtol=1e-5, atol=0)
        codes = torch.cat([st[moment + "_codes"] for st in states[1:]])
        assert (codes != states[0][moment + "_codes"]).float().mean() < 1e-3, moment


@pytest.mark.parametrize("optim", LOW_BIT)
def test_the_state_round_trips_as_uint8_and_the_next_step_is_exact(optim):
    """state_dict → load_state_dict (torch's would cast the codes to the parameter's float dtype) → the same next step."""
    torch.manual_seed(2)
    make = lambda g: LowBitAdamW(g, optim, weight_decay=0.0, **HYPER)  # noqa: E731
    a = torch.nn.Parameter(torch.randn(64, 64))
    opt = make([a])
    for s in range(3):
        a.grad = grads(s, (64, 64))
        opt.step()
    b = torch.nn.Parameter(a.detach().clone())
    other = make([b])
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint holds it: a copy
    state = other.state[b]
    assert state["exp_avg_codes"].dtype == torch.uint8 and state["exp_avg_scale"].dtype == torch.float32
    assert state["exp_avg_codes"].shape == (64, 64 * {"adamw_torch_8bit": 8, "adamw_torch_4bit": 4}[optim] // 8)
    a.grad, b.grad = grads(3, (64, 64)), grads(3, (64, 64))
    opt.step(), other.step()
    assert torch.equal(a, b)


def test_bf16_moments_are_adamw_rounded_to_bf16_after_each_step():
    """adamw_anyprecision with bf16 moments: each step is torch.optim.AdamW's in fp32 from the stored moments, which
    are then kept rounded to bf16 (a hand-written reference); the state is bf16 (4 bytes a parameter), round-trips as
    bf16, and the losses' direction stays AdamW's."""
    torch.manual_seed(3)
    weights = [torch.randn(48, 32), torch.randn(32)]
    got = train(lambda g: LowBitAdamW(g, BF16, weight_decay=0.0, **HYPER), weights)
    beta1, beta2 = HYPER["betas"]
    for i, (w, decay) in enumerate(zip(weights, (0.1, 0.0))):
        p, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
        for step in range(1, 5):
            g = grads(step - 1, tuple(w.shape))
            m = m.lerp(g, 1 - beta1)
            v = v * beta2 + g * g * (1 - beta2)
            p = p * (1 - HYPER["lr"] * decay) - HYPER["lr"] / (1 - beta1**step) * m / (
                (v.sqrt() / (1 - beta2**step) ** 0.5) + HYPER["eps"]
            )
            m, v = m.bfloat16().float(), v.bfloat16().float()  # what the next step reads back
        torch.testing.assert_close(got[i], p, rtol=1e-6, atol=1e-7)
    fp32 = train(lambda g: torch.optim.AdamW(g, **HYPER), weights)
    for a, b in zip(got, fp32):
        assert not torch.equal(a, b) and torch.allclose(a, b, rtol=1e-2, atol=1e-3)
    a = torch.nn.Parameter(torch.randn(16, 8))
    opt = LowBitAdamW([a], BF16, weight_decay=0.0, **HYPER)
    a.grad = torch.ones(16, 8)
    opt.step()
    other = LowBitAdamW([torch.nn.Parameter(a.detach().clone())], BF16, weight_decay=0.0, **HYPER)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    state = next(iter(other.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert (
        sum(t.numel() * t.element_size() for t in opt.state[a].values() if t.dim())
        == state_bytes((16, 8), 128, BF16)
        == 4 * 128
    )


@pytest.mark.parametrize(
    "optim_args, said",
    [
        ("momentum_dtype=bfloat16", "both moments in bfloat16"),
        (f"{BF16_ARGS},use_kahan_summation=True", "use_kahan_summation compensates bf16 weights"),
        ("betas=0.9", "betas unknown"),
    ],
)
def test_optim_args_that_cannot_work_are_refused(optim_args, said):
    with pytest.raises(UsageError, match=said):
        parse_args([*TINY, "--optim", "adamw_anyprecision", "--optim_args", optim_args, "--output_dir", "/tmp/unused"])
    with pytest.raises(UsageError, match="is for --optim adamw_anyprecision"):
        parse_args([*TINY, "--optim_args", BF16_ARGS, "--output_dir", "/tmp/unused"])
    _, _, args = parse_args([*TINY, "--optim", "adamw_anyprecision", "--output_dir", "/tmp/unused"])
    assert args.optim_state == "adamw_torch"  # float32 moments, its default as in HF: AdamW


@pytest.mark.parametrize("optim", LOW_BIT)
def test_the_counted_bytes_are_the_states(optim):
    """`state_bytes` (the plan's and the start-up checks' count) is what the optimizer allocates, for row blocks,
    fp32 fallbacks (small, 1-D, rows no block of 32 divides) alike."""
    for shape in ((64, 64), (8192, 64), (64, 128), (32, 64), (64,), (100, 90), (40, 48, 8)):
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = LowBitAdamW([p], optim, weight_decay=0.0, **HYPER)
        p.grad = torch.ones(shape)
        opt.step()
        held = sum(v.numel() * v.element_size() for v in opt.state[p].values() if v.dim() > 0)
        assert held == state_bytes(shape, p.numel(), optim), shape
    assert state_bytes((4096, 4096), 4096 * 4096, "adamw_torch_8bit") / (4096 * 4096) == pytest.approx(2.03, abs=0.01)
    assert state_bytes((4096, 4096), 4096 * 4096, "adamw_torch_4bit") / (4096 * 4096) == pytest.approx(1.06, abs=0.01)
    assert state_bytes((4096, 4096), 4096 * 4096, "adamw_torch") == 8 * 4096 * 4096


def test_the_plan_counts_low_bit_state_and_suggests_it_before_offload():
    """The plan's optimizer column shrinks ~4x (8-bit) on FSDP2 and DDP, ZeRO rows are dropped; where the fp32 moments
    need offload (70B on 2 nodes of 8 H100), the plan names the 8-bit state that fits without it."""
    shapes, _, _ = plan_tool.load_shapes(None, "llama-70b")
    machine = memory_plan.Machine(16, 80 << 30, "H100", num_nodes=2)
    full = memory_plan.make_plan(shapes, machine, 4096, 64)
    low = memory_plan.make_plan(memory_plan.replace(shapes, optim="adamw_torch_8bit"), machine, 4096, 64)
    row = lambda r, s: next(x for x in r.rows if x.strategy == s and x.precision == "bf16")  # noqa: E731
    ratio = row(low, "fsdp2").per_gpu_bytes["optimizer"] / row(full, "fsdp2").per_gpu_bytes["optimizer"]
    assert 0.25 <= ratio <= 0.26, ratio
    assert not any(r.strategy.startswith("zero") for r in low.rows)
    assert full.recommended.cpu_bytes and full.low_bit_advice is not None
    optim, advised = full.low_bit_advice
    assert optim == "adamw_torch_8bit" and not advised.cpu_bytes and advised.fits
    assert low.recommended is not None and not low.recommended.cpu_bytes
    text = "\n".join(plan_tool.recommendation(full))
    assert "or without offload, AdamW's moments in 8 bits: --optim adamw_torch_8bit" in text, text
    assert "with --optim adamw_torch_8bit (either engine" in "\n".join(plan_tool.recommendation(low))


@pytest.mark.parametrize(
    "value, said",
    [
        ("adamw_bnb_8bit", "--optim adamw_bnb_8bit: bitsandbytes' 8-bit AdamW is not offered here; --optim adamw_torch_8bit"),
        ("adafactor", "--optim 'adafactor' is unknown: use one of adamw_torch, adamw_torch_fused, adamw_torch_8bit"),
    ],
)  # fmt: skip
def test_an_optimizer_not_offered_is_refused_naming_the_valid_ones(value, said):
    with pytest.raises(UsageError) as err:
        parse_args([*TINY, "--optim", value])
    assert said in str(err.value)


def test_the_hf_engine_refuses_low_bit_state_under_deepspeed(monkeypatch):
    from anygpu.engines.hf import engine

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    model_args, _, train_args = parse_args([*TINY, "--optim", "adamw_torch_8bit"])
    from anygpu.config.args import HFEngineArguments

    with pytest.raises(UsageError) as err:
        engine.refuse_early(model_args, train_args, HFEngineArguments())
    assert "--optim adamw_torch_8bit under" in str(err.value) and "DeepSpeed ZeRO" in str(err.value)
    assert "--engine fsdp" in str(err.value)


SIX = [*TINY, "--max_steps", "6", "--save_steps", "3", "--export_final", "false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 ranks: 8-bit (saving at step 3) and 4-bit; 1 rank: 8-bit, 4-bit, plain AdamW, and 8-bit resumed from the
    2-rank checkpoint-3; the HF engine's one process, 8-bit."""
    root = tmp_path_factory.mktemp("lowbit")
    d = {f"{o}-{n}": root / f"{o}-{n}" for o in ("8bit", "4bit") for n in (1, 2)}
    d.update(adamw=root / "adamw", resumed=root / "resumed", hf=root / "hf")
    d.update({"bf16-1": root / "bf16-1", "bf16-2": root / "bf16-2", "bf16-resumed": root / "bf16-resumed"})

    def arg(name: str, optim: str) -> list[str]:
        chosen = (
            ["--optim", "adamw_anyprecision", "--optim_args", BF16_ARGS]
            if optim == "bf16"
            else ["--optim", f"adamw_torch_{optim}"]
        )
        return [*SIX, *chosen, "--output_dir", str(d[name])]

    two = fsdp_runs(2, [arg("8bit-2", "8bit"), arg("4bit-2", "4bit"), arg("bf16-2", "bf16")])
    one = fsdp_runs(
        1,
        [arg("8bit-1", "8bit"), arg("4bit-1", "4bit"), [*SIX, "--output_dir", str(d["adamw"])],
         [*arg("resumed", "8bit"), "--resume_from_checkpoint", str(d["8bit-2"] / "checkpoint-3")],
         arg("bf16-1", "bf16"),
         [*arg("bf16-resumed", "bf16"), "--resume_from_checkpoint", str(d["bf16-2"] / "checkpoint-3")]],
    )  # fmt: skip
    hf = python("run_hf_standalone.py", arg("hf", "8bit"))
    return {"dirs": d, "two": two, "one": one, "hf": hf.stdout}


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_two_ranks_train_one_ranks_curve(runs, bits):
    d = runs["dirs"]
    assert f"optimizer: AdamW with {bits[0]}-bit moments (adamw_torch_{bits}" in runs["two"][0 if bits == "8bit" else 1]
    assert_close(losses(d[f"{bits}-1"]), losses(d[f"{bits}-2"]), rel=1e-5, steps=range(1, 7))


@pytest.mark.slow
@pytest.mark.parametrize("bits, rel", [("8bit", 1e-3), ("4bit", 5e-3)])  # measured: 1.1e-4 and 1.1e-3
def test_low_bit_state_stays_near_full_adamw(runs, bits, rel):
    d = runs["dirs"]
    full, low = losses(d["adamw"]), losses(d[f"{bits}-1"])
    assert low != full  # quantised moments do change the updates
    assert_close(full, low, rel=rel, steps=range(1, 7))


@pytest.mark.slow
def test_the_hf_engine_trains_the_same_8bit_curve(runs):
    """One implementation for both engines: the HF Trainer's optimizer is the same LowBitAdamW (engine parity's 1e-4)."""
    assert "optimizer: AdamW with 8-bit moments" in runs["hf"]
    assert_close(losses(runs["dirs"]["8bit-1"]), losses(runs["dirs"]["hf"]), rel=1e-4, steps=range(1, 7))


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_one_rank_exactly(runs):
    """The 8-bit state (uint8 codes and fp32 scales, row-sharded DTensors) saved by 2 ranks, read by one: steps
    4-6 as the uninterrupted runs'."""
    out = runs["one"][3]
    assert "resumed from" in out and "was 2 ranks, now 1" in out, out[-2000:]
    assert_close(losses(runs["dirs"]["8bit-2"]), losses(runs["dirs"]["resumed"]), rel=1e-5, steps=range(4, 7))


@pytest.mark.slow
def test_bf16_moments_keep_the_curve_on_any_world_size_and_resume(runs):
    """bf16 moments: 2 ranks = 1 rank, near fp32 AdamW, and the 2-rank checkpoint (bf16 moments, sharded) resumed on 1
    rank continues as the uninterrupted run."""
    d = runs["dirs"]
    assert "optimizer: AdamW with bf16 moments" in runs["two"][2]
    assert_close(losses(d["bf16-1"]), losses(d["bf16-2"]), rel=1e-5, steps=range(1, 7))
    assert losses(d["bf16-1"]) != losses(d["adamw"])
    assert_close(losses(d["adamw"]), losses(d["bf16-1"]), rel=1e-3, steps=range(1, 7))
    assert "was 2 ranks, now 1" in runs["one"][5]
    assert_close(losses(d["bf16-2"]), losses(d["bf16-resumed"]), rel=1e-5, steps=range(4, 7))
