"""The reference of hf_vs_trainer.py: a bare `transformers.Trainer` on the engine's model, packed data and batch
shape (same arguments as run_hf_standalone.py). hf_vs_trainer.py runs it under benchmarks/_trainer_timing.py,
which times it."""

from __future__ import annotations

import sys

from _common import anygpu  # noqa: F401
from transformers import Trainer, TrainingArguments

from anygpu.config.args import parse_args
from anygpu.data.prepare import prepare
from anygpu.model import modeling
from anygpu.runtime import distributed


def main() -> None:
    model_args, data_args, train_args = parse_args(sys.argv[1:])
    info = distributed.DistInfo(0, 0, 1, __import__("torch").device("cpu"))
    prep = prepare(model_args, data_args, train_args, info)
    model = modeling.build_full_model(prep.config, model_args, train_args.seed)
    targs = TrainingArguments(
        output_dir=train_args.output_dir,
        max_steps=train_args.max_steps,
        per_device_train_batch_size=prep.plan.per_device_train_batch_size,
        gradient_accumulation_steps=prep.plan.gradient_accumulation_steps,
        learning_rate=train_args.learning_rate,
        weight_decay=train_args.weight_decay,
        warmup_steps=train_args.warmup_steps,
        lr_scheduler_type=train_args.lr_scheduler_type,
        max_grad_norm=train_args.max_grad_norm,
        seed=train_args.seed,
        logging_steps=train_args.logging_steps,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        skip_memory_metrics=True,
    )
    Trainer(model=model, args=targs, train_dataset=prep.datasets["train"], data_collator=prep.collator).train()


if __name__ == "__main__":
    main()
