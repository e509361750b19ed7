"""Conversation → token ids with the target's chat template, and a loss mask over assistant turns.

The mask comes from character spans: render the template for the conversation up to each assistant
turn (with the generation prompt) and through it, and mark the tokens whose text lies between. This
works for any template that renders a prefix of a conversation as a prefix of the whole.
"""

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from eaglet.shared.chatlines import BadLine


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    # A template refuses what it cannot render (an assistant turn first, roles out of order) by raising:
    # that is this line's fault, reported as such, never the end of the ingest.
    try:
        return _tokenize(tokenizer, messages)
    except (TemplateError, ValueError, TypeError) as e:
        raise BadLine(f"chat template cannot render this conversation: {type(e).__name__}: {e}") from e


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(text, str):  # tokenize=False renders text; the stubs type every mode's reply as one union
        raise TypeError(f"chat template rendered {type(text).__name__}, not text")
    return text


def _tokenize(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (through.startswith(before) and full.startswith(through)):
            raise BadLine(f"chat template does not render turn {i} as a prefix; cannot mark assistant tokens")
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask
