"""One JSONL line → one record: a conversation (ShareGPT or OpenAI messages) or pre-tokenized ids.

Every way a line can be wrong raises ``BadLine`` with the reason; the caller adds file and line number.
"""

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from .ids import UnsafeName, check_id

MAX_LINE_BYTES = 64 * 1024 * 1024
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = {"system", "user", "assistant"}


class BadLine(ValueError):
    """A line that cannot become a sample; the message says why."""


@dataclass
class Conversation:
    sample_id: str
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]


@dataclass
class Pretokenized:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]


def read_lines(f: BinaryIO, first_line: int = 1) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, line, its size) for each line from the file's position, blank lines and newlines kept; the line
    is None when it is over ``MAX_LINE_BYTES``, and skipped in chunks: a file without newlines (or a 10 GB line)
    never sits in memory whole."""
    for number in itertools.count(first_line):
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        size = len(raw)
        if size > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while chunk := f.readline(1 << 20):
                size += len(chunk)
                if chunk.endswith(b"\n"):
                    break
        yield number, raw if size <= MAX_LINE_BYTES else None, size


def oversize(size: int) -> BadLine:
    return BadLine(f"line of {size} bytes exceeds the {MAX_LINE_BYTES}-byte limit")


def parse_line(raw: bytes) -> Conversation | Pretokenized:
    if len(raw) > MAX_LINE_BYTES:
        raise oversize(len(raw))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine(f"not UTF-8 (byte {e.start})") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(f"malformed JSON: {e.msg} at column {e.colno}") from e
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    sample_id = _sample_id(obj, raw)
    if "input_ids" in obj:
        return _pretokenized(sample_id, obj)
    if "messages" in obj:
        return Conversation(sample_id, _messages(obj["messages"], "role", "content", {r: r for r in ROLES}))
    if "conversations" in obj:
        return Conversation(sample_id, _messages(obj["conversations"], "from", "value", SHAREGPT_ROLES))
    raise BadLine("no 'messages', 'conversations' or 'input_ids' field")


def _sample_id(obj: dict, raw: bytes) -> str:
    """The line's own ``id`` if it has one, else a hash of the line: stable across re-ingests."""
    given = obj.get("id")
    if given is None:
        return "s" + hashlib.sha1(raw).hexdigest()[:20]
    try:
        return check_id(str(given) if isinstance(given, int) else given, "sample id")
    except UnsafeName as e:
        raise BadLine(str(e)) from e


def _messages(turns: object, role_key: str, text_key: str, roles: dict[str, str]) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise BadLine("empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadLine(f"turn {i} is not an object")
        given = turn.get(role_key)
        role = roles.get(given) if isinstance(given, str) else None  # a list or dict here is not hashable
        if role is None:
            raise BadLine(f"turn {i}: unknown {role_key} {turn.get(role_key)!r}")
        content = turn.get(text_key)
        if not isinstance(content, str):
            raise BadLine(f"turn {i}: {text_key} is not a string")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadLine("no assistant turn: nothing to learn from")
    return messages


def _pretokenized(sample_id: str, obj: dict) -> Pretokenized:
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise BadLine("input_ids must be a non-empty list of non-negative integers")
    if mask is None:
        raise BadLine("pre-tokenized sample without loss_mask")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise BadLine(f"loss_mask must be a list of 0/1 of the same length as input_ids ({len(ids)})")
    if not any(mask):
        raise BadLine("loss_mask is all zeros: nothing to learn from")
    return Pretokenized(sample_id, ids, mask)
