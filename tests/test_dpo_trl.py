"""--objective dpo against TRL's DPOTrainer (trl pinned in constraints.txt), the outside oracle, on the same
policy and reference folders and rows: the same tokens for every format (explicit and implicit prompts, strings and
conversations) and chat template; the native engine's step-0 evaluation (loss, rewards, log-probs) and its first
step's loss and gradient norm for plain and conversational rows, sigmoid and ipo; and every per-pair loss type of the
library's objective. TRL runs in a process of its own (tests/scripts/trl_oracle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import fsdp_runs, python, records
from dpo_data import TEMPLATES, build_models, write_kinds

BLOCK, BETA, G = 64, 0.1, 8
TOKENIZE_BLOCK = 1024  # TRL's default max_length: no row of any template is left without a completion token
RUNS = [(kind, loss) for kind in ("plain", "conv") for loss in ("sigmoid", "ipo")]
# (TRL's loss type, its label smoothing): every per-pair type both compute, and sft (a token mean)
LOSS_TYPES = [
    ("sigmoid", 0.0),
    ("hinge", 0.0),
    ("ipo", 0.0),
    ("robust", 0.1),
    ("sigmoid_norm", 0.0),
    ("exo_pair", 1e-3),
    ("nca_pair", 0.0),
    ("bco_pair", 0.0),
    ("sppo_hard", 0.0),
    ("apo_zero", 0.0),
    ("apo_down", 0.0),
    ("discopop", 0.0),
    ("sft", 0.0),
]
# SimPO (reference-free; TRL's CPOTrainer): sequence log-probs and their scored tokens, averaged on TRL's side
SIMPO = {
    "beta": 2.0,
    "gamma": 0.5,
    "label_smoothing": 0.1,
    "pairs": [(-12.0, 4), (-30.5, 10), (-3.25, 1)],
    "rejected_pairs": [(-20.0, 5), (-18.0, 9), (-9.5, 2)],
}
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def tokenizers(root: Path, base: Path) -> dict[str, Path]:
    """Tokenizer folders: the base's own (no generation prompt), one that adds a BOS, three other chat templates and
    anygpu's default (what a tokenizer without a template gets)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from anygpu.data.chat_template import DEFAULT_CHAT_TEMPLATE

    out = {"base": base}
    for name, template in {**TEMPLATES, "default": DEFAULT_CHAT_TEMPLATE, "bos": None}.items():
        tok = AutoTokenizer.from_pretrained(base)
        if name == "bos":
            tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
            )
        else:
            tok.chat_template = template
        tok.save_pretrained(root / f"tok-{name}")
        out[name] = root / f"tok-{name}"
    return out


TOKENIZE = [
    ("base", "plain"),
    ("base", "plain_implicit"),
    ("base", "conv"),
    ("base", "conv_implicit"),
    ("bos", "plain"),
    ("bos", "plain_implicit"),
    ("chatml", "conv"),
    ("chatml", "conv_implicit"),
    ("llama3", "conv"),
    ("thinking", "conv"),
    ("default", "conv_implicit"),
]


def engine_args(base: Path, ref: Path, files, kind: str, loss: str, out: Path) -> list[str]:
    train, validation = files[kind]
    return [
        *("--model_name_or_path", str(base), "--ref_model_name_or_path", str(ref), "--objective", "dpo"),
        *("--train_file", str(train), "--validation_file", str(validation), "--loss_type", loss),
        *("--block_size", str(BLOCK), "--global_batch_size", str(G), "--beta", str(BETA), "--max_steps", "1"),
        *("--eval_on_start", "true", "--eval_steps", "0", "--logging_steps", "1", "--report_to", "none"),
        *("--disable_tqdm", "true", "--export_final", "false", "--save_strategy", "no", "--warmup_steps", "0"),
        *("--learning_rate", "1e-3", "--output_dir", str(out)),
    ]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dpo-oracle")
    base, ref = build_models(root)
    files = write_kinds(root, train=G, validation=8)  # the train set is one global batch: step 1 sees every pair
    toks = tokenizers(root, base)
    spec = {
        "policy": str(base),
        "reference": str(ref),
        "block_size": BLOCK,
        "tokenize_block_size": TOKENIZE_BLOCK,
        "beta": BETA,
        "global_batch_size": G,
        "scratch": str(root / "trl-scratch"),
        "tokenize": [{"name": f"{t}-{k}", "tokenizer": str(toks[t]), "train": str(files[k][0])} for t, k in TOKENIZE],
        "runs": [
            {"name": f"{k}-{loss}", "train": str(files[k][0]), "validation": str(files[k][1]), "loss_type": loss}
            for k, loss in RUNS
        ],
        "loss_types": {"train": str(files["conv"][0]), "validation": str(files["conv"][1]), "types": LOSS_TYPES},
        "simpo": {
            **SIMPO,
            "chosen": [c / n for c, n in SIMPO["pairs"]],
            "rejected": [r / n for r, n in SIMPO["rejected_pairs"]],
        },
    }
    (root / "spec.json").write_text(json.dumps(spec))
    python("tests/scripts/trl_oracle.py", [str(root / "spec.json"), str(root / "trl.json")], timeout=600)
    outs = {f"{k}-{loss}": root / f"ours-{k}-{loss}" for k, loss in RUNS}
    fsdp_runs(1, [engine_args(base, ref, files, k, loss, outs[f"{k}-{loss}"]) for k, loss in RUNS])
    trl = json.loads((root / "trl.json").read_text())
    return {"root": root, "base": base, "ref": ref, "files": files, "toks": toks, "trl": trl, "outs": outs}


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer,kind", TOKENIZE)
def test_the_same_tokens_as_trl(oracle, tokenizer, kind):
    """The rows' prompt, chosen and rejected ids, as TRL's DPOTrainer prepares them, whatever the format and template."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from anygpu.data import preference

    tok = AutoTokenizer.from_pretrained(oracle["toks"][tokenizer])
    ds = load_dataset("json", data_files=str(oracle["files"][kind][0]), split="train")
    ours, _ = preference.encode_split(ds, tok, TOKENIZE_BLOCK, "keep_start", None, "train")
    got = [[r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]] for r in ours]
    assert got == oracle["trl"]["tokenize"][f"{tokenizer}-{kind}"]


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    """Within `tol`, relative for large values, absolute near 0 (a reward is a difference of two sums)."""
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.mark.slow
@pytest.mark.parametrize("kind,loss", RUNS)
def test_step0_evaluation_and_first_step_match_trl(oracle, kind, loss):
    """The native engine's eval at step 0 (loss, TRL's rewards and log-probs) and its first step's loss and gradient
    norm, on the same folders and rows, within 1e-5."""
    trl = oracle["trl"]["runs"][f"{kind}-{loss}"]
    recs = records(oracle["outs"][f"{kind}-{loss}"])
    step0 = next(r for r in recs if r["step"] == 0 and "eval_loss" in r)
    step1 = next(r for r in recs if r["step"] == 1 and "loss" in r)
    for key in ("loss", *METRICS):
        assert close(step0[f"eval_{key}"], trl["eval"][f"eval_{key}"]), (key, step0, trl["eval"])
    assert close(step1["loss"], trl["step1"]["loss"]) and close(step1["grad_norm"], trl["step1"]["grad_norm"], 1e-4), (
        step1,
        trl["step1"],
    )
    assert step0["eval_rewards/margins"] != 0  # the reference differs from the policy: the comparison is not 0 = 0


@pytest.mark.slow
def test_every_loss_type_matches_trl(oracle, monkeypatch):
    """The library's objective (the lean loss in 48-token chunks, packed rows) against TRL's evaluation with each loss."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anygpu.data import preference
    from anygpu.data.pair_batches import PairCollator
    from anygpu.model import lean_loss
    from anygpu.runtime.distributed import DistInfo
    from anygpu.train import dpo, reference

    monkeypatch.setenv("ANYGPU_LEAN_LOSS_CHUNK_TOKENS", "48")
    tok = AutoTokenizer.from_pretrained(oracle["base"])
    ds = load_dataset("json", data_files=str(oracle["files"]["conv"][1]), split="train")
    pairs, _ = preference.encode_split(ds, tok, BLOCK, "keep_start", None, "validation")
    collator = PairCollator(tok.pad_token_id, BLOCK, packed=True)
    models = [AutoModelForCausalLM.from_pretrained(p) for p in (oracle["base"], oracle["ref"])]
    for m in models:
        lean_loss.install(m, True)
    info = DistInfo(0, 0, 1, torch.device("cpu"))
    pairs = reference.with_columns(
        pairs, reference.compute(pairs, collator, reference.forward_of(models[1], models[1]), info, 3)
    )
    for kind, smoothing in LOSS_TYPES:
        cfg = dpo.LossConfig((kind,), (1.0,), BETA, smoothing)
        ours = dpo.DPOObjective(cfg, None, "").evaluate(models[0], models[0], pairs, collator, 3, 0, 1, info.device)
        trl = oracle["trl"]["loss_types"][kind]
        for key in ("loss", *METRICS):
            assert close(ours[f"eval_{key}"], trl[f"eval_{key}"]), (kind, key, ours, trl)


@pytest.mark.slow
def test_simpo_is_trls_cpo_simpo(oracle):
    """The reference-free SimPO term and its logged rewards against TRL's CPOTrainer.cpo_loss (loss_type simpo)."""
    import torch

    from anygpu.train import dpo

    cfg = dpo.LossConfig(("simpo",), (1.0,), SIMPO["beta"], SIMPO["label_smoothing"], SIMPO["gamma"])
    chosen, rejected = (torch.tensor(SIMPO[k], dtype=torch.float64) for k in ("pairs", "rejected_pairs"))
    zero = torch.zeros(3, dtype=torch.float64)
    lengths = torch.cat([chosen[:, 1], rejected[:, 1]])
    p = dpo.PairLogps(chosen[:, 0], rejected[:, 0], zero, zero, lengths, lengths)
    trl = oracle["trl"]["simpo"]
    assert torch.allclose(dpo.pair_terms(cfg, p), torch.tensor(trl["losses"], dtype=torch.float64), atol=1e-6)
    rc, rr = dpo.rewards(cfg, p)
    assert torch.allclose(rc, torch.tensor(trl["rewards/chosen"], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(rr, torch.tensor(trl["rewards/rejected"], dtype=torch.float64), atol=1e-6)
