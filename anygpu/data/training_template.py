"""The chat template the assistant-only loss renders with where the tokenizer's own cannot find the assistant's
tokens.

anygpu finds them by the template's `{% generation %}` markers, or else by rendering the conversation turn by turn
(each assistant turn: the text it adds). Templates that render earlier turns differently once later ones follow
(Qwen3 drops the reasoning of earlier answers; Phi-3, DeepSeek-V3, gpt-oss and Nemotron also differ) defeat the
second way. TRL ships training versions of those (prefix-preserving, with markers) and its SFTTrainer trains with
them; anygpu does the same, through `trl.chat_template_utils.get_training_chat_template`. The tokenizer saved with
the model keeps its own template.
"""

from __future__ import annotations

import logging

from anygpu.data import chat_template
from anygpu.errors import UsageError

logger = logging.getLogger(__name__)

# two exchanges after a system turn: enough for a template to re-render the first answer once the second follows
PROBE = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And the sea?"},
    {"role": "assistant", "content": "Blue too."},
]
_CHOSEN: dict[str, str | None] = {}  # the tokenizer's template → the one the loss renders with (None: its own)


def for_assistant_loss(tokenizer) -> str | None:
    """TRL's training version of the tokenizer's template where the template has no markers and does not render
    turn by turn; None where its own serves (or TRL knows no version of it: then the turn-by-turn error says why)."""
    template = tokenizer.chat_template
    if not isinstance(template, str) or chat_template.has_generation_markers(tokenizer):
        return None
    if template not in _CHOSEN:
        _CHOSEN[template] = None if renders_turn_by_turn(tokenizer) else trl_version(tokenizer)
        if _CHOSEN[template] is not None:
            logger.warning(
                "the chat template renders earlier turns differently once later ones follow and marks no assistant "
                "tokens: the assistant-only loss renders with TRL's training version of it (as TRL's SFTTrainer "
                "does); the saved tokenizer keeps its own"
            )
    return _CHOSEN[template]


def renders_turn_by_turn(tokenizer) -> bool:
    """Whether each assistant turn of the probe is the text it adds (without the system turn where the template
    takes none)."""
    for probe in (PROBE, PROBE[1:]):
        try:
            chat_template.assistant_char_spans(tokenizer, probe, chat_template.render(tokenizer, probe))
            return True
        except UsageError:
            continue
    return False


def trl_version(tokenizer) -> str | None:
    """TRL's training template for this tokenizer's, None where TRL has none."""
    from trl.chat_template_utils import get_training_chat_template

    try:
        return get_training_chat_template(tokenizer)
    except ValueError:  # TRL's word for a template it has no training version of
        return None
