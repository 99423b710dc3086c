"""Reward functions (anygpu.train.rewards): loading `--reward_funcs` in its three forms and every refusal, the
built-ins on a few cases (and equal to TRL's own functions where they mirror one), weights, None, conversational
completions, a failing function named with its row, and the rewards and metrics TRL 1.16's GRPOTrainer computes
from the same functions on the same rows (its `_calculate_rewards`, then its weighting and logged statistics)."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest

from anygpu.errors import UsageError
from anygpu.train import rewards
from anygpu.train.rewards import BuiltinOptions, RewardError, RewardSet

USER_FILE = """
import dataclasses

@dataclasses.dataclass
class Settings:  # a dataclass needs its module registered by name
    bonus: float = 0.5

def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def short(completions, **kwargs):
    return [-len(c) / 10 for c in completions]

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def refusal(spec: str, **options) -> str:
    with pytest.raises(UsageError) as e:
        rewards.load(spec, BuiltinOptions(**options))
    message = str(e.value)
    assert "\n" not in message
    return message


# ---- loading ---------------------------------------------------------------------------------------------------


def test_a_file_loads_from_where_it_is_without_touching_sys_path(user_file):
    path_before = list(sys.path)
    fn = rewards.load(f"{user_file}:exact")
    assert fn(completions=[" 4", "5"], answer=["4", "4"]) == [1.0, 0.0]
    assert rewards.name_of(fn) == "exact"
    assert sys.path == path_before


def test_a_module_loads_by_its_dotted_name():
    fn = rewards.load("anygpu.train.rewards:answer_of")
    assert fn is rewards.answer_of


def test_trls_dotted_spelling_loads_a_module_attribute():
    """TRL's `trl grpo --reward_funcs package.module.fn` (its last dot parts the module from the function)."""
    assert rewards.load("anygpu.train.rewards.answer_of") is rewards.answer_of
    assert "module no_such_package_xyz does not import" in refusal("no_such_package_xyz.fn")


def test_trls_registry_names_are_its_functions_under_its_metric_names():
    """The names TRL's grpo script registers: think_format_reward and get_soft_overlong_punishment are the built-ins
    format (TRL's pattern, whatever --format_pattern says) and overlong (this run's length), logged under TRL's names;
    TRL's math_verify rewards are TRL's own functions where math-verify is installed, else refused in one line."""
    from trl.import_utils import is_math_verify_available
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    think = rewards.load("think_format_reward", BuiltinOptions(format_pattern="^x$"))
    texts = [[{"role": "assistant", "content": t}] for t in ("<think>a</think>b", "x", "<think>a")]
    assert rewards.name_of(think) == "think_format_reward" and think(completions=texts) == think_format_reward(texts)
    trl_overlong = get_soft_overlong_punishment(100, 20)
    overlong = rewards.load("get_soft_overlong_punishment", BuiltinOptions(max_completion_length=100))
    ids = [[1] * n for n in (10, 90, 120)]
    assert rewards.name_of(overlong) == rewards.name_of(trl_overlong) == "soft_overlong_punishment_reward"
    assert overlong(completion_ids=ids) == trl_overlong(ids)
    for name in ("accuracy_reward", "reasoning_accuracy_reward"):
        if is_math_verify_available():
            assert rewards.name_of(rewards.load(name)) == name
        else:
            message = refusal(name)
            assert f"--reward_funcs {name}: TRL's {name} checks answers with math_verify" in message
            assert "pip install math-verify" in message and "or use accuracy" in message


@pytest.mark.parametrize(
    "spec, words",
    [
        ("exact", ["'exact'", "is not a reward function", "path/to/rewards.py:accuracy", "accuracy, format"]),
        ("rewards.py:", ["'rewards.py:'", "is not a reward function"]),
        ("nowhere/r.py:exact", ["'nowhere/r.py:exact'", "no file nowhere/r.py", "./rewards.py:accuracy"]),
        ("no_such_package_xyz.mod:fn", ["module no_such_package_xyz.mod does not import", "ModuleNotFoundError"]),
    ],
)
def test_a_spec_that_names_nothing_is_refused(spec, words):
    message = refusal(spec)
    assert message.startswith("--reward_funcs ")
    for word in words:
        assert word in message


def test_a_file_that_does_not_import_is_refused_saying_why(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import math\nx = 1 / 0\n")
    message = refusal(f"{bad}:fn")
    assert (
        f"--reward_funcs '{bad}:fn'" in message and "does not import (ZeroDivisionError: division by zero)" in message
    )
    assert not [m for m in sys.modules if m.startswith("anygpu_rewards_broken")]


def test_a_missing_attribute_and_a_non_callable_are_refused(user_file):
    missing = refusal(f"{user_file}:exactly")
    assert f"--reward_funcs '{user_file}:exactly'" in missing and "has no 'exactly'" in missing
    assert "exact" in missing and "short" in missing  # the callables it does have
    not_callable = refusal(f"{user_file}:NOT_A_FUNCTION")
    assert "NOT_A_FUNCTION is a int, not a function" in not_callable and ":accuracy" in not_callable


def test_the_built_ins_options_are_checked():
    assert "--format_pattern '(' is not a regular expression" in refusal("format", format_pattern="(")
    assert "--soft_punish_cache 0 must be in (0, --max_completion_length 100]" in refusal(
        "overlong", max_completion_length=100, soft_punish_cache=0
    )


def test_the_set_is_refused_when_empty_doubly_named_or_wrongly_weighted(user_file):
    with pytest.raises(UsageError, match=r"^--reward_funcs is empty: name at least one"):
        RewardSet.build([])
    with pytest.raises(UsageError, match=r"two functions are named 'exact' .* rewards/exact/\*"):
        RewardSet.build([f"{user_file}:exact", f"{user_file}:exact"])
    with pytest.raises(
        UsageError, match=r"^--reward_weights 1: give one weight per --reward_funcs \(2: exact,format\)"
    ):
        RewardSet.build([f"{user_file}:exact", "format"], ["1"])
    with pytest.raises(UsageError, match=r"^--reward_weights 'x' is not a number: give one per --reward_funcs"):
        RewardSet.build(["format"], ["x"])


def test_a_missing_column_is_refused_before_any_work():
    rs = RewardSet.build(["accuracy", "format"], options=BuiltinOptions(solution_column="answer"))
    rs.check_columns(["prompt", "answer"])
    with pytest.raises(UsageError, match=r"^--reward_funcs accuracy reads the column 'answer', which the data lacks"):
        rs.check_columns(["prompt", "solution"])


def test_a_column_the_validation_rows_lack_is_refused_before_training():
    """The evaluation scores the validation prompts too: their columns are checked with the training rows'."""
    from types import SimpleNamespace

    from datasets import Dataset

    from anygpu.engines.trunk.objectives import check_reward_columns

    rs = RewardSet.build(["accuracy"])
    train = Dataset.from_dict({"prompt_ids": [[1]], "solution": ["4"]})
    check_reward_columns(rs, SimpleNamespace(datasets={"train": train, "validation": train}))
    prep = SimpleNamespace(datasets={"train": train, "validation": Dataset.from_dict({"prompt_ids": [[1]]})})
    with pytest.raises(UsageError, match=r"^--reward_funcs accuracy reads the column 'solution', which the validation"):
        check_reward_columns(rs, prep)


# ---- the built-ins ---------------------------------------------------------------------------------------------


def test_accuracy_compares_the_final_answer_with_the_solution():
    acc = rewards.load("accuracy")
    completions = [
        "<think>2+2 is 5? no</think> 4",
        "<think>…</think><answer> 4 </answer>",
        r"so the answer is \boxed{\frac{1}{3}}.",
        "<think>4</think> 5",
        "anything",
        "anything",
    ]
    solutions = ["4", "4", r"\frac{1}{3}", "4", None, ""]
    assert acc(completions=completions, solution=solutions) == [1.0, 1.0, 1.0, 0.0, None, None]
    by_answer = rewards.load("accuracy", BuiltinOptions(solution_column="answer"))
    assert by_answer(completions=["7"], answer=["7"], solution=["8"]) == [1.0]


def test_format_is_trls_think_format_reward_by_default():
    from trl.rewards import think_format_reward

    texts = [
        "<think>\nreasoning\n</think>\nanswer",
        "<think>\nreasoning\nanswer",
        "answer <think>x</think>",
        "<think>a</think><think>b</think>",
        "<think></think>",
    ]
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    fmt = rewards.load("format")
    assert fmt(completions=texts) == think_format_reward(conversational) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert fmt(completions=conversational) == think_format_reward(conversational)
    answer_tags = rewards.load("format", BuiltinOptions(format_pattern=r"^<answer>.*</answer>$"))
    assert answer_tags(completions=["<answer>4</answer>", "4"]) == [1.0, 0.0]


def test_overlong_and_repetition_are_trls_functions():
    from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

    ids = [[1] * n for n in (10, 80, 81, 90, 100, 120)]
    overlong = rewards.load("overlong", BuiltinOptions(max_completion_length=100, soft_punish_cache=20))
    assert overlong(completion_ids=ids) == get_soft_overlong_punishment(100, 20)(ids)
    assert overlong(completion_ids=ids) == [0.0, 0.0, -0.05, -0.5, -1.0, -1.0]
    assert rewards.load("overlong", BuiltinOptions(max_completion_length=100)).trl.soft_punish_cache == 20
    ids = [[1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2]]
    assert rewards.load("repetition")(completion_ids=ids) == get_repetition_penalty_reward(3, -1.0)(ids)


# ---- scoring ---------------------------------------------------------------------------------------------------


def test_weights_sum_the_functions_and_none_is_left_out(user_file):
    rs = RewardSet.build(["accuracy", f"{user_file}:short"], ["2", "0.5"])
    assert rs.names == ("accuracy", "short") and rs.weights == (2.0, 0.5)
    totals, per_func = rs.score(["p"] * 3, ["4", "55", "x"], {"solution": ["4", "4", None]})
    assert per_func["short"] == [-0.1, -0.2, -0.1]
    assert per_func["accuracy"][:2] == [1.0, 0.0] and math.isnan(per_func["accuracy"][2])
    assert totals == pytest.approx([2 - 0.05, -0.1, -0.05])  # row 3: accuracy left out, short alone


def test_a_completion_no_function_scores_has_no_total(tmp_path):
    (tmp_path / "r.py").write_text("def never(completions, **kw):\n    return [None] * len(completions)\n")
    rs = RewardSet.build([f"{tmp_path / 'r.py'}:never", "accuracy"])
    totals, _ = rs.score(["p", "q"], ["4", "4"], {"solution": [None, "4"]})
    assert math.isnan(totals[0]) and totals[1] == 1.0
    metrics = rs.metrics(rs.moments(totals, _))
    assert math.isnan(metrics["rewards/never/mean"]) and metrics["reward"] == 1.0 and math.isnan(metrics["reward_std"])


def test_functions_get_the_columns_ids_and_extra_by_name_as_trl_passes_them():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, **columns):
        seen.update(columns, prompts=prompts, ids=completion_ids, step=trainer_state.global_step)
        return [0.0] * len(completions)

    rs = RewardSet(("spy",), (spy,), (1.0,))
    columns = {"prompt": ["dropped"] * 2, "answer": ["a", "b"], "level": [1, 2]}
    rs.score(["p", "q"], ["x", "y"], columns, [[1], [2]], extra={"trainer_state": SimpleNamespace(global_step=7)})
    assert seen == {"answer": ["a", "b"], "level": [1, 2], "prompts": ["p", "q"], "ids": [[1], [2]], "step": 7}


def test_conversational_completions_are_scored_on_their_last_message():
    rs = RewardSet.build(["accuracy", "format"])
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    completions = [
        [{"role": "assistant", "content": "<think>add</think> 4"}],
        [
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "<think>x</think>"}, {"type": "text", "text": "5"}],
            }
        ],
    ]
    totals, per_func = rs.score(prompts, completions, {"solution": ["4", "4"]})
    assert per_func == {"accuracy": [1.0, 0.0], "format": [1.0, 1.0]} and totals == [2.0, 1.0]


def test_a_function_that_raises_is_named_with_its_row():
    def picky(prompts, completions, **kw):
        return [1.0 / (len(c) - 3) for c in completions]

    rs = RewardSet(("picky",), (picky,), (1.0,))
    prompts = ["fine", "What is the capital of France? Answer in one word, please, and be brief about it."]
    with pytest.raises(RewardError) as e:
        rs.score(prompts, ["long one", "abc"], {})
    message = str(e.value)
    assert message.startswith("reward function 'picky' raised on row 1 of 2 (prompt 'What is the capital")
    assert message.endswith("…'): ZeroDivisionError: float division by zero")
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_async_functions_are_awaited_side_by_side_and_named_when_they_fail():
    """TRL takes async reward functions (an LLM judge) and runs them together on one event loop: each waits here
    for the other to have started, which only running them side by side allows (each gives up after 10 s)."""
    import asyncio

    started: set[str] = set()

    def judge(name: str, other: str, value: float):
        async def fn(completions, **kw):
            started.add(name)
            for _ in range(10_000):
                if other in started:
                    return [value * len(c) for c in completions]
                await asyncio.sleep(0.001)
            raise TimeoutError(f"{other} never started")

        fn.__name__ = name
        return fn

    async def picky(completions, **kw):
        return [1.0 / (len(c) - 3) for c in completions]

    rs = RewardSet(("a", "b"), (judge("a", "b", 1.0), judge("b", "a", -0.5)), (1.0, 2.0))
    totals, per_func = rs.score(["p", "q"], ["xy", "xyzw"], {})
    assert per_func == {"a": [2.0, 4.0], "b": [-1.0, -2.0]} and totals == [0.0, 0.0]
    with pytest.raises(RewardError, match=r"^reward function 'picky' raised on row 1 of 2 .*ZeroDivisionError"):
        RewardSet(("picky",), (picky,), (1.0,)).score(["p", "q"], ["long one", "abc"], {})


def test_a_function_that_fails_only_on_the_whole_batch_is_named():
    def batch_only(completions, **kw):
        if len(completions) > 1:
            raise ValueError("batch too big")
        return [0.0]

    with pytest.raises(RewardError, match=r"^reward function 'batch_only' raised on a batch: ValueError: batch too"):
        RewardSet(("batch_only",), (batch_only,), (1.0,)).score(["p", "q"], ["a", "b"], {})


@pytest.mark.parametrize(
    "out, match",
    [
        ([1.0], r"^reward function 'bad' returned 1 values for 2 completions: return one per completion"),
        (1.0, r"^reward function 'bad' returned a float, not a list of 2 numbers"),
        ("10", r"^reward function 'bad' returned a str, not a list of 2 numbers"),
        ([1.0, "yes"], r"^reward function 'bad' returned 'yes' for completion 1: give a number, or None"),
        ([1.0, math.inf], r"^reward function 'bad' returned inf for completion 1: rewards must be finite"),
        ([1e308, 5e307], r"^reward function 'bad' returned 1e\+308 for completion 0: .* within ±1e\+15"),
    ],
)
def test_a_wrong_output_is_refused_with_the_functions_name(out, match):
    def bad(completions, **kw):
        return out

    with pytest.raises(RewardError, match=match):
        RewardSet(("bad",), (bad,), (1.0,)).score(["p", "q"], ["a", "b"], {})


def test_numbers_of_every_kind_are_taken():
    import numpy as np
    import torch

    def kinds(completions, **kw):
        return [True, np.float32(0.5), torch.tensor(2.0), np.int64(3), math.nan]

    totals, per_func = RewardSet(("kinds",), (kinds,), (1.0,)).score(["p"] * 5, ["c"] * 5, {})
    assert per_func["kinds"][:4] == [1.0, 0.5, 2.0, 3.0] and math.isnan(totals[4])
    torch_out = RewardSet(("t",), (lambda completions, **kw: torch.tensor([1.0, 2.0]),), (1.0,))
    assert torch_out.score(["p", "q"], ["a", "b"], {})[0] == [1.0, 2.0]


def test_metrics_summed_over_ranks_are_the_global_batchs():
    rs = RewardSet.build(["format"])
    texts = ["<think>a</think>b", "x", "<think>c</think>", "y", "z"]
    whole = rs.metrics(rs.moments(*rs.score(["p"] * 5, texts, {})))
    parts = [rs.moments(*rs.score(["p"] * len(t), t, {})) for t in (texts[:2], texts[2:])]  # two ranks
    summed = rs.metrics({k: parts[0][k] + parts[1][k] for k in parts[0]})
    assert summed == pytest.approx(whole)
    assert whole["rewards/format/mean"] == pytest.approx(0.4)
    assert whole["rewards/format/std"] == pytest.approx(math.sqrt(0.3))  # Bessel: 5 · 0.4 · 0.6 / 4


# ---- against TRL's GRPOTrainer ---------------------------------------------------------------------------------


def trl_rewards(funcs, names, weights, inputs, prompts, completions, completion_ids, monkeypatch):
    """TRL 1.16's `_calculate_rewards` on a stand-in trainer (one process: its gather is the identity), then its
    weighted total and logged statistics (grpo_trainer.py, `_generate_and_score_completions`)."""
    import torch
    from trl.trainer import grpo_trainer
    from trl.trainer.utils import nanstd

    monkeypatch.setattr(grpo_trainer, "gather", lambda t: t)
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=SimpleNamespace(report_to=[]),
        state=SimpleNamespace(global_step=3),
        reward_funcs=list(funcs),
        reward_processing_classes=[None] * len(funcs),
        reward_func_names=list(names),
        environments=None,
        _log_completion_extra=lambda column, values: None,
        _log_metric=lambda name, value: None,
    )
    per_func = grpo_trainer.GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)
    unscorable = torch.isnan(per_func).all(dim=1)
    totals = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    totals[unscorable] = torch.nan
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    metrics["reward"], metrics["reward_std"] = torch.nanmean(totals).item(), nanstd(totals).item()
    return totals.tolist(), per_func, metrics


@pytest.mark.parametrize("conversational", [False, True], ids=["text", "conversational"])
def test_rewards_and_metrics_equal_trls(user_file, conversational, monkeypatch):
    opts = BuiltinOptions(max_completion_length=8, soft_punish_cache=4)
    rs = RewardSet.build(["accuracy", "format", "overlong", f"{user_file}:short"], ["1", "0.5", "2", "0.1"], opts)
    texts = ["<think>a</think> 4", "4", "<think>b</think><answer>5</answer>", "junk", "<think></think>4", "x"]
    solutions = ["4", "4", "5", None, "4", None]
    answers = ["a", "b", "c", "d", "e", "f"]  # a column no function reads: passed, ignored
    ids = [[1] * n for n in (3, 5, 6, 7, 8, 2)]
    if conversational:
        prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(6)]
        completions = [[{"role": "assistant", "content": t}] for t in texts]
    else:
        prompts, completions = [f"q{i}" for i in range(6)], texts
    inputs = [{"prompt": p, "solution": s, "answer": a} for p, s, a in zip(prompts, solutions, answers)]
    columns = {"solution": solutions, "answer": answers}

    totals, per_func = rs.score(prompts, completions, columns, ids)
    ours = rs.metrics(rs.moments(totals, per_func))
    trl_totals, trl_per_func, theirs = trl_rewards(
        rs.funcs, rs.names, rs.weights, inputs, prompts, completions, ids, monkeypatch
    )
    for i, name in enumerate(rs.names):
        assert per_func[name] == pytest.approx(trl_per_func[:, i].tolist(), nan_ok=True)
    assert totals == pytest.approx(trl_totals, nan_ok=True)
    assert ours.keys() == theirs.keys()
    assert ours == pytest.approx(theirs, nan_ok=True, rel=1e-5)
