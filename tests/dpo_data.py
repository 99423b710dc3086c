"""What the --objective dpo tests share: a tiny pretrained policy, a reference that differs from it, and preference
rows in TRL's formats (explicit and implicit prompts, strings and conversations), written as JSON lines."""

from __future__ import annotations

import json
import random
from pathlib import Path

from test_lora import build_base

# Chat templates of other shapes than the base folder's: ChatML with a generation prompt (Qwen), Llama 3's with a BOS
# and headers, and one whose generation prompt renders what the whole conversation does not (an empty thinking block,
# as Qwen 3 and Gemma templates do), so the completion starts where the token lists first differ.
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
        "m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "thinking": (
        "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<assistant><think></think>' }}{% endif %}"
    ),
}
WORDS = "the sky is blue green red cat dog runs fast slow why how def return import class print self".split()


def build_models(root: Path) -> tuple[Path, Path]:
    """(policy, reference): the tiny Llama folder of tests/test_lora.py and a copy with every weight moved a little."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, ref = root / "base", root / "ref"
    build_base(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(ref)
    AutoTokenizer.from_pretrained(base).save_pretrained(ref)
    return base, ref


def rows(kind: str, n: int, seed: int) -> list[dict]:
    """`n` pairs of one format: plain / conv (explicit prompt), plain_implicit / conv_implicit (chosen and rejected
    share the prompt)."""
    rng = random.Random(seed)
    text = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    out = []
    for _ in range(n):
        prompt, chosen, rejected = text(rng.randint(3, 12)), text(rng.randint(2, 10)), text(rng.randint(2, 10))
        rejected = rejected + " no" if rejected == chosen else rejected
        user, system = {"role": "user", "content": prompt}, {"role": "system", "content": text(3)}
        reply = lambda content: {"role": "assistant", "content": content}  # noqa: E731
        out.append(
            {
                "plain": {"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected},
                "plain_implicit": {"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"},
                "conv": {"prompt": [system, user], "chosen": [reply(chosen)], "rejected": [reply(rejected)]},
                "conv_implicit": {"chosen": [user, reply(chosen)], "rejected": [user, reply(rejected)]},
            }[kind]
        )
    return out


def write(path: Path, data: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def write_kinds(root: Path, train: int, validation: int) -> dict[str, tuple[Path, Path]]:
    """Every format as (train, validation) files in `root`."""
    kinds = ("plain", "conv", "plain_implicit", "conv_implicit")
    return {
        k: (write(root / f"{k}_train.jsonl", rows(k, train, 1)), write(root / f"{k}_val.jsonl", rows(k, validation, 2)))
        for k in kinds
    }
