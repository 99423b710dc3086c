"""The conformance matrix: every capability on model families of unlike shapes, each on 1 and 2 ranks and two
micro-batch sizes, checked against the invariance it promises (docs/invariance.md#the-conformance-matrix).

A family is a Hub folder written by save_pretrained (tests/hub_sources.py's tokenizer: 300 tokens, under each
model's vocabulary, itself no power of two). Each test file of the matrix (tests/test_conformance_*.py) trains one
family: every capability's runs in one 1-rank and one 2-rank launch (tests/scripts/fsdp_runs.py), so a family costs
two start-ups. A capability's runs are its layouts (ranks × micro-batch); its curve in each must equal its first
layout's within its bound. A run that crashes fails the family's launch, and so every test of its file.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from conftest import fsdp_runs, losses, records

# name → (config, storage dtype): hidden sizes not multiples of 128, odd and even layer counts, GQA, MHA and MQA,
# tied and untied embeddings, fp32 and bf16 folders; MLP (or attention) weights of whole NF4 blocks (64 × 256
# elements) where QLoRA is run, every dimension a multiple of 16 (FP8's conversion).
FAMILIES = {
    "llama": (
        dict(model_type="llama", vocab_size=331, hidden_size=96, intermediate_size=512, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False),
        "float32",
    ),
    "qwen2": (
        dict(model_type="qwen2", vocab_size=307, hidden_size=80, intermediate_size=1024, num_hidden_layers=1,
             num_attention_heads=5, num_key_value_heads=5, tie_word_embeddings=True),
        "bfloat16",
    ),
    "qwen3_moe": (
        dict(model_type="qwen3_moe", vocab_size=350, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=16, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, tie_word_embeddings=False),
        "float32",
    ),
}  # fmt: skip
NAMED = tuple(FAMILIES)
DRAWN_TYPES = (
    "mistral",
    "gemma",
    "phi3",
    "olmo2",
    "granite",
    "stablelm",
    "qwen3",
    "starcoder2",
    "gemma2",
    "cohere2",
    "olmo3",
)


def draw_family(seed: int) -> tuple[dict, str]:
    """A family the matrix has not named: a config drawn from `seed` (type, heads, head size, KV heads, layers, MLP,
    vocabulary, tying, storage dtype), every dimension a multiple of 16 (FP8's conversion)."""
    rng = random.Random(seed)
    heads, head_dim = rng.choice((2, 3, 4, 5, 6)), rng.choice((16, 32))
    config = dict(
        model_type=rng.choice(DRAWN_TYPES),
        vocab_size=rng.randint(301, 509),
        hidden_size=heads * head_dim,
        head_dim=head_dim,
        intermediate_size=16 * rng.randint(4, 16),
        num_hidden_layers=rng.randint(1, 3),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([k for k in range(1, heads + 1) if heads % k == 0]),
        tie_word_embeddings=rng.random() < 0.5,
    )
    return config, rng.choice(("float32", "bfloat16"))


G, STEPS = 4, 4
GRPO_REWARDS = Path(__file__).parent / "scripts" / "grpo_rewards.py"
COMMON = [
    *("--block_size", "32", "--global_batch_size", str(G), "--max_steps", str(STEPS), "--logging_steps", "1"),
    *("--eval_steps", "0", "--eval_on_start", "false", "--disable_tqdm", "true", "--report_to", "none"),
    *(
        "--warmup_steps",
        "0",
        "--lr_scheduler_type",
        "constant",
        "--learning_rate",
        "3e-3",
        "--export_final",
        "false",
        "--save_steps",
        "0",
    ),
    *("--max_eval_samples", "8", "--max_corpus_mb", "0.3"),
]


@dataclass(frozen=True)
class Layout:
    """Where a run's global batch goes: ranks, micro-batch per rank, and mesh arguments (HSDP, CP, EP)."""

    ranks: int
    micro_batch: int
    mesh: tuple[str, ...] = ()
    banner: str = ""  # what the run's banner says of that mesh

    @property
    def name(self) -> str:
        mesh = "".join(self.mesh[i].strip("-") + self.mesh[i + 1] for i in range(0, len(self.mesh), 2))
        return f"{self.ranks}r-m{self.micro_batch}{'-' + mesh if mesh else ''}"


ONE_BIG, ONE_SMALL, TWO = Layout(1, 4), Layout(1, 1), Layout(2, 1)  # no, 4 and 2 accumulation steps
HSDP = Layout(2, 2, ("--dp_replicate", "2"), "HSDP, 2 whole replicas")
CP = Layout(2, 2, ("--cp", "2"), "each sequence split into 2 parts")
EP = Layout(2, 2, ("--ep", "2"), "split over 2 ranks (--ep 2)")


@dataclass(frozen=True)
class Capability:
    name: str
    args: tuple[str, ...]
    layouts: tuple[Layout, ...] = (ONE_BIG, ONE_SMALL, TWO)
    rel: float = 1e-5  # the bound docs/invariance.md states for it
    data: str = "text"  # text (the embedded corpus), sft, dpo, mixture
    banner: str = ""  # what the run's banner says when the capability is on (so a test knows it ran)
    own_effect_of: str = ""  # FP8: the layouts agree to the capability's own effect on this capability's curve
    curve: str = "loss"  # the metrics.jsonl value compared (grpo: grad_norm, its loss is ~0 at one step a round)


def capabilities(family: str) -> list[Capability]:
    """What the matrix runs on `family` (the MoE family adds expert parallelism; a drawn family a subset)."""
    dpo_loss = {"qwen2": "ipo", "qwen3_moe": "hinge"}.get(family, "sigmoid")  # each loss type on one family
    bf16_moments = ("--optim", "adamw_anyprecision", "--optim_args", "momentum_dtype=bfloat16,variance_dtype=bfloat16")
    lora = ("--use_peft", "true", "--lora_r", "4")
    dpo = ("--objective", "dpo", "--loss_type", dpo_loss, "--block_size", "64")
    grpo = ("--objective", "grpo", "--reward_funcs", f"{GRPO_REWARDS}:vowels,{GRPO_REWARDS}:brevity",
            "--num_generations", "2", "--max_prompt_length", "24", "--max_completion_length", "6",
            "--loss_type", {"qwen2": "dr_grpo", "qwen3_moe": "grpo"}.get(family, "dapo"))  # fmt: skip
    # the KL to a reference (a frozen copy; LoRA's base) and a round serving two steps (old log-probs, the clip)
    grpo_kl = ("--beta", "0.04", "--num_iterations", "2", "--epsilon", "0.002")
    caps = [
        Capability("pretraining", (), (ONE_BIG, ONE_SMALL, TWO, HSDP, CP), banner="embedded default"),
        Capability("lora", lora, banner="LoRA: "),
        Capability("qlora", (*lora, "--load_in_4bit", "true"), (ONE_BIG, TWO), banner="QLoRA: "),
        Capability("fp8_rowwise", ("--fp8", "rowwise"), banner="FP8 rowwise", own_effect_of="pretraining"),
        Capability("fp8_tensorwise", ("--fp8", "tensorwise"), banner="FP8 tensorwise", own_effect_of="pretraining"),
        Capability("dpo", dpo, data="dpo", banner="objective: dpo"),
        Capability("cpu_offload", ("--cpu_offload", "true"), (ONE_BIG, TWO), banner="their shards in host memory"),
        Capability("adamw_8bit", ("--optim", "adamw_torch_8bit"), (ONE_BIG, TWO), banner="8-bit moments"),
        Capability("adamw_bf16", bf16_moments, (ONE_BIG, TWO), banner="bf16 moments"),
        Capability("mixture", (), data="mixture", banner="digits: weight 0.3"),
        Capability(
            "packed_sft", (), (ONE_BIG, ONE_SMALL, TWO, CP), data="sft", banner="packed rows (attention confined"
        ),
        Capability("grpo", grpo, data="grpo", banner="objective: grpo", curve="grad_norm"),
        Capability("grpo_kl", (*grpo, *grpo_kl), (ONE_BIG, TWO), data="grpo", banner="a frozen copy",
                   curve="grad_norm"),
        Capability("grpo_lora", (*grpo, *grpo_kl, *lora), (ONE_BIG, TWO), data="grpo",
                   banner="the LoRA adapter disabled", curve="grad_norm"),
        # one step a round: the reference's forward (the adapter off) right before the step's backward
        Capability("grpo_qlora", (*grpo, "--beta", "0.04", *lora, "--load_in_4bit", "true"), (ONE_BIG, TWO),
                   data="grpo", banner="QLoRA: ", curve="grad_norm"),
    ]  # fmt: skip
    if family not in NAMED:
        keep = ("pretraining", "lora", "fp8_rowwise", "dpo", "packed_sft", "grpo")
        return [cap for cap in caps if cap.name in keep]
    if FAMILIES[family][0]["model_type"].endswith("_moe"):
        caps.append(Capability("expert_parallel", (), (ONE_BIG, EP), banner="experts compute"))
    return caps


def write_data(root: Path) -> dict[str, list[str]]:
    """Each data kind's arguments: SFT prompt-completion rows (packed), DPO pairs, a two-source mixture."""
    from dpo_data import WORDS, rows, write

    rng = random.Random(0)
    text = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    sft = write(root / "sft.jsonl", [{"prompt": text(rng.randint(3, 9)), "completion": " " + text(rng.randint(2, 9))}
                                     for _ in range(48)])  # fmt: skip
    dpo = write(root / "dpo.jsonl", rows("plain", 32, 1))
    (root / "mix").mkdir()
    mix = {"datasets": [
        {"name": "words", "path": str(write(root / "mix" / "words.jsonl", [{"text": text(40)} for _ in range(40)])),
         "weight": 0.7},
        {"name": "digits", "path": str(write(root / "mix" / "digits.jsonl",
                                             [{"text": " ".join(str(rng.randint(0, 99)) for _ in range(40))}
                                              for _ in range(40)])), "weight": 0.3},
    ]}  # fmt: skip
    (root / "mixture.json").write_text(json.dumps(mix))
    return {
        "text": [],
        "grpo": [],  # the embedded default's prompts
        "sft": ["--train_file", str(sft)],
        "dpo": ["--train_file", str(dpo)],
        "mixture": ["--dataset_mixture", str(root / "mixture.json")],
    }


def build_family(root: Path, family: str) -> Path:
    """root/<family>: the family's folder as save_pretrained writes it, with the shared test tokenizer."""
    from hub_sources import write

    return write(root / family, *FAMILIES[family])


def run_family(root: Path, family: str) -> dict[tuple[str, str], dict[int, float]]:
    """Every capability's runs on `family`: one 1-rank launch, one 2-rank launch; (capability, layout) → losses."""
    folder, data = build_family(root, family), write_data(root)
    runs: dict[int, list[tuple[Capability, Layout, list[str]]]] = {1: [], 2: []}
    for cap in capabilities(family):
        for layout in cap.layouts:
            out = root / "runs" / f"{cap.name}-{layout.name}"
            args = [*COMMON, "--model_name_or_path", str(folder), *data[cap.data], *cap.args, *layout.mesh]
            args += ["--per_device_train_batch_size", str(layout.micro_batch), "--output_dir", str(out)]
            runs[layout.ranks].append((cap, layout, args))
    curves = {}
    for ranks, group in runs.items():
        stdouts = fsdp_runs(ranks, [args for _, _, args in group], timeout=900)
        for (cap, layout, _), stdout in zip(group, stdouts):
            for said in (cap.banner, layout.banner):  # the capability and the mesh were really on
                assert said in stdout, f"{family} {cap.name} {layout.name}: no {said!r} line\n{stdout[-3000:]}"
            curves[(cap.name, layout.name)] = curve(root / "runs" / f"{cap.name}-{layout.name}", cap.curve)
    return curves


def curve(output_dir: Path, name: str) -> dict[int, float]:
    """step → the run's `name` value (the loss, or a grad norm)."""
    return losses(output_dir) if name == "loss" else {r["step"]: r[name] for r in records(output_dir) if name in r}


def check(curves: dict[tuple[str, str], dict[int, float]], family: str, cap: Capability) -> None:
    """The capability's curve in every layout equals its first layout's within its bound (and has every step): a
    relative bound, or for FP8 its own effect (the largest distance of its first layout's curve from the same layout
    without it: FP8's rounding magnifies another sum order's float rounding, docs/fp8.md)."""
    first = curves[(cap.name, cap.layouts[0].name)]
    family = family if family in NAMED else f"{family} {FAMILIES[family]}"  # a drawn family: its seed and config
    assert sorted(first) == list(range(1, STEPS + 1)), (family, cap.name, first)
    if cap.own_effect_of:
        plain = curves[(cap.own_effect_of, cap.layouts[0].name)]
        effect = max(abs(first[s] - plain[s]) for s in first)
        assert effect > 0, (family, cap.name, "changed nothing", first)
    for layout in cap.layouts[1:]:
        other = curves[(cap.name, layout.name)]
        assert sorted(other) == sorted(first), (family, cap.name, layout.name, other)
        for step in first:
            bound = effect if cap.own_effect_of else cap.rel * abs(first[step])
            assert abs(other[step] - first[step]) <= bound, (
                f"{family} {cap.name}: {layout.name} differs from {cap.layouts[0].name} at step {step} by "
                f"{abs(other[step] - first[step]):.2e} (bound {bound:.2e}): {other} vs {first}"
            )


def family_tests(family: str) -> tuple[Callable, Callable]:
    """A test file's fixture and test for `family` (one file a family, so pytest-xdist spreads the families)."""

    @pytest.fixture(scope="module")
    def curves(tmp_path_factory) -> dict[tuple[str, str], dict[int, float]]:
        return run_family(tmp_path_factory.mktemp(family), family)

    @pytest.mark.parametrize("cap", capabilities(family), ids=lambda cap: cap.name)
    def test_capability_keeps_its_curve(curves, cap) -> None:
        check(curves, family, cap)

    return curves, test_capability_keeps_its_curve
