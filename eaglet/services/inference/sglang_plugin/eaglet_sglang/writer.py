"""Device-to-host copies that do not stall the forward, and the thread that writes the dumps.

The hook runs on the scheduler thread right after the forward. Its outputs may be views of CUDA-graph
buffers that the next replay overwrites, so the rows are copied at once, but asynchronously: into
pinned host memory, queued on the current (forward) stream, with one event recorded after them. The
writer thread waits for that event, joins a prompt's chunks and writes the file.
"""

import logging
import queue
import threading
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


class DumpWriter:
    """One daemon thread writing ``<dump_dir>/<rid>.safetensors`` atomically (``write_dump``)."""

    def __init__(self, dump_dir: Path):
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: queue.Queue[DumpJob] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="eaglet-dump-writer", daemon=True)
        self._thread.start()

    def submit(self, job: DumpJob) -> None:
        self._jobs.put(job)

    def flush(self) -> None:
        """Waits until every submitted dump is written (tests, shutdown)."""
        self._jobs.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                self._write(job)
            except Exception:
                # Thread boundary: one bad dump must not stop the writer; the worker sees no file,
                # records the failure and retries under a new rid.
                log.error("rid %s: dump not written", job.rid, exc_info=True)
            finally:
                self._jobs.task_done()

    def _write(self, job: DumpJob) -> None:
        for chunk in job.chunks:
            if chunk.event is not None:
                chunk.event.synchronize()
        if len(job.chunks) == 1:
            hidden, aux = job.chunks[0].hidden_states, job.chunks[0].aux_hidden_states
        else:
            hidden = torch.cat([c.hidden_states for c in job.chunks])
            aux = torch.cat([c.aux_hidden_states for c in job.chunks])
        path = write_dump(self.dump_dir, job.rid, hidden, aux, aux_layer_ids=job.aux_layer_ids, model=job.model)
        log.debug("rid %s: dump %s written (%d tokens)", job.rid, path.name, hidden.shape[0])
