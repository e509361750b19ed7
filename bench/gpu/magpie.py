"""Magpie prompt synthesis: the target writes its own user turns, sampled from its chat template's user prefix
(system prompt and earlier turns included), then deduplicated and filtered; conversations are split into a
training set and a held-out set by a salted hash of their id, so the held-out prompts are never ingested."""

import hashlib
import re

SENTINEL = "\x00MAGPIE-USER-TURN\x00"
MIN_CHARS, MAX_CHARS, MIN_WORDS = 12, 2000, 3


def user_prefix(tokenizer, history: list[dict]) -> str:
    """The chat template's text up to where the next user turn's content starts, after ``history``."""
    text = tokenizer.apply_chat_template(history + [{"role": "user", "content": SENTINEL}], tokenize=False)
    cut = text.find(SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not place a user turn's content verbatim: no Magpie prefix")
    return text[:cut]


def clean_turn(text: str, stop_markers: tuple[str, ...] = ("<|im_end|>", "<|im_start|>")) -> str | None:
    """A sampled turn cut at the first template marker and stripped; None when empty, too short or too long."""
    for marker in stop_markers:
        text = text.split(marker, 1)[0]
    text = text.strip()
    if len(text) < MIN_CHARS or len(text) > MAX_CHARS or len(text.split()) < MIN_WORDS:
        return None
    return text


def dedupe_key(text: str) -> bytes:
    """Case, punctuation and spacing do not make a prompt new: 8 bytes of a hash of its words."""
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return hashlib.sha1(" ".join(words).encode()).digest()[:8]


class Deduper:
    """Remembers the prompts kept so far (8 bytes each) and refuses repeats."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.repeats = 0

    def keep(self, text: str) -> bool:
        key = dedupe_key(text)
        if key in self.seen:
            self.repeats += 1
            return False
        self.seen.add(key)
        return True


def is_heldout(conversation_id: str, fraction: float) -> bool:
    """Salted apart from the trainer's own held-out hash, so the two splits are independent."""
    h = int.from_bytes(hashlib.sha1(f"h2h-heldout:{conversation_id}".encode()).digest()[:4], "big")
    return h < fraction * 2**32


def filter_prompts(raw: list[str], dedupe: Deduper) -> tuple[list[str], dict]:
    """The kept prompts in order, and how many were dropped and why."""
    kept, empty, before = [], 0, dedupe.repeats
    for text in raw:
        turn = clean_turn(text)
        if turn is None:
            empty += 1
        elif dedupe.keep(turn):
            kept.append(turn)
    return kept, {
        "sampled": len(raw),
        "kept": len(kept),
        "empty_or_bad_length": empty,
        "repeats": dedupe.repeats - before,
    }
