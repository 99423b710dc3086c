"""Is the model, tokenizer and data the arguments name actually there? Checked before any work.

A missing local path or a hub id that is not in the cache would otherwise surface as a 50-line
traceback from transformers or datasets, once per rank, after the process group is up. These checks
read only the file system (the Hugging Face caches included): no network, no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from anygpu.errors import UsageError

TRUE = ("1", "true", "yes", "on")


def offline(variable: str = "HF_HUB_OFFLINE") -> bool:
    return os.environ.get(variable, os.environ.get("HF_HUB_OFFLINE", "")).strip().lower() in TRUE


def _looks_like_path(value: str) -> bool:
    """A hub id is 'name' or 'org/name'; anything else (./x, /x, ~/x, a/b/c, x.json) is meant as a path."""
    return (
        value.startswith((".", "/", "~"))
        or value.count("/") > 1
        or value.endswith((".json", ".yaml"))
        or os.sep != "/"
        and os.sep in value
    )


def _in_hub_cache(repo_id: str, filenames: tuple[str, ...], repo_type: str | None = None) -> bool:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    for filename in filenames:
        try:
            if isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str):
                return True
        except HFValidationError:  # not a valid repo id at all: certainly not cached
            return False
    return False


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _advice(arg: str, value: str, what: str, repo_type: str = "") -> str:
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    return (
        f"{arg} {value}: no such local {what}, and not in the Hugging Face cache ({_hub_cache()}); nothing is "
        f"downloaded while HF_HUB_OFFLINE=1. Give a local folder, or download it once with "
        f"`hf download{kind} {value}` (or run with HF_HUB_OFFLINE=0 when online)."
    )


def check_pretrained(
    arg: str, value: str | None, files: tuple[str, ...], what: str = "model folder (with config.json)"
) -> None:
    """`value` of `arg` is an existing path, or a hub id whose `files` (any of them) are cached or downloadable."""
    if not value:
        return
    path = Path(value).expanduser()
    if path.exists():
        return
    if _looks_like_path(value):
        raise UsageError(
            f"{arg} {value}: no such file or folder. Give an existing {what}, or a cached hub id such as "
            "Qwen/Qwen2.5-0.5B."
        )
    if offline() and not _in_hub_cache(value, files):
        raise UsageError(_advice(arg, value, "folder"))


def _datasets_cache() -> Path:
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "datasets"


def _in_datasets_cache(name: str) -> bool:
    """datasets keeps a prepared hub data set as <cache>/<org>___<name> (the name snake-cased): compared loosely."""
    cache = _datasets_cache()
    if not cache.is_dir():
        return False
    wanted = "___".join(name.split("/")).lower().replace("-", "_")
    squashed = wanted.replace("_", "")
    for entry in cache.iterdir():
        seen = entry.name.lower().replace("-", "_")
        if seen == wanted or seen.replace("_", "") == squashed:
            return True
    return False


def check_dataset(value: str | None) -> None:
    """--dataset_name is a folder saved with save_to_disk, or a hub id in the hub or datasets cache (offline)."""
    if not value:
        return
    if Path(value).expanduser().is_file():
        raise UsageError(
            f"--dataset_name {value} is a file: give it with --train_file (a data set is a folder or a hub id)."
        )
    if Path(value).expanduser().exists():
        return
    if _looks_like_path(value):
        raise UsageError(
            f"--dataset_name {value}: no such folder. Give a folder written by Dataset.save_to_disk, "
            "a cached hub id, or a file with --train_file."
        )
    if offline("HF_DATASETS_OFFLINE") and not (
        _in_datasets_cache(value) or _in_hub_cache(value, ("README.md",), "dataset")
    ):
        raise UsageError(_advice("--dataset_name", value, "folder", "dataset") + " Or give a file with --train_file.")


def check_sources(model_args, data_args, presets: list[str]) -> None:
    """Every model, config, tokenizer and data set the arguments name, before any work (raises UsageError)."""
    if model_args.config_name not in presets and "/" in (
        model_args.config_name or ""
    ):  # else resolve_config lists the presets
        check_pretrained(
            "--config_name",
            model_args.config_name,
            ("config.json",),
            f"config.json file or folder, a preset ({', '.join(presets)})",
        )
    check_pretrained("--model_name_or_path", model_args.model_name_or_path, ("config.json",))
    check_pretrained(
        "--tokenizer_name",
        model_args.tokenizer_name,
        ("tokenizer_config.json", "tokenizer.json", "vocab.json", "tokenizer.model"),
        "tokenizer folder",
    )
    check_dataset(data_args.dataset_name)
