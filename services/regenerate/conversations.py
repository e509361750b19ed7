"""One input line of a regeneration → the turns the target answers: a prompt, or a conversation whose assistant
turns are written again.

Takes ``{"id", "prompt"}``, OpenAI ``{"messages": [{"role", "content"}]}`` and ShareGPT
``{"conversations": [{"from", "value"}]}``. The given assistant turns are dropped: each user turn is answered by the
target in turn, after the target's own earlier answers (as SpecForge and the EAGLE authors regenerate). Every way a
line can be wrong raises ``BadLine`` with the reason; the reader adds file and line number.
"""

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import BinaryIO

from eaglet.shared import chatlines
from eaglet.shared.chatlines import MAX_LINE_BYTES, ROLES, SHAREGPT_ROLES, BadLine
from eaglet.shared.ids import UnsafeName, check_id


@dataclass
class Prompt:
    line: int
    """Line number in the input file (1-based)."""
    prompt_id: str
    turns: list[dict[str, str]]
    """System and user messages in order; the target answers after every user message."""


def parse_prompt(raw: bytes, line: int) -> Prompt:
    """``raw`` (one line, without its newline or with it) as a ``Prompt``; ``BadLine`` if it is not one."""
    if len(raw) > MAX_LINE_BYTES:
        raise chatlines.oversize(len(raw))
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadLine(f"not UTF-8 (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise BadLine(f"malformed JSON: {e.msg} at column {e.colno}") from e
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise BadLine("prompt is not a string")
        turns = [{"role": "user", "content": obj["prompt"]}]
    elif "messages" in obj:
        turns = _turns(obj["messages"], "role", "content", {r: r for r in ROLES})
    elif "conversations" in obj:
        turns = _turns(obj["conversations"], "from", "value", SHAREGPT_ROLES)
    else:
        raise BadLine("no 'prompt', 'messages' or 'conversations' field")
    if not any(t["role"] == "user" for t in turns):
        raise BadLine("no user turn: nothing to answer")
    for i, turn in enumerate(turns):
        if not turn["content"].strip():
            raise BadLine(f"turn {i}: empty {turn['role']} message")
    return Prompt(line, _prompt_id(obj, raw), turns)


def _turns(given: object, role_key: str, text_key: str, roles: dict[str, str]) -> list[dict[str, str]]:
    if not isinstance(given, list) or not given:
        raise BadLine("empty conversation")
    turns = []
    for i, turn in enumerate(given):
        if not isinstance(turn, dict):
            raise BadLine(f"turn {i} is not an object")
        name = turn.get(role_key)
        role = roles.get(name) if isinstance(name, str) else None
        if role is None:
            raise BadLine(f"turn {i}: unknown {role_key} {name!r}")
        content = turn.get(text_key)
        if not isinstance(content, str):
            raise BadLine(f"turn {i}: {text_key} is not a string")
        if role != "assistant":  # the target writes those again
            turns.append({"role": role, "content": content})
    return turns


def _prompt_id(obj: dict, raw: bytes) -> str:
    """The line's own ``id``, else a hash of the line, as ingest names a sample: stable across runs."""
    given = obj.get("id")
    if given is None:
        return "s" + hashlib.sha1(raw.rstrip(b"\r\n")).hexdigest()[:20]
    try:
        return check_id(str(given) if isinstance(given, int) else given, "prompt id")
    except (UnsafeName, TypeError) as e:
        raise BadLine(str(e)) from e


def read_lines(f: BinaryIO, first_line: int, count: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, line or None if it is over the size limit, its size) for the next ``count`` non-blank lines
    from the file's position; nothing is read past the last of them (a batch's end offset is the file's position)."""
    kept = ((number, raw if raw is None else raw.rstrip(b"\r\n"), size)
            for number, raw, size in chatlines.read_lines(f, first_line) if raw is None or raw.strip())  # fmt: skip
    return islice(kept, count)
