"""`anygpu verify`: real runs of a tiny job at 1 and 2 CPU processes (and resumed from 1 on 2) agree; the same runs judged below what reordered fp32 reductions can meet fail; a job whose global batch
follows the world size is caught; bad input is refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import ROOT, python

from anygpu.errors import UsageError

# The tiny job as a user would pass it (verify adds --output_dir <job>/verify/<run>, --max_steps, …).
JOB = [
    "--config_name",
    "tiny",
    "--max_corpus_mb",
    "1",
    "--block_size",
    "64",
    "--eval_steps",
    "0",
    "--warmup_steps",
    "2",
    "--learning_rate",
    "3e-3",
]
# verify's default: both engines take gradient norms that do not depend on the sharding
# (anygpu.train.optim.clip_grad_norm), so the grad norm agrees as closely as the loss on any world size
TOLERANCE = "1e-5"


def verify(args: list[str]) -> subprocess.CompletedProcess:
    """`anygpu verify ARGS`, its runs forked from a process that has imported the engines (tests/scripts/warm_tool.py)."""
    return python("tests/scripts/warm_tool.py", ["verify", *args], check=False, timeout=900)


@pytest.fixture(scope="session")
def verified(tmp_path_factory):
    """One verify of the tiny job: the FSDP2 engine at 1 and 2 processes, and resumed from 1 on 2 at step 1 (the HF
    engine's runs: the world-size test below; both engines side by side: test_hf_parity.py)."""
    out = tmp_path_factory.mktemp("verify-job")
    proc = verify(
        [
            "--world_sizes",
            "1,2",
            "--engines",
            "fsdp",
            "--resume_at",
            "1",
            "--max_steps",
            "2",
            "--tolerance",
            TOLERANCE,
            "--",
            *JOB,
            "--global_batch_size",
            "4",
            "--output_dir",
            str(out),
        ]
    )
    return out, proc


@pytest.mark.slow
def test_the_same_job_on_1_and_2_processes_and_resumed_passes(verified):
    out, proc = verified
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith("verdict:")]
    assert len(verdict) == 1 and verdict[0].startswith("verdict: PASS: largest relative difference"), proc.stdout
    names = ["fsdp-w1", "fsdp-w2", "fsdp-w1to2-at1"]
    for i, name in enumerate(names, 1):  # progress: which run, then its time
        assert f"[verify] {i}/3 {name}: done in " in proc.stderr
    result = json.loads((out / "verify" / "result.json").read_text())
    assert result["passed"] and result["reference"] == "fsdp-w1" and [r["name"] for r in result["runs"]] == names
    worst = result["largest_relative_difference"]
    assert 0 < worst["value"] <= float(TOLERANCE) and f"{worst['value']:.2e}" in verdict[0]
    for run in result["runs"]:
        assert run["global_batch_size"] == 4 and (out / "verify" / run["name"] / "final").is_dir()
        resumed = run["resumed_from"] is not None
        assert sorted(run["loss"]) == (["2"] if resumed else ["1", "2"])  # a resumed run logs the steps after K
        if run["name"] != "fsdp-w1":
            # losses and final weights agree far below the tolerance; every quantity was compared
            assert run["max_rel_diff"]["loss"] < 1e-6 and run["max_rel_diff"]["weights"] < 1e-6, run
            assert run["max_rel_diff"]["grad_norm"] <= float(TOLERANCE)
    assert "fsdp-w1/checkpoint-1" in result["runs"][2]["resumed_from"]
    # the table: a loss row per step, a difference row per run
    assert [ln.split()[0] for ln in proc.stdout.splitlines()[1:3]] == ["1", "2"]
    assert any(ln.split()[:3] == ["fsdp-w1to2-at1", "2", "fsdp"] for ln in proc.stdout.splitlines())


@pytest.mark.slow
def test_a_tolerance_below_reordered_reductions_fails(verified):
    """The same 1- and 2-process runs judged at 1e-12: fp32 sums in another order cannot meet it → exit 1."""
    out, _ = verified
    proc = verify(
        [
            "--world_sizes",
            "1,2",
            "--engines",
            "fsdp",
            "--resume_at",
            "1",
            "--max_steps",
            "2",
            "--tolerance",
            "1e-12",
            "--compare_only",
            "--",
            *JOB,
            "--global_batch_size",
            "4",
            "--output_dir",
            str(out),
        ]
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: FAIL: largest relative difference" in proc.stdout and "exceeds the tolerance 1e-12" in proc.stdout
    assert "[verify]" not in proc.stderr  # nothing trained again
    assert json.loads((out / "verify" / "result.json").read_text())["passed"] is False


@pytest.mark.slow
def test_a_global_batch_that_follows_the_world_size_is_caught(tmp_path):
    """--per_device_train_batch_size without --global_batch_size (the HF habit): 2 sequences a step on 1 process,
    4 on 2 — another training. verify fails it and says why (here through the HF engine's runs)."""
    proc = verify(
        [
            "--world_sizes",
            "1,2",
            "--engines",
            "hf",
            "--max_steps",
            "2",
            "--",
            *JOB,
            "--per_device_train_batch_size",
            "2",
            "--output_dir",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "verdict: FAIL" in proc.stdout
    assert "hint: the global batch differs between runs: 2 (hf-w1), 4 (hf-w2)" in proc.stdout
    result = json.loads((tmp_path / "verify" / "result.json").read_text())
    assert result["largest_relative_difference"]["value"] > 1e-3
    # a math that follows the world size moves the grad norm by more than bf16's default tolerance allows too
    from anygpu.tools.verify import TOLERANCE

    assert result["largest_relative_difference"]["value"] > 2 * TOLERANCE["bf16"]


@pytest.mark.slow
def test_a_correct_bf16_job_passes_at_the_default_tolerance(tmp_path):
    """The docs' bf16 example in small: a LoRA job in bf16 on both engines (one process each: the world sizes are the
    fixture's), no --tolerance. bf16's 8-bit roundings move the adapter's weights by far more than 1e-5; the default
    tolerance is the precision's, the verdict says which, and the runs were deterministic with TF32 off."""
    from test_lora import build_base

    from anygpu.tools.verify import TOLERANCE

    build_base(tmp_path / "base")
    out = tmp_path / "job"
    job = [*JOB[2:], "--model_name_or_path", str(tmp_path / "base"), "--use_peft", "true", "--bf16", "true"]
    proc = verify(
        ["--world_sizes", "1", "--engines", "fsdp,hf", "--max_steps", "3", "--", *job, "--global_batch_size", "4"]
        + ["--output_dir", str(out)]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith("verdict:")][0]
    assert verdict.startswith("verdict: PASS") and verdict.endswith(
        f"within the tolerance {TOLERANCE['bf16']:g} (the bf16 default; deterministic algorithms, TF32 off)"
    ), verdict
    result = json.loads((out / "verify" / "result.json").read_text())
    assert result["precision"] == "bf16" and result["tolerance"] == TOLERANCE["bf16"] and result["deterministic"]
    assert result["tolerance_from"] == "the bf16 default"
    assert result["largest_relative_difference"]["value"] > TOLERANCE["fp32"]  # what the old default failed
    for run in result["runs"]:  # each run's banner: bf16 with deterministic algorithms, no TF32
        log = (out / "verify" / f"{run['name']}.log").read_text()
        assert "precision: bf16 mixed, deterministic algorithms" in log, log[-2000:]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--world_sizes", "0,2"], "--world_sizes '0,2': every count must be at least 1"),
        (["--engines", "fsdp,deepspeed"], "'deepspeed' is not an engine (valid: fsdp, hf or fsdp,hf)"),
        (["--resume_at", "3", "--max_steps", "3"], "--resume_at 3: must be a step before the last (valid: 1..2"),
        (
            ["--world_size", "2"],
            "unknown option --world_size (did you mean --world_sizes?) (the job's own arguments go after --)",
        ),
        (["--world_sizes", "2"], "one run has nothing to compare with"),
        (["--world_sizes", "1,3", "--", "--global_batch_size", "4"], "world size 3: "),
        (["--", "--learning_rate", "-1"], "--learning_rate -1.0 must be a finite number > 0"),
        (["--compare_only", "--"], "--compare_only: no earlier run fsdp-w1, fsdp-w2 in "),
        (["--", "--resume_from_checkpoint", "latest"], "job argument --resume_from_checkpoint latest: verify starts"),
        (["--cp", "3"], "--cp 3: 3 divides none of --world_sizes 1,2: give a C that divides one of them, e.g. 2"),
        (["--cp", "2", "--engines", "hf"], "--cp 2: context parallelism is the FSDP2 engine's: add --engines fsdp"),
        (["--ep", "0"], "--ep 0: 0 must be at least 1 (a degree such as 2)"),
        (["--cp", "-2"], "--cp -2: -2 must be at least 1 (a degree such as 2)"),
        (["--ep", "4"], "--ep 4: 4 divides none of --world_sizes 1,2: give a E that divides one of them, e.g. 2"),
        (["--ep", "2", "--engines", "hf"], "--ep 2: expert parallelism is the FSDP2 engine's: add --engines fsdp"),
        (
            ["--engines", "fsdp,hf", "--", "--cpu_offload", "true"],
            "engine hf: --cpu_offload true is the FSDP2 engine's",
        ),
        (
            ["--engines", "fsdp,hf", "--", "--objective", "grpo", "--reward_funcs", "format"],
            "engine hf: --objective grpo is the FSDP2 engine's",
        ),
        (["--", "--config_name", "tinyy"], "--config_name 'tinyy' is neither a preset"),
        (["--", "--config_name", "tiny", "--block_size", "100000"], "--block_size 100000 is above the model's maximum"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, says, tmp_path, capsys):
    from anygpu.tools import verify as verify_tool

    if "--" in args:
        args = [*args, "--output_dir", str(tmp_path)]
    assert verify_tool.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anygpu verify: error: ") and says in err[0], err
    assert not (tmp_path / "verify").exists()  # refused before any run


def test_weights_compare_by_tensor_norm():
    """A tensor's relative difference is ‖b − a‖ / ‖a‖ (elementwise ratios would blow up on values near 0);
    different tensor names or shapes are an infinite difference."""
    import torch

    from anygpu.tools.verify import rel_diff, weights_diff

    a = {"w": torch.tensor([3.0, 4.0, 0.0]), "b": torch.zeros(2)}
    assert weights_diff(a, {"w": torch.tensor([3.0, 4.0, 1e-3]), "b": torch.zeros(2)}) == (pytest.approx(2e-4), "w")
    assert weights_diff(a, {"w": a["w"]})[0] == float("inf")
    assert weights_diff(a, {"w": torch.zeros(4), "b": a["b"]})[0] == float("inf")
    assert rel_diff(2.0, 2.0) == 0 and rel_diff(2.0, 2.5) == 0.25 and rel_diff(1.0, float("nan")) == float("inf")


def test_world_sizes_are_capped_at_the_gpus_unless_cpu(monkeypatch, capsys):
    """One process per GPU: with 2 GPUs (fake nvidia-smi, torch counting 2), world size 4 is skipped with a
    message; --cpu runs every size as CPU processes; no size that fits is refused with exit 2."""
    from anygpu.launch.detect import NVIDIA
    from anygpu.tools.verify import usable_sizes

    monkeypatch.setenv("PATH", f"{ROOT / 'tests' / 'fakes'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GPUS", "2")
    monkeypatch.setenv("FAKE_NVIDIA", "ok")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    torch_sees_two = lambda env: {"torch": "2.9.0", "cuda": "12.8", "hip": None, "count": 2}  # noqa: E731
    assert usable_sizes([1, 2, 4], False, NVIDIA, torch_sees_two) == ([1, 2], "NVIDIA GPUs")
    assert "world size 4 skipped: 2 NVIDIA GPUs here (one process per GPU); pass --cpu" in capsys.readouterr().err
    assert usable_sizes([1, 2, 4], True, NVIDIA, torch_sees_two) == ([1, 2, 4], "CPU processes (gloo)")
    with pytest.raises(UsageError, match="--world_sizes 4,8: only 2 NVIDIA GPU"):
        usable_sizes([4, 8], False, NVIDIA, torch_sees_two)


def test_each_cp_is_one_more_fsdp_run_at_the_largest_world_size_it_divides(tmp_path):
    """--cp 2,4 with --world_sizes 1,2,4: fsdp-w4-cp2 and fsdp-w4-cp4 after the world sizes, before the resumed run."""
    from anygpu.tools.verify import plan_runs

    runs = plan_runs(tmp_path, [1, 2, 4], ["fsdp"], 1, [2, 4])
    assert [(r.name, r.world_size, r.cp) for r in runs] == [
        ("fsdp-w1", 1, 1),
        ("fsdp-w2", 2, 1),
        ("fsdp-w4", 4, 1),
        ("fsdp-w4-cp2", 4, 2),
        ("fsdp-w4-cp4", 4, 4),
        ("fsdp-w1to4-at1", 4, 1),
    ]


def test_each_ep_is_one_more_fsdp_run_at_the_largest_world_size_it_divides(tmp_path):
    """--ep 2 with --world_sizes 1,2 and --cp 2: fsdp-w2-cp2, then fsdp-w2-ep2 with --ep 2 in its arguments."""
    from anygpu.tools.verify import plan_runs

    runs = plan_runs(tmp_path, [1, 2], ["fsdp"], None, [2], [2])
    assert [(r.name, r.world_size, r.cp, r.ep) for r in runs] == [
        ("fsdp-w1", 1, 1, 1),
        ("fsdp-w2", 2, 1, 1),
        ("fsdp-w2-cp2", 2, 2, 1),
        ("fsdp-w2-ep2", 2, 1, 2),
    ]


# --objective grpo: its reward and kl curves and its completions are compared too (unit tests of the comparison;
# the runs themselves agree in test_grpo.py)
def grpo_run(root, name: str, losses, rewards, kls=None, completions=None, weight=1.0, resumed_from=None):
    """A finished GRPO run's folder as verify reads it: metrics.jsonl, final/*.safetensors, completions.jsonl."""
    import torch
    from safetensors.torch import save_file

    from anygpu.tools.verify import Run

    out = root / name
    (out / "final").mkdir(parents=True)
    save_file({"w": torch.tensor([weight, 2.0])}, str(out / "final" / "model.safetensors"))
    lines = []
    for i, (loss, reward) in enumerate(zip(losses, rewards), 1):
        rec = {"step": i, "loss": loss, "grad_norm": 1.0, "reward": reward, "global_batch_size": 4}
        if kls is not None:
            rec["kl"] = kls[i - 1]
        lines.append(json.dumps(rec))
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if completions is not None:
        (out / "completions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in completions))
    run = Run(name, "fsdp", 1, str(out), resumed_from=resumed_from)
    return run


def samples(texts_by_step: dict[int, list[str]]) -> list[dict]:
    """completions.jsonl's rows: two prompts × two generations a step, in the global batch's order."""
    prompts = ["def f(x):", [{"role": "user", "content": "Sum 2 and 3."}]]
    return [
        {"step": step, "prompt": prompts[i // 2], "completion": text, "generation": i % 2, "reward": 0.5}
        for step, texts in texts_by_step.items()
        for i, text in enumerate(texts)
    ]


SAME = {1: ["a", "b", "c", "d"], 2: ["e", "f", "g", "h"]}


def test_grpo_completions_are_compared_exactly_from_the_first_difference():
    from anygpu.tools.verify import completions_diff

    ref = samples(SAME)
    assert completions_diff(ref, samples(SAME), [1, 2]) is None
    flipped = samples({1: SAME[1], 2: ["e", "f", "x", "h"]})
    said = completions_diff(ref, flipped, [1, 2])
    assert said.startswith('step 2, completion 2 (generation 0 of prompt \'[{"role": "user"') and "'x'" in said
    assert completions_diff(ref, flipped, [1]) is None  # a resumed run: only the steps after the checkpoint
    fewer = [r for r in ref if not (r["step"] == 1 and r["completion"] == "d")]
    assert completions_diff(ref, fewer, [1, 2]) == "step 1: 3 completions written, the reference 4"
    swapped = samples(SAME)
    swapped[0]["generation"], swapped[1]["generation"] = 1, 0
    assert "step 1, completion 0" in completions_diff(ref, swapped, [1, 2])


def test_grpo_runs_compare_reward_kl_and_completions(tmp_path):
    """Two runs that agree: reward and kl compared, a loss that sits near 0 (a sum of advantages that cancel) judged
    against max(|loss|, 1), not its own size; completions the same → PASS, with a table column for each. A flipped
    completion fails the verification in one line that names it and says why it can happen."""
    from anygpu.tools.verify import completions_verdict, compare, read_metrics, table

    ref = grpo_run(tmp_path, "fsdp-w1", [3e-9, -0.25], [0.5, 0.75], [0.0, 1e-3], samples(SAME))
    two = grpo_run(tmp_path, "fsdp-w2", [-2e-9, -0.25000001], [0.5, 0.75], [0.0, 1e-3 + 1e-12], samples(SAME))
    odd = {1: SAME[1], 2: ["e", "f", "g", "x"]}
    three = grpo_run(tmp_path, "fsdp-w3", [3e-9, -0.25], [0.5, 0.75], [0.0, 1e-3], samples(odd))
    for run in (ref, two, three):
        read_metrics(run)
    assert ref.reward == {1: 0.5, 2: 0.75} and ref.kl == {1: 0.0, 2: 1e-3}
    worst = compare([ref, two], None, grpo=True)
    assert set(two.max_rel_diff) == {"loss", "grad_norm", "reward", "kl", "weights"}
    assert two.max_rel_diff["loss"] == pytest.approx(1e-8) and two.max_rel_diff["kl"] == pytest.approx(1e-12)
    assert worst.value < 1e-7 and two.completions == "same" and completions_verdict([ref, two]) is None
    head, _, row = table([ref, two]).splitlines()[-3:]
    assert head.split()[7:11] == ["weights", "reward", "kl", "completions"] and row.split()[-1] == "same"
    assert compare([ref, two], None).value > 1  # the same loss curve judged relative to its own size: noise
    compare([ref, three], None, grpo=True)
    line = completions_verdict([ref, three])
    assert line.startswith("verdict: FAIL: the completions of fsdp-w3 differ from fsdp-w1's: step 2, completion 3")
    assert "near-tie" in line and "\n" not in line
    assert table([ref, three]).splitlines()[-1].split()[-1] == "DIFFER"


def test_a_grpo_run_that_differs_only_after_an_agreeing_first_step_gets_the_rounding_hint(tmp_path):
    """Weights apart (what Adam makes of cancelling gradients summed in another order), the first step's grad norm and
    every completion equal: the hint says why and where to read; a first step apart, or a completion, gets none."""
    from anygpu.tools.verify import compare, grpo_rounding_hint, read_metrics

    ref = grpo_run(tmp_path, "fsdp-w1", [3e-9, -0.25], [0.5, 0.75], completions=samples(SAME))
    moved = grpo_run(tmp_path, "fsdp-w3", [3e-9, -0.25], [0.5, 0.75], completions=samples(SAME), weight=1.01)
    for run in (ref, moved):
        read_metrics(run)
    assert compare([ref, moved], None, grpo=True).quantity == "weights"
    (hint,) = grpo_rounding_hint([ref, moved], 1e-5)
    assert "first step agrees" in hint and "docs/grpo.md#verify" in hint
    moved.grad_norm[1] = 1.001  # the math itself differs: the first step, before any weight moved, says so
    assert grpo_rounding_hint([ref, moved], 1e-5) == []
    moved.grad_norm[1], moved.completions = 1.0, "step 2, completion 3"
    assert grpo_rounding_hint([ref, moved], 1e-5) == []


def test_runs_apart_in_one_weight_alone_get_the_zero_gradient_hint(tmp_path):
    """A language-model job (Qwen2's key bias at 1 vs 3 ranks: 7.9e-5 in that tensor, 8e-8 in the loss): the FAIL says
    which weight and why it can be rounding alone; a loss apart as well gets no such hint."""
    from anygpu.tools.verify import compare, read_metrics, weights_only_hint

    ref = grpo_run(tmp_path, "fsdp-w1", [2.5, 2.25], [0.0, 0.0])
    moved = grpo_run(tmp_path, "fsdp-w3", [2.5, 2.25], [0.0, 0.0], weight=1.0001)
    for run in (ref, moved):
        read_metrics(run)
    worst = compare([ref, moved], None)
    (hint,) = weights_only_hint([ref, moved], worst, 1e-5)
    assert "only the weights differ, most in w" in hint and "key bias" in hint
    moved.loss[2] = 2.2501
    assert weights_only_hint([ref, moved], compare([ref, moved], None), 1e-5) == []


def test_a_grpo_run_missing_its_reward_curve_is_an_error(tmp_path):
    from anygpu.tools.verify import VerifyError, compare, read_metrics

    ref = grpo_run(tmp_path, "a", [0.1, 0.2], [0.5, 0.75], completions=samples(SAME))
    other = grpo_run(tmp_path, "b", [0.1, 0.2], [0.5, 0.75], completions=samples(SAME))
    for run in (ref, other):
        read_metrics(run)
    other.reward.pop(2)
    with pytest.raises(VerifyError, match=r"b: no reward logged for step\(s\) \[2\]"):
        compare([ref, other], None, grpo=True)


def test_a_grpo_job_gets_every_completion_printed_unless_it_sets_how_many(tmp_path, monkeypatch):
    """verify reads a GRPO job as such and has its runs write every completion of the global batch
    (--num_completions_to_print G), unless the job sets the flag, on its command line or in its YAML file; a
    language-model job gets nothing added. The flag reaches the run's command line."""
    from types import SimpleNamespace

    from anygpu.tools import verify as verify_tool

    job = ["--config_name", "tiny", "--objective", "grpo", "--reward_funcs", "format", "--global_batch_size", "8"]
    job += ["--num_generations", "4", "--output_dir", str(tmp_path)]
    facts = verify_tool.check_job(job, ["fsdp"], [1, 2])
    assert facts.grpo and facts.extra == ("--num_completions_to_print", "8") and facts.precision == "fp32"
    assert verify_tool.check_job([*job, "--num_completions_to_print", "2"], ["fsdp"], [1, 2]).extra == ()
    config = tmp_path / "job.yaml"
    config.write_text("num_completions_to_print: 0\n")
    assert verify_tool.check_job([str(config), *job], ["fsdp"], [1, 2]).extra == ()
    lm = verify_tool.check_job(["--config_name", "tiny", "--output_dir", str(tmp_path)], ["fsdp"], [1, 2])
    assert not lm.grpo and lm.extra == ()

    seen = []

    def plan(argv, env, probe_torch):  # what the run is launched with; the run itself is `true`
        seen.append(list(argv))
        return SimpleNamespace(cmd=["true"], env=dict(env))

    monkeypatch.setattr(verify_tool.launcher, "make_plan", plan)
    (tmp_path / "verify").mkdir()
    run = verify_tool.Run("fsdp-w1", "fsdp", 1, str(tmp_path / "verify" / "fsdp-w1"))
    verify_tool.launch(run, job, 2, True, "nvidia", None, facts.extra)
    assert seen[0][-2:] == ["--num_completions_to_print", "8"] and run.seconds is not None, seen
