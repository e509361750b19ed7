"""Device-to-host copies that do not stall the forward, and the dump each prompt's copies make.

The hook runs on the scheduler thread right after the forward. Its outputs may be views of CUDA-graph
buffers that the next replay overwrites, so the rows are copied at once, but asynchronously: into
pinned host memory, queued on the current (forward) stream, with one event recorded after them. A
writer thread (shared/dumpwriter.py, bounded in bytes) waits for that event, joins a prompt's
chunks and writes the file. A chunk holds what its request asked for (fp8 states and their scales, the top-k
distribution in place of the final state, 4-bit aux states), named as the dump names them.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.shared.dumpfile import write_dump_parts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostChunk:
    """One request's rows from one forward, on the host (or being copied there until ``event``): the dump's tensors
    by name (shared/dumpfile.py), those the request asked for. Every chunk of a request holds the same names."""

    parts: dict[str, torch.Tensor]
    event: "torch.cuda.Event | None"


def copy_rows(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of ``t`` into memory no later forward can touch."""
    rows = t[start : start + length]
    if not rows.is_cuda:
        return rows.clone()
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)  # queued on the current stream: after the forward's kernels
    return host


def record_event(device: torch.device) -> "torch.cuda.Event | None":
    """An event on ``device``'s current stream after the work queued there so far (None on CPU: that work is done):
    the end of a forward's copies, which the writer waits for, and both ends of the capture's device time."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
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
        return sum(t.nbytes for c in self.chunks for t in c.parts.values())

    def write(self, dump_dir: Path) -> Path:
        """Waits for the copies, joins the prompt's chunks and writes the dump (on a writer thread)."""
        for chunk in self.chunks:
            if chunk.event is not None:
                chunk.event.synchronize()
        parts = {name: _join([c.parts[name] for c in self.chunks]) for name in self.chunks[0].parts}
        path = write_dump_parts(dump_dir, self.rid, parts, aux_layer_ids=self.aux_layer_ids, model=self.model,
                                model_dtype=self.model_dtype)  # fmt: skip
        log.debug("rid %s: dump %s written (%d chunks)", self.rid, path.name, len(self.chunks))
        return path


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
