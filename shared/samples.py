"""Ingested samples: token ids and loss masks, opened in O(1) per sample without loading the dataset.

``<run>/samples/`` holds three append-only flat files, memory-mapped by readers:

    input_ids.bin   int32, every sample's tokens back to back
    loss_mask.bin   uint8, 1 where the token belongs to an assistant turn
    index.bin       one fixed-size row per sample: offset, length, loss tokens, id
    manifest.json   counts, the tokenizer, the source file (written when ingest ends)

Ingest appends and flushes before it queues a sample, so a worker may read a sample while the rest
of the dataset is still being ingested. The sample's index (its row) is its place in the run's bitmaps.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .ids import check_id

ID_BYTES = 128
INDEX_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i4"), ("loss_tokens", "<i4"), ("id", f"S{ID_BYTES}")])


@dataclass
class Sample:
    index: int
    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


class SampleWriter:
    """Appends samples as they are ingested; ``flush`` makes them visible, ``close`` writes the manifest."""

    def __init__(self, folder: Path, *, keep: tuple[int, int] | None = None):
        """``keep=(samples, tokens)`` reopens a writer that died: what it flushed up to there stays, anything
        appended after (never queued) is cut off, and appending goes on from there."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.samples, self.tokens = keep or (0, 0)
        names = ("input_ids.bin", "loss_mask.bin", "index.bin")
        if keep is None:
            self._files: list[BinaryIO] = [open(self.folder / name, "wb") for name in names]
            return
        self._files = [open(self.folder / name, "r+b") for name in names]
        for f, size in zip(self._files, (4 * self.tokens, self.tokens, INDEX_DTYPE.itemsize * self.samples),
                           strict=True):  # fmt: skip
            if os.fstat(f.fileno()).st_size < size:
                raise ValueError(f"{f.name}: shorter than the {size} bytes its last flush recorded")
            f.truncate(size)
            f.seek(size)

    def append(self, sample_id: str, input_ids: list[int], loss_mask: list[int]) -> int:
        check_id(sample_id, "sample id")
        ids = np.asarray(input_ids, dtype=np.int32)
        mask = np.asarray(loss_mask, dtype=np.uint8)
        if ids.shape != mask.shape:
            raise ValueError(f"sample {sample_id}: input_ids and loss_mask differ in length")
        row = np.array([(self.tokens, len(ids), int(mask.sum()), sample_id.encode())], dtype=INDEX_DTYPE)
        arrays: tuple[np.ndarray, ...] = (ids, mask, row)
        for f, data in zip(self._files, arrays, strict=True):
            f.write(data.tobytes())
        self.tokens += len(ids)
        self.samples += 1
        return self.samples - 1

    def flush(self) -> None:
        """Makes every appended sample readable by other processes (and hosts, on a shared volume)."""
        for f in self._files:
            f.flush()
            os.fsync(f.fileno())

    def close(self, manifest: dict) -> None:
        self.flush()
        for f in self._files:
            f.close()
        manifest = {**manifest, "num_samples": self.samples, "num_tokens": self.tokens}
        (self.folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


class SampleSet:
    """Read side: ``samples[i]`` maps one sample's rows from disk, whatever the dataset size."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._map()

    def _map(self) -> None:
        # Maps what is on disk now; a reader asked for a sample appended later maps again.
        rows = os.path.getsize(self.folder / "index.bin") // INDEX_DTYPE.itemsize
        index: np.ndarray | list = (
            np.memmap(self.folder / "index.bin", dtype=INDEX_DTYPE, mode="r", shape=(rows,)) if rows else []
        )
        # The writer's three files reach the disk one by one (a full buffer, a flush, a kill between them): an index
        # row whose tokens are not all there yet is left out, as if not yet appended.
        on_disk = min(
            os.path.getsize(self.folder / "input_ids.bin") // 4, os.path.getsize(self.folder / "loss_mask.bin")
        )
        while rows and int(index[rows - 1]["offset"] + index[rows - 1]["length"]) > on_disk:
            rows -= 1
        self.index = index[:rows] if rows else []
        tokens = int(self.index[-1]["offset"] + self.index[-1]["length"]) if rows else 0
        self._ids = (
            np.memmap(self.folder / "input_ids.bin", dtype=np.int32, mode="r", shape=(tokens,)) if tokens else None
        )
        self._mask = (
            np.memmap(self.folder / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(tokens,)) if tokens else None
        )

    def __len__(self) -> int:
        return len(self.index)

    def manifest(self) -> dict:
        return json.loads((self.folder / "manifest.json").read_text())

    def __getitem__(self, i: int) -> Sample:
        if i >= len(self.index):
            self._map()
        if not 0 <= i < len(self.index):
            raise IndexError(f"sample index {i} out of range 0..{len(self.index) - 1} in {self.folder}")
        row = self.index[i]
        start, end = int(row["offset"]), int(row["offset"]) + int(row["length"])
        ids, mask = self._ids, self._mask
        assert ids is not None and mask is not None  # a sample in range: its tokens were mapped
        return Sample(i, row["id"].decode(), np.array(ids[start:end]), np.array(mask[start:end]))

    def length(self, i: int) -> int:
        return int(self.index[i]["length"])
