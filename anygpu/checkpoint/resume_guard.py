"""What a checkpoint must agree with to be resumed: the fingerprint of the training math.

Saved in each checkpoint as `fingerprint.json`. Which arguments belong to it is read from each
argument's own marking (metadata "resume" in anygpu/config/args.py), so a new option cannot be left
out: SAME ones are compared by value, FREE ones (the world size, logging, paths…) may change, and the
rest are covered by an entry measured from the run itself (the corpus and tokenizer fingerprints, the
model config, the resolved block size, global batch, sample count and packing). A resume that changes
any entry is refused with the list of differences, each named by the arguments behind it, unless
--allow_changed_args (the banner then lists them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from anygpu.checkpoint import manifest
from anygpu.config.args import FREE, SAME, DataArguments, ModelArguments, TrainArguments
from anygpu.config.objective import REFERENCE_FREE
from anygpu.data.tokenizer import tokenizer_key
from anygpu.errors import UsageError
from anygpu.model import hub_weights

FINGERPRINT_FILE = "fingerprint.json"
ARGUMENT_TYPES = (ModelArguments, DataArguments, TrainArguments)
# Keys of a model config that do not change the model.
CONFIG_NOISE = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "use_cache")
BEHIND = {"base_weights": "model_config"}  # a measured entry named by another entry's arguments
SOURCES = "sources"  # the covered arguments' values, to name them when their entry differs (not compared)


def markings(*types: type) -> dict[str, str]:
    """Argument name → its "resume" marking, for every field of `types` (KeyError: a field without one)."""
    return {f.name: f.metadata["resume"] for t in (types or ARGUMENT_TYPES) for f in fields(t)}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    return hashlib.sha256(tokenizer_key(tokenizer).encode()).hexdigest()[:16]


def fingerprint(args: dict[str, Any], prep: Any) -> dict[str, Any]:
    """The training math of this run (`args`: `resolved_dict` of the run's arguments; `prep`: the engine's `Prepared`)."""
    marks = markings()
    config = {k: v for k, v in prep.config.to_dict().items() if k not in CONFIG_NOISE}
    measured = {
        "block_size": prep.block_size,
        "global_batch_size": prep.plan.global_batch_size,
        "total_steps": prep.total_steps,
        "num_train_samples": prep.order.num_samples,
        "packed": bool(getattr(prep.collator, "packed", False)),
        "corpus": getattr(prep, "data_fingerprint", "")[:16],
        "tokenizer": tokenizer_fingerprint(prep.tokenizer),
        "model_config": json.loads(json.dumps(config, default=str)),
        "base_weights": base_weights(args),
    }
    covered = {mark for mark in marks.values() if mark not in (FREE, SAME)}
    assert covered <= set(measured), f"arguments marked with an unmeasured entry: {covered - set(measured)}"
    same = {name: args[name] for name, mark in marks.items() if mark == SAME}
    sources = {name: args[name] for name, mark in marks.items() if mark not in (FREE, SAME)}
    return json.loads(json.dumps({**same, **measured, SOURCES: sources}, default=str))


def base_weights(args: dict[str, Any]) -> str:
    """The fingerprint of the pretrained weights a resumed run reads again ('' where it reads none): LoRA's frozen
    base, DPO's or GRPO's reference (the checkpoint of a full fine-tune holds every weight it trains)."""
    paths = set()
    if args.get("use_peft"):
        paths.add(args["model_name_or_path"])
    dpo_reference = args.get("objective") == "dpo" and not set(args.get("loss_type") or ()) <= set(REFERENCE_FREE)
    if dpo_reference or (args.get("objective") == "grpo" and (args.get("beta") or 0) > 0):
        paths.add(args.get("ref_model_name_or_path") or args.get("model_name_or_path"))
    return "|".join(hub_weights.weights_fingerprint(p) for p in sorted(p for p in paths if p))


def _behind(key: str, saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The arguments behind a measured entry: the changed ones, else the ones given (same value, new content)."""
    key = BEHIND.get(key, key)
    names = [n for n, mark in markings().items() if mark == key]
    was, new = saved.get(SOURCES, {}), now.get(SOURCES, {})
    changed = [f"--{n} {was.get(n)!r} → {new.get(n)!r}" for n in names if n in was and was.get(n) != new.get(n)]
    if changed:
        return f" (from {', '.join(changed)})"
    if any(was.get(n) != v for n, v in new.items() if n in was):  # another entry's argument changed: that one did it
        return ""
    given = [f"--{n} {new[n]}" for n in names if new.get(n) not in (None, False)]
    return f" (the content behind {', '.join(given)} changed)" if given else ""


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    marks = markings()
    labels = {"corpus": "corpus fingerprint", "tokenizer": "tokenizer fingerprint", "packed": "packing (resolved)",
              "base_weights": "base model weights", "total_steps": "total steps", "num_train_samples": "training samples",
              "block_size": "block size", "global_batch_size": "global batch"}  # fmt: skip
    out = []
    # An entry the checkpoint does not have (written by an older anygpu) cannot be compared.
    for key in sorted(k for k in set(saved) & set(now) if k != SOURCES):
        a, b = saved.get(key), now.get(key)
        if key == "model_config" and isinstance(a, dict) and isinstance(b, dict):
            behind = _behind(key, saved, now)
            out += [
                f"model config {k}: {a.get(k)!r} → {b.get(k)!r}{behind}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            out.append(
                f"{labels.get(key, f'--{key}')}: {a!r} → {b!r}"
                + (_behind(key, saved, now) if BEHIND.get(key, key) in marks.values() else "")
            )
    return out


def check_engine(checkpoint: Path, engine: str) -> None:
    """A checkpoint of the other engine gets a message, not a loader traceback."""
    other = manifest.engine_of(checkpoint)
    if other is not None and other != engine:
        names = {"fsdp": "run_fsdp_standalone.py (FSDP2 engine)", "hf": "run_hf_standalone.py (HF Trainer engine)"}
        raise UsageError(
            f"--resume_from_checkpoint {checkpoint}: a checkpoint of {names[other]}, which this engine "
            f"cannot load: resume it with {names[other].split(' ')[0]}, or start a new --output_dir."
        )


def check(checkpoint: Path, now: dict[str, Any], allow_changed: bool) -> list[str]:
    """Refuse a resume that changes the training math; return the differences (allowed ones, for the banner)."""
    file = checkpoint / FINGERPRINT_FILE
    if not file.exists():
        return []
    diffs = differences(json.loads(file.read_text()), now)
    if diffs and not allow_changed:
        raise UsageError(
            f"--resume_from_checkpoint {checkpoint}: this run's training math differs from the "
            f"checkpoint's: {'; '.join(diffs)}. Resume with the original arguments and data, or pass "
            "--allow_changed_args true to continue anyway."
        )
    return diffs


def banner_line(diffs: list[str]) -> str | None:
    return f"--allow_changed_args: resuming with changed training math: {'; '.join(diffs)}" if diffs else None
