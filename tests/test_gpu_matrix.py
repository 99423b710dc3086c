"""benchmarks/gpu_matrix.sh without a GPU: the commands it would run (every configuration through the vendor
launcher, under a time limit, the compiled ones logging dynamo's recompiles), that the launcher accepts each of
them, and the recompile count of its table on a real compiled run of GPT-2 with keyed dropout."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, env

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_matrix_summary  # noqa: E402


def matrix(**knobs: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/gpu_matrix.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, **knobs},
    )


def commands(stdout: str) -> dict[str, str]:
    """name → command, from the plan the script prints (`  # name` then `  command`)."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.startswith("  ")]
    return {lines[i][2:]: lines[i + 1] for i in range(len(lines) - 1) if lines[i].startswith("# ")}


@pytest.mark.slow  # the script, its Python processes
def test_gpu_matrix_without_a_gpu_prints_its_plan_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the matrix")
    proc = matrix()
    assert proc.returncode == 0, proc.stderr
    assert "no GPU" in proc.stdout
    for what in (
        "--torch_compile true",
        "--gradient_checkpointing true",
        "--accelerate-config ddp",
        "--accelerate-config fsdp",
        "--accelerate-config deepspeed_zero3",
    ):
        assert what in proc.stdout, what
    assert proc.stdout.count("--bf16 true") == 9
    assert "--lean_loss false" in proc.stdout and "benchmarks/lean_loss.py --bf16" in proc.stdout
    assert "skipped: HSDP needs at least 2 GPUs (world size 1)" in proc.stdout
    assert "skipped: context parallelism needs an even number of GPUs (world size 1)" in proc.stdout
    # on a multi-GPU node the HSDP row runs two replica groups (what two nodes would get by default)
    four = matrix(NGPU="4", DRY_RUN="1")
    assert (
        four.returncode == 0
        and "# native bf16 + HSDP 2 x 2" in four.stdout
        and "--dp_replicate 2 --output_dir" in four.stdout
    )


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_every_configuration_runs_through_the_vendor_launcher_under_a_time_limit(vendor):
    """Each training command is `timeout … bash run_<vendor>_all.sh --nproc N --engine …` (the launcher's
    environment presets, as a user's run gets them), and the launcher accepts each one (its --dry-run)."""
    proc = matrix(NGPU="2", DRY_RUN="1", VENDOR=vendor, TIME_LIMIT="77")
    assert proc.returncode == 0, proc.stderr
    extra = ("lean loss", "gradient accumulation")  # the benchmarks after the training rows
    runs = {name: cmd for name, cmd in commands(proc.stdout).items() if not name.startswith(("the lean loss", *extra))}
    assert len(runs) == 12, runs
    assert "--cp 2 --gradient_checkpointing true --attn_implementation flash_attention_2" in proc.stdout
    prefix = re.compile(
        rf"^(env TORCH_LOGS=recompiles )?timeout --kill-after 60 77 bash run_{vendor}_all.sh --nproc 2 "
    )
    for name, cmd in runs.items():
        assert prefix.match(cmd), cmd
        # compiled runs log dynamo's recompiles (the table counts them); the others need not
        assert cmd.startswith("env TORCH_LOGS=recompiles ") == ("--torch_compile true" in cmd), cmd
        assert ("--engine hf --accelerate-config" in cmd) == name.startswith("HF engine"), cmd
    assert "timeout --kill-after 60 77 " in proc.stdout.split("# the lean loss")[1]
    accumulation = commands(proc.stdout)[
        "gradient accumulation: reduce-scatter every micro-batch against deferred, every GPU, bf16"
    ]
    assert accumulation.startswith("timeout --kill-after 60 77 ") and "--nproc-per-node 2" in accumulation
    assert "benchmarks/accumulation_speed.py --bf16" in accumulation
    keyed = runs["native bf16 + torch.compile, GPT-2 124M with keyed dropout 0.1"]
    assert "--config_name benchmarks/gpt2_dropout.json" in keyed and "--torch_compile true" in keyed
    engines = {re.search(r"--engine (fsdp|hf( --accelerate-config \S+)?) --", c).group(1) for c in runs.values()}
    assert len(engines) == 4  # fsdp and the HF engine's three configs
    for engine in engines:
        launch = [
            "bash",
            f"run_{vendor}_all.sh",
            "--nproc",
            "2",
            "--cpu",
            "--dry-run",
            "--engine",
            *engine.split(),
            "--",
            "--config_name",
            "tiny",
        ]
        out = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env())
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_gpt2_configuration_has_dropout_to_key():
    from transformers import AutoConfig

    from anygpu.model import dropout

    config = AutoConfig.from_pretrained(ROOT / "benchmarks" / "gpt2_dropout.json")
    assert dropout.dropout_rates(config) == {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}


# dynamo's TORCH_LOGS=recompiles lines, as torch 2.13 prints them (one rank of two: rank 1's are not counted twice)
LOG = """\
[rank0]:V1125 07:55:35.277000 15964 torch/_dynamo/guards.py:5396] [5/1] [__recompiles] Recompiling function keyed_dropout in anygpu/model/dropout.py:133
[rank1]:V1125 07:55:35.277000 15965 torch/_dynamo/guards.py:5396] [5/1] [__recompiles] Recompiling function keyed_dropout in anygpu/model/dropout.py:133
step 1/6 | loss 9.0155 | lr 0.00e+00 | grad_norm 1.216 | 14 tok/s
step 2/6 | loss 9.0229 | lr 1.67e-04 | grad_norm 1.389 | 10,115 tok/s
{between}step 6/6 | loss 8.9827 | lr 8.33e-04 | grad_norm 1.550 | 9,675 tok/s
[rank0]:V1125 07:55:42.222000 15964 torch/_dynamo/guards.py:5396] [1/1] [__recompiles] Recompiling function forward_with_checkpointing in transformers/modeling_layers.py:88
step 6/6 | eval_loss 8.9399 | ppl 7630.46
"""
RECOMPILE = (
    "[rank0]:V1125 07:55:38.1 15964 torch/_dynamo/guards.py:5396] [5/2] [__recompiles] Recompiling function "
    "keyed_dropout in anygpu/model/dropout.py:133\n"
)


def test_the_table_counts_rank_0s_recompiles_between_step_2_and_the_last_step():
    assert gpu_matrix_summary.recompiles_after(LOG.format(between="")) == 0  # step 1's and the evaluation's left out
    assert gpu_matrix_summary.recompiles_after(LOG.format(between=RECOMPILE * 3)) == 3
    assert gpu_matrix_summary.recompiles_after("step 1/6 | loss 9.0 | lr 0\n") is None  # never reached step 2


def test_dynamos_own_recompile_line_is_what_the_table_counts():
    """The matrix counts TORCH_LOGS=recompiles lines by their text: this torch's own line for a recompile (a new
    shape) must hold it, or a row would say 0 whatever happened. That keyed dropout itself does not recompile is
    tests/test_keyed_dropout.py's (dynamo's guards without code generation); the GPU matrix runs the whole row."""
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: x * 2, backend='eager', dynamic=False)\n"
        "f(torch.ones(2)); f(torch.ones(3))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env(), "TORCH_LOGS": "recompiles"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if gpu_matrix_summary.RECOMPILE in ln]
    assert len(lines) == 1 and "<lambda>" in lines[0], proc.stderr[-3000:]
