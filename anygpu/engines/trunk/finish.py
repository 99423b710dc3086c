"""The end of a run, both engines: the final model (or LoRA adapter) and the curves, with their messages."""

from __future__ import annotations

from pathlib import Path

from anygpu.checkpoint import export
from anygpu.model import lora
from anygpu.runtime import progress
from anygpu.train import metrics


def export_final(
    model, prep, model_args, output_dir: str, rank: int, watched: progress.Progress | None, state_dict=None
) -> None:
    """`final/`: safetensors + config + tokenizer, or the PEFT adapter (and `final-merged/` with --merge_lora).
    `state_dict`: full tensors the engine gathered itself (ZeRO-3); every rank calls it (collective)."""
    final = Path(output_dir) / "final"
    with progress.protected(watched):  # the preemption watchdog waits for the export, however long
        if lora.is_peft(model):
            out = export.export_adapter(
                model, prep.tokenizer, model_args.model_name_or_path, final, rank, model_args.merge_lora, state_dict
            )
            said = f"final adapter: {out} (PeftModel.from_pretrained loads it over the base)"
        else:
            out = export.export_safetensors(model, prep.config, prep.tokenizer, final, rank, state_dict=state_dict)
            said = f"final model: {out} (AutoModelForCausalLM.from_pretrained loads it)"
    if rank == 0:
        print(said, flush=True)


def curves(output_dir: str, is_main: bool) -> None:
    """Rank 0: `loss.png` from metrics.jsonl, and where both are."""
    if is_main:
        png = metrics.plot_losses(output_dir)
        print(f"metrics: {Path(output_dir) / 'metrics.jsonl'}, curves: {png}", flush=True)
