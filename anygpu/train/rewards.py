"""Reward functions for `--objective grpo`, called the way TRL 1.16's GRPOTrainer calls them.

A reward function is any callable `f(prompts=, completions=, completion_ids=, **columns) -> list[float | None]`:
one value per completion, the row's other dataset columns passed by name as lists (TRL's `reward_kwargs`; `prompt`,
`completion` and `completion_ids` are not among them). Completions are strings, or for conversational prompts a
list of one message each, `[{"role": "assistant", "content": "..."}]` (TRL's shape). A function written for TRL
runs here unchanged, provided it takes `**kwargs` or only the arguments it names: TRL also passes `trainer_state`,
`log_extra` and `log_metric`, which a caller gives here through `score`'s `extra` when it has them.

`--reward_funcs` names each function: a built-in (`BUILTINS`), `path/to/rewards.py:accuracy` or
`package.module:accuracy`. Loading a file or module runs the user's code, as TRL's `trl grpo --reward_funcs` does:
that is what the user asks for. `--reward_weights` weighs them (default 1 each).

None means "does not apply to this completion" (TRL: a multi-task row another function scores). As in TRL, a None
(or a NaN) is left out of that function's mean and std and out of the completion's weighted sum (TRL's `nansum`);
a completion every function left out has no total (NaN): it is left out of `reward` / `reward_std`, and GRPO gives it
no advantage. An infinite value is refused (TRL would take it, and it would turn its whole group's advantages NaN).

Metrics keep TRL's names: `rewards/<name>/mean`, `rewards/<name>/std` per function and `reward`, `reward_std` for
the weighted total, std with Bessel's correction (TRL's `nanstd`). `RewardSet.moments` gives sums and counts that a
caller sums over every rank (in float64) before `RewardSet.metrics`, so they describe the global batch as TRL's do
(TRL gathers every process's rewards first).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from anygpu.config.objective import weights_for
from anygpu.errors import UsageError

BUILTINS = ("accuracy", "format", "overlong", "repetition")
# the names TRL's `trl grpo` script registers: built-ins that compute the same (by TRL's metric name), or TRL's own
TRL_REGISTRY = {
    "think_format_reward": "format",
    "get_soft_overlong_punishment": "overlong",
    "accuracy_reward": None,  # math_verify's LaTeX comparison: TRL's function, not the exact-match built-in
    "reasoning_accuracy_reward": None,
}
THINK_PATTERN = r"^<think>(?!.*<think>)(.*?)</think>.*$"  # TRL's think_format_reward
SPEC_FORMS = (
    f"a built-in ({', '.join(BUILTINS)}), path/to/rewards.py:accuracy, package.module:accuracy (or TRL's "
    "package.module.accuracy and registry names)"
)
NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # TRL passes these by their own names, never as columns


LARGEST = 1e15  # a reward's magnitude: its square, summed over a batch, stays finite (the std's moments)


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not one number (or None) per completion: a bug in
    the user's function, not a bad argument, so it keeps its traceback (the original exception is `__cause__`)."""


@dataclass(frozen=True)
class BuiltinOptions:
    """The built-ins' settings (the flags named in their refusals)."""

    solution_column: str = "solution"  # TRL's accuracy_reward column
    format_pattern: str = THINK_PATTERN
    max_completion_length: int | None = None  # overlong: TRL's max_completion_len (GRPOConfig.max_completion_length)
    soft_punish_cache: int | None = None  # overlong: TRL's soft_punish_cache; default a fifth of the length (DAPO)


# ---- the built-ins ---------------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of its last message (TRL's built-ins read the first;
    the same for TRL's one-message completions, the final answer after tool calls), text blocks joined."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"]
    if isinstance(content, list):  # content blocks: [{"type": "text", "text": ...}, ...]
        return "".join(block.get("text", "") for block in content if isinstance(block, dict))
    return content


def answer_of(text: str) -> str:
    """The final answer in a completion: after the last `</think>`, the last `<answer>…</answer>`, else the last
    `\\boxed{…}`, else all of it; whitespace collapsed."""
    text = text.rsplit("</think>", 1)[-1]
    tagged = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if tagged:
        text = tagged[-1]
    elif (boxed := _last_boxed(text)) is not None:
        text = boxed
    return " ".join(text.split())


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):  # braces balanced: \boxed{\frac{1}{3}}
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


class Accuracy:
    """`accuracy`: 1.0 when the completion's final answer (`answer_of`) equals the row's solution (whitespace
    collapsed), else 0.0; None where the row's solution is None or empty (TRL's accuracy_reward: None for a gold
    answer it cannot parse). An exact match: TRL's accuracy_reward compares LaTeX with math_verify instead."""

    __name__ = "accuracy"

    def __init__(self, column: str = "solution") -> None:
        self.column = column
        self.required_columns = (column,)

    def __call__(self, completions: list, **columns: Any) -> list[float | None]:
        solutions = columns[self.column]
        out: list[float | None] = []
        for completion, solution in zip(completions, solutions, strict=True):
            gold = " ".join(str(solution).split()) if solution is not None else ""
            out.append(None if not gold else float(answer_of(completion_text(completion)) == gold))
        return out


class Format:
    """`format`: 1.0 when `re.match(pattern, text, DOTALL | MULTILINE)` matches the completion, else 0.0. The
    default pattern is TRL's think_format_reward's (one `<think>…</think>` at the start, then anything), so the
    default is that function."""

    __name__ = "format"
    required_columns = ()

    def __init__(self, pattern: str = THINK_PATTERN) -> None:
        self.regex = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def __call__(self, completions: list, **kwargs: Any) -> list[float]:
        return [1.0 if self.regex.match(completion_text(c)) else 0.0 for c in completions]


class Overlong:
    """`overlong`: TRL's get_soft_overlong_punishment (DAPO eq. 13) on the completion's token count n: 0 up to
    L - cache, then falling linearly to -1 at L, -1 beyond (L = max_completion_length)."""

    __name__ = "overlong"
    required_columns = ()

    def __init__(self, max_completion_length: int, soft_punish_cache: int) -> None:
        from trl.rewards import get_soft_overlong_punishment

        self.trl = get_soft_overlong_punishment(max_completion_length, soft_punish_cache)

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return self.trl(completion_ids)


class Repetition:
    """`repetition`: TRL's get_repetition_penalty_reward(ngram_size=3, max_penalty=-1): -(1 - unique/total) over
    the completion's token 3-grams, 0 for a completion without a repeat (or under 3 tokens)."""

    __name__ = "repetition"
    required_columns = ()

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0) -> None:
        from trl.rewards import get_repetition_penalty_reward

        self.trl = get_repetition_penalty_reward(ngram_size, max_penalty)

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return self.trl(completion_ids)


def builtin(name: str, options: BuiltinOptions) -> Callable:
    if name == "accuracy":
        return Accuracy(options.solution_column)
    if name == "format":
        try:
            return Format(options.format_pattern)
        except re.error as e:
            raise UsageError(
                f"--format_pattern {options.format_pattern!r} is not a regular expression ({e}): e.g. {THINK_PATTERN}"
            ) from None
    if name == "overlong":
        length = options.max_completion_length
        assert length is not None and length > 0, "overlong needs the run's max_completion_length"
        cache = options.soft_punish_cache if options.soft_punish_cache is not None else max(length // 5, 1)
        if not 0 < cache <= length:
            raise UsageError(
                f"--soft_punish_cache {cache} must be in (0, --max_completion_length {length}], e.g. {max(length // 5, 1)}."
            )
        return Overlong(length, cache)
    return Repetition()


# ---- loading ---------------------------------------------------------------------------------------------------


def load(spec: str, options: BuiltinOptions = BuiltinOptions()) -> Callable:
    """The reward function `spec` names: a built-in, `path/to/rewards.py:fn` (the file imported from where it is,
    sys.path untouched: it may not import a sibling file, a package may) or `package.module:fn`. Importing runs the
    user's code, as TRL does."""
    if spec in BUILTINS:
        return builtin(spec, options)
    if spec in TRL_REGISTRY:
        return _trl_registered(spec, options)
    source, colon, attr = spec.rpartition(":")
    if not colon and "." in spec and "/" not in spec and not spec.endswith(".py"):  # TRL's package.module.fn
        source, colon, attr = spec.rpartition(".")
    if not colon or not source or not attr:
        raise UsageError(f"--reward_funcs {spec!r} is not a reward function: name {SPEC_FORMS}.")
    module = _load_file(spec, source) if source.endswith(".py") or "/" in source else _import(spec, source)
    fn = getattr(module, attr, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:8]
        raise UsageError(
            f"--reward_funcs {spec!r}: {source} has no {attr!r}; its callables: {', '.join(found) or '(none)'}."
        )
    if not callable(fn):
        raise UsageError(
            f"--reward_funcs {spec!r}: {attr} is a {type(fn).__name__}, not a function; name a function, "
            f"e.g. {source}:accuracy."
        )
    return fn


def _trl_registered(name: str, options: BuiltinOptions) -> Callable:
    """A name TRL's grpo script registers. Its overlong reward takes this run's --max_completion_length (TRL's script
    fixes 1280 tokens); its format reward is TRL's pattern whatever --format_pattern says."""
    from trl.import_utils import is_math_verify_available

    ours = TRL_REGISTRY[name]
    if ours is not None:
        fn = builtin(ours, dataclasses.replace(options, format_pattern=THINK_PATTERN))
        fn.__name__ = "soft_overlong_punishment_reward" if ours == "overlong" else name  # TRL's metric names
        return fn
    if not is_math_verify_available():
        raise UsageError(
            f"--reward_funcs {name}: TRL's {name} checks answers with math_verify, which is not installed: "
            "pip install math-verify, or use accuracy (an exact match of the final answer with --solution_column)."
        )
    import trl.rewards

    return getattr(trl.rewards, name)


def _load_file(spec: str, source: str) -> Any:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise UsageError(
            f"--reward_funcs {spec!r}: no file {source}; name an existing one, e.g. ./rewards.py:accuracy."
        )
    # A name of its own, registered (dataclasses and pickling look a module up by name), never on sys.path.
    name = f"anygpu_rewards_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:  # a second function from the same file: its code runs once
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UsageError(f"--reward_funcs {spec!r}: {source} does not import ({_why(e)}); fix it.") from e
    return module


def _import(spec: str, source: str) -> Any:
    try:
        return importlib.import_module(source)
    except Exception as e:
        raise UsageError(
            f"--reward_funcs {spec!r}: module {source} does not import ({_why(e)}); name an importable module or "
            "a file, e.g. path/to/rewards.py:accuracy."
        ) from e


def _why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:100]}" if first else type(e).__name__


def name_of(fn: Callable) -> str:
    """TRL's get_callable_name: a function's `__name__`, through functools.partial, else the class name."""
    while hasattr(fn, "func") and hasattr(fn, "args") and hasattr(fn, "keywords"):  # functools.partial
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _weights(words: Sequence[str | float] | None, names: Sequence[str]) -> tuple[float, ...]:
    if words is None:
        return (1.0,) * len(names)
    return tuple(weights_for("reward_weights", words, "reward_funcs", names))


# ---- scoring ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSet:
    """The run's reward functions, their metric names (TRL's: the callable's name) and weights."""

    names: tuple[str, ...]
    funcs: tuple[Callable, ...]
    weights: tuple[float, ...]

    @classmethod
    def build(
        cls,
        specs: Sequence[str],
        weights: Sequence[str | float] | None = None,
        options: BuiltinOptions = BuiltinOptions(),
    ) -> RewardSet:
        """Load `--reward_funcs` and weigh them with `--reward_weights`; refuse two that share a metric name."""
        if not specs:
            raise UsageError(f"--reward_funcs is empty: name at least one, {SPEC_FORMS}.")
        funcs = tuple(load(spec, options) for spec in specs)
        names = tuple(name_of(fn) for fn in funcs)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UsageError(
                f"--reward_funcs {','.join(specs)}: two functions are named {twice[0]!r} and would share the "
                f"metrics rewards/{twice[0]}/*; rename one."
            )
        return cls(names, funcs, _weights(weights, names))

    def check_columns(self, columns: Iterable[str], where: str = "the data") -> None:
        """Refuse, before any work, a built-in that reads a column the data (`where`) lacks."""
        have = set(columns)
        for name, fn in zip(self.names, self.funcs):
            missing = [c for c in getattr(fn, "required_columns", ()) if c not in have]
            if missing:
                raise UsageError(
                    f"--reward_funcs {name} reads the column {missing[0]!r}, which {where} lacks (it has "
                    f"{', '.join(sorted(have))}): add it, or name the column with --solution_column."
                )

    def score(
        self,
        prompts: list,
        completions: list,
        columns: dict[str, list],
        completion_ids: list[list[int]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Each function's value per completion (NaN for None) and the weighted total per completion: the sum over
        the functions that gave a value (TRL's nansum), NaN where none did. `columns`: the rows' other columns, one
        value per completion; `extra`: further keyword arguments for every function (TRL's `trainer_state`)."""
        n = len(completions)
        assert len(prompts) == n and all(len(v) == n for v in columns.values()), "one prompt and row per completion"
        kwargs = {k: v for k, v in columns.items() if k not in NOT_COLUMNS}
        kwargs.update(prompts=prompts, completions=completions, completion_ids=completion_ids, **(extra or {}))
        started = {name: _start(fn, kwargs) for name, fn in zip(self.names, self.funcs)}  # async ones run meanwhile
        per_func = {name: self._call(name, fn, started[name], kwargs, n) for name, fn in zip(self.names, self.funcs)}
        totals = []
        for i in range(n):
            given = [(w, per_func[name][i]) for name, w in zip(self.names, self.weights)]
            given = [w * v for w, v in given if not math.isnan(v)]
            totals.append(math.fsum(given) if given else math.nan)
        return totals, per_func

    def _call(self, name: str, fn: Callable, result: Callable[[], Any], kwargs: dict[str, Any], n: int) -> list[float]:
        try:
            out = result()
        except Exception as e:
            row, cause = _failing_row(fn, kwargs, n)
            where = f"row {row} of {n} (prompt {_excerpt(kwargs['prompts'][row])})" if row is not None else "a batch"
            raise RewardError(f"reward function {name!r} raised on {where}: {_why(cause or e)}") from (cause or e)
        return _values(name, out, n)

    def moments(self, totals: list[float], per_func: dict[str, list[float]]) -> dict[str, float]:
        """Sum, sum of squares and count of the non-NaN values of each function (`rewards/<name>/…`) and of the
        totals (`reward/…`): sum these over every rank, in float64, then call `metrics`."""
        out: dict[str, float] = {}
        for prefix, values in [*((f"rewards/{n}", per_func[n]) for n in self.names), ("reward", totals)]:
            kept = [v for v in values if not math.isnan(v)]
            out[f"{prefix}/sum"] = math.fsum(kept)
            out[f"{prefix}/sum_sq"] = math.fsum(v * v for v in kept)
            out[f"{prefix}/count"] = float(len(kept))
        return out

    def metrics(self, moments: dict[str, float]) -> dict[str, float]:
        """TRL's metrics from summed `moments`: rewards/<name>/mean and /std, reward and reward_std (NaN where no
        value, or one for a std, as TRL's nanmean and nanstd give)."""
        out: dict[str, float] = {}
        for name in self.names:
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = _mean_std(moments, f"rewards/{name}")
        out["reward"], out["reward_std"] = _mean_std(moments, "reward")
        return out


def _mean_std(moments: dict[str, float], prefix: str) -> tuple[float, float]:
    total, squares, count = (moments[f"{prefix}/{k}"] for k in ("sum", "sum_sq", "count"))
    mean = total / count if count else math.nan
    if count <= 1:
        return mean, math.nan
    return mean, math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))  # Bessel, as TRL's nanstd


def _values(name: str, out: Any, n: int) -> list[float]:
    """The function's output as floats (None → NaN), refused unless it is one finite number or None per completion."""
    try:
        values = list(out)
    except TypeError:
        values = None
    if values is None or isinstance(out, (str, bytes, dict)):
        raise RewardError(f"reward function {name!r} returned a {type(out).__name__}, not a list of {n} numbers.")
    if len(values) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} completions: return one per "
            "completion (None where it does not apply)."
        )
    floats = []
    for i, v in enumerate(values):
        if v is not None and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # a 0-d tensor or array
            v = v.item()
        if v is not None and not isinstance(v, numbers.Real):
            raise RewardError(
                f"reward function {name!r} returned {v!r} for completion {i}: give a number, or None where it "
                "does not apply."
            )
        x = math.nan if v is None else float(v)
        if abs(x) > LARGEST:  # infinite too; NaN passes (TRL's "no value")
            raise RewardError(
                f"reward function {name!r} returned {x} for completion {i}: rewards must be finite and within "
                f"±{LARGEST:g} (the statistics square them), e.g. scaled to about ±1."
            )
        floats.append(x)
    return floats


def _start(fn: Callable, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """Call `fn`; what gives its result (or raises its error). An async function's coroutine runs on the rewards'
    event loop, beside the other async functions, until the result is asked for (TRL gathers them on one loop in a
    daemon thread: an LLM judge's requests overlap)."""
    try:
        out = fn(**kwargs)
    except Exception as e:
        error = e

        def fail() -> Any:
            raise error

        return fail
    if inspect.isawaitable(out):
        return asyncio.run_coroutine_threadsafe(_awaited(out), _event_loop()).result
    return lambda: out


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


_LOOP: list[asyncio.AbstractEventLoop] = []  # the rewards' event loop, started with the first async function


def _event_loop() -> asyncio.AbstractEventLoop:
    if not _LOOP:
        _LOOP.append(asyncio.new_event_loop())
        threading.Thread(target=_LOOP[0].run_forever, name="anygpu-async-rewards", daemon=True).start()
    return _LOOP[0]


def _failing_row(fn: Callable, kwargs: dict[str, Any], n: int) -> tuple[int | None, BaseException | None]:
    """The first row on which `fn`, called on that row alone, raises (None when each row alone passes)."""
    for i in range(n):
        one = {k: v[i : i + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
        try:
            _start(fn, one)()
        except Exception as e:
            return i, e
    return None, None


def _excerpt(prompt: Any, limit: int = 60) -> str:
    text = prompt if isinstance(prompt, str) else completion_text(prompt) if prompt else ""
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")
