"""Where the inference servers write their dumps: several threads, a cap on the bytes waiting, back-pressure
measured.

Both servers (the reference server and the SGLang plugin) hand each complete dump here as a write to run and its
size. ``submit`` blocks the caller, which is the thread that runs the forwards, while the bytes queued or being
written would pass the cap: the server slows to the disk's pace instead of growing its host memory (at SGLang
those bytes are pinned buffers, 57 KB a token at Kimi-K2.5's width, and an unbounded queue grew the scheduler by
1.3 GB in a 39K tok/s run). A dump larger than the cap alone is let through once nothing else is queued, or it
would wait forever. Dumps are independent files named by request id, so writing several at once reorders
nothing a reader sees: a dump exists only when complete.

The time ``submit`` waited is the back-pressure. Each writer publishes its figures (``WriterStats``) to
``<dump_dir>/.writers/<host>-<pid>.json`` at most once a second; the extractor workers read that small folder
(one file per server process, never the dumps) and report it with their server's health, so ``/status`` shows
how much of the time the forwards waited for the disk.
"""

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

STATS_DIR = ".writers"
PUBLISH_EVERY_S = 1.0
WAIT_WINDOW_S = 10.0
DEFAULT_CAP_BYTES = 2 << 30
DEFAULT_THREADS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterStats:
    """One writer's figures at ``ts``; ``wait_fraction`` is the share of the last ``WAIT_WINDOW_S`` that ``submit``
    spent waiting for room (0: the disk keeps up; near 1: the forwards run at the disk's pace)."""

    ts: float
    cap_bytes: int
    queued_bytes: int
    peak_bytes: int
    waited_s: float
    wait_fraction: float
    written: int
    failed: int
    threads: int


class DumpWriter:
    """Writes submitted dumps on ``threads`` daemon threads, holding at most ``cap_bytes`` of them at a time."""

    def __init__(self, dump_dir: Path, *, cap_bytes: int = DEFAULT_CAP_BYTES, threads: int = DEFAULT_THREADS):
        if cap_bytes <= 0 or threads <= 0:
            raise ValueError(f"dump writer: cap_bytes={cap_bytes} and threads={threads} must be positive")
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.cap_bytes = cap_bytes
        self.threads = threads
        self._room = threading.Condition()
        self._jobs: deque[tuple[int, Callable[[], object], Future, str]] = deque()
        self._queued = self._peak = self._written = self._failed = 0
        self._waited = 0.0
        self._waits: deque[tuple[float, float]] = deque()  # (start, end) of the waits within the window
        self._started = self._published = time.monotonic()
        self._stats_path = self.dump_dir / STATS_DIR / f"{socket.gethostname()}-{os.getpid()}.json"
        for i in range(threads):
            threading.Thread(target=self._run, name=f"eaglet-dump-writer-{i}", daemon=True).start()

    def submit(self, nbytes: int, write: Callable[[], object], label: str) -> Future:
        """Queues ``write`` (``nbytes`` of dump) once there is room; the future holds its result or error."""
        future: Future = Future()
        with self._room:
            if self._queued and self._queued + nbytes > self.cap_bytes:
                started = time.monotonic()
                while self._queued and self._queued + nbytes > self.cap_bytes:
                    self._room.wait()
                ended = time.monotonic()
                self._waited += ended - started
                self._waits.append((started, ended))
            self._queued += nbytes
            self._peak = max(self._peak, self._queued)
            self._jobs.append((nbytes, write, future, label))
            self._room.notify_all()
        self._maybe_publish()
        return future

    def flush(self) -> None:
        """Waits until every submitted dump is written (tests, shutdown)."""
        with self._room:
            while self._queued:
                self._room.wait()
        self.publish()

    def stats(self) -> WriterStats:
        with self._room:
            now = time.monotonic()
            since = now - WAIT_WINDOW_S
            while self._waits and self._waits[0][1] < since:
                self._waits.popleft()
            waited = sum(end - max(start, since) for start, end in self._waits)
            fraction = waited / min(WAIT_WINDOW_S, now - self._started) if now > self._started else 0.0
            return WriterStats(
                ts=time.time(),
                cap_bytes=self.cap_bytes,
                queued_bytes=self._queued,
                peak_bytes=self._peak,
                waited_s=round(self._waited, 6),
                wait_fraction=round(min(1.0, fraction), 4),
                written=self._written,
                failed=self._failed,
                threads=self.threads,
            )

    def publish(self) -> None:
        """Writes the figures for the workers (temp + rename: a reader never sees half a file)."""
        stats = self.stats()
        self._published = time.monotonic()
        try:
            self._stats_path.parent.mkdir(exist_ok=True)
            tmp = self._stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(stats)))
            os.replace(tmp, self._stats_path)
        except OSError as e:  # figures only: a full dump folder must not stop the dumps
            log.warning("dump writer figures not written to %s: %s", self._stats_path, e)

    def _maybe_publish(self) -> None:
        if time.monotonic() - self._published >= PUBLISH_EVERY_S:
            self.publish()

    def _run(self) -> None:
        while True:
            with self._room:
                while not self._jobs:
                    self._room.wait()
                nbytes, write, future, label = self._jobs.popleft()
            try:
                future.set_result(write())
                ok = True
            except Exception as e:
                # Thread boundary: one bad dump must not stop the writer. The request's worker finds no dump,
                # records that and retries under a new rid; the reference server fails the request with it.
                log.error("%s: dump not written", label, exc_info=True)
                future.set_exception(e)
                ok = False
            with self._room:
                self._queued -= nbytes
                self._written += ok
                self._failed += not ok
                self._room.notify_all()
            self._maybe_publish()


def read_writer_stats(dump_dir: Path, max_age_s: float) -> list[WriterStats]:
    """The figures of the writers that published within ``max_age_s`` (a server that stopped drops out)."""
    folder = Path(dump_dir) / STATS_DIR
    try:
        names = [e.name for e in os.scandir(folder) if e.name.endswith(".json")]
    except OSError:
        return []
    found, now = [], time.time()
    for name in names:
        try:
            stats = WriterStats(**json.loads((folder / name).read_text()))
        except (OSError, ValueError, TypeError):
            continue  # removed meanwhile, or not a writer's file
        if now - stats.ts <= max_age_s:
            found.append(stats)
    return found
