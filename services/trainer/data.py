"""Training data streamed from the durable store: one sample file opened (memory-mapped) per use, never the
whole dataset.

Which samples: those ingested (``SampleSet``) whose bit is set in the run's done bitmap (read once).
Held-out split: a stable hash of the sample id, so it never changes between runs, ranks or resumes.
Batches: samples grouped by length (sorted within shuffled windows) under a token budget, then shuffled;
the order is a pure function of (seed, epoch), so a resumed run skips to the same batch.
"""

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from eaglet.shared.samples import SampleSet
from eaglet.shared.store import decode_states, open_sample, read_metadata, sample_path


@dataclass(frozen=True, slots=True)
class Item:
    index: int  # the sample's row in the SampleSet (its bit in the done bitmap)
    sample_id: str
    length: int


def done_indexes(bitmap: bytes | None, total: int) -> list[int]:
    """Indexes whose bit is set in a Redis bitmap (bit 0 is the most significant bit of byte 0)."""
    if not bitmap:
        return []
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8))[:total]
    return np.flatnonzero(bits).tolist()


def is_heldout(sample_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(sample_id.encode()).digest()[:4], "big")
    return h < fraction * 2**32


def split_items(samples: SampleSet, indexes: list[int], heldout: float) -> tuple[list[Item], list[Item]]:
    """(train, held-out) items of the done samples."""
    train, held = [], []
    for i in indexes:
        row = samples.index[i]
        item = Item(i, row["id"].decode(), int(row["length"]))
        (held if is_heldout(item.sample_id, heldout) else train).append(item)
    return train, held


def load_sample(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One stored sample, read by the store, as training tensors: its state tensors decoded to ``dtype``."""
    metadata = read_metadata(path)  # first: a truncated or foreign file fails here, as a StoreError
    stored = open_sample(path)
    return {
        "input_ids": stored["input_ids"].long(),  # [T]
        "loss_mask": stored["loss_mask"].bool(),  # [T]
        # aux [T, 3H]; hidden_states [T, H] after the final norm, or the target's topk_ids / topk_logp [T, k]
        **decode_states(stored, metadata, dtype),
    }


def make_batches(items: list[Item], tokens_per_batch: int, seed: int, epoch: int, window: int = 64) -> list[list[Item]]:
    """Length-grouped batches of at most ``tokens_per_batch`` padded tokens (an over-long sample is a batch alone)."""
    rng = random.Random(seed * 100_003 + epoch)
    order = items[:]
    rng.shuffle(order)
    batches: list[list[Item]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda it: it.length)
        batch: list[Item] = []
        for it in chunk:
            if batch and max(it.length, batch[-1].length) * (len(batch) + 1) > tokens_per_batch:
                batches.append(batch)
                batch = []
            batch.append(it)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def shard(batches: list[list[Item]], rank: int, world: int) -> list[list[Item]]:
    """This rank's batches; every rank gets as many (DDP steps in lock-step)."""
    n = len(batches) // world * world
    return batches[rank:n:world]


class BatchSet(Dataset):
    """Batches as dataset items, so a DataLoader's workers read and pad the next ones ahead of the step."""

    def __init__(self, batches: list[list[Item]], data_dir: Path, run_id: str, dtype: torch.dtype, max_len: int):
        self.batches, self.data_dir, self.run_id, self.dtype, self.max_len = batches, data_dir, run_id, dtype, max_len

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        samples = [
            load_sample(sample_path(self.data_dir, self.run_id, it.sample_id), self.dtype) for it in self.batches[i]
        ]
        return collate(samples, self.max_len)


def collate(samples: list[dict[str, torch.Tensor]], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: padding sits after every real token, so the causal mask alone keeps it out. One run's
    samples share a layout: all hold ``hidden_states``, or all ``topk_ids`` and ``topk_logp``."""
    T = min(max(len(s["input_ids"]) for s in samples), max_len)
    out = {}
    for k in samples[0]:
        rows = []
        for s in samples:
            x = s[k][:T]
            pad = [0, 0] * (x.dim() - 1) + [0, T - len(x)]
            rows.append(torch.nn.functional.pad(x, pad))
        out[k] = torch.stack(rows)
    out["tokens"] = torch.tensor(sum(min(len(s["input_ids"]), T) for s in samples))
    return out


def loader(batch_set: BatchSet, start: int, loader_workers: int) -> DataLoader:
    """Batches from position ``start`` on (resume), read ahead by ``loader_workers`` processes (0: in the loop)."""
    subset = torch.utils.data.Subset(batch_set, range(start, len(batch_set)))
    return DataLoader(subset, batch_size=None, shuffle=False, num_workers=loader_workers, persistent_workers=False)
