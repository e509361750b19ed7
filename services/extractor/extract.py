"""Extracting one sample: send its prompt, take the dump named by the request id, check it, store it.

Each attempt has its own rid (``eaglet:<run>:<sample>:<attempt>``), so a dump left by an earlier
attempt or another request can never be taken for this one.

Every dump records the layers the server captured, and a run names the layers it stores (``RunOptions.aux_layer_ids``,
fixed at ingest from its method's default where it gave none): the worker takes those out of the dump, in the run's
order, so one server capturing several drafters' layers (EAGLE-3's and DFlash's) serves runs of each. A dump without
one of the run's layers fails its sample at once, naming the layers and the server setting that captures them: the
same server would give the same on every retry. The first dump stored sets the run's captured layers
(``RunMeta.captured_layers``, once); a run recorded before runs named their layers stores each dump's own, and a
later dump of other layers is refused the same way.
"""

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from redis import Redis

from eaglet.services.extractor.exceptions import SampleRejected, Transient
from eaglet.shared.config import Settings
from eaglet.shared.dumpfile import (
    FP8_ENCODING,
    Dump,
    DumpEncoding,
    DumpInvalid,
    LayersMissing,
    dump_path,
    read_dump,
    validate_dump,
)
from eaglet.shared.ids import make_rid
from eaglet.shared.layout import Layout
from eaglet.shared.records import RunMeta
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.samples import Sample, SampleSet
from eaglet.shared.store import StoreError, sample_is_complete, sample_path, samples_dir, write_sample
from eaglet.shared.topk import loss_spans

log = logging.getLogger(__name__)


class LayersDisagree(SampleRejected):
    """The dump's captured layers are not the run's: no retry on the same server can give others."""


@dataclass
class Extractor:
    """What a worker keeps between jobs: its connections and the runs' sample sets, opened once."""

    redis: Redis
    http: httpx.Client
    data_dir: Path
    dump_dir: Path
    worker: str
    instance: str = ""
    """Unique per process (see shared/heartbeats.py); names the temp files this process writes."""
    dump_wait_s: float = 60.0
    store_dtype: str = "model"
    """How the hidden states of a run whose record names no storage are stored (shared/store.py)."""
    max_attempts: int = 4
    backoff_s: tuple[float, ...] = (1, 2, 5, 10, 30, 60)
    max_transient_s: float = 3600.0
    on_state: Callable[[str, str, str, str], None] | None = None  # (state, run, sample, detail) for the heartbeat
    on_stored: Callable[[int, dict[str, float]], None] | None = None  # tokens, seconds per stage of a stored sample
    captured: tuple[int, list[int]] | None = None
    """Hidden size and captured layers of the newest dump checked: what the server captures, as it wrote it."""
    _samples: dict[str, SampleSet] = field(default_factory=dict)
    _meta: dict[str, RunMeta] = field(default_factory=dict)
    _layers: dict[str, list[int]] = field(default_factory=dict)
    """Each run's captured layers, once known: set once in Redis, they never change."""

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        redis: Redis,
        *,
        worker: str,
        instance: str = "",
        on_state: Callable[[str, str, str, str], None] | None = None,
        on_stored: Callable[[int, dict[str, float]], None] | None = None,
    ) -> "Extractor":
        """The extractor of a process named ``worker``: ``redis`` its (decoded) client, a client of its own for the
        inference server."""
        return cls(
            redis=redis,
            http=httpx.Client(base_url=settings.inference_url, timeout=settings.request_timeout_s),
            data_dir=settings.data_dir,
            dump_dir=settings.dump_dir,
            worker=worker,
            instance=instance,
            dump_wait_s=settings.dump_wait_s,
            max_attempts=settings.max_attempts,
            store_dtype=settings.store_dtype,
            on_state=on_state,
            on_stored=on_stored,
        )

    def extract(self, run_id: str, index: int) -> str:
        """Runs one job to an outcome in Redis; returns what happened, for the job's log."""
        state = RunState(self.redis, run_id)
        stage = state.stage()
        if stage in (Stage.cancelled, Stage.failed):
            return f"run {stage}"  # a failed run's ingest stopped: its samples are not wanted
        if state.is_done(index):
            return "already done"
        sample = self.sample_set(run_id)[index]
        path = sample_path(self.data_dir, run_id, sample.sample_id)
        if sample_is_complete(path, len(sample.input_ids), int(sample.loss_mask[1:].sum())):
            # Stored by an earlier attempt whose mark was lost (a crash between rename and mark).
            state.mark_done(index, len(sample.input_ids), path.stat().st_size)
            return "found stored"
        return self._extract_with_retries(state, sample, path)

    def _extract_with_retries(self, state: RunState, sample: Sample, path: Path) -> str:
        rejected, waited, backoff = 0, 0.0, 0
        while True:
            attempt = state.start_attempt(sample.index, self.worker, self.instance)
            timings: dict[str, float] = {}
            try:
                nbytes = self._attempt(state, sample, path, attempt, timings)
            except Transient as e:
                delay = self.backoff_s[min(backoff, len(self.backoff_s) - 1)]
                backoff += 1
                waited += delay
                state.record_error(sample.index, sample.sample_id, f"transient: {e}", self.worker)
                if waited > self.max_transient_s:
                    state.mark_failed(sample.index, sample.sample_id, f"gave up after {waited:.0f}s: {e}", self.worker)
                    return "failed"
                log.warning("%s: sample %s: %s; retrying in %.0fs", self.worker, sample.sample_id, e, delay)
                self.report("backoff", state.run_id, sample.sample_id, str(e))
                time.sleep(delay)
                continue
            except SampleRejected as e:
                rejected += 1
                if rejected >= self.max_attempts or isinstance(e, LayersDisagree):
                    state.mark_failed(sample.index, sample.sample_id, str(e), self.worker)
                    return "failed"
                state.record_error(sample.index, sample.sample_id, f"attempt {attempt}: {e}", self.worker)
                log.warning("%s: sample %s attempt %d rejected: %s", self.worker, sample.sample_id, attempt, e)
                continue
            state.mark_done(sample.index, len(sample.input_ids), nbytes)
            if self.on_stored is not None:
                self.on_stored(len(sample.input_ids), timings)
            return "done (" + ", ".join(f"{stage} {seconds:.3f}s" for stage, seconds in timings.items()) + ")"

    def _attempt(self, state: RunState, sample: Sample, path: Path, attempt: int, timings: dict[str, float]) -> int:
        """One try; ``timings`` gets the seconds of each stage, for the job's log line: where a worker's time goes."""
        rid = make_rid(state.run_id, sample.sample_id, attempt)
        self.report("busy", state.run_id, sample.sample_id, "")
        dump_file = dump_path(self.dump_dir, rid)
        self._drop_old_dumps(state.run_id, sample.sample_id, attempt)
        clock = time.perf_counter()

        def lap(stage: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[stage] = now - clock
            clock = now

        store = self.store_dtype_of(state)
        meta = self._run_meta(state)
        layout = meta.options.layout() if meta.options else Layout()  # none recorded: every state, as dumped
        # The server computes on its device what saves host work: the top-k distribution in place of the final state
        # (it alone has the LM head), fp8 states (half the bytes to move and write), 4-bit aux states (a quarter).
        # A run storing fp8 with 4-bit aux states gets its final state at full width and encodes it here: fp8 then
        # 4-bit would round the aux states twice.
        # A top-k kept at loss positions is scored at those rows only: the request names them (a few spans).
        spans = loss_spans(torch.from_numpy(sample.loss_mask)) if layout.topk_rows == "loss" else None
        encoding = DumpEncoding(fp8=store == "fp8" and layout.aux == "full", topk=layout.topk,
                                aux_fp4=layout.aux == "fp4", topk_rows=spans)  # fmt: skip
        try:
            self._prefill(rid, sample, encoding)
            lap("prefill")
            dump = self._wait_for_dump(dump_file, rid)
            lap("dump_wait")
            validate_dump(dump, rid=rid, num_tokens=len(sample.input_ids), hidden_size=meta.hidden_size,
                          topk=layout.topk, vocab_size=meta.vocab_size, aux_fp4=encoding.aux_fp4,
                          topk_rows=encoding.topk_length(len(sample.input_ids)))  # fmt: skip
            if dump.fp8 != encoding.fp8:
                raise DumpInvalid(f"dump {rid}: storage {dump.metadata.get('storage')!r}, but this worker asked for "
                                  f"{FP8_ENCODING if encoding.fp8 else 'full width'}")  # fmt: skip
            self.captured = (dump.hidden_size, dump.aux_layer_ids)
            dump = self._run_layers(state, sample, dump, rid, meta.options.aux_layer_ids if meta.options else None)
            lap("check")
            tensors = {
                "input_ids": torch.from_numpy(sample.input_ids),
                "loss_mask": torch.from_numpy(sample.loss_mask),
                **dump.states,
            }
            metadata = {**dump.metadata, "run_id": state.run_id, "sample_id": sample.sample_id}
            try:
                nbytes = write_sample(path, tensors, metadata, writer=self.instance or None,
                                      store_dtype=store, layout=layout, slices=dump.slices)  # fmt: skip
            except StoreError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
                    raise Transient(f"data volume: {e}") from e
                raise
            lap("store")
            return nbytes
        except DumpInvalid as e:
            raise SampleRejected(str(e)) from e
        finally:
            dump_file.unlink(missing_ok=True)

    def _run_layers(self, state: RunState, sample: Sample, dump: Dump, rid: str, wanted: list[int] | None) -> Dump:
        """The dump reduced to the layers the run stores (``wanted``; None: the dump's own); the first dump stored
        sets the run's captured layers, and a dump that cannot give them is refused."""
        if wanted is not None:
            captured = dump.aux_layer_ids
            try:
                dump = dump.with_layers(wanted)
            except LayersMissing as e:
                both = ",".join(map(str, sorted(set(captured) | set(wanted))))
                raise LayersDisagree(
                    f"sample {sample.sample_id}: the run stores layers {wanted}, its dump {rid} holds layers "
                    f"{captured}, without {e.missing}: set the inference server's EAGLET_AUX_LAYER_IDS to capture "
                    f"them (EAGLET_AUX_LAYER_IDS={both} serves this run and the server's others)"
                ) from e
        layers = dump.aux_layer_ids
        run_layers = self._layers.get(state.run_id)
        if run_layers is None:
            run_layers = self._layers[state.run_id] = state.claim_captured_layers(layers)
        if layers != run_layers:
            raise LayersDisagree(
                f"sample {sample.sample_id}: its dump captured layers {layers}, the run's samples were captured at "
                f"layers {run_layers}; one run's samples must all come from the same layers (is this inference "
                "server set to capture other layers than the one that extracted the first samples?)"
            )
        return dump

    def _drop_old_dumps(self, run_id: str, sample_id: str, attempt: int) -> None:
        # Dumps of earlier attempts whose worker died, or whose answer never came (a server killed after it
        # wrote the file): never read again, since each attempt has its own rid, so only removed, by name.
        for earlier in range(max(1, attempt - 64), attempt):
            dump_path(self.dump_dir, make_rid(run_id, sample_id, earlier)).unlink(missing_ok=True)

    def store_dtype_of(self, state: RunState) -> str:
        """The run's storage, fixed in its record at ingest; this worker's own setting for a run that has none."""
        options = self._run_meta(state).options
        return (options.store_dtype if options else None) or self.store_dtype

    def _prefill(self, rid: str, sample: Sample, encoding: DumpEncoding) -> None:
        params: dict = {"max_new_tokens": 1, "temperature": 0}
        if encoding.params():
            params["custom_params"] = encoding.params()
        body = {"input_ids": sample.input_ids.tolist(), "rid": rid, "sampling_params": params}
        try:
            response = self.http.post("/generate", json=body)
        except httpx.TransportError as e:
            raise Transient(f"inference server unreachable ({type(e).__name__}: {e})") from e
        if response.status_code >= 500 or response.status_code == 429:
            raise Transient(f"inference server answered {response.status_code}: {response.text[:200]}")
        if response.status_code != 200:
            raise SampleRejected(
                f"inference server refused the request ({response.status_code}): {response.text[:300]}"
            )
        prompt_tokens = response.json().get("meta_info", {}).get("prompt_tokens")
        if prompt_tokens != len(sample.input_ids):
            raise SampleRejected(f"server saw {prompt_tokens} prompt tokens, sent {len(sample.input_ids)}")

    def _wait_for_dump(self, dump_file: Path, rid: str):
        # SGLang's plugin writes from a background thread: the answer may come before the file.
        deadline = time.monotonic() + self.dump_wait_s
        delay = 0.002
        while not dump_file.exists():
            if time.monotonic() > deadline:
                raise SampleRejected(f"no dump for rid {rid} after {self.dump_wait_s:.0f}s (is the dump plugin on?)")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)  # a dump of a long prompt takes ~0.1 s to write: poll finely
        return read_dump(dump_file)

    def sample_set(self, run_id: str) -> SampleSet:
        if run_id not in self._samples:
            self._samples[run_id] = SampleSet(samples_dir(self.data_dir, run_id))
        return self._samples[run_id]

    def _run_meta(self, state: RunState) -> RunMeta:
        """The run's settings, read once: ingest writes them before it queues the first sample."""
        if state.run_id not in self._meta:
            meta = state.meta()
            if meta.hidden_size is None:
                raise RuntimeError(f"run {state.run_id}: no hidden_size in its meta (was it created by ingest?)")
            self._meta[state.run_id] = meta
        return self._meta[state.run_id]

    def report(self, what: str, run_id: str, sample_id: str, detail: str) -> None:
        if self.on_state is not None:
            self.on_state(what, run_id, sample_id, detail)
