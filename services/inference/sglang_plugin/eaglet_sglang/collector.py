"""Which rows of a forward belong to which eaglet request, and the joining of a prompt's chunks.

Pure bookkeeping on plain lists: no SGLang import, no tensors touched. The hook feeds it one
forward at a time (scheduler thread); the chunks it holds are opaque to it.
"""

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eaglet.shared.ids import UnsafeName, check_rid, is_eaglet_rid

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rows:
    """One request's part of one forward: batch rows ``[start, start + length)``, prompt tokens
    ``[prefix_len, prefix_len + length)``."""

    rid: str
    prompt_len: int
    prefix_len: int
    start: int
    length: int

    @property
    def end_token(self) -> int:
        return self.prefix_len + self.length


def plan_rows(
    rids: Sequence[object],
    prompt_lens: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    decoding: Sequence[bool],
) -> list[Rows]:
    """The rows to dump in one extend forward, one entry per eaglet request still in its prompt.

    Rows are laid out by cumulative ``extend_lens`` (never by tensor shape: padded and DP-attention
    batches carry more rows). Decode rows (a mixed batch's running requests, or a decode batch seen
    as 1-token extends) and rows past the prompt are skipped; so are other rids (warm-ups, health
    checks) and eaglet rids that are not safe file names.
    """
    out = []
    start = 0
    for rid, prompt_len, prefix_len, extend_len, is_decoding in zip(
        rids, prompt_lens, prefix_lens, extend_lens, decoding, strict=True
    ):
        row_start, start = start, start + extend_len
        if is_decoding or not isinstance(rid, str) or not is_eaglet_rid(rid) or prefix_len >= prompt_len:
            continue
        try:
            check_rid(rid)
        except UnsafeName as e:
            log.warning("rid %r: refused, not dumped: %s", rid, e)
            continue
        # A re-prefill after retraction also covers output tokens: keep the prompt's rows only.
        out.append(Rows(rid, prompt_len, prefix_len, row_start, min(extend_len, prompt_len - prefix_len)))
    return out


@dataclass(slots=True)
class _Pending:
    prompt_len: int
    gathered: int = 0
    chunks: list[Any] = field(default_factory=list)
    last_seen: float = 0.0


@dataclass(frozen=True, slots=True)
class Complete:
    """A whole prompt: its chunks in token order, ready to be joined and written."""

    rid: str
    num_tokens: int
    chunks: list[Any]


class Collector:
    """Joins the chunks of each request's prompt and says when one is whole.

    A chunk must start where the gathered tokens end, else the request is marked incomplete and
    never written (a radix hit, a lost chunk): the worker sees no dump and retries with a new rid.
    A chunk at prefix 0 starts the request over (re-prefill after retraction). Buffers of requests
    that stop arriving (aborted, timed out) are dropped after ``timeout_s``.
    """

    def __init__(self, *, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._closed: dict[str, float] = {}  # rid -> when: written or marked incomplete; later chunks ignored

    def add(self, rows: Rows, chunk: Any) -> Complete | None:
        now = self.clock()
        rid = rows.rid
        if rows.prefix_len == 0:
            self._closed.pop(rid, None)
            self._pending[rid] = _Pending(rows.prompt_len, last_seen=now)
        elif rid in self._closed:
            return None
        pending = self._pending.get(rid)
        if pending is None or rows.prefix_len != pending.gathered or rows.prompt_len != pending.prompt_len:
            gathered = None if pending is None else pending.gathered
            log.warning(
                "rid %s: chunk at token %d but %s tokens gathered: incomplete, not dumped",
                rid,
                rows.prefix_len,
                gathered,
            )
            self._close(rid, now)
            return None
        pending.chunks.append(chunk)
        pending.gathered = rows.end_token
        pending.last_seen = now
        if pending.gathered < pending.prompt_len:
            return None
        self._close(rid, now)
        return Complete(rid, pending.gathered, pending.chunks)

    def expire(self) -> list[str]:
        """Drops the buffers of requests not seen for ``timeout_s``; returns their rids."""
        now = self.clock()
        stale = [rid for rid, p in self._pending.items() if now - p.last_seen > self.timeout_s]
        for rid in stale:
            log.warning("rid %s: no chunk for %.0f s (aborted?): buffer dropped", rid, self.timeout_s)
            del self._pending[rid]
        for rid in [rid for rid, t in self._closed.items() if now - t > self.timeout_s]:
            del self._closed[rid]
        return stale

    @property
    def pending(self) -> list[str]:
        return list(self._pending)

    def _close(self, rid: str, now: float) -> None:
        self._pending.pop(rid, None)
        self._closed[rid] = now
