"""What a checkpoint must agree with to be resumed: the fingerprint of the training math.

Saved in each checkpoint as `fingerprint.json`: the arguments that define the data order, the schedule
and the update (not the world size, which may change freely), the corpus and tokenizer fingerprints and
the model config. A resume that changes any of them is refused with the list of differences, unless
--allow_changed_args (the banner then lists them).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from anygpu.checkpoint import manifest
from anygpu.errors import UsageError

FINGERPRINT_FILE = "fingerprint.json"
# Arguments that change the data order, the schedule or the update. The data source itself (files, hub
# id, text column, corpus size) is covered by the corpus fingerprint, the tokenizer by its own,
# --max_train_samples by num_train_samples.
MATH_ARGS = ("max_steps", "num_train_epochs", "learning_rate", "weight_decay", "adam_beta1",
             "adam_beta2", "adam_epsilon", "warmup_steps", "lr_scheduler_type", "max_grad_norm", "seed", "bf16", "fp16")
# Keys of a model config that do not change the model.
CONFIG_NOISE = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "use_cache")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(train_args: Any, prep: Any) -> dict[str, Any]:
    """The training math of this run (`prep`: the engine's `Prepared`)."""
    config = {k: v for k, v in prep.config.to_dict().items() if k not in CONFIG_NOISE}
    return {
        **{name: getattr(train_args, name) for name in MATH_ARGS},
        "block_size": prep.block_size,
        "global_batch_size": prep.plan.global_batch_size,
        "total_steps": prep.total_steps,
        "num_train_samples": prep.order.num_samples,
        "corpus": getattr(prep, "data_fingerprint", "")[:16],
        "tokenizer": tokenizer_fingerprint(prep.tokenizer),
        "model_config": json.loads(json.dumps(config, default=str)),
    }


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if key == "model_config" and isinstance(a, dict) and isinstance(b, dict):
            out += [f"model config {k}: {a.get(k)!r} → {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            label = {"corpus": "corpus fingerprint", "tokenizer": "tokenizer fingerprint"}.get(key, f"--{key}")
            out.append(f"{label}: {a!r} → {b!r}")
    return out


def check_engine(checkpoint: Path, engine: str) -> None:
    """A checkpoint of the other engine gets a message, not a loader traceback."""
    other = manifest.engine_of(checkpoint)
    if other is not None and other != engine:
        names = {"fsdp": "run_fsdp_standalone.py (FSDP2 engine)", "hf": "run_hf_standalone.py (HF Trainer engine)"}
        raise UsageError(f"--resume_from_checkpoint {checkpoint}: a checkpoint of {names[other]}, which this engine "
                         f"cannot load: resume it with {names[other].split(' ')[0]}, or start a new --output_dir.")


def check(checkpoint: Path, now: dict[str, Any], allow_changed: bool) -> list[str]:
    """Refuse a resume that changes the training math; return the differences (allowed ones, for the banner)."""
    file = checkpoint / FINGERPRINT_FILE
    if not file.exists():
        return []
    diffs = differences(json.loads(file.read_text()), now)
    if diffs and not allow_changed:
        raise UsageError(f"--resume_from_checkpoint {checkpoint}: this run's training math differs from the "
                         f"checkpoint's: {'; '.join(diffs)}. Resume with the original arguments and data, or pass "
                         "--allow_changed_args true to continue anyway.")
    return diffs


def banner_line(diffs: list[str]) -> str | None:
    return f"--allow_changed_args: resuming with changed training math: {'; '.join(diffs)}" if diffs else None
