"""The end of a run, both engines: the final model (or LoRA adapter) and the curves, with their messages."""

from __future__ import annotations

from pathlib import Path

import torch

from anygpu.checkpoint import export
from anygpu.model import hub_weights, lora, qlora
from anygpu.runtime import progress
from anygpu.train import metrics


def export_final(
    model, prep, model_args, train_args, rank: int, watched: progress.Progress | None, state_dict=None
) -> None:
    """`final/`: safetensors + config + tokenizer, or the PEFT adapter (and `final-merged/` with --merge_lora), in
    --export_dtype with files of at most --save_max_shard_size. `state_dict`: full tensors the engine gathered
    itself (ZeRO-3); every rank calls it (collective)."""
    final = Path(train_args.output_dir) / "final"
    dtype = export_dtype(train_args.export_dtype, model_args.model_name_or_path, train_args.bf16)
    size = train_args.save_max_shard_size
    with progress.protected(watched):  # the preemption watchdog waits for the export, however long
        if lora.is_peft(model):
            out = export.export_adapter(
                model,
                prep.tokenizer,
                model_args.model_name_or_path,
                final,
                rank,
                model_args.merge_lora,
                state_dict,
                dtype,
                size,
                quantised_from=qlora.quantised_from(model),
            )
            said = f"final adapter: {out} (PeftModel.from_pretrained loads it over the base)"
            if model_args.merge_lora and qlora.quantised_from(model) is not None:
                said += (
                    f"; {out}-merged: merged over the base dequantised from its 4-bit NF4 weights, as the run computed"
                )
        else:
            out = export.export_safetensors(model, prep.config, prep.tokenizer, final, rank, dtype, size, state_dict)
            said = f"final model: {out} in {str(dtype).removeprefix('torch.')} (AutoModelForCausalLM.from_pretrained loads it)"
    if rank == 0:
        print(said, flush=True)


def export_dtype(choice: str, source: str | None, bf16: bool) -> torch.dtype:
    """--export_dtype: a name, or auto: the pretrained checkpoint's storage dtype; from scratch bf16 under --bf16,
    else fp32."""
    if choice != "auto":
        return getattr(torch, choice)
    if source:
        return hub_weights.storage_dtype(source)
    return torch.bfloat16 if bf16 else torch.float32


def curves(output_dir: str, is_main: bool) -> None:
    """Rank 0: `loss.png` from metrics.jsonl, and where both are."""
    if is_main:
        png = metrics.plot_losses(output_dir)
        print(f"metrics: {Path(output_dir) / 'metrics.jsonl'}, curves: {png}", flush=True)
