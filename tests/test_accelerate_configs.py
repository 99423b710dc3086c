"""Every shipped accelerate config: loaded by accelerate's own loader and launcher, the keys the
HF engine relies on asserted, unknown keys refused, `num_processes: 8` as typed (overridden by the
command line), a comment on every non-obvious key. In-process and fast except `accelerate test`."""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import HIDE_GPUS, ROOT

CONFIG_DIR = ROOT / "accelerate_configs"
SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
SINGLE_NODE = [name for name in SHIPPED if name != "multi_node"]
# Keys whose meaning is plain from name and value; every other key carries a comment.
OBVIOUS = {
    "compute_environment",
    "distributed_type",
    "num_machines",
    "machine_rank",
    "use_cpu",
    "fsdp_config",
    "deepspeed_config",
    "zero_stage",
    "fsdp_offload_params",
    "offload_optimizer_device",
    "offload_param_device",
}
# FSDP1 settings accelerate ignores (or rejects) under fsdp_version 2: they would only mislead a reader.
FSDP1_ONLY = {
    "fsdp_sharding_strategy",
    "fsdp_use_orig_params",
    "fsdp_sync_module_states",
    "fsdp_forward_prefetch",
    "fsdp_backward_prefetch",
}
# DeepSpeed batch numbers must stay "auto" (the engine fills them from the global batch).
DS_BATCH_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}


def load(name_or_path) -> "ClusterConfig":  # noqa: F821
    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(name_or_path) if str(name_or_path).endswith(".yaml") else CONFIG_DIR / f"{name_or_path}.yaml"
    return load_config_from_file(str(path))


def launch_args(name_or_path, *extra: str):
    """What `accelerate launch --config_file … [extra] train.py` resolves, by accelerate's own code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = Path(name_or_path) if str(name_or_path).endswith(".yaml") else CONFIG_DIR / f"{name_or_path}.yaml"
    args = launch_command_parser().parse_args(["--config_file", str(path), *extra, "train.py"])
    return _validate_launch_command(args)


def dead_top_level_keys(raw: dict) -> list[str]:
    """Top-level keys `accelerate launch` never takes from a file: a command-line default (e.g.
    same_network=False, rdzv_backend='static') is already set, and file values only fill unset ones."""
    from accelerate.commands.launch import launch_command_parser

    defaults = {a.dest: a.default for a in launch_command_parser()._actions}
    handled = {"compute_environment", "distributed_type", "mixed_precision", "debug", "fsdp_config", "deepspeed_config"}
    return [k for k in raw if k not in handled and defaults.get(k) is not None]


def unknown_nested_keys(cfg) -> list[str]:
    """Nested keys no `accelerate launch` option reads (accelerate ignores them without a word)."""
    from accelerate.commands.launch import launch_command_parser

    options = {a.dest for a in launch_command_parser()._actions}
    bad = []
    for key in cfg.fsdp_config:
        if (key if key.startswith("fsdp_") else f"fsdp_{key}") not in options:
            bad.append(f"fsdp_config.{key}")
    bad += [f"deepspeed_config.{key}" for key in cfg.deepspeed_config if key not in options]
    return bad


def launched_plugin(name: str):
    """The FSDP / DeepSpeed plugin a script started by `accelerate launch` builds from its environment."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, _ = launch_args(name, "--num_processes", "2")
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command does
        _, env = prepare_deepspeed_cmd_env(args)
        with mock.patch.dict(os.environ, env, clear=True):
            return DeepSpeedPlugin()
    env = prepare_multi_gpu_env(args)
    with mock.patch.dict(os.environ, env, clear=True):
        return FullyShardedDataParallelPlugin()


def test_the_expected_configs_ship():
    assert set(SHIPPED) == {
        "ddp",
        "fsdp",
        "fsdp_offload",
        "deepspeed_zero2",
        "deepspeed_zero3",
        "deepspeed_zero3_offload",
        "multi_node",
    }


@pytest.mark.parametrize("name", SHIPPED)
def test_loads_with_accelerates_loader_and_launcher(name):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = load(name)
    assert isinstance(cfg, ClusterConfig) and cfg.compute_environment.value == "LOCAL_MACHINE"
    assert cfg.mixed_precision == "no"  # precision is the script's --bf16/--fp16, one knob in one place
    assert not cfg.use_cpu
    assert unknown_nested_keys(cfg) == []
    assert dead_top_level_keys(yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())) == []
    args, _, _ = launch_args(name, "--num_processes", "3")
    assert args.num_processes == 3


@pytest.mark.parametrize("name", SINGLE_NODE)
def test_eight_processes_as_typed_overridden_by_the_command_line(name):
    """TRL's convention: `num_processes: 8` (the common node) so the line works as typed; the
    command line (the launchers pass the GPU count they detected) overrides it."""
    raw = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
    assert raw["num_processes"] == 8 and raw.get("gpu_ids", "all") == "all"
    assert raw["num_machines"] == 1
    assert raw["main_process_port"] == 0  # a free port: two jobs on one host do not collide
    assert launch_args(name)[0].num_processes == 8  # typed without --num_processes
    for n in (1, 2, 8):  # whatever the host has, passed by the launchers or the user
        assert launch_args(name, "--num_processes", str(n))[0].num_processes == n


def test_multi_node_still_needs_the_total_on_the_command_line():
    with pytest.raises(ValueError, match="--num_processes"):
        launch_args("multi_node")


@pytest.mark.slow
def test_accelerate_own_check_forms_one_group(tmp_path):
    """accelerate's own config check (the script `accelerate test` runs) on ddp.yaml, launched as
    the CPU launcher does (ACCELERATE_USE_CPU=true): the processes form one gloo group and pass.
    Without that switch a CPU host runs N unconnected single processes (DistributedType.NO), which
    is what an earlier version of this test passed on, by luck of a file race."""
    import subprocess
    import sys

    import accelerate.test_utils as tu

    script = Path(tu.__file__).parent / "scripts" / "test_script.py"
    bindir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "true",
    }
    env.update(HIDE_GPUS)
    # 2 processes: accelerate's script checks tensor splits as if there were at most 2
    # (huggingface/accelerate#1722, #2769), whatever the hardware.
    proc = subprocess.run(
        [
            str(bindir / "accelerate"),
            "launch",
            "--config_file",
            str(CONFIG_DIR / "ddp.yaml"),
            "--num_processes",
            "2",
            str(script),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("Distributed environment: DistributedType.MULTI_CPU") == 2, out[-6000:]
    assert out.count("Num processes: 2") == 2 and "DistributedType.NO" not in out


def test_ddp():
    cfg = load("ddp")
    assert cfg.distributed_type.value == "MULTI_GPU" and cfg.fsdp_config == {} and cfg.deepspeed_config == {}
    args, _, _ = launch_args("ddp", "--num_processes", "2")
    assert args.multi_gpu and not args.use_fsdp and not args.use_deepspeed


@pytest.mark.parametrize("name, offload", [("fsdp", False), ("fsdp_offload", True)])
def test_fsdp2(name, offload):
    cfg = load(name)
    assert cfg.distributed_type.value == "FSDP"
    fsdp = cfg.fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # the model's _no_split_modules: any causal LM
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is True
    assert fsdp["fsdp_offload_params"] is offload
    assert fsdp["fsdp_activation_checkpointing"] is False  # --gradient_checkpointing is the one knob
    assert not FSDP1_ONLY & set(fsdp)
    # what the launched script builds from it
    plugin = launched_plugin(name)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.cpu_ram_efficient_loading
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert type(plugin.cpu_offload).__name__ == ("CPUOffloadPolicy" if offload else "OffloadPolicy")


@pytest.mark.parametrize(
    "name, stage, offload",
    [("deepspeed_zero2", 2, "none"), ("deepspeed_zero3", 3, "none"), ("deepspeed_zero3_offload", 3, "cpu")],
)
def test_deepspeed(name, stage, offload):
    cfg = load(name)
    assert cfg.distributed_type.value == "DEEPSPEED"
    ds = cfg.deepspeed_config
    assert ds["zero_stage"] == stage
    assert "deepspeed_config_file" not in ds  # together with inline keys it is an error
    assert ds["gradient_accumulation_steps"] == "auto" and ds["gradient_clipping"] == "auto"
    assert ds["zero3_init_flag"] is (stage == 3)  # ZeRO-3: partitioned while built (anygpu.engines.hf.construct)
    assert ds["offload_optimizer_device"] == offload
    assert ds.get("offload_param_device", "none") == (offload if stage == 3 else "none")
    # what the launched script builds: batch numbers left to the engine's batch math
    plugin = launched_plugin(name)
    conf = plugin.deepspeed_config
    assert {k: conf[k] for k in DS_BATCH_KEYS} == dict.fromkeys(DS_BATCH_KEYS, "auto")
    assert conf["gradient_clipping"] == "auto"
    assert conf["zero_optimization"]["stage"] == stage
    assert conf["zero_optimization"]["offload_optimizer"]["device"] == offload
    assert plugin.zero3_init_flag is (stage == 3)


def test_multi_node():
    cfg = load("multi_node")
    assert cfg.distributed_type.value == "MULTI_GPU"
    assert cfg.num_machines >= 2
    assert cfg.main_process_port and cfg.main_process_port > 0  # every node must be told the same port
    assert cfg.main_process_ip
    # node 1 of 2 with 8 GPUs each: the torchrun arguments accelerate derives from the file + command line
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = launch_args(
        "multi_node",
        "--num_processes",
        "16",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
    )
    prepare_multi_gpu_env(args)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert args.rdzv_backend == "static" and args.rdzv_endpoint == "10.0.0.1:29500"


@pytest.mark.parametrize("name", SHIPPED)
def test_every_non_obvious_key_has_a_comment(name):
    lines = (CONFIG_DIR / f"{name}.yaml").read_text().splitlines()
    assert lines[0].startswith("#"), "each file starts with what it is for and how to launch it"
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"^\s*([A-Za-z_0-9]+):", line)
        if not m or m.group(1) in OBVIOUS:
            continue
        commented = "#" in line.split(":", 1)[1] or (i > 0 and lines[i - 1].strip().startswith("#"))
        if not commented:
            bare.append(m.group(1))
    assert not bare, f"{name}.yaml: keys without a comment: {bare}"


def test_unknown_keys_are_refused(tmp_path):
    """The checks above can fail: an unknown top-level key (accelerate raises) and an unknown nested
    key (accelerate would ignore it; `unknown_nested_keys` catches it)."""
    raw = yaml.safe_load((CONFIG_DIR / "fsdp.yaml").read_text())
    top = tmp_path / "top.yaml"
    top.write_text(yaml.safe_dump({**raw, "num_gpus": 8}))
    with pytest.raises(ValueError, match="unknown keys"):
        load(top)
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        yaml.safe_dump({**raw, "fsdp_config": {**raw["fsdp_config"], "fsdp_backward_prefetch_policy": "BACKWARD_PRE"}})
    )
    assert unknown_nested_keys(load(nested)) == ["fsdp_config.fsdp_backward_prefetch_policy"]
    ds = yaml.safe_load((CONFIG_DIR / "deepspeed_zero3.yaml").read_text())
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({**ds, "deepspeed_config": {**ds["deepspeed_config"], "zero_stages": 3}}))
    assert unknown_nested_keys(load(typo)) == ["deepspeed_config.zero_stages"]
    # a key accelerate's loader accepts but the launcher never applies
    assert dead_top_level_keys({**raw, "same_network": True, "rdzv_backend": "c10d"}) == [
        "same_network",
        "rdzv_backend",
    ]
