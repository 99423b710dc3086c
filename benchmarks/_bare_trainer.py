"""The reference of hf_vs_trainer.py: a bare `transformers.Trainer` on the engine's model, packed data and
batch shape (same arguments as run_hf_standalone.py), printing its steady tokens/s per logging window."""
from __future__ import annotations

import json
import statistics
import sys
import time

from _common import anygpu  # noqa: F401
from transformers import Trainer, TrainerCallback, TrainingArguments

from anygpu import distributed, modeling
from anygpu.args import parse_args
from anygpu.prepare import prepare


class Windows(TrainerCallback):
    def __init__(self, every: int, tokens_per_step: int) -> None:
        self.every, self.tokens_per_step, self.rates, self.t = every, tokens_per_step, [], None

    def on_train_begin(self, args, state, control, **kwargs):
        self.t = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step % self.every == 0 and "loss" in (logs or {}):
            now = time.perf_counter()
            self.rates.append(self.tokens_per_step * self.every / (now - self.t))
            self.t = now


def main() -> None:
    model_args, data_args, train_args = parse_args(sys.argv[1:])
    info = distributed.DistInfo(0, 0, 1, __import__("torch").device("cpu"))
    prep = prepare(model_args, data_args, train_args, info)
    model = modeling.build_full_model(prep.config, model_args, train_args.seed)
    targs = TrainingArguments(
        output_dir=train_args.output_dir, max_steps=train_args.max_steps, per_device_train_batch_size=prep.plan.per_device_train_batch_size,
        gradient_accumulation_steps=prep.plan.gradient_accumulation_steps, learning_rate=train_args.learning_rate,
        weight_decay=train_args.weight_decay, warmup_steps=train_args.warmup_steps, lr_scheduler_type=train_args.lr_scheduler_type,
        max_grad_norm=train_args.max_grad_norm, seed=train_args.seed, logging_steps=train_args.logging_steps,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False, skip_memory_metrics=True,
    )
    cb = Windows(train_args.logging_steps, prep.plan.global_batch_size * prep.block_size)
    Trainer(model=model, args=targs, train_dataset=prep.datasets["train"], data_collator=prep.collator, callbacks=[cb]).train()
    print("BARE " + json.dumps({"tokens_per_second": statistics.median(cb.rates[1:] or cb.rates), "windows": cb.rates}))


if __name__ == "__main__":
    main()
