"""Fine-tuning data through both engines (real gloo ranks): chat and prompt-completion data, where ranks and
micro-batches hold very different numbers of target tokens, give the same losses on 1, 2 and 3 ranks (FSDP2
engine, 1e-5) and on the HF engine (1e-4); so do a MoE model with its router loss (Qwen2-MoE shapes), LoRA over
it and LoRA over a dense model, on chat data, at micro-batches of 1, 2 and 4; completion-only loss learns a fixed
completion after random prompts, which training on every token cannot."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import TINY, assert_close, fsdp_runs, hf_runs, losses
from test_lora import build_base

from anygpu.config.args import parse_args
from anygpu.data.prepare import prepare
from anygpu.runtime.distributed import DistInfo
from anygpu.train.metrics import read_metrics

pytestmark = pytest.mark.slow

WORDS = "the sky is blue and green red cat dog runs fast slow why how".split()
COMMON = [*TINY, "--vocab_size", "400", "--block_size", "128", "--export_final", "false", "--max_eval_samples", "8"]


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """Conversations of 1 to 3 turns, from a few words to ~40 per message: packed rows hold 1 to many samples."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with path.open("w") as f:
        for _ in range(160):
            long = rng.random() < 0.3
            msgs = []
            for _ in range(rng.randint(1, 3)):
                msgs += [
                    {"role": "user", "content": sentence(rng, 1, 30 if long else 6)},
                    {"role": "assistant", "content": sentence(rng, 1, 40 if long else 4)},
                ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


@pytest.fixture(scope="module")
def long_chat_file(tmp_path_factory):
    """One-turn conversations of 10 to 70 words: a 128-token row holds one or two, so rows differ in length and
    a micro-batch's padding depends on the split (where a router loss that counted padding would drift)."""
    rng = random.Random(2)
    path = tmp_path_factory.mktemp("long-chat") / "chat.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": sentence(rng, 5, 30)},
                        {"role": "assistant", "content": sentence(rng, 5, 40)},
                    ]
                }
            )
            + "\n"
            for _ in range(120)
        )
    )
    return path


@pytest.fixture(scope="module")
def pc_file(tmp_path_factory):
    """Random prompts (1 to 30 words) that end with '=>', one fixed completion."""
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("completion") / "pc.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": sentence(rng, 1, 30) + " =>", "completion": " the cat runs fast"}) + "\n"
            for _ in range(300)
        )
    )
    return path


def build_moe_base(folder, dense) -> None:
    """A Qwen2-MoE folder (4 experts, top 2, a shared expert, router loss 0.1) with the dense base's tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(dense)
    config = Qwen2MoeConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    model.save_pretrained(folder)
    # in the in-memory layout (experts fused per layer): the FSDP2 engine loads tensors by name, without transformers'
    # conversion from the per-expert layout save_pretrained writes (and Hub checkpoints have)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tok.save_pretrained(folder)


# Over the pretrained folders: chat data, a global batch of 12 (splits over 1, 2, 3 ranks and micro-batches of 1, 2, 4)
PRETRAINED = [
    *[a for a in COMMON if a not in ("--config_name", "tiny", "--vocab_size", "400")],
    "--global_batch_size",
    "12",
    "--max_steps",
    "2",
]
LORA = ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1", "--learning_rate", "1e-2"]


@pytest.fixture(scope="module")
def sft_runs(chat_file, long_chat_file, pc_file, tmp_path_factory):
    """Every run of this module: one launch per world size (1, 2, 3 ranks) of the FSDP2 engine, one of the
    HF engine (2 processes). Chat: 6 conversations-rows per step, 5 steps on 1, 2, 3 ranks and the HF engine on 2 processes.
    Prompt-completion: the loss on the completion only (the default) and on every token, 30 steps; 5 steps
    of the first on 2 ranks; and 4 steps of a global batch of 6 on 1 and 3 ranks and on the HF engine."""
    out = tmp_path_factory.mktemp("chat-runs")
    root = pc_file.parent
    chat = [*COMMON, "--train_file", str(chat_file), "--global_batch_size", "6", "--max_steps", "5"]
    base = [*COMMON, "--train_file", str(pc_file), "--learning_rate", "1e-2"]
    pc = [*base, "--global_batch_size", "8", "--max_steps", "30", "--per_device_train_batch_size", "2"]
    # a global batch of 6 splits over 1, 3 ranks and 2 HF-engine processes: 4 steps each
    six = [*base, "--global_batch_size", "6", "--max_steps", "4", "--per_device_train_batch_size", "1"]
    # MoE with router loss, LoRA over it (default targets) and LoRA over a dense model: runs named <kind><W>m<m>
    dense, moe = tmp_path_factory.mktemp("dense-base"), tmp_path_factory.mktemp("moe-base")
    build_base(dense)
    build_moe_base(moe, dense)
    pre = [*PRETRAINED, "--train_file", str(long_chat_file)]
    kinds = {
        "moe": [*pre, "--model_name_or_path", str(moe)],
        "lmoe": [*pre, "--model_name_or_path", str(moe), *LORA],
        "ldense": [*pre, "--model_name_or_path", str(dense), *LORA],
    }

    def runs(*names: str) -> list[list[str]]:  # "<kind>_<W>m<micro-batch>"
        return [
            [*kinds[n.split("_")[0]], "--per_device_train_batch_size", n[-1], "--output_dir", str(out / n)]
            for n in names
        ]

    fsdp_runs(
        1,
        [
            [*chat, "--per_device_train_batch_size", "3", "--output_dir", str(out / "f1")],
            [*pc, "--output_dir", str(root / "only")],
            [*pc, "--completion_only_loss", "false", "--output_dir", str(root / "all")],
            [*six, "--output_dir", str(root / "six1")],
            *runs("moe_1m4", "moe_1m1", "lmoe_1m4", "ldense_1m2"),
        ],
    )
    fsdp_runs(
        2,
        [
            [*chat, "--per_device_train_batch_size", "1", "--output_dir", str(out / "f2")],
            [*pc, "--stop_at_step", "5", "--output_dir", str(root / "two")],
            *runs("moe_2m2", "lmoe_2m1", "ldense_2m1"),
        ],
    )
    fsdp_runs(
        3,
        [
            [*chat, "--per_device_train_batch_size", "1", "--output_dir", str(out / "f3")],
            [*six, "--output_dir", str(root / "six3")],
            *runs("moe_3m4", "lmoe_3m1", "ldense_3m4"),
        ],
    )
    # m = 3: the micro-batches of the 1-rank run (padding_fraction is a property of the split)
    hf_runs(
        2,
        [
            [*chat, "--per_device_train_batch_size", "3", "--output_dir", str(out / "hf2")],
            [*six, "--output_dir", str(root / "sixhf")],
            *runs("moe_hf2m2", "lmoe_hf2m1"),
        ],
    )
    return chat, out, root


@pytest.fixture(scope="module")
def chat_runs(sft_runs):
    args, out, _ = sft_runs
    return {k: losses(out / k) for k in ("f1", "f2", "f3", "hf2")}, args, out


@pytest.fixture(scope="module")
def completion_runs(sft_runs):
    root = sft_runs[2]
    return {k: losses(root / k) for k in ("only", "all", "two", "six1", "six3", "sixhf")}


def test_chat_ranks_hold_very_different_target_counts(chat_runs, tmp_path):
    """The premise of the parity tests below: the global batches split into very uneven shares."""
    _, args, out = chat_runs
    m, d, t = parse_args([*args, "--output_dir", str(tmp_path)])
    prep = prepare(m, d, t, DistInfo(0, 0, 1, torch.device("cpu")))
    assert "format messages" in prep.data_lines[0] and "packed rows" in prep.data_lines[0]
    ratios = []
    for step in range(5):
        idx = prep.order.global_batch(step)
        counts = [
            int((prep.collator.read(prep.datasets["train"], idx[2 * r : 2 * r + 2])["labels"][:, 1:] != -100).sum())
            for r in range(3)
        ]
        ratios.append(max(counts) / min(counts))
    assert max(ratios) > 1.5, ratios


def test_chat_loss_is_the_same_on_1_2_and_3_ranks(chat_runs):
    runs, _, _ = chat_runs
    assert sorted(runs["f1"]) == [1, 2, 3, 4, 5]
    assert_close(runs["f1"], runs["f2"], rel=1e-5)
    assert_close(runs["f1"], runs["f3"], rel=1e-5)


def test_chat_loss_is_the_same_on_the_hf_engine(chat_runs):
    runs, _, out = chat_runs
    assert_close(runs["f1"], runs["hf2"], rel=1e-4)
    # the export carries the default chat template the run gave the tokenizer
    assert (
        "<|im_start|>"
        in json.loads((out / "f1" / "tokenizer" / "tokenizer_config.json").read_text()).get("chat_template", "")
        or (out / "f1" / "tokenizer" / "chat_template.jinja").exists()
    )


def test_chat_metrics_count_real_tokens_and_log_the_padding(chat_runs):
    """Both engines log padding_fraction on padded data, the same for the same micro-batches (1 rank × 3 and
    2 HF processes × 3), none with one row per micro-batch (3 ranks × 1); tokens/s counts the real tokens."""
    _, _, out = chat_runs
    recs = {k: [r for r in read_metrics(out / k / "metrics.jsonl") if "loss" in r] for k in ("f1", "f3", "hf2")}
    assert [set(r) for r in recs["f1"]] == [set(r) for r in recs["hf2"]]
    f1 = [r["padding_fraction"] for r in recs["f1"]]
    assert all(0 < p < 0.5 for p in f1), f1
    assert f1 == pytest.approx([r["padding_fraction"] for r in recs["hf2"]], rel=1e-12)
    assert all(r["padding_fraction"] == 0 for r in recs["f3"])


def test_completion_only_loss_learns_the_fixed_completion(completion_runs):
    only, every = completion_runs["only"], completion_runs["all"]
    assert only[30] < 0.1, only  # 0.017 when written (5.8 at step 1)
    assert every[30] > 1.0, every  # 2.26 when written: the random prompt tokens cannot be predicted


def test_prompt_completion_loss_is_the_same_on_1_and_2_ranks(completion_runs):
    assert_close(completion_runs["only"], completion_runs["two"], rel=1e-5, steps=range(1, 6))


def test_prompt_completion_loss_is_the_same_on_3_ranks_and_the_hf_engine(completion_runs):
    assert sorted(completion_runs["six1"]) == [1, 2, 3, 4]
    assert_close(completion_runs["six1"], completion_runs["six3"], rel=1e-5)
    assert_close(completion_runs["six1"], completion_runs["sixhf"], rel=1e-4)


@pytest.fixture(scope="module")
def pretrained_runs(sft_runs):
    out = sft_runs[1]
    return {p.name: losses(p) for p in out.iterdir() if "_" in p.name}


@pytest.mark.parametrize("kind", ["moe", "lmoe", "ldense"])
def test_moe_and_lora_losses_are_the_same_on_1_2_3_ranks_and_any_micro_batch(pretrained_runs, kind):
    """Chat rows of unequal lengths: MoE with its router loss, LoRA over MoE, LoRA over a dense model (1e-5)."""
    runs = {k.split("_")[1]: v for k, v in pretrained_runs.items() if k.split("_")[0] == kind}
    ref = min(r for r in runs if r.startswith("1"))
    assert sorted(runs[ref]) == [1, 2] and len([r for r in runs if not r.startswith("hf")]) >= 3, runs
    for name, got in runs.items():
        if not name.startswith("hf"):
            assert_close(runs[ref], got, rel=1e-5)


@pytest.mark.parametrize("kind", ["moe", "lmoe"])
def test_moe_and_lora_losses_are_the_same_on_the_hf_engine(pretrained_runs, kind):
    """The HF engine on 2 processes: its MoE loss is scaled as any loss (× processes), its router loss the same."""
    runs = {k.split("_")[1]: v for k, v in pretrained_runs.items() if k.split("_")[0] == kind}
    ref = min(r for r in runs if r.startswith("1"))
    assert_close(runs[ref], runs[[r for r in runs if r.startswith("hf")][0]], rel=1e-4)
