"""The hooks that SGLang calls, in every scheduler process, and the state they share.

- AROUND ``TpModelWorker.forward_batch_generation``: the one place that sees the ``ScheduleBatch``
  (rids, prefix and extend lengths, in row order) next to the forward's ``logits_output``, the same
  whether the forward ran eagerly or through a CUDA graph. Rows of eaglet requests are copied out
  at once and joined per request; a whole prompt is written by the writer thread.
- AROUND ``ModelRunner.init_attention_backends``: where SGLang itself turns on EAGLE-3 capture,
  before any CUDA graph is captured. Versions without the capture flag get it turned on here.
- AROUND ``LogitsProcessor.forward``: its ``hidden_states`` argument is the final layer after the
  final norm. Versions with the capture flag hand it back as ``logits_output.last_hidden_states``;
  for the others the hook keeps a reference while an eaglet forward runs.
"""

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.shared.ids import is_eaglet_rid
from eaglet_sglang.collector import Collector, Rows, plan_rows
from eaglet_sglang.writer import DumpJob, DumpWriter, HostChunk, copy_rows, record_event

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Settings:
    """Read from the server process's environment (``from_env``)."""

    dump_dir: Path
    """``EAGLET_DUMP_DIR``: where ``<rid>.safetensors`` appear; shared memory on the host, read by the workers."""
    timeout_s: float = 600.0
    """``EAGLET_DUMP_TIMEOUT_S``: a request whose next chunk does not come within this is dropped (aborted)."""
    aux_layer_ids: list[int] | None = None
    """``EAGLET_AUX_LAYER_IDS`` (e.g. ``2,15,27``), SGLang's convention (the layer whose input is captured).
    Unset: the model's default, [2, L//2, L-3]. Only used where the plugin enables capture itself."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"EAGLET_DUMP_TIMEOUT_S={self.timeout_s}: give a positive number of seconds")
        if self.aux_layer_ids is not None and (not self.aux_layer_ids or min(self.aux_layer_ids) < 1):
            raise ValueError(f"EAGLET_AUX_LAYER_IDS={self.aux_layer_ids}: give layer indices >= 1, comma-separated")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        dump_dir = env.get("EAGLET_DUMP_DIR")
        if not dump_dir:
            raise RuntimeError("EAGLET_DUMP_DIR is not set: the SGLang server needs the dump dir the workers read")
        ids = env.get("EAGLET_AUX_LAYER_IDS")
        return cls(
            dump_dir=Path(dump_dir),
            timeout_s=float(env.get("EAGLET_DUMP_TIMEOUT_S", "600")),
            aux_layer_ids=[int(x) for x in ids.split(",")] if ids else None,
        )


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """The batch's lists as they were when the forward started (the overlap scheduler mutates them)."""

    rows: list[Rows]


class DumpPlugin:
    """Per-process state of the dump hooks: the collector, the writer, what each worker captures."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.collector = Collector(timeout_s=settings.timeout_s)
        self._writer: DumpWriter | None = None  # started on the first dump: the launcher process never needs one
        self._workers: dict[int, tuple[bool, list[int], str]] = {}  # id(worker) -> (writes?, layer ids, model)
        self._armed = False
        self._final: torch.Tensor | None = None
        self._next_expiry = 0.0
        self._warned: set[str] = set()

    # --- hooks ---------------------------------------------------------------------------------

    def around_forward(self, original: Any, worker: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
        snapshot = self._snapshot(worker, batch)
        if snapshot is None:
            return original(worker, batch, *args, **kwargs)
        self._armed, self._final = True, None
        try:
            result = original(worker, batch, *args, **kwargs)
            final = self._final
        finally:
            self._armed, self._final = False, None
        try:
            self._capture(worker, snapshot, result, final)
        except Exception:
            # Boundary between SGLang and the plugin: a fault here must not fail the batch. The
            # worker finds no dump for these rids and records that.
            log.error("dump capture failed for rids %s", [r.rid for r in snapshot.rows], exc_info=True)
        return result

    def around_init_attention_backends(self, original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(runner, *args, **kwargs)
        if not getattr(runner, "is_draft_worker", False):
            self.enable_capture(runner.model)
        return result

    def around_logits_forward(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self._armed:
            # args: (logits_processor, input_ids, hidden_states, ...); a reference only, copied after the forward
            self._final = args[2] if len(args) > 2 else kwargs.get("hidden_states")
        return original(*args, **kwargs)

    # --- capture -------------------------------------------------------------------------------

    def enable_capture(self, model: Any) -> None:
        """Turns on EAGLE-3 aux capture unless the server's own flag already did (must precede graph capture)."""
        if getattr(model, "capture_aux_hidden_states", False):
            log.info("EAGLE-3 capture already on (server flag): layers %s", captured_layers(model))
            return
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise RuntimeError(f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang cannot capture it")
        wanted = self.settings.aux_layer_ids
        # SGLang adds one to each id it is given (it captures the input of layer id+1).
        model.set_eagle3_layers_to_capture(None if wanted is None else [i - 1 for i in wanted])
        got = captured_layers(model)
        if wanted is not None and got != wanted:
            log.warning(
                "asked to capture layers %s, %s captures %s: recording %s", wanted, type(model).__name__, got, got
            )
        log.info("EAGLE-3 capture enabled by the eaglet plugin: layers %s", got)

    def _snapshot(self, worker: Any, batch: Any) -> _Snapshot | None:
        if batch is None or batch.forward_mode is None or batch.forward_mode.is_decode_or_idle():
            return None
        reqs = list(batch.reqs)
        if not any(is_eaglet_rid(r.rid) for r in reqs) or not self._worker(worker)[0]:
            return None
        decoding = {id(r) for r in (batch.decoding_reqs or [])}
        rows = plan_rows(
            [r.rid for r in reqs],
            [len(r.origin_input_ids) for r in reqs],
            list(batch.prefix_lens),
            list(batch.extend_lens),
            [id(r) in decoding for r in reqs],
        )
        return _Snapshot(rows) if rows else None

    def _capture(self, worker: Any, snapshot: _Snapshot, result: Any, stashed: torch.Tensor | None) -> None:
        _, layer_ids, model = self._worker(worker)
        out = getattr(result, "logits_output", None)
        aux = getattr(out, "hidden_states", None)
        final = getattr(out, "last_hidden_states", None)
        final = stashed if final is None else final
        needed = max(r.start + r.length for r in snapshot.rows)
        problem = _check_outputs(aux, final, len(layer_ids), needed)
        if problem:
            self._warn_once(problem)
            return
        copies = [(r, copy_rows(aux, r.start, r.length), copy_rows(final, r.start, r.length)) for r in snapshot.rows]
        event = record_event(aux.device)
        for rows, aux_rows, final_rows in copies:
            done = self.collector.add(rows, HostChunk(aux_rows, final_rows, event))
            if done is not None:
                self.writer.submit(DumpJob(done.rid, done.chunks, layer_ids, model))
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 1.0
            self.collector.expire()

    @property
    def writer(self) -> DumpWriter:
        if self._writer is None:
            self._writer = DumpWriter(self.settings.dump_dir)
        return self._writer

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def _worker(self, worker: Any) -> tuple[bool, list[int], str]:
        key = id(worker)
        if key not in self._workers:
            model = worker.model_runner.model
            args = worker.server_args
            name = getattr(args, "served_model_name", None) or args.model_path
            self._workers[key] = (is_writer_rank(), captured_layers(model), str(name))
            log.info("worker %s: writes dumps %s, layers %s, model %s", key, *self._workers[key])
        return self._workers[key]

    def _warn_once(self, problem: str) -> None:
        if problem not in self._warned:
            self._warned.add(problem)
            log.error("no dumps: %s", problem)


def _check_outputs(aux: Any, final: Any, num_aux: int, rows: int) -> str | None:
    if not isinstance(aux, torch.Tensor):
        return (
            "logits_output.hidden_states is empty: launch with the capture flags "
            "(eaglet/services/inference/sglang_launch.py: --enable-return-aux-hidden-states, or "
            "--enable-return-hidden-states before 0.5.23)"
        )
    if not isinstance(final, torch.Tensor):
        return "no final-layer hidden states beside the aux states (logits processor hook not applied?)"
    if aux.shape[0] < rows or final.shape[0] < rows:
        return f"forward output has {aux.shape[0]} / {final.shape[0]} rows, the batch needs {rows}"
    if aux.shape[-1] != num_aux * final.shape[-1]:
        return (
            f"aux states are {aux.shape[-1]} wide, expected {num_aux} x {final.shape[-1]}: "
            "EAGLE-3 capture is off for this model"
        )
    return None


def captured_layers(model: Any) -> list[int]:
    """The layers whose input SGLang captures, in its own convention (``layers_to_capture``)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers_to_capture", None)
    if layers is None:
        layers = getattr(model, "layers_to_capture", None)
    return [int(i) for i in layers or []]


def is_writer_rank() -> bool:
    """Rank 0 of the attention TP group and of the attention CP group writes.

    With DP attention each DP group has its own attention TP group and schedules only its own
    requests, so this is each DP group's rank 0, writing its own requests.
    """
    from sglang.srt.distributed import parallel_state

    return (
        parallel_state.get_attn_tensor_model_parallel_rank() == 0
        and parallel_state.get_attn_context_model_parallel_rank() == 0
    )
