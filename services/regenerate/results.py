"""Where a run's regenerated prompts are kept: one append-only JSONL file per batch, and the final file.

Each finished prompt is one line, flushed and fsynced before its prompt is counted in Redis, so a worker killed at
any moment loses at most the prompts it had in flight. A batch taken up again reads its file first and skips the
prompts in it; a torn last line (the kill landed mid-write) is cut off before anything is appended. A line is
``{"index", "line", "id", "messages", "tokens_in", "tokens_out"}``, or ``{"index", "line", "id", "error"}`` for a
prompt given up.

The final file is assembled once every prompt has an outcome: the batch files in batch order, each sorted by
prompt (a batch's prompts finish in any order), through a temp file and a rename; one batch in memory at a time.
"""

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from eaglet.shared.store import run_dir


def batch_path(data_dir: Path, run_id: str, batch: int) -> Path:
    return run_dir(data_dir, run_id) / "regenerate" / f"{batch:07d}.jsonl"


def output_path(data_dir: Path, run_id: str) -> Path:
    return run_dir(data_dir, run_id) / "regenerated.jsonl"


class ResultFile:
    """One batch's results. ``open`` reads what an earlier attempt wrote; ``append`` adds one, durably."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._f: BinaryIO | None = None

    def open(self) -> dict[int, dict]:
        """The entries written so far, by prompt index; cuts off a torn last line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entries, good = {}, 0
        if self.path.exists():
            with open(self.path, "rb") as f:
                for raw in f:
                    entry = _parse(raw)
                    if entry is None:
                        break  # torn: a kill mid-write; only the last line can be, as each is fsynced in turn
                    entries[entry["index"]] = entry
                    good += len(raw)
            if good < self.path.stat().st_size:
                os.truncate(self.path, good)
        self._f = open(self.path, "ab")
        return entries

    def append(self, entry: dict) -> None:
        assert self._f is not None, "open() first: it cuts off a torn last line before anything is appended"
        data = (json.dumps(entry, ensure_ascii=False) + "\n").encode()
        with self._lock:
            self._f.write(data)
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _parse(raw: bytes) -> dict | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("index"), int) else None


def read_batch(path: Path) -> list[dict]:
    """A batch's complete entries, in input order."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        entries = {e["index"]: e for e in map(_parse, f) if e is not None}
    return [entries[i] for i in sorted(entries)]


def assemble(batch_paths: Iterator[Path], out: Path) -> tuple[int, int]:
    """Writes every regenerated conversation (``{"id", "messages"}``) in input order to ``out``, atomically;
    returns (conversations written, prompts given up)."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # concurrent assemblers
    written, failed = 0, 0
    with open(tmp, "w", encoding="utf-8") as f:
        for path in batch_paths:
            for entry in read_batch(path):
                if "error" in entry:
                    failed += 1
                    continue
                f.write(json.dumps({"id": entry["id"], "messages": entry["messages"]}, ensure_ascii=False) + "\n")
                written += 1
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(out)
    return written, failed
