"""Training data streamed from the durable store: one sample file opened (memory-mapped) per use, never the
whole dataset.

Which samples: those ingested (``SampleSet``) whose bit is set in the run's done bitmap (read once).
Held-out split: a stable hash of the sample id, so it never changes between runs, ranks or resumes.
Batches: samples grouped by length (sorted within shuffled windows) under a token budget, then shuffled;
the order is a pure function of (seed, epoch), so a resumed run skips to the same batch. A batch is one row: its
samples packed end to end (no padding), each a document of its own that attention and the loss keep apart.
"""

import hashlib
import random
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from eaglet.services.trainer.config import LossMaskAlign
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import StoreError, decode_states, open_sample, read_metadata, sample_path


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
    train: list[Item] = []
    held: list[Item] = []
    for i in indexes:
        row = samples.index[i]
        item = Item(i, row["id"].decode(), int(row["length"]))
        (held if is_heldout(item.sample_id, heldout) else train).append(item)
    return train, held


def load_sample(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One stored sample, read by the store, as training tensors: its state tensors decoded to ``dtype``.
    StoreError for a file that cannot be read as one: absent, truncated, a bad header, a tensor missing."""
    metadata = read_metadata(path)  # first: a truncated or foreign file fails here, as a StoreError
    stored = open_sample(path)
    try:
        return {
            "input_ids": stored["input_ids"].long(),  # [T]
            "loss_mask": stored["loss_mask"].bool(),  # [T]
            # aux [T, 3H]; hidden_states [T, H] after the final norm, or the target's topk_ids / topk_logp [T, k]
            **decode_states(stored, metadata, dtype),
        }
    except (KeyError, ValueError) as e:
        raise StoreError(f"{path}: not a sample file of this run ({type(e).__name__}: {e})") from e


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A stored sample that could not be read: which one, its file, and why (the store's message)."""

    index: int
    sample_id: str
    path: str
    reason: str


def make_batches(items: list[Item], tokens_per_batch: int, seed: int, epoch: int, window: int = 64) -> list[list[Item]]:
    """Length-grouped batches of at most ``tokens_per_batch`` tokens packed (an over-long sample is a batch alone)."""
    rng = random.Random(seed * 100_003 + epoch)
    order = items[:]
    rng.shuffle(order)
    batches: list[list[Item]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda it: it.length)
        batch: list[Item] = []
        used = 0
        for it in chunk:
            if batch and used + it.length > tokens_per_batch:
                batches.append(batch)
                batch, used = [], 0
            batch.append(it)
            used += it.length
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def longest_row(items: list[Item], tokens_per_batch: int, max_len: int) -> int:
    """The most tokens a batch of ``items`` can pack into its row: the budget (or all the tokens there are), or a
    sample longer than it alone, cut to ``max_len``."""
    cut = [min(it.length, max_len) for it in items]
    return max(min(tokens_per_batch, sum(cut)), max(cut, default=0))


def shard(batches: list[list[Item]], rank: int, world: int) -> list[list[Item]]:
    """This rank's batches; every rank gets as many (DDP steps in lock-step)."""
    n = len(batches) // world * world
    return batches[rank:n:world]


Batch = dict[str, torch.Tensor | tuple]
"""A packed batch: tensors [1, L, ...], ``loss_row_counts`` (host integers: how the loss rows split by step) and
``unreadable`` (the batch's samples whose files could not be read, ``Unreadable``, left out of it). A batch none of
whose samples could be read holds ``unreadable`` alone (``is_empty``)."""


class BatchSet(Dataset):
    """Batches as dataset items, so a DataLoader's workers read and pack the next ones ahead of the step."""

    def __init__(self, batches: list[list[Item]], data_dir: Path, run_id: str, dtype: torch.dtype, max_len: int,
                 steps: int, align: LossMaskAlign = "predicted", blocks: "BlockRule | None" = None):  # fmt: skip
        self.batches, self.data_dir, self.run_id, self.dtype = batches, data_dir, run_id, dtype
        self.max_len, self.steps, self.align, self.blocks = max_len, steps, align, blocks

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Batch:
        """The batch's samples packed; a sample whose file cannot be read is left out and named in ``unreadable``,
        so the loader's worker processes hand the failure to the training loop instead of stopping it."""
        samples, unreadable = [], []
        for it in self.batches[i]:
            path = sample_path(self.data_dir, self.run_id, it.sample_id)
            try:
                samples.append(load_sample(path, self.dtype))
            except StoreError as e:
                unreadable.append(Unreadable(it.index, it.sample_id, str(path), str(e)))
        batch = collate(samples, self.max_len, self.steps, self.align) if samples else {}
        if samples and self.blocks is not None:  # a DFlash batch: its blocks' anchors, drawn by the batch's index
            batch["anchors"], batch["labels"] = self.blocks.rows(batch, seed=i)
        batch["unreadable"] = tuple(unreadable)
        return batch


def is_empty(batch: Batch) -> bool:
    """True when none of the batch's samples could be read: nothing to train or evaluate on."""
    return "input_ids" not in batch


def collate(
    samples: list[dict[str, torch.Tensor]], max_len: int, steps: int, align: LossMaskAlign = "predicted"
) -> Batch:
    """The samples, each cut to ``max_len``, packed end to end into one row [1, L] (L their total length): no
    padding to compute. Each token's position in its sample (``position_ids``) and its sample's index
    (``document_ids``) go with it, and the rows of each of the ``steps`` TTT steps' loss (``ttt_rows`` by
    ``align``), worked
    out here on the host so the training step never waits on the GPU to find them. One run's samples share a
    layout: all hold ``hidden_states``, or all ``topk_ids`` and ``topk_logp``."""
    cut = [{k: v[:max_len] for k, v in s.items()} for s in samples]
    lengths = torch.tensor([len(s["input_ids"]) for s in cut])
    tensors = {k: torch.cat([s[k] for s in cut])[None] for k in cut[0]}
    out: Batch = {**tensors}
    starts = torch.cumsum(lengths, 0) - lengths
    out["position_ids"] = (torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths))[None]
    out["document_ids"] = documents = torch.arange(len(cut), dtype=torch.int32).repeat_interleave(lengths)[None]
    out["tokens"] = lengths.sum()
    if steps > 0:  # 0: a DFlash batch, whose rows are its blocks' (BlockRule)
        out["loss_rows"], out["loss_row_counts"] = ttt_rows(tensors["loss_mask"], documents, steps, align)
    return out


MASK_ALIGN: dict[str, tuple[int, int]] = {"predicted": (2, 2), "position": (0, 1)}
"""Per ``loss_mask_align``, at step 0: (the offset of the mask entry that decides position t, the offset of the
furthest row the position needs in its document: the predicted token, or the target's distribution before it)."""


def ttt_rows(
    loss_mask: torch.Tensor, documents: torch.Tensor | None, steps: int, align: LossMaskAlign = "predicted"
) -> tuple[torch.Tensor, tuple]:
    """The positions of each TTT step's loss: step i at position t reads token t + 1 + i and learns the target's
    distribution at t + 1 + i (that of token t + 2 + i). Its rows are the t whose loss-mask entry by ``align``
    (``TrainConfig.loss_mask_align``) is set and whose furthest row it needs is in t's document: ``predicted``,
    mask[t + 2 + i], the predicted token in the document; ``position``, mask[t + i], the target's distribution at
    t + 1 + i in the document. ``loss_mask`` [B, T], ``documents`` [B, T] or None (one a row). Returns (the rows
    of every step, each step's rising, as flat indexes b * T + t [sum of counts]; each step's count)."""
    B, T = loss_mask.shape
    flat = torch.arange(B * T).view(B, T)
    masked, reach = MASK_ALIGN[align]
    rows = []
    for i in range(steps):
        n = max(T - reach - i, 0)
        keep = loss_mask[:, masked + i : masked + i + n].bool()
        if documents is not None:
            keep = keep & (documents[:, :n] == documents[:, reach + i : reach + i + n])
        rows.append(flat[:, :n][keep])
    return torch.cat(rows), tuple(len(r) for r in rows)


@dataclass(frozen=True, slots=True)
class BlockRule:
    """Where a DFlash batch's blocks start: ``block_size`` tokens a block, at most ``max_anchors`` blocks a batch."""

    block_size: int
    max_anchors: int

    def rows(self, batch: Batch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [A]: flat positions p of a packed row whose block is trained, rising; labels [A, block_size -
        1] bool: block index j predicts token p + j and is a loss position). An anchor has context (a token of its
        document before it) and its first predicted token p + 1 is a loss position of its document; block index j
        counts where p + j is in the document and a loss position. At most ``max_anchors``, drawn at random by
        ``seed`` among those that qualify: worked out on the host, so the step never waits on the GPU to find
        them."""
        mask, docs, pos = batch["loss_mask"][0].bool(), batch["document_ids"][0], batch["position_ids"][0]
        T, bs = len(mask), self.block_size
        p = torch.arange(max(T - 1, 0))
        ok = (pos[:-1] >= 1) & (docs[:-1] == docs[1:]) & mask[1:]
        anchors = p[ok]
        if len(anchors) > self.max_anchors:
            g = torch.Generator().manual_seed(seed)
            anchors = anchors[torch.randperm(len(anchors), generator=g)[: self.max_anchors]].sort().values
        at = anchors[:, None] + torch.arange(1, bs)  # [A, bs - 1]
        inside = at < T
        at = at.clamp(max=T - 1)
        labels = inside & (docs[at] == docs[anchors][:, None]) & mask[at]
        return anchors, labels


def loader(batch_set: BatchSet, start: int, loader_workers: int, pin: bool = False) -> DataLoader:
    """Batches from position ``start`` on (resume), read ahead by ``loader_workers`` processes (0: in the loop);
    ``pin``: in page-locked memory, so copying them to the GPU does not hold the host up."""
    subset = torch.utils.data.Subset(batch_set, range(start, len(batch_set)))
    return DataLoader(subset, batch_size=None, shuffle=False, num_workers=loader_workers, persistent_workers=False,
                      pin_memory=pin, worker_init_fn=ignore_sigterm)  # fmt: skip


def ignore_sigterm(worker_id: int) -> None:
    """A loader worker outlives a SIGTERM sent to the trainer's whole process group: the trainer, stopping at its
    next step (``preemption.py``), still reads from it, then ends it itself (and torch ends it if the trainer dies)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def on_device(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """The batches moved to ``device``, each one's copy started before the step ahead of it runs: on a GPU on a
    stream of its own (from pinned memory the copy overlaps that step's compute), the step's stream waiting for
    the copy only when the batch is used. Integers (``loss_row_counts``) stay on the host."""
    if device.type != "cuda":
        yield from ({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches)
        return
    copies = torch.cuda.Stream(device)
    ahead: tuple[Batch, torch.cuda.Event] | None = None
    for b in batches:
        with torch.cuda.stream(copies):
            moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
            copied = torch.cuda.Event()
            copied.record(copies)
        if ahead is not None:
            yield ready(*ahead)
        ahead = moved, copied
    if ahead is not None:
        yield ready(*ahead)


def ready(batch: Batch, copied: torch.cuda.Event) -> Batch:
    """The batch, once the current stream has waited for its copy; its memory marked as used by that stream, so
    the allocator does not hand it back to the copy stream while the step still reads it."""
    stream = torch.cuda.current_stream()
    stream.wait_event(copied)
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            v.record_stream(stream)
    return batch
