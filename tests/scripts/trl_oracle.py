"""TRL's DPOTrainer (the pinned test dependency) on given folders and rows: what --objective dpo must reproduce.

    trl_oracle.py SPEC.json OUT.json

SPEC: {"policy", "reference", "block_size", "beta",
       "tokenize": [{"name", "tokenizer", "train"}],                   TRL's prompt/chosen/rejected ids of each file
       "runs": [{"name", "train", "validation", "loss_type"}],          eval at step 0, and step 1's loss and grad norm
       "loss_types": {"train", "validation", "types": [[type, label_smoothing], ...]},   eval loss and metrics of each
       "simpo": {"chosen", "rejected", "beta", "gamma", "label_smoothing"}}   CPOTrainer.cpo_loss of average log-probs
One process, CPU, fp32, no dropout (TRL's default), the eval set in one batch and the train set in one step."""

import json
import os
import sys
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")
warnings.filterwarnings("ignore")

from datasets import load_dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402


def config(
    spec: dict, out: str, loss_type: str, label_smoothing: float = 0.0, block: str = "block_size", precompute=False
) -> DPOConfig:
    return DPOConfig(
        output_dir=out,
        per_device_train_batch_size=spec["global_batch_size"],
        per_device_eval_batch_size=256,
        max_length=spec[block],
        beta=spec["beta"],
        loss_type=[loss_type],
        label_smoothing=label_smoothing,
        bf16=False,
        use_cpu=True,
        report_to="none",
        max_steps=1,
        logging_steps=1,
        gradient_checkpointing=False,
        precompute_ref_log_probs=precompute,
        save_strategy="no",
        learning_rate=1e-3,
        seed=42,
    )


def load(path: str):
    return load_dataset("json", data_files=path, split="train")


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.found: dict = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.found = {"loss": logs["loss"], "grad_norm": logs["grad_norm"]}


def trainer(spec: dict, tok, train: str, validation: str, loss_type: str, callbacks=(), precompute=False) -> DPOTrainer:
    ref = AutoModelForCausalLM.from_pretrained(spec["reference"])
    return DPOTrainer(
        model=spec["policy"],
        ref_model=ref,
        args=config(spec, spec["scratch"], loss_type, precompute=precompute),
        train_dataset=load(train),
        eval_dataset=load(validation),
        processing_class=tok,
        callbacks=list(callbacks),
    )


def simpo(spec: dict) -> dict:
    """SimPO's per-pair loss and rewards: TRL's CPOTrainer.cpo_loss on length-normalised log-probs."""
    from types import SimpleNamespace

    import torch
    from trl.experimental.cpo import CPOTrainer

    trainer = SimpleNamespace(
        alpha=0.0,
        beta=spec["beta"],
        simpo_gamma=spec["gamma"],
        label_smoothing=spec["label_smoothing"],
        loss_type="simpo",
        accelerator=SimpleNamespace(device="cpu"),
    )
    losses, chosen, rejected = CPOTrainer.cpo_loss(
        trainer, torch.tensor(spec["chosen"]), torch.tensor(spec["rejected"])
    )
    return {"losses": losses.tolist(), "rewards/chosen": chosen.tolist(), "rewards/rejected": rejected.tolist()}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    out: dict = {"tokenize": {}, "runs": {}, "loss_types": {}}
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    for item in spec["tokenize"]:  # TRL's own preparation of the rows, no model involved
        t = AutoTokenizer.from_pretrained(item["tokenizer"])
        holder = type("Holder", (), {"_tokenizer": t})()
        ds = DPOTrainer._prepare_dataset(
            holder, load(item["train"]), t, config(spec, spec["scratch"], "sigmoid", block="tokenize_block_size"), "x"
        )
        out["tokenize"][item["name"]] = [[r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]] for r in ds]
    for run in spec["runs"]:
        logs = Logs()
        t = trainer(spec, tok, run["train"], run["validation"], run["loss_type"], [logs])
        found = t.evaluate()
        t.train()
        out["runs"][run["name"]] = {"eval": found, "step1": logs.found}
    lt = spec["loss_types"]
    t = trainer(spec, tok, lt["train"], lt["validation"], "sigmoid", precompute=True)  # the reference's forward once
    for kind, smoothing in lt["types"]:  # one trainer, its loss switched: TRL reads these attributes per batch
        t.loss_types, t.loss_weights, t.label_smoothing = [kind], [1.0], smoothing
        out["loss_types"][kind] = t.evaluate()
    out["simpo"] = simpo(spec["simpo"])
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
