"""Chat rendering: the tokenizer's own template, or a documented default, and which tokens are the assistant's.

A tokenizer without a chat template (the BPE trained on the spot, base models) gets DEFAULT_CHAT_TEMPLATE:
ChatML's layout, with each turn ended by the tokenizer's EOS token (one token in every vocabulary, so
generation stops there without new special tokens or resized embeddings):

    <|im_start|>user
    What colour is the sky?<EOS>
    <|im_start|>assistant
    Blue.<EOS>

The assistant's content and its EOS are marked with `{% generation %}`, so `apply_chat_template(...,
return_assistant_tokens_mask=True)` finds them. Templates without those markers (most shipped ones) are
handled by rendering each prefix of the conversation and taking the characters each assistant turn adds.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from anygpu.errors import UsageError

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer) -> bool:
    """Give `tokenizer` the default template when it has none (saved with it, so the export carries it).
    Returns whether the default was set."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    logger.info(
        "the tokenizer has no chat template: using anygpu's default (ChatML layout, turns end with %s); "
        "it is saved with the model",
        tokenizer.eos_token,
    )
    return True


def clean_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template expects them: datasets fills keys missing from some rows with None."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def template_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """What a row gives its template besides the messages, as TRL passes them: its `tools` (a list, or JSON text)
    and its `chat_template_kwargs` (keys that datasets filled with None for rows without them left out)."""
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    extra = {k: v for k, v in (row.get("chat_template_kwargs") or {}).items() if v is not None}
    return {**({"tools": tools} if tools else {}), **extra}


def apply(tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template`, a template's own refusal (its `raise_exception`: a role it does not take,
    turns out of order) said in one line with the conversation's turns, before any training."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except TemplateError as e:
        turns = ", ".join(str(m.get("role")) for m in messages)
        raise UsageError(
            f"the tokenizer's chat template refused a conversation of turns ({turns}): {e}. Give conversations its "
            "template takes (where it takes no system turn, fold that text into the first user turn), or a tokenizer "
            "whose template takes them (--tokenizer_name)."
        ) from e


def chat_ids(tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The conversation's token ids, as `apply_chat_template` tokenises it."""
    return list(apply(tokenizer, messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def render(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = False,
    template: str | None = None,
    **kwargs: Any,
) -> str:
    """The conversation as text, with `template` where given (else the tokenizer's own)."""
    return apply(
        tokenizer,
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=template,
        **kwargs,
    )


def has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}")


def assistant_char_spans(tokenizer, messages: list[dict[str, Any]], text: str, **kwargs: Any) -> list[tuple[int, int]]:
    """[start, end) character spans of each assistant turn in `text` (the whole rendered chat), found as the
    text the turn adds to the rendering of the conversation before it (with the generation prompt)."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, **kwargs) if i else ""
        through = render(tokenizer, messages[: i + 1], **kwargs)
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            raise UsageError(
                f"the chat template does not render conversations prefix by prefix (turn {i}), so the assistant "
                "tokens cannot be found: use a template with {% generation %} markers, or --assistant_only_loss false."
            )
        # the turn's text, less the whitespace the template puts between turns (not generated by the model)
        spans.append((len(before), len(through.rstrip())))
    return spans


def encode_chat(
    tokenizer, messages: list[dict[str, Any]], assistant_only: bool, template: str | None = None, **kwargs: Any
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered chat and, per token, whether it is trained on. `template`: one with markers to
    render with instead of the tokenizer's own (`training_template.for_assistant_loss`); `kwargs`: the row's
    (`template_kwargs`)."""
    messages = clean_messages(messages)
    text = render(tokenizer, messages, template=template, **kwargs)
    if not assistant_only:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, [True] * len(ids)
    if template is not None or has_generation_markers(tokenizer):
        out = apply(
            tokenizer,
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            chat_template=template,
            **kwargs,
        )
        return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
    spans = assistant_char_spans(tokenizer, messages, text, **kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    # a token belongs to the turn its first character is in
    return enc["input_ids"], [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
