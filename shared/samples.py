"""Ingested samples: token ids and loss masks, opened in O(1) per sample without loading the dataset.

``<run>/samples/`` holds three flat arrays and an index, all memory-mapped by readers:

    input_ids.bin   int32, every sample's tokens back to back
    loss_mask.bin   uint8, 1 where the token belongs to an assistant turn
    index.npy       one row per sample: offset, length, loss tokens, id
    manifest.json   counts, the tokenizer, the source file

The sample's index (its row) is its place in the run's done/failed bitmaps.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.ids import check_id

ID_BYTES = 128
INDEX_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i4"), ("loss_tokens", "<i4"), ("id", f"S{ID_BYTES}")])


@dataclass
class Sample:
    index: int
    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]


class SampleWriter:
    """Appends samples as they are ingested; ``close`` writes the index and the manifest."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._ids = open(self.folder / "input_ids.bin", "wb")
        self._mask = open(self.folder / "loss_mask.bin", "wb")
        self._rows: list[tuple[int, int, int, bytes]] = []
        self._offset = 0
        self.tokens = 0

    def append(self, sample_id: str, input_ids: list[int], loss_mask: list[int]) -> int:
        check_id(sample_id, "sample id")
        ids = np.asarray(input_ids, dtype=np.int32)
        mask = np.asarray(loss_mask, dtype=np.uint8)
        assert ids.shape == mask.shape, "input_ids and loss_mask differ in length"
        self._ids.write(ids.tobytes())
        self._mask.write(mask.tobytes())
        self._rows.append((self._offset, len(ids), int(mask.sum()), sample_id.encode()))
        self._offset += len(ids)
        self.tokens += len(ids)
        return len(self._rows) - 1

    def __len__(self) -> int:
        return len(self._rows)

    def close(self, manifest: dict) -> None:
        self._ids.close()
        self._mask.close()
        np.save(self.folder / "index.npy", np.array(self._rows, dtype=INDEX_DTYPE))
        manifest = {**manifest, "num_samples": len(self._rows), "num_tokens": self.tokens}
        (self.folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


class SampleSet:
    """Read side: ``samples[i]`` maps one sample's rows from disk, whatever the dataset size."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.index = np.load(self.folder / "index.npy", mmap_mode="r")
        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        n = int(self.manifest["num_tokens"])
        self._ids = np.memmap(self.folder / "input_ids.bin", dtype=np.int32, mode="r", shape=(n,)) if n else None
        self._mask = np.memmap(self.folder / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(n,)) if n else None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self.index):
            raise IndexError(f"sample index {i} out of range 0..{len(self.index) - 1} in {self.folder}")
        row = self.index[i]
        start, end = int(row["offset"]), int(row["offset"]) + int(row["length"])
        return Sample(i, row["id"].decode(), np.array(self._ids[start:end]), np.array(self._mask[start:end]))

    def length(self, i: int) -> int:
        return int(self.index[i]["length"])
