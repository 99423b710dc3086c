"""Keep DeepSpeed unimported in runs that do not use it.

accelerate's `extract_model_from_parallel` (behind transformers' `unwrap_model`: Trainer's start-up,
`save_pretrained`, so every HF-engine process and every final export) imports DeepSpeed whenever it is
installed, only to add `DeepSpeedEngine` to an `isinstance` check. That import costs over a second of
CPU per process (and probes for CUDA). No model can be a `DeepSpeedEngine` unless DeepSpeed was imported,
so while it is not, the check asks for it no more; once a run imports DeepSpeed (its accelerate plugin does,
before any model is wrapped), the check is accelerate's own again.
"""

from __future__ import annotations

import sys


def unwrap_without_importing_deepspeed() -> None:
    """Make accelerate's unwrapping import DeepSpeed only once something else has (idempotent)."""
    try:
        import accelerate.utils.other as other
    except ImportError:
        return
    real = getattr(other, "is_deepspeed_available", None)
    if real is None or getattr(real, "_anygpu_lazy", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and real()

    is_deepspeed_available._anygpu_lazy = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = is_deepspeed_available
