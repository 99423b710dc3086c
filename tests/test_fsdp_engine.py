"""The native FSDP2 engine: same loss on any number of ranks and mesh (FSDP2 or HSDP), exact elastic resume
(also onto another mesh), torch.compile as eager, real sharding, a final export that Hugging Face loads, a dead rank ends the job. (SIGTERM's checkpoint and its
resume with a changed --max_steps: test_faults.py; the plain-python run and --save_total_limit: test_trackers.py,
on runs those files make anyway.)"""

import json
import math
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    LEAN_CHUNKS,
    ROOT,
    TINY,
    assert_close,
    env,
    fsdp_runs,
    losses,
    python,
    records,
    shared_runs,
    torchrun,
)
from test_hf_engine import parity_args

pytestmark = pytest.mark.slow  # starts training processes

SCRIPT = "run_fsdp_standalone.py"
TEN = [*TINY, "--max_steps", "10"]


EVAL24 = ["--max_eval_samples", "24"]  # the evaluation set the export round trip recomputes


# The 4-rank reference runs as HSDP: 2 replica groups × 2 shards.
HSDP_2X2 = ["--dp_replicate", "2", "--dp_shard", "2"]


def state_at_step_5(run_dir: Path, dest: Path) -> None:
    """A run as it stood after step 5: checkpoint-5, metrics up to step 5 (what --stop_at_step 5 leaves)."""
    shutil.copytree(
        run_dir, dest, dirs_exist_ok=True, ignore=lambda d, names: [n for n in names if n in ("checkpoint-10", "final")]
    )
    metrics = dest / "metrics.jsonl"
    metrics.write_text("".join(ln + "\n" for ln in metrics.read_text().splitlines() if json.loads(ln)["step"] <= 5))


def fsdp_reference(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """10 steps of the tiny preset on 1, 2 and 4 ranks, the runs that start from them, and the engine-parity runs
    (test_hf_parity.py), in three launches (once per session): 1 rank: `ws1`, `parity1`, `own` (ws1 with the
    model's own loss; the 1- and 4-rank launches cut the lean loss into 48-token chunks); 4 ranks: `ws4` as HSDP
    2 × 2 (saving checkpoint-5); 2 ranks: `ws2` (exporting final/ after its last evaluation), `finetune` (1 step
    from that export), `bf16` (4 steps), `parity2`, `elastic` (ws4's checkpoint-5 resumed on 2 ranks as 1 × 2:
    another world size and mesh), `compile` (--torch_compile on HSDP 2 × 1, 4 of the 10 steps)."""

    def launch(root: Path) -> dict[str, str]:
        names = ("ws1", "ws2", "ws4", "finetune", "bf16", "elastic", "compile", "parity1", "parity2", "own")
        d = {name: root / name for name in names}
        out = {}
        out["ws1"], out["parity1"], out["own"] = fsdp_runs(
            1,
            [
                [*TEN, *EVAL24, "--output_dir", str(d["ws1"]), "--export_final", "false"],
                [*parity_args(1), "--output_dir", str(d["parity1"])],
                [*TEN, *EVAL24, "--output_dir", str(d["own"]), "--export_final", "false", "--lean_loss", "false"],
            ],
            extra_env=LEAN_CHUNKS,
        )
        (out["ws4"],) = fsdp_runs(
            4,
            [[*TEN, *EVAL24, "--output_dir", str(d["ws4"]), *HSDP_2X2, "--save_steps", "5", "--export_final", "false"]],
            extra_env=LEAN_CHUNKS,
        )
        state_at_step_5(d["ws4"], d["elastic"])
        assert (d["elastic"] / "checkpoint-5" / "trainer_state.json").exists() and not (d["elastic"] / "final").exists()
        assert sorted(losses(d["elastic"])) == list(range(1, 6))
        out["ws2"], out["finetune"], out["bf16"], out["parity2"], out["elastic"], out["compile"] = fsdp_runs(
            2,
            [
                [*TEN, *EVAL24, "--output_dir", str(d["ws2"]), "--save_steps", "5"],
                [
                    *TINY,
                    "--model_name_or_path",
                    str(d["ws2"] / "final"),
                    "--max_steps",
                    "1",
                    "--eval_on_start",
                    "true",
                    "--output_dir",
                    str(d["finetune"]),
                    *EVAL24,
                    "--export_final",
                    "false",
                ],
                [
                    *TINY,
                    "--max_steps",
                    "4",
                    "--bf16",
                    "true",
                    "--output_dir",
                    str(d["bf16"]),
                    "--export_final",
                    "false",
                ],
                [*parity_args(2), "--output_dir", str(d["parity2"])],
                [
                    *TEN,
                    *EVAL24,
                    "--output_dir",
                    str(d["elastic"]),
                    "--save_steps",
                    "5",
                    "--resume_from_checkpoint",
                    "latest",
                    "--export_final",
                    "false",
                ],
                # --stop_at_step 4 keeps the schedule of 10 steps and skips the final evaluation's no-grad recompile
                [
                    *TEN,
                    "--stop_at_step",
                    "4",
                    "--dp_replicate",
                    "2",
                    "--torch_compile",
                    "true",
                    "--output_dir",
                    str(d["compile"]),
                ],
            ],
        )
        return out

    return shared_runs(tmp_path_factory, "fsdp", launch)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root, stdout = fsdp_reference(tmp_path_factory)
    names = ("ws1", "ws2", "ws4", "finetune", "bf16", "elastic", "compile", "own")
    return {"dirs": {name: root / name for name in names}, "stdout": stdout}


@pytest.fixture(scope="module")
def baseline_dirs(runs) -> dict[int, Path]:
    return {n: runs["dirs"][f"ws{n}"] for n in (1, 2, 4)}


@pytest.fixture(scope="module")
def baseline(baseline_dirs) -> dict[int, dict[int, float]]:
    return {n: losses(d) for n, d in baseline_dirs.items()}


def test_world_size_invariance(baseline, runs):
    """1 rank, 2 ranks (FSDP2, 1 × 2) and 4 ranks as HSDP 2 × 2: the same losses (the data is split over all 4)."""
    assert sorted(baseline[1]) == list(range(1, 11))
    assert baseline[1][10] < baseline[1][1]  # it trains
    for n in (2, 4):
        assert_close(baseline[1], baseline[n], rel=1e-5)
    assert "mesh 1 × 2 (dp_replicate × dp_shard): FSDP2" in runs["stdout"]["ws2"]
    ws4 = runs["stdout"]["ws4"]
    assert "mesh 2 × 2 (dp_replicate × dp_shard): HSDP, state sharded over the 2 ranks of each of 2" in ws4
    assert "global batch 8 = 2 per device × 4 devices × 1 accumulation step" in ws4


def test_the_lean_loss_is_the_models_own(baseline, runs):
    """The default lean loss (in 48-token chunks) against --lean_loss false: the same training and eval losses."""
    own = runs["dirs"]["own"]
    assert_close(losses(own), baseline[1], rel=1e-5)
    evals = [{r["step"]: r["eval_loss"] for r in records(d) if "eval_loss" in r} for d in (own, runs["dirs"]["ws1"])]
    assert evals[0] and evals[0].keys() == evals[1].keys()
    assert_close(*evals, rel=1e-5)
    assert (
        "loss: lean (chunked cross-entropy, 48 tokens ($ANYGPU_LEAN_LOSS_CHUNK_TOKENS) at a time"
        in runs["stdout"]["ws1"]
    )
    assert "loss: the model's own (full logits; --lean_loss false)" in runs["stdout"]["own"]


def test_elastic_resume_onto_another_world_size_and_mesh(baseline, runs):
    """checkpoint-5 of the 4-rank HSDP 2 × 2 run resumed on 2 ranks as plain FSDP2 (1 × 2): DCP reshards, the
    manifest and the resume guard accept it, and steps 6-10 match the 4-rank run's own."""
    state = json.loads((runs["dirs"]["ws4"] / "checkpoint-5" / "trainer_state.json").read_text())
    assert (state["world_size"], state["dp_replicate"], state["dp_shard"]) == (4, 2, 2)
    out = runs["stdout"]["elastic"]
    assert "resumed from" in out and "was 4 ranks, now 2; mesh was 2 × 2, now 1 × 2" in out
    resumed = losses(runs["dirs"]["elastic"])
    assert sorted(resumed) == list(range(1, 11))  # steps 1-5 kept, 6-10 appended once
    assert_close(baseline[4], resumed, rel=1e-5, steps=range(6, 11))


def test_torch_compile_with_hsdp_matches_eager(baseline, runs):
    """--torch_compile (inductor, built with the C++ compiler here) on HSDP 2 × 1: steps 1-4 within 1e-4 of the
    eager 1-rank run (same schedule: --max_steps 10, stopped at 4)."""
    assert "mesh 2 × 1 (dp_replicate × dp_shard): HSDP" in runs["stdout"]["compile"]
    assert_close(baseline[1], losses(runs["dirs"]["compile"]), rel=1e-4, steps=range(1, 5))


def test_sharding_halves_per_rank_state():
    args = [*TINY, "--max_steps", "1", "--output_dir", "/tmp/unused"]
    per_rank = {}
    for n in (1, 2):  # 1 rank: plain python (a one-rank group, the same FSDP2 wrapping)
        proc = (
            python("tests/scripts/shard_bytes.py", args)
            if n == 1
            else torchrun(n, "tests/scripts/shard_bytes.py", args)
        )
        per_rank[n] = json.loads(proc.stdout.split("BYTES ", 1)[1].splitlines()[0])
    full = per_rank[1][0]
    for b in per_rank[2]:
        assert abs(b - full / 2) <= 0.05 * full / 2, (per_rank, full)


def test_gradient_accumulation_holds_only_this_ranks_shard_of_the_gradients():
    """2 ranks, 4 accumulation steps: after every micro-batch's backward a rank holds its shard of the gradients,
    never the whole model's (FSDP2 left to accumulate unsharded gradients until the last micro-batch holds +1x the
    model's fp32 size per rank, which the memory plan and the auto micro-batch do not count)."""
    args = [*TINY, "--per_device_train_batch_size", "1", "--global_batch_size", "8", "--max_steps", "1"]
    proc = torchrun(2, "tests/scripts/accumulation_bytes.py", [*args, "--output_dir", "/tmp/unused"])
    lines = [json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines() if line.startswith("GRAD_BYTES")]
    assert len(lines) == 2, proc.stdout[-2000:]
    for rank in lines:
        held, shard = rank["after_each_backward"], rank["sharded_parameters"]
        assert len(held) == 4, held  # one backward per micro-batch
        assert max(held) <= 1.05 * shard, (held, shard)


def test_final_export_round_trip(baseline_dirs, runs):
    """The 2-rank baseline run's final/ (10 steps, evaluated on 24 samples at the end)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anygpu.config.args import parse_args
    from anygpu.data.prepare import prepare
    from anygpu.runtime import distributed

    run_dir = baseline_dirs[2]
    args = [*TEN, *EVAL24, "--output_dir", str(run_dir), "--save_steps", "5"]
    final = run_dir / "final"
    assert (final / "model.safetensors").exists() and (final / "config.json").exists()
    engine_eval = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in ln][
        -1
    ]
    assert engine_eval["step"] == 10

    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    m_args, d_args, t_args = parse_args(args)
    info = distributed.DistInfo(0, 0, 1, torch.device("cpu"))  # no process group: prepare only reads the cache
    val = prepare(m_args, d_args, t_args, info).datasets["validation"]
    assert len(val) == 24 and len(tok) <= model.config.vocab_size
    ids = torch.tensor(val["input_ids"])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert math.isclose(loss, engine_eval["eval_loss"], rel_tol=1e-4), (loss, engine_eval)

    # fine-tuning from the export starts from exactly those weights (streamed into the shards)
    start = json.loads((runs["dirs"]["finetune"] / "metrics.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and math.isclose(start["eval_loss"], engine_eval["eval_loss"], rel_tol=1e-5)


def test_other_architecture_and_corpus_on_an_odd_world_size(tmp_path):
    """A GPT-2 config.json and a jsonl corpus: same losses on 1 and 3 ranks."""
    cfg = tmp_path / "gpt2.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 2,
                "n_embd": 48,
                "n_head": 3,
                "n_positions": 128,
                "vocab_size": 500,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
            }
        )
    )
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"body": f"record {i}: " + "lorem ipsum dolor sit amet " * (i % 9 + 1)}) + "\n"
            for i in range(400)
        )
    )
    args = [
        "--config_name",
        str(cfg),
        "--train_file",
        str(corpus),
        "--text_column",
        "body",
        "--vocab_size",
        "400",
        "--block_size",
        "32",
        "--global_batch_size",
        "6",
        "--max_steps",
        "4",
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--eval_on_start",
        "false",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
    ]
    runs = {}
    for n in (1, 3):  # 1 rank: plain python (a one-rank group)
        out = ["--output_dir", str(tmp_path / f"r{n}")]
        python(SCRIPT, [*args, *out]) if n == 1 else torchrun(n, SCRIPT, [*args, *out])
        runs[n] = losses(tmp_path / f"r{n}")
    assert_close(runs[1], runs[3], rel=1e-5)
    cfg_out = json.loads((tmp_path / "r3" / "final" / "config.json").read_text())
    assert cfg_out["model_type"] == "gpt2" and cfg_out["vocab_size"] == 448  # 400 tokens rounded up to 64
    assert cfg_out["use_cache"] is True  # training turns the KV cache off; the export's generate() wants it
    # GPT-2 ties lm_head to the input embedding: stored once, tied again on load
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(tmp_path / "r3" / "final" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "r3" / "final")
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_bf16_mixed_precision_path(runs, baseline):
    """bf16 compute with fp32 master weights and reduction: close to the fp32 curve, not equal."""
    got = losses(runs["dirs"]["bf16"])
    assert got.keys() == {1, 2, 3, 4}
    for s in got:
        assert abs(got[s] - baseline[2][s]) / baseline[2][s] < 2e-2
    assert any(got[s] != baseline[2][s] for s in got)  # it really ran in bf16


def start_and_wait_for_steps(args: list[str], metrics: Path, steps: int) -> subprocess.Popen:
    """Start a 2-rank torchrun job and return once metrics.jsonl has `steps` records."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", SCRIPT, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        time.sleep(0.2)
    return proc


def test_a_dead_rank_brings_the_job_down_fast(tmp_path):
    """SIGKILL rank 1 mid-run: torchrun exits non-zero within seconds, no half-written checkpoint."""
    import os

    args = [
        *TINY,
        "--max_steps",
        "100000",
        "--save_steps",
        "2",
        "--output_dir",
        str(tmp_path),
        "--export_final",
        "false",
    ]
    proc = start_and_wait_for_steps(args, tmp_path / "metrics.jsonl", 3)
    ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    rank1 = [
        p for p in ranks if "LOCAL_RANK=1" in Path(f"/proc/{p}/environ").read_bytes().replace(b"\0", b" ").decode()
    ]
    assert len(rank1) == 1, ranks
    os.kill(int(rank1[0]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)  # the bound: rank 0 would otherwise wait out --ddp_timeout's 30 minutes
    assert proc.returncode != 0, proc.returncode
    assert "SIGKILL" in out or "Signals.SIGKILL" in out or "exitcode  : -9" in out, out[-2000:]
    for ckpt in tmp_path.glob("checkpoint-*"):  # every listed checkpoint is complete
        assert (ckpt / "trainer_state.json").exists()
