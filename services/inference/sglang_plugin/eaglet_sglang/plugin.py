"""The hooks that SGLang calls, in every scheduler process, and the state they share.

- AROUND ``TpModelWorker.forward_batch_generation``: the one place that sees the ``ScheduleBatch``
  (rids, prefix and extend lengths, in row order) next to the forward's ``logits_output``, the same
  whether the forward ran eagerly or through a CUDA graph. Rows of eaglet requests are copied out
  at once and joined per request; a whole prompt is written by the writer thread.
- AROUND ``ModelRunner.init_attention_backends``: where SGLang itself turns on EAGLE-3 capture,
  before any CUDA graph is captured. After it, the plugin sets the wanted layers in every version
  (translating the ids to the model family's convention) and checks that the model reads exactly
  those, else the server does not start.
- AROUND ``LogitsProcessor.forward``: its ``hidden_states`` argument is the final layer after the
  final norm. Versions with the capture flag hand it back as ``logits_output.last_hidden_states``;
  for the others the hook keeps a reference while an eaglet forward runs.

What a request asks computed on the device (``custom_params``, shared/dumpfile.py ``DumpEncoding``) is computed in the
forward hook, on the forward's outputs, before the copy to the host: fp8-encoded states (the store's encoder), 4-bit
aux states (shared/fp4.py), and the target's top-k distribution in place of the final state (``encode_topk``, from the
final states before any encoding). The top-k needs the target's LM head over its whole real vocabulary, the one the
trainer uses; SGLang's own is padded and sharded across TP ranks (and Gemma's class scores with its embedding), so the
writer rank reads it from the server's model directory (shared/targettensors.py, as the trainer does) at its first
top-k request and keeps it on its GPU: V x H x 2 bytes there in bf16 (Llama 3 8B: 1.05 GB; Kimi-K2.5: 2.35 GB). A
model path that is not a local safetensors checkpoint (a hub id, a GGUF file) cannot serve a top-k: the reason is
logged once and those requests get no dump, which their worker reports.
"""

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eaglet.shared.dumpfile import DumpEncoding, dump_forms, encode_forms
from eaglet.shared.dumpwriter import DEFAULT_CAP_BYTES, DEFAULT_THREADS, DumpWriter
from eaglet.shared.ids import is_eaglet_rid
from eaglet.shared.layers import default_layer_ids, layer_ids_problem, parse_layer_ids, sglang_arg_ids
from eaglet.shared.layout import FP4_BLOCK
from eaglet.shared.targettensors import load_target_tensors
from eaglet.shared.topk import TOPK_PARAM, TOPK_TENSORS, encode_topk, span_rows
from eaglet_sglang import versions
from eaglet_sglang.collector import Collector, Rows, plan_rows
from eaglet_sglang.writer import DumpJob, HostChunk, copy_rows, record_event

log = logging.getLogger(__name__)


CAPTURE_STREAMS = ("forward", "side")


@dataclass(kw_only=True, slots=True)
class DumpSettings:
    """Read from the server process's environment (``from_env``)."""

    dump_dir: Path
    """``EAGLET_DUMP_DIR``: where ``<rid>.safetensors`` appear; shared memory on the host, read by the workers."""
    timeout_s: float = 600.0
    """``EAGLET_DUMP_TIMEOUT_S``: a request whose next chunk does not come within this is dropped (aborted)."""
    aux_layer_ids: list[int] | None = None
    """``EAGLET_AUX_LAYER_IDS`` (e.g. ``2,15,27``), SGLang's convention (the layer whose input is captured), any
    number of them (EAGLE-3's, DFlash's, or both for runs of either). Unset: EAGLE-3's ``default_layer_ids(L)``.
    Checked against the model's layer count at server start."""
    queue_bytes: int = DEFAULT_CAP_BYTES
    """``EAGLET_DUMP_QUEUE_BYTES``: most bytes of dumps held on the host waiting for the disk, per scheduler
    process; when full, the forward waits (back-pressure, shown in /status) rather than growing."""
    writer_threads: int = DEFAULT_THREADS
    """``EAGLET_DUMP_WRITER_THREADS``: dumps written at once, per scheduler process."""
    capture_stream: str = "forward"
    """``EAGLET_CAPTURE_STREAM``: where a GPU runs the capture's kernels and copies to the host. ``forward``: on the
    forward's own stream, after it (the next forward starts once they are done); ``side``: on a stream of the plugin's,
    after the forward, beside the next one (the copies use the copy engines the forward leaves idle, the top-k's
    product shares the SMs)."""
    capture_log_s: float = 60.0
    """``EAGLET_CAPTURE_LOG_S``: how often the capture logs what it cost the forwards since its last line."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"EAGLET_DUMP_TIMEOUT_S={self.timeout_s}: give a positive number of seconds")
        if self.queue_bytes <= 0 or self.writer_threads <= 0:
            raise ValueError(
                f"EAGLET_DUMP_QUEUE_BYTES={self.queue_bytes}, EAGLET_DUMP_WRITER_THREADS={self.writer_threads}: "
                "both must be positive"
            )
        if self.capture_log_s <= 0:
            raise ValueError(f"EAGLET_CAPTURE_LOG_S={self.capture_log_s}: give a positive number of seconds")
        if self.capture_stream not in CAPTURE_STREAMS:
            raise ValueError(f"EAGLET_CAPTURE_STREAM={self.capture_stream!r}: one of {', '.join(CAPTURE_STREAMS)}")
        if self.aux_layer_ids is not None:
            problem = layer_ids_problem(self.aux_layer_ids, None)
            if problem:
                raise ValueError(f"EAGLET_AUX_LAYER_IDS={self.aux_layer_ids}: {problem}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "DumpSettings":
        env = os.environ if env is None else env
        dump_dir = env.get("EAGLET_DUMP_DIR")
        if not dump_dir:
            raise RuntimeError("EAGLET_DUMP_DIR is not set: the SGLang server needs the dump dir the workers read")
        ids = env.get("EAGLET_AUX_LAYER_IDS")
        return cls(
            dump_dir=Path(dump_dir),
            timeout_s=float(env.get("EAGLET_DUMP_TIMEOUT_S", "600")),
            aux_layer_ids=parse_layer_ids(ids, "EAGLET_AUX_LAYER_IDS") if ids else None,
            queue_bytes=int(env.get("EAGLET_DUMP_QUEUE_BYTES", DEFAULT_CAP_BYTES)),
            writer_threads=int(env.get("EAGLET_DUMP_WRITER_THREADS", DEFAULT_THREADS)),
            capture_stream=env.get("EAGLET_CAPTURE_STREAM", "forward"),
            capture_log_s=float(env.get("EAGLET_CAPTURE_LOG_S", "60")),
        )


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """The batch's lists as they were when the forward started (the overlap scheduler mutates them)."""

    rows: list[Rows]
    encodings: dict[str, DumpEncoding]
    """rid -> what its request asked computed on the device (``custom_params``), for every rid of ``rows``."""


@dataclass(slots=True)
class _Worker:
    """What the plugin knows of one ``TpModelWorker``, learnt at its first eaglet forward."""

    writes: bool
    layer_ids: list[int]
    model: str
    """The served name, recorded in each dump."""
    model_path: str
    """Where the server loaded the model from: the LM head of a top-k is read there."""
    lm_head: torch.Tensor | None = None
    """[V, H], read at the first top-k request and kept (on the capture device after the first top-k forward)."""
    lm_head_problem: str | None = None
    """Why it could not be read: no top-k request is served, none is tried again."""


@dataclass(slots=True)
class CaptureClock:
    """What the capture costs the forwards it rides on, logged every ``every_s``: the scheduler thread's time in the
    hook (the next forward's launch waits for it) and, on a GPU, the device's time from the hook's first kernel to
    its last copy (on the forward's stream they run before the next forward). Events are read once they have passed,
    never waited for; at most ``pending.maxlen`` wait to be read."""

    every_s: float = 60.0
    stream: str = "forward"
    """The stream its device work runs on (``DumpSettings.capture_stream``), named in each line."""
    forwards: int = 0
    host_s: float = 0.0
    device_ms: float = 0.0
    timed: int = 0
    pending: deque = field(default_factory=lambda: deque(maxlen=1024))
    since: float = field(default_factory=time.monotonic)

    def add(self, host_s: float, events: "tuple[torch.cuda.Event, torch.cuda.Event] | None") -> None:
        self.forwards, self.host_s = self.forwards + 1, self.host_s + host_s
        if events is not None:
            self.pending.append(events)
        while self.pending and self.pending[0][1].query():
            first, last = self.pending.popleft()
            self.device_ms, self.timed = self.device_ms + first.elapsed_time(last), self.timed + 1
        now = time.monotonic()
        if now - self.since >= self.every_s:
            device = f"{self.device_ms / self.timed:.2f} ms" if self.timed else "not timed (no GPU)"
            log.info("capture: %d forwards in %.0f s; a forward's hook took %.2f ms of the scheduler's time, its "
                     "kernels and copies %s of the device's (%d timed; on the %s stream)", self.forwards,
                     now - self.since, 1e3 * self.host_s / self.forwards, device, self.timed, self.stream)  # fmt: skip
            self.forwards, self.host_s, self.device_ms, self.timed, self.since = 0, 0.0, 0.0, 0, now


class DumpPlugin:
    """Per-process state of the dump hooks: the collector, the writer, what each worker captures."""

    def __init__(self, settings: DumpSettings):
        self.settings = settings
        self.collector = Collector(timeout_s=settings.timeout_s)
        self._writer: DumpWriter | None = None  # started on the first dump: the launcher process never needs one
        self._workers: dict[int, _Worker] = {}  # by id(worker)
        self._armed = False
        self._final: torch.Tensor | None = None
        self._next_expiry = 0.0
        self._warned: set[str] = set()
        self._side: dict[torch.device, torch.cuda.Stream] = {}  # EAGLET_CAPTURE_STREAM=side: one a device
        self.clock = CaptureClock(every_s=settings.capture_log_s, stream=settings.capture_stream)

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
        t0, events = time.perf_counter(), None
        try:
            events = self._capture(worker, snapshot, result, final)
        except Exception:
            # Boundary between SGLang and the plugin: a fault here must not fail the batch. The
            # worker finds no dump for these rids and records that.
            log.error("dump capture failed for rids %s", [r.rid for r in snapshot.rows], exc_info=True)
        self.clock.add(time.perf_counter() - t0, events)
        return result

    def around_init_attention_backends(self, original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(runner, *args, **kwargs)
        if not getattr(runner, "is_draft_worker", False):
            check_prefill_graph(runner.server_args)
            self.enable_capture(runner.model)
        return result

    def around_logits_forward(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self._armed:
            # args: (logits_processor, input_ids, hidden_states, ...); a reference only, copied after the forward
            self._final = args[2] if len(args) > 2 else kwargs.get("hidden_states")
        return original(*args, **kwargs)

    # --- capture -------------------------------------------------------------------------------

    def enable_capture(self, model: Any) -> None:
        """Makes SGLang capture exactly the wanted layers, or refuses to start (must precede graph capture).

        Runs after SGLang's own setup, which may already have called ``set_eagle3_layers_to_capture``
        (the capture flag). Model families read the ids they are given differently (most add one,
        DeepSeek adds one only when the first id is 1, GPT-OSS keeps them when the last is L), so
        each convention is tried in turn and the list the model ends up reading is compared with
        the wanted one. Any number of layers: every family's ``set_eagle3_layers_to_capture`` in 0.5.17 and
        0.5.23 takes a list of any length, and the forward concatenates what it captured (DFlash's own
        ``set_dflash_layers_to_capture`` sets the same list, one up).
        """
        name = type(model).__name__
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise RuntimeError(f"{name} has no set_eagle3_layers_to_capture: SGLang cannot capture it")
        site = capture_site(model)
        wanted = self.settings.aux_layer_ids or default_layer_ids(site.num_layers)
        problem = layer_ids_problem(wanted, site.num_layers)
        if problem:
            raise RuntimeError(f"{name}: aux layer ids {wanted}: {problem}")
        tried: list[str] = []
        for ids in (sglang_arg_ids(wanted), list(wanted)):
            try:
                model.set_eagle3_layers_to_capture(ids)
            except IndexError as e:  # a family that indexes its layers with the ids it is given
                tried.append(f"{ids} -> {e!r}")
                continue
            got = [int(i) for i in site.layers_owner.layers_to_capture]
            if got == wanted:
                break
            tried.append(f"{ids} -> {got}")
        else:
            raise RuntimeError(
                f"{name} cannot capture layers {wanted} (SGLang's convention): set_eagle3_layers_to_capture "
                f"gave {'; '.join(tried)}. Choose other --aux-layer-ids."
            )
        _clear_stale_marks(site.layers_owner, wanted)
        log.info("aux capture of %s: layers %s of %d", name, wanted, site.num_layers)

    def _snapshot(self, worker: Any, batch: Any) -> _Snapshot | None:
        if batch is None or batch.forward_mode is None or batch.forward_mode.is_decode_or_idle():
            return None
        reqs = list(batch.reqs)
        if not any(is_eaglet_rid(r.rid) for r in reqs) or not self._worker(worker).writes:
            return None
        decoding = {id(r) for r in (batch.decoding_reqs or [])}
        rows = plan_rows(
            [r.rid for r in reqs],
            [len(r.origin_input_ids) for r in reqs],
            list(batch.prefix_lens),
            list(batch.extend_lens),
            [id(r) in decoding for r in reqs],
        )
        planned = {r.rid for r in rows}
        encodings = {}
        for req in reqs:
            if req.rid in planned and (encoding := self._encoding(worker, req)) is not None:
                encodings[req.rid] = encoding
        rows = [r for r in rows if r.rid in encodings]
        return _Snapshot(rows, encodings) if rows else None

    def _encoding(self, worker: Any, req: Any) -> DumpEncoding | None:
        """What ``req`` asks computed on the device; None (the reason logged once) for a top-k this worker cannot
        give, and the request is not dumped: a dump without the top-k it asked for would only be refused."""
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        params = params if isinstance(params, dict) else {}
        vocab_size = 0
        if params.get(TOPK_PARAM):
            head = self._lm_head(self._worker(worker))
            if head is None:
                return None
            vocab_size = head.shape[0]
        try:
            return DumpEncoding.from_params(params, vocab_size)
        except ValueError as e:
            self._warn_once(str(e))
            return None

    def _lm_head(self, info: _Worker) -> torch.Tensor | None:
        """The target's LM head as the trainer reads it: the whole real vocabulary, unpadded and unsharded."""
        if info.lm_head is None and info.lm_head_problem is None:
            try:
                info.lm_head = load_target_tensors(Path(info.model_path), ("lm_head",))["lm_head"]
                log.info("LM head of %s read for the top-k: %s", info.model_path, list(info.lm_head.shape))
            except Exception as e:  # any reason at all: the server goes on, these requests get no dump
                info.lm_head_problem = (
                    f"top-k asked, but the LM head cannot be read from the model path {info.model_path!r}, which "
                    f"must be a local directory with config.json and safetensors files ({type(e).__name__}: {e})"
                )
        if info.lm_head_problem is not None:
            self._warn_once(info.lm_head_problem)
        return info.lm_head

    def _capture(
        self, worker: Any, snapshot: _Snapshot, result: Any, stashed: torch.Tensor | None
    ) -> "tuple[torch.cuda.Event, torch.cuda.Event] | None":
        """Encodes the forward's rows as each request asked, queues their copies to the host and hands complete
        dumps to the writer; returns the events around its device work (None on a CPU, or when nothing was kept)."""
        info = self._worker(worker)
        out = getattr(result, "logits_output", None)
        aux = getattr(out, "hidden_states", None)
        final = getattr(out, "last_hidden_states", None)
        final = stashed if final is None else final
        needed = max(r.start + r.length for r in snapshot.rows)
        problem = _check_outputs(aux, final, len(info.layer_ids), needed)
        if problem:
            self._warn_once(problem)
            return None
        assert aux is not None and final is not None  # _check_outputs names a missing one
        encodings = snapshot.encodings
        kept = snapshot.rows
        if aux.shape[-1] % FP4_BLOCK and any(encodings[r.rid].aux_fp4 for r in kept):
            # the run's ingest refuses such a target; a request from elsewhere must not fail the forward's others
            self._warn_once(f"4-bit aux states asked, but the aux states are {aux.shape[-1]} wide, not a multiple of "
                            f"{FP4_BLOCK}: those requests get no dump")  # fmt: skip
            kept = [r for r in kept if not encodings[r.rid].aux_fp4]
            if not kept:
                return None
        with self._capture_stream(aux, final):
            first = record_event(aux.device)
            device = encode_forms(
                aux=aux[:needed], final=final[:needed], wanted=[dump_forms(e) for e in encodings.values()]
            )
            topk = self._topk(info, snapshot, final) if any(e.topk for e in encodings.values()) else {}
            copies = []
            for r in kept:
                forms = dump_forms(encodings[r.rid]).items()
                host = {name: copy_rows(device[form], r.start, r.length) for name, form in forms}
                if r.rid in topk:
                    host.update(zip(TOPK_TENSORS, (copy_rows(t, 0, t.shape[0]) for t in topk[r.rid]), strict=True))
                copies.append((r, host))
            event = record_event(aux.device)
        for rows, host in copies:
            done = self.collector.add(rows, HostChunk(host, event))
            if done is not None:
                job = DumpJob(done.rid, done.chunks, info.layer_ids, info.model, aux.dtype)
                # Blocks while the writer holds its cap of bytes: the forwards slow to the disk's pace.
                self.writer.submit(job.nbytes, partial(job.write, self.settings.dump_dir), f"rid {job.rid}")
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + 1.0
            self.collector.expire()
        return None if first is None or event is None else (first, event)

    def _capture_stream(self, aux: torch.Tensor, final: torch.Tensor) -> "contextlib.AbstractContextManager":
        """The stream the capture's device work is queued on: the current (the forward's), or with
        ``capture_stream="side"`` on a GPU the plugin's side stream, made to wait for the forward's work first. The
        forward's outputs are then read on the side stream while the next forward runs: ``record_stream`` keeps the
        allocator from handing their memory to that forward before the reads are done (prefill forwards run eagerly
        here, their outputs fresh tensors, never a CUDA graph's buffers: see ``check_prefill_graph``)."""
        if self.settings.capture_stream != "side" or not aux.is_cuda:
            return contextlib.nullcontext()
        side = self._side.get(aux.device)
        if side is None:
            side = self._side[aux.device] = torch.cuda.Stream(aux.device)
        side.wait_stream(torch.cuda.current_stream(aux.device))
        for t in (aux, final):
            t.record_stream(side)
        return torch.cuda.stream(side)

    def _topk(
        self, info: _Worker, snapshot: _Snapshot, final: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """rid -> the top-k (ids, log-probs) of its rows, on the device, for the requests that asked: [n, k] crosses
        to the host, never [n, V]. One pass over the rows of all the requests asking the same k; of a request that
        names its positions (its loss spans), only the rows of this chunk among them are scored."""
        assert info.lm_head is not None  # read in _snapshot, else no request here asks for a top-k
        # Moved at the first top-k forward (then .to is a no-op): the head scores the states in their own dtype.
        head = info.lm_head = info.lm_head.to(final.device, final.dtype)
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for k in sorted({e.topk for e in snapshot.encodings.values()} - {0}):
            asked = [r for r in snapshot.rows if snapshot.encodings[r.rid].topk == k]
            picks = [span_rows(snapshot.encodings[r.rid].topk_rows, r.prefix_len, r.length) for r in asked]
            lengths = [r.length if rows is None else len(rows) for r, rows in zip(asked, picks, strict=True)]
            index = torch.cat([torch.arange(r.start, r.start + r.length) if rows is None else rows + r.start
                               for r, rows in zip(asked, picks, strict=True)])  # fmt: skip
            ids, logp = encode_topk(final.index_select(0, index.to(final.device, non_blocking=True)), head, k)
            for r, pair in zip(asked, zip(ids.split(lengths), logp.split(lengths), strict=True), strict=True):
                out[r.rid] = pair
        return out

    @property
    def writer(self) -> DumpWriter:
        if self._writer is None:
            self._writer = DumpWriter(
                self.settings.dump_dir, cap_bytes=self.settings.queue_bytes, threads=self.settings.writer_threads
            )
        return self._writer

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def _worker(self, worker: Any) -> _Worker:
        key = id(worker)
        if key not in self._workers:
            model = worker.model_runner.model
            args = worker.server_args
            name = getattr(args, "served_model_name", None) or args.model_path
            info = _Worker(is_writer_rank(), captured_layers(model), str(name), str(args.model_path))
            self._workers[key] = info
            log.info("worker %s: writes dumps %s, layers %s, model %s", key, info.writes, info.layer_ids, info.model)
        return self._workers[key]

    def _warn_once(self, problem: str) -> None:
        if problem not in self._warned:
            self._warned.add(problem)
            log.error("no dumps: %s", problem)


def _check_outputs(aux: Any, final: Any, num_aux: int, rows: int) -> str | None:
    if not isinstance(aux, torch.Tensor):
        return (
            "logits_output.hidden_states is empty: launch with the capture flags "
            "(services/inference/sglang_launch.py: --enable-return-aux-hidden-states, or "
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


@dataclass(frozen=True, slots=True)
class CaptureSite:
    """Where a served model keeps what the dumps need, found by walking its wrappers."""

    layers_owner: Any
    """The module whose ``layers_to_capture`` the forward reads (its ``layers`` are the decoder layers)."""
    num_layers: int
    logits_owner: Any
    """The module whose ``logits_processor`` gets the final-norm states (and, beside them, the aux states)."""


def _wrapped(model: Any) -> list[Any]:
    """``model`` and what it wraps, breadth first, each module once.

    Multimodal and wrapper classes hold the text model as ``language_model`` and/or ``model``
    (Kimi-K2.5's ``model`` is a property returning ``language_model``); SGLang's own layer lookup
    follows the same two attributes.
    """
    seen: set[int] = set()
    order: list[Any] = []
    queue = [model]
    while queue:
        obj = queue.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        order.append(obj)
        queue += [getattr(obj, "language_model", None), getattr(obj, "model", None)]
    return order


def capture_site(model: Any) -> CaptureSite:
    """Finds the capture list and the final-norm source of ``model``, or raises naming its class."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    modules = _wrapped(model)
    layers_owner = _layers_owner(model, modules)
    logits_owner = next((m for m in modules if hasattr(m, "logits_processor")), None)
    if logits_owner is None or not isinstance(logits_owner.logits_processor, LogitsProcessor):
        raise RuntimeError(
            f"{type(model).__name__}: found no SGLang LogitsProcessor under it (looked through "
            f"{[type(m).__name__ for m in modules]}): the final-norm states are taken from its input"
        )
    return CaptureSite(layers_owner, len(layers_owner.layers), logits_owner)


def _layers_owner(model: Any, modules: list[Any]) -> Any:
    owner = next((m for m in modules if hasattr(m, "layers_to_capture")), None)
    if owner is None or not hasattr(owner, "layers"):
        raise RuntimeError(
            f"{type(model).__name__}: found no module with layers_to_capture and layers under it (looked "
            f"through {[type(m).__name__ for m in modules]} via .language_model / .model): the plugin cannot "
            "check which layers SGLang captures"
        )
    return owner


def captured_layers(model: Any) -> list[int]:
    """The layers whose input SGLang captures, in its own convention (``layers_to_capture``)."""
    return [int(i) for i in _layers_owner(model, _wrapped(model)).layers_to_capture]


def _clear_stale_marks(layers_owner: Any, wanted: list[int]) -> None:
    """Unmarks layers an earlier call marked. Some families (Qwen MoE, Qwen3-Next, MiniMax) flag
    each captured layer as ``_is_layer_to_capture`` and never clear the flag, so SGLang's own call
    with other ids would leave extra layers captured."""
    for i, layer in enumerate(layers_owner.layers):
        if getattr(layer, "_is_layer_to_capture", False) and i not in wanted:
            layer._is_layer_to_capture = False


def check_prefill_graph(server_args: Any) -> None:
    """Refuses a prefill CUDA graph that runs the logits processor inside the graph where the final
    states come from its input (versions without the capture flag): on replay the hook never runs."""
    import sglang

    if versions.has_capture_flag(sglang.__version__):
        return
    backend = server_args.cuda_graph_config.prefill.backend
    if backend == versions.TC_PIECEWISE:
        raise RuntimeError(
            f"SGLang {sglang.__version__} chose the {backend} prefill CUDA graph, which captures the logits "
            "processor: no final-norm states would reach the dumps. Launch with --cuda-graph-backend-prefill "
            "disabled (services/inference/sglang_launch.py does)."
        )


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
