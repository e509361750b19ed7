"""Device-to-host copies that do not stall the forward, and the dump each prompt's copies make.

The hook runs on the scheduler thread right after the forward. Its outputs may be views of CUDA-graph
buffers that the next replay overwrites, so the rows are copied at once, but asynchronously: into
pinned host memory, queued on the current (forward) stream, with one event recorded after them. A
writer thread (shared/dumpwriter.py, bounded in bytes) waits for that event, joins a prompt's
chunks and writes the file. A chunk holds what its request asked for (fp8 scales, the top-k
distribution) beside the states, and so does the dump.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.shared.dumpfile import write_dump

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostChunk:
    """One request's rows from one forward, on the host (or being copied there until ``event``)."""

    aux_hidden_states: torch.Tensor  # [n, 3H]
    hidden_states: torch.Tensor  # [n, H]
    event: "torch.cuda.Event | None"
    aux_scale: torch.Tensor | None = None  # [n, 1] float32 when the states are fp8-encoded
    hidden_scale: torch.Tensor | None = None
    topk: tuple[torch.Tensor, torch.Tensor] | None = None
    """The target's top-k (ids int32, log-probs float16) [n, k] when the request asked for it."""

    def tensors(self) -> list[torch.Tensor]:
        """In dump order: final, aux, then their scales when encoded, then the top-k when asked."""
        scales = [] if self.hidden_scale is None else [self.hidden_scale, self.aux_scale]
        return [self.hidden_states, self.aux_hidden_states, *scales, *(self.topk or ())]


def copy_rows(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of ``t`` into memory no later forward can touch."""
    rows = t[start : start + length]
    if not rows.is_cuda:
        return rows.clone()
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)  # queued on the current stream: after the forward's kernels
    return host


def record_event(device: torch.device) -> "torch.cuda.Event | None":
    """Marks the end of the copies just queued on the current stream (None on CPU: copies are done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(frozen=True, slots=True)
class DumpJob:
    rid: str
    chunks: list[HostChunk]
    aux_layer_ids: list[int]
    model: str
    model_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for c in self.chunks for t in c.tensors())

    def write(self, dump_dir: Path) -> Path:
        """Waits for the copies, joins the prompt's chunks and writes the dump (on a writer thread)."""
        for chunk in self.chunks:
            if chunk.event is not None:
                chunk.event.synchronize()
        parts = [_join([c.tensors()[i] for c in self.chunks]) for i in range(len(self.chunks[0].tensors()))]
        hidden, aux, *rest = parts
        # Every chunk of a request holds the same parts, those the request asked for: scales first, then the top-k.
        first = self.chunks[0]
        path = write_dump(
            dump_dir,
            self.rid,
            hidden,
            aux,
            aux_layer_ids=self.aux_layer_ids,
            model=self.model,
            scales=(rest[0], rest[1]) if first.hidden_scale is not None else None,
            model_dtype=self.model_dtype,
            topk=(rest[-2], rest[-1]) if first.topk is not None else None,
        )
        log.debug("rid %s: dump %s written (%d tokens)", self.rid, path.name, hidden.shape[0])
        return path


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
