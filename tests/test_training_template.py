"""The assistant-only loss on templates that render earlier turns differently once later ones follow (Qwen3 drops
the reasoning of earlier answers; Phi-3, DeepSeek-V3, gpt-oss): rendered with TRL's training version of the template,
the tokens and the mask TRL's SFTTrainer trains on; a template that renders turn by turn (Llama 3) keeps its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import trl
from trl.chat_template_utils import get_training_chat_template

from anygpu.data import chat_template, training_template
from anygpu.data import tokenizer as tok_lib

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
WORDS = "the sky is blue green red cat dog runs fast slow why how what colour answer sea too".split()
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what colour is the sky"},
    {"role": "assistant", "content": "blue"},
    {"role": "user", "content": "and the sea"},
    {"role": "assistant", "content": "blue too"},
]


@pytest.fixture(scope="module")
def tok():
    return tok_lib.train_bpe(iter(WORDS * 20), 400)


@pytest.mark.parametrize("name", ["qwen3", "phi3", "deepseekv3", "gptoss"])
def test_a_template_that_re_renders_earlier_turns_trains_as_trl_does(tok, name):
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    assert not training_template.renders_turn_by_turn(tok)  # what refused the assistant-only loss before
    template = training_template.for_assistant_loss(tok)
    ids, mask = chat_template.encode_chat(tok, CHAT, assistant_only=True, template=template)
    trl_side = tok.apply_chat_template(
        CHAT, chat_template=get_training_chat_template(tok), tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    assert ids == list(trl_side["input_ids"]) and mask == [bool(x) for x in trl_side["assistant_masks"]]
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    untrained = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert trained.index("blue") < trained.index("blue too")  # both answers, in order
    assert "what colour is the sky" in untrained and "and the sea" in untrained and "sky" not in trained
    assert tok.chat_template == (TEMPLATES / f"{name}.jinja").read_text()  # the saved tokenizer keeps its own


def test_a_template_that_renders_turn_by_turn_keeps_its_own(tok):
    tok.chat_template = (TEMPLATES / "llama3.jinja").read_text()
    assert training_template.for_assistant_loss(tok) is None
    ids, mask = chat_template.encode_chat(tok, CHAT, assistant_only=True, template=None)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "blue<|eot_id|>blue too<|eot_id|>"
