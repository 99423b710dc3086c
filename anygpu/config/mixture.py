"""`--dataset_mixture`: several text sources mixed by weight, in the shape of TRL's `ScriptArguments.dataset_mixture`
(a mapping with a `datasets` list), each entry a source of raw text:

    dataset_mixture:
      datasets:
        - {name: web, path: data/web/*.jsonl.zst, weight: 0.7}
        - {name: code, path: data/code/, weight: 0.2, text_column: content}
        - {name: math, path: data/math.parquet, weight: 0.1}

Parsed and checked here, before any work: every refusal names the source and the key. TRL's entries name a hub
data set (`path`, its config `name`, `split`, `data_files`); ours name files, and `name` is the source's label
(the `samples/<name>` and `eval_loss/<name>` metrics)."""

from __future__ import annotations

import glob
import json
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from anygpu.errors import UsageError

SOURCE_KEYS = ("name", "path", "weight", "text_column", "validation_path")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # it becomes part of a metric key
ARG = "--dataset_mixture"


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture: where its text is, its label, its share of the samples drawn."""

    name: str
    path: str
    weight: float
    text_column: str
    validation_path: str | None = None


def exact_weight(weight: float) -> Fraction:
    """A weight as the decimal written (0.7 is 7/10, not the nearest binary float): the shares are exact."""
    return Fraction(repr(float(weight)))


def _load(value: str) -> Any:
    """The mixture as data: a YAML/JSON file's contents, or the YAML/JSON text itself (a config file's mapping
    reaches the command line as JSON)."""
    text = value
    if value.strip().endswith((".yaml", ".yml", ".json")) and "\n" not in value and "{" not in value:
        if not Path(value).is_file():
            raise UsageError(f"{ARG} {value}: no such file. Give a YAML/JSON file with a 'datasets' list.")
        text = Path(value).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(
            f"{ARG} {value[:80]!r} cannot be read ({str(e).splitlines()[0]}): give "
            "{'datasets': [{'name': 'web', 'path': 'data/web/', 'weight': 0.7}, ...]}."
        ) from None
    if isinstance(data, dict) and "dataset_mixture" in data:  # a run config's whole file
        data = data["dataset_mixture"]
    if isinstance(data, list):  # the list alone
        data = {"datasets": data}
    return data


def _matches(path: str) -> bool:
    return bool(glob.glob(path, recursive=True)) or Path(path).exists()


def _weight(entry: dict, where: str) -> float:
    weight = entry.get("weight", 1.0)
    if isinstance(weight, str):  # YAML 1.1 reads 1e-3 (no dot) as text; a run config's JSON writes 1e-05 so
        try:
            weight = float(weight)
        except ValueError:
            pass
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise UsageError(f"{ARG}: {where} has weight {weight!r}: give a number ≥ 0, e.g. 0.2 (shares of the samples).")
    return float(weight)


def _default_name(path: str, i: int) -> str:
    """A source's name where it gives none: its path's stem up to any glob (data/web/*.jsonl: web), made a valid
    name (other characters become '_'), else source<i>."""
    stem = Path(re.split(r"[*?\[]", path)[0].rstrip("/") or ".").stem
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_.-")[:64]
    return name or f"source{i + 1}"


def _source(entry: Any, i: int, text_column: str) -> SourceSpec:
    where = f"source {i + 1}"
    if not isinstance(entry, dict):
        raise UsageError(
            f"{ARG}: {where} is {entry!r}: give a mapping such as {{name: web, path: data/web/, weight: 0.7}}."
        )
    unknown = sorted(set(entry) - set(SOURCE_KEYS))
    if unknown:
        raise UsageError(f"{ARG}: {where} has unknown key(s) {', '.join(unknown)}: use {', '.join(SOURCE_KEYS)}.")
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise UsageError(f"{ARG}: {where} has no 'path': give a file, a folder or a glob of text files.")
    name = str(entry.get("name") or _default_name(path, i))
    where = f"source {name!r}"
    if not NAME.match(name):
        raise UsageError(
            f"{ARG}: {where}: a name is 1 to 64 letters, digits, '_', '.', '-', starting with a letter or digit (it "
            "names metrics such as samples/<name>), e.g. web."
        )
    for key, value in (("path", path), ("validation_path", entry.get("validation_path"))):
        if value is not None and not _matches(str(value)):
            raise UsageError(
                f"{ARG}: {where} {key} {value}: no file matches it. Give an existing file, folder or glob."
            )
    column = entry.get("text_column", text_column)
    if not isinstance(column, str) or not column:
        raise UsageError(f"{ARG}: {where} text_column {column!r}: give the name of the column that holds the text.")
    validation = entry.get("validation_path")
    return SourceSpec(name, path, _weight(entry, where), column, str(validation) if validation else None)


def parse_mixture(value: str | None, text_column: str = "text") -> list[SourceSpec] | None:
    """The sources of `--dataset_mixture` (None when not given), refused in one line when malformed."""
    if not value:
        return None
    data = _load(value)
    if not isinstance(data, dict) or not isinstance(data.get("datasets"), list) or not data["datasets"]:
        raise UsageError(
            f"{ARG} {value[:80]!r}: expected a mapping with a non-empty 'datasets' list, e.g. "
            "{datasets: [{name: web, path: data/web/, weight: 0.7}, {name: code, path: data/code/, weight: 0.3}]}."
        )
    unknown = sorted(set(data) - {"datasets"})
    if unknown:
        raise UsageError(
            f"{ARG}: unknown key(s) {', '.join(unknown)} beside 'datasets' (TRL's streaming and test_split_size have "
            "no meaning here: use --validation_split_percentage)."
        )
    sources = [_source(entry, i, text_column) for i, entry in enumerate(data["datasets"])]
    names = [s.name for s in sources]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"{ARG}: two sources are named {dup!r}: give each a name of its own.")
    if sum(s.weight for s in sources) <= 0:
        raise UsageError(f"{ARG}: the weights sum to 0: give at least one source a weight > 0, e.g. 1.")
    return sources


def as_argument(value: Any) -> str:
    """A run config's `dataset_mixture` mapping (or list) as the one command-line word that carries it."""
    return json.dumps(value)
