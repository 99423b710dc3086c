"""HSDP in the FSDP2 engine, the parts that need no processes: the mesh it picks (shard within a node,
replicate across nodes), bad --dp_replicate/--dp_shard refused before any process group, and what
`anygpu plan` counts (states divided by the shard group S, not the world size). Real runs (4 ranks as
2 × 2 against 1 rank; a 2 × 2 checkpoint resumed as 1 × 2): test_fsdp_engine.py; the default mesh of two
nodes under the real launcher: test_launch.py."""

import json

import pytest
import torch.distributed as dist
from conftest import TINY
from test_plan import run_plan

from anygpu.engines.fsdp import main as fsdp_main
from anygpu.engines.hf.engine import main as hf_main
from anygpu.config.batch import plan_batch
from anygpu.planning import auto_batch, memory_plan
from anygpu.runtime.mesh import MeshShape, resolve
from anygpu.tools import plan as plan_tool


@pytest.mark.parametrize(
    "replicate, shard, world, per_node, expected",
    [
        (None, None, 8, 8, (1, 8)),  # one node: shard over all
        (None, None, 16, 8, (2, 8)),  # two nodes of 8: shard within a node, replicate across nodes
        (None, None, 2, 1, (2, 1)),  # two nodes of one process
        (None, None, 1, 1, (1, 1)),  # plain python
        (2, None, 8, 8, (2, 4)),  # one given, the other derived
        (None, 2, 8, 8, (4, 2)),
        (2, 2, 4, 4, (2, 2)),
        (1, None, 16, 8, (1, 16)),  # several nodes, plain FSDP2 over all of them
    ],
)
def test_the_mesh_given_derived_or_by_default(replicate, shard, world, per_node, expected):
    assert resolve(replicate, shard, world, per_node) == MeshShape(*expected)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--dp_replicate", "3"],
            "--dp_replicate 3 does not divide the world size 4 (--dp_replicate × --dp_shard must "
            "equal it): use one of (R × S) 4 × 1, 2 × 2, 1 × 4.",
        ),
        (
            ["--dp_replicate", "2", "--dp_shard", "4"],
            "--dp_replicate 2 × --dp_shard 4 = 8, not the world size 4: give "
            "R × S = 4, e.g. (R × S) 4 × 1, 2 × 2, 1 × 4.",
        ),
        (["--dp_shard", "0"], "--dp_shard 0 must be a finite number ≥ 1"),
    ],
    ids=["indivisible", "product", "zero"],
)
def test_a_mesh_that_does_not_fit_is_refused_before_any_process_group(extra, expected, capsys, tmp_path, monkeypatch):
    assert_refused_on_four_ranks(extra, expected, capsys, tmp_path, monkeypatch)


def assert_refused_on_four_ranks(extra: list[str], expected: str, capsys, tmp_path, monkeypatch) -> None:
    """The FSDP2 engine as one of 4 torchrun ranks refuses `extra` in one line saying `expected`, exit 2, before
    any process group or output."""
    monkeypatch.setenv("WORLD_SIZE", "4")  # what torchrun --nproc-per-node 4 sets
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as e:
        fsdp_main([*TINY, *extra, "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and expected in err, err
    assert not dist.is_initialized() and not (tmp_path / "metrics.jsonl").exists()


def test_the_hf_engine_names_the_engine_that_has_hsdp(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        hf_main([*TINY, "--dp_shard", "2", "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--dp_shard 2: HSDP is the FSDP2 engine's (run_fsdp_standalone.py" in err


def test_plan_divides_hsdp_states_by_the_shard_group():
    """Two nodes of 8 GPUs: the hsdp rows (2 × 8) hold what FSDP2 holds on 8 GPUs, twice FSDP2's over 16."""
    proc = run_plan(
        "--config_name",
        "default",
        "--num_nodes",
        "2",
        "--num_gpus",
        "16",
        "--gpu_memory_gb",
        "80",
        "--block_size",
        "256",
        "--global_batch_size",
        "64",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["hsdp"] == {"dp_replicate": 2, "dp_shard": 8}
    rows = {(r["strategy"], r["precision"], r["activation_checkpointing"], r["lora"]): r for r in plan["rows"]}
    shapes, _, _ = plan_tool.load_shapes(None, "default")
    for precision in ("fp32", "bf16"):
        hsdp, fsdp16 = rows["hsdp", precision, False, False], rows["fsdp2", precision, False, False]
        on_8, _ = memory_plan.model_state_bytes(shapes, "fsdp2", precision, 8)
        assert {k: hsdp["per_gpu_bytes"][k] for k in on_8} == on_8
        states = sum(on_8.values())
        assert abs(states - 16 * shapes.num_params / 8) < 0.01 * states  # 16 bytes per parameter over S = 8
        assert sum(fsdp16["per_gpu_bytes"][k] for k in on_8) < 0.51 * states
        assert hsdp["accelerate_config"] == "run_fsdp_standalone.py --dp_replicate 2 --dp_shard 8"
    # one node: no hsdp rows (the default mesh is plain FSDP2); a shard group that does not divide: refused
    one = json.loads(run_plan("--config_name", "tiny", "--num_gpus", "8", "--gpu_memory_gb", "80", "--json").stdout)
    assert one["hsdp"] is None and all(r["strategy"] != "hsdp" for r in one["rows"])
    bad = run_plan("--config_name", "tiny", "--num_gpus", "16", "--dp_shard", "3")
    assert bad.returncode == 2 and "--dp_shard 3 does not divide --num_gpus 16: use one of 1, 2, 4, 8, 16" in bad.stderr


def test_auto_micro_batch_counts_the_states_over_the_shard_group():
    """--per_device_train_batch_size auto under HSDP 2 × 2 budgets the states of 2 shards, not 4."""
    import torch

    shapes, _, _ = plan_tool.load_shapes(None, "default")
    cost = {}
    for shard_size in (None, 2):
        _, probe = auto_batch.resolve(
            plan_batch(16, 4), shapes, "fsdp2", "fp32", 64, False, 8.0, torch.device("cpu"), shard_size=shard_size
        )
        cost[shard_size] = dict((m, b) for m, b, _ in probe.tried)[4]  # the largest candidate, tried first
    states_on = {n: sum(memory_plan.model_state_bytes(shapes, "fsdp2", "fp32", n)[0].values()) for n in (2, 4)}
    assert cost[2] - cost[None] == states_on[2] - states_on[4] + (
        memory_plan.transient_bytes(shapes, "fsdp2", "fp32", 2)
        - memory_plan.transient_bytes(shapes, "fsdp2", "fp32", 4)
    )


@pytest.fixture(scope="module")
def meta_models():
    """Llama-3-8B and -70B shapes on the meta device (nothing allocated)."""
    from anygpu.config.args import ModelArguments
    from anygpu.model import modeling

    def build(name):
        args = ModelArguments(config_name=name)
        return modeling.build_meta_model(modeling.resolve_config(args), args)

    return {"8b": build("llama-8b"), "70b": build("llama-70b")}


@pytest.mark.parametrize(
    "model, nodes, budget_gib, expected",
    [
        ("8b", 2, 40, MeshShape(2, 8)),  # 15 GiB per GPU over one node: the node-local default stays
        ("70b", 4, 80, MeshShape(2, 16)),  # 131 GiB over 8; 66 GiB over two nodes' 16 fits 80
        ("70b", 4, 40, MeshShape(1, 32)),  # 66 GiB over 16 does not fit 40: FSDP2 over all 32 (33 GiB)
        ("70b", 2, 20, MeshShape(1, 16)),  # nothing fits: as wide as the job goes
    ],
)
def test_the_default_mesh_shards_as_wide_as_the_model_state_needs(meta_models, model, nodes, budget_gib, expected):
    """Several nodes of 8: the default (one replica group per node) widens its shard group by whole nodes until a
    rank's 16 bytes per parameter of state fit the budget (the engine's: half a GPU), saying so."""
    from anygpu.runtime import mesh, parallel

    m = meta_models[model]
    default = resolve(None, None, 8 * nodes, 8)
    assert default == MeshShape(nodes, 8)
    shape, note = mesh.widen(default, lambda s: parallel.state_bytes_per_rank(m, s), budget_gib << 30)
    assert shape == expected
    if shape == default:
        assert note is None
    else:
        assert f"sharded over {shape.shard_group} ranks" in note and "--dp_replicate/--dp_shard" in note
        held = parallel.state_bytes_per_rank(m, shape.shard_group)
        assert held <= budget_gib << 30 or shape.dp_replicate == 1


def test_a_mesh_the_user_sets_or_cpu_ranks_keep_their_mesh():
    """--dp_replicate/--dp_shard given, or ranks without a GPU: `fitted_mesh` changes nothing (and builds nothing)."""
    from types import SimpleNamespace

    import torch

    from anygpu.engines import fsdp

    given = SimpleNamespace(dp_replicate=2, dp_shard=None, cpu_offload=False)
    assert fsdp.fitted_mesh(MeshShape(2, 8), None, None, given, torch.device("cuda")) == (MeshShape(2, 8), None)
    default = SimpleNamespace(dp_replicate=None, dp_shard=None, cpu_offload=False)
    assert fsdp.fitted_mesh(MeshShape(2, 8), None, None, default, torch.device("cpu")) == (MeshShape(2, 8), None)
