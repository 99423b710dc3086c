"""--objective grpo keeps the same curve and the same completions on 1, 2 and 3 ranks, micro-batches of 1 to 12
completions, and resumed within a round on another world size; conversational prompts reach the reward functions
with their rows' columns, as TRL passes them; the offline demo's reward rises; bad input is refused up front.
(The matrix in tests/conformance.py runs grpo, its KL and LoRA on four unlike families; test_grpo_trl.py and
test_grpo_loss.py hold the loss to TRL's.)"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from conftest import TINY, fsdp_runs, python, records

from anygpu.engines.fsdp import main

G, K, STEPS = 12, 4, 4  # 3 prompts a round, each round serving 2 steps
LORA = ("--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear")
REWARDS = Path(__file__).parent / "scripts" / "grpo_rewards.py"
CURVES = ("loss", "grad_norm", "reward", "reward_std", "kl", "rewards/mentions/mean", "rewards/accuracy/mean",
          "completions/mean_length", "clip_ratio/region_mean", "entropy")  # fmt: skip
WORDS = ("alpha", "beta", "gamma", "delta", "json", "load", "dump", "value", "key", "list")


def write_prompts(path: Path, n: int) -> Path:
    """Conversational prompts with a `keyword` column (None on some rows: not scored there) and a `solution`."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 7))]
        messages = [{"role": "user", "content": " ".join(words)}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "answer in one word"})
        rows.append({"prompt": messages, "keyword": None if i % 4 == 1 else rng.choice(WORDS),
                     "solution": rng.choice(WORDS)})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job(model: Path, data: Path, out: Path, micro_batch: int, *extra: str) -> list[str]:
    return [
        *("--model_name_or_path", str(model), "--objective", "grpo", "--train_file", str(data)),
        *("--reward_funcs", f"{REWARDS}:mentions,accuracy,{REWARDS}:vowels,{REWARDS}:brevity"),
        *("--reward_weights", "1,0.5,2,0.2"),
        *("--num_generations", str(K), "--global_batch_size", str(G), "--per_device_train_batch_size", str(micro_batch)),
        *("--max_prompt_length", "40", "--max_completion_length", "10", "--num_iterations", "2"),
        *("--beta", "0.04", "--epsilon", "0.01", "--loss_type", "bnpo", "--importance_sampling_level", "sequence"),
        *("--num_completions_to_print", str(G)),
        *("--max_steps", str(STEPS), "--logging_steps", "1", "--eval_steps", "0", "--eval_on_start", "true"),
        *("--max_eval_samples", "6", "--learning_rate", "2e-2", "--warmup_steps", "0", "--lr_scheduler_type", "constant"),
        *("--report_to", "none", "--disable_tqdm", "true", "--export_final", "false", "--output_dir", str(out)),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> dict:
    """One launch per world size: 1 rank (micro-batches of 12 and 3; LoRA, of 12), 2 ranks (of 2; and a run stopped
    after step 3, within its second round), 3 ranks (of 1; that stopped run resumed; LoRA, of 2)."""
    from hub_sources import SMALL, write

    root = tmp_path_factory.mktemp("grpo")
    model = write(root / "llama", dict(model_type="llama", **{**SMALL, "tie_word_embeddings": False}), "float32")
    data = write_prompts(root / "prompts.jsonl", 40)
    out = {name: root / name for name in ("a", "b", "c", "stopped", "d", "lora-a", "lora-d")}
    said = {}
    runs = [job(model, data, out["a"], 12), job(model, data, out["b"], 3), job(model, data, out["lora-a"], 12, *LORA)]
    said.update(zip(("a", "b", "lora-a"), fsdp_runs(1, runs)))
    stop = ("--save_steps", "3", "--stop_at_step", "3")
    runs = [job(model, data, out["c"], 2), job(model, data, out["stopped"], 1, *stop)]
    said.update(zip(("c", "stopped"), fsdp_runs(2, runs)))
    resume = ("--resume_from_checkpoint", str(out["stopped"] / "checkpoint-3"))
    runs = [job(model, data, out["d"], 1), job(model, data, out["stopped"], 2, *resume)]
    said.update(zip(("d", "e", "lora-d"), fsdp_runs(3, [*runs, job(model, data, out["lora-d"], 2, *LORA)])))
    return {"out": out, "said": said}


def curve(out: Path, name: str) -> dict[int, float]:
    return {r["step"]: r[name] for r in records(out) if name in r and "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("run", ["b", "c", "d", "stopped", "lora-d"])
def test_every_world_size_micro_batch_and_resume_gives_the_same_curve(grpo, run):
    """LoRA (its base the reference: the adapter off) on 3 ranks against LoRA on 1."""
    first, other = grpo["out"]["lora-a" if run.startswith("lora") else "a"], grpo["out"][run]
    for name in CURVES:
        a, b = curve(first, name), curve(other, name)
        assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (name, a, b)
        for step in a:
            assert math.isclose(a[step], b[step], rel_tol=1e-5, abs_tol=1e-7), (run, name, step, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["b", "c", "d", "stopped"])
def test_the_completions_themselves_are_the_same(grpo, run):
    read = lambda out: [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]  # noqa: E731
    first, other = read(grpo["out"]["a"]), read(grpo["out"][run])
    assert len(first) == G * STEPS and [r["step"] for r in first] == [s for s in range(1, STEPS + 1) for _ in range(G)]
    for a, b in zip(first, other, strict=True):
        assert (a["step"], a["prompt"], a["completion"], a["generation"]) == (
            b["step"], b["prompt"], b["completion"], b["generation"]
        )  # fmt: skip
        assert a["reward"] == pytest.approx(b["reward"]) and a["advantage"] == pytest.approx(b["advantage"], abs=1e-9)
    rounds = {r["step"]: [x["completion"] for x in first if x["step"] == r["step"]] for r in first}
    assert rounds[1] == rounds[2] != rounds[3] == rounds[4], "a round serves --num_iterations 2 steps"


@pytest.mark.slow
def test_the_run_says_what_it_does_and_logs_trls_metrics(grpo):
    said, out = grpo["said"]["a"], grpo["out"]["a"]
    assert "objective: grpo, loss bnpo, 4 completions a prompt, beta 0.04" in said
    assert "rewards: mentions ×1, accuracy ×0.5, vowels ×2, brevity ×0.2" in said and "a frozen copy of" in said
    assert "reward columns: keyword, solution" in said
    assert "resumed from" in grpo["said"]["e"] and "was 2 ranks, now 3" in grpo["said"]["e"]
    rec = next(r for r in records(out) if "loss" in r)
    for name in ("reward", "reward_std", "rewards/mentions/mean", "rewards/mentions/std", "rewards/accuracy/mean",
                 "rewards/brevity/mean", "completions/mean_length", "completions/clipped_ratio", "kl",
                 "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy",
                 "frac_reward_zero_std"):  # fmt: skip
        assert name in rec and math.isfinite(rec[name]), (name, rec)
    first_eval = records(out)[0]
    assert first_eval["step"] == 0 and "eval_reward" in first_eval and "eval_rewards/mentions/mean" in first_eval
    trained = [r for r in records(out) if "loss" in r]
    assert all(r["grad_norm"] > 0 for r in trained) and len({r["reward"] for r in trained}) > 1, trained
    assert any(r["clip_ratio/region_mean"] > 0 for r in trained) and trained[-1]["kl"] > 0, "a weak test"


@pytest.mark.slow
def test_rewards_see_conversational_completions_and_the_rows_columns(grpo):
    """The completion reaches `mentions` as one assistant message (a string would fail its [-1]["content"]); rows
    without a keyword (None) are left out of its mean, so it differs from an all-rows mean."""
    samples = [json.loads(line) for line in (grpo["out"]["a"] / "completions.jsonl").read_text().splitlines()]
    assert all(isinstance(s["prompt"], list) and s["prompt"][-1]["role"] == "user" for s in samples)
    brevity = [r["rewards/brevity/mean"] for r in records(grpo["out"]["a"]) if "loss" in r]
    assert all(-10 / 8 <= b <= -1 / 8 for b in brevity)


@pytest.mark.slow
def test_the_offline_demo_reward_rises(tmp_path):
    """examples/grpo/demo.yaml, shortened to 20 steps: the mean reward goes from ~0 to most of its maximum (1)."""
    out = tmp_path / "demo"
    said = python("run_fsdp_standalone.py", ["examples/grpo/demo.yaml", "--max_steps", "20", "--eval_steps", "20",
                                              "--output_dir", str(out), "--disable_tqdm", "true"]).stdout  # fmt: skip
    evals = {r["step"]: r["eval_reward"] for r in records(out) if "eval_reward" in r}
    assert evals[0] < 0.05 and evals[20] > 0.5, (evals, said[-2000:])
    assert "reward" in said.splitlines()[-3] or any("| reward " in line for line in said.splitlines())


# ---- refusals, before any work ----------------------------------------------------------------------------------


def refuse(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the prompts' progress, for a column check
    assert err.startswith("error: ") and "Traceback" not in err
    return err


GRPO = ["--objective", "grpo", "--reward_funcs", "accuracy", "--num_generations", "4", "--global_batch_size", "8",
        "--max_prompt_length", "32", "--max_completion_length", "16"]  # fmt: skip


@pytest.mark.parametrize(
    "extra, said",
    [
        ([], None),
        (["--reward_funcs", ""], "--reward_funcs '' is empty: give a value"),
        (["--loss_type", "sigmoid"], "--loss_type 'sigmoid' is not one of grpo, dr_grpo, dapo, bnpo"),
        (["--global_batch_size", "10"], "--global_batch_size 10 completions is not whole groups of --num_generations 4"),
        (["--num_generations", "1"], "--num_generations 1 must be at least 2"),
        (["--temperature", "0"], "--temperature 0.0 must be positive"),
        (["--top_p", "1.5"], "--top_p 1.5 must be in (0, 1]"),
        (["--beta", "-1"], "--beta -1.0 cannot be negative"),
        (["--epsilon", "-0.1"], "--epsilon -0.1 cannot be negative"),
        (["--scale_rewards", "rank"], "--scale_rewards 'rank' is not one of group, batch, none"),
        (["--importance_sampling_level", "step"], "--importance_sampling_level 'step' is not one of token, sequence"),
        (["--use_vllm", "true", "--vllm_gpu_memory_utilization", "1.5"], "--vllm_gpu_memory_utilization 1.5 must be in (0, 1)"),
        (["--use_vllm", "true", "--vllm_importance_sampling_mode", "token"], "--vllm_importance_sampling_mode 'token' is not one of token_truncate"),
        (["--use_vllm", "true", "--vllm_importance_sampling_clip_min", "4"], "--vllm_importance_sampling_clip_min 4.0 and --vllm_importance_sampling_clip_max 3.0: the bounds"),
        (["--cp", "2"], "--cp 2 with --objective grpo"),
        (["--ep", "2"], "--ep 2 with --objective grpo"),
        (["--fp8", "rowwise"], "--fp8 rowwise with --objective grpo"),
        (["--torch_compile", "true"], "--torch_compile true with --objective grpo"),
        (["--cpu_offload", "true"], "--cpu_offload true with --objective grpo"),
        (["--packing", "true"], "--packing true with --objective grpo"),
        (["--global_batch_size", None, "--global_batch_tokens", "4096"], "--global_batch_tokens 4096 with --objective grpo"),
        (["--beta", "0.04"], "--beta 0.04 without --model_name_or_path"),
        (["--reward_funcs", "nowhere.py:f"], "--reward_funcs 'nowhere.py:f'"),
        (["--reward_funcs", "accuracy,format", "--reward_weights", "1"], "--reward_weights 1: give one weight per"),
        (["--max_prompt_length", "400", "--max_completion_length", "200"], "exceed the model's 512 positions"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
def test_bad_grpo_input_is_refused_by_name(capsys, tmp_path, extra, said):
    argv = [*TINY, *GRPO, "--output_dir", str(tmp_path / "run")]
    for i in range(0, len(extra), 2):  # an option given again overrides; None drops it
        if extra[i] in argv and extra[i + 1] is None:
            j = argv.index(extra[i])
            del argv[j : j + 2]
        elif extra[i + 1] is not None:
            argv += extra[i : i + 2]
    if said is None:  # the base command is accepted as far as the checks go (then a reward column is missing)
        err = refuse(argv, capsys)
        assert "--reward_funcs accuracy reads the column 'solution'" in err
        return
    assert said in refuse(argv, capsys)


def test_trls_former_boolean_scale_rewards_are_taken(tmp_path):
    """TRL's GRPOConfig still takes scale_rewards true and false: its group and none."""
    from anygpu.config.args import parse_args

    for given, meant in (("true", "group"), ("False", "none"), ("batch", "batch")):
        train_args = parse_args([*TINY, *GRPO, "--scale_rewards", given, "--output_dir", str(tmp_path)])[2]
        assert train_args.scale_rewards == meant, given


def test_an_epsilon_of_one_or_more_is_taken_as_trl_takes_it(tmp_path):
    """TRL's GRPOConfig takes any epsilon: from 1 on, the clip has no lower bound (the ratio is never below 0)."""
    from anygpu.config.args import parse_args

    train_args = parse_args([*TINY, *GRPO, "--epsilon", "1.5", "--output_dir", str(tmp_path)])[2]
    assert (train_args.epsilon, train_args.epsilon_high) == (1.5, None)


def test_use_vllm_without_vllm_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    err = refuse([*TINY, *GRPO, "--use_vllm", "true", "--output_dir", str(tmp_path / "run")], capsys)
    assert "--use_vllm true: vLLM is not installed here" in err and "leave --use_vllm out" in err


def test_use_vllm_over_a_4_bit_base_is_refused_saying_why(tmp_path):
    from anygpu.config.args import parse_args
    from anygpu.config.objective import check_grpo_run
    from anygpu.errors import UsageError

    model_args, _, train_args = parse_args([*TINY, *GRPO, "--use_vllm", "true", "--output_dir", str(tmp_path)])[:3]
    model_args.load_in_4bit = True  # QLoRA (a pretrained base and --use_peft: the check reads the flag alone)
    with pytest.raises(UsageError, match="--use_vllm true and --load_in_4bit true with --objective grpo: vLLM would"):
        check_grpo_run(model_args, train_args)


def test_the_hf_engine_refuses_grpo_saying_why(tmp_path):
    from anygpu.config.args import parse_args
    from anygpu.engines.trunk import startup
    from anygpu.errors import UsageError

    model_args, _, train_args = parse_args([*TINY, *GRPO, "--output_dir", str(tmp_path)])[:3]
    with pytest.raises(UsageError, match="--objective grpo is the FSDP2 engine's .* Trainer's loop owns the batches"):
        startup.check_levers(model_args, train_args, "hf")


def test_lm_and_dpo_keep_their_defaults_and_refuse_rewards(capsys, tmp_path):
    from anygpu.config.args import parse_args

    train = parse_args([*TINY, "--output_dir", str(tmp_path)])[2]
    assert (train.loss_type, train.beta) == (["sigmoid"], 0.1)
    train = parse_args([*TINY, *GRPO, "--output_dir", str(tmp_path)])[2]
    assert (train.loss_type, train.beta, train.num_generations, train.epsilon_high) == (["dapo"], 0.0, 4, None)
    err = refuse([*TINY, "--reward_funcs", "accuracy", "--output_dir", str(tmp_path)], capsys)
    assert "--reward_funcs accuracy with --objective lm" in err


def test_completions_end_on_the_tokenizers_and_the_models_end_tokens():
    """A chat model may end a turn on a token the tokenizer does not call EOS (Llama 3's <|eot_id|>): sampling stops
    on either, as Hugging Face's generate would; an id outside the vocabulary is no token."""
    from types import SimpleNamespace

    from anygpu.train.grpo_objective import stop_ids

    class Tok(SimpleNamespace):
        def __len__(self) -> int:
            return 100

    assert stop_ids(Tok(eos_token_id=2), SimpleNamespace(eos_token_id=[2, 7, 500])) == (2, 7)
    assert stop_ids(Tok(eos_token_id=2), SimpleNamespace(eos_token_id=None)) == (2,)
