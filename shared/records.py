"""One typed record per Redis hash of a run, and per heartbeat value; the stages and the constants they share.

Redis keeps text; these records parse it once, here, so no other module reads or writes those fields by name.

    Stage                  the run's stage, the truth of where it is (``RunMeta.stage``)
    ACTIVE_STAGES          stages in which prompts are regenerated or samples ingested or extracted
    TRAINER_STAGES         stages in which a trainer process runs (and beats)
    FINISHED_STAGES        stages a run never leaves
    GPUS_RELEASED          the meta field the trainer waits for when it needs the inference service's GPUs
    HEARTBEAT_INTERVAL_S   seconds between two heartbeats of a worker or a trainer, unless set otherwise
    LOST_AFTER_BEATS       a process is lost once its heartbeat is this many intervals old

    RunMeta                RunKeys.meta: settings, stage, flags (unix s) and ingest figures of a run
    TrainProgress          RunKeys.train: the trainer's progress and heartbeat; its state is the run's stage
    EvalResult             RunKeys.eval: the evaluation's figures as they come
    WorkerBeat             one value of keys.WORKERS: a worker's heartbeat (JSON)
    InferenceBeat          one value of keys.INFERENCE: an inference server's health as a worker saw it (JSON)
    GpuBeat                one value of keys.GPUS: the GPUs of an inference supervisor or a trainer, read via NVML
    WorkerState            what a worker is doing (``WorkerBeat.state``)
    WorkerRole             what kind of worker it is (``WorkerBeat.role``)

Hash records: ``to_redis()`` gives the fields that are set, as text, so a record with a few fields is a partial
update; ``from_redis(fields)`` parses a whole ``HGETALL`` reply, ignoring fields it does not know, and reads a
field it cannot parse as unset (a status page must not break on one bad value). Heartbeat records: ``to_redis()``
gives the JSON value, ``from_redis(value)`` parses it.
"""

import json
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any, ClassVar, Self

from .runoptions import RunOptions


class Stage(StrEnum):
    regenerating = "regenerating"  # the target writes the dataset's assistant turns again, before ingest
    ingesting = "ingesting"
    extracting = "extracting"
    extracted = "extracted"  # every sample has an outcome; the trainer has not started yet
    waiting_for_gpus = "waiting_for_gpus"
    training = "training"
    evaluating = "evaluating"
    done = "done"
    failed = "failed"
    cancelled = "cancelled"


ACTIVE_STAGES = frozenset({Stage.regenerating, Stage.ingesting, Stage.extracting})
TRAINER_STAGES = frozenset({Stage.waiting_for_gpus, Stage.training, Stage.evaluating})
FINISHED_STAGES = frozenset({Stage.done, Stage.failed, Stage.cancelled})
GPUS_RELEASED = "gpus_released"
HEARTBEAT_INTERVAL_S = 5.0
LOST_AFTER_BEATS = 3


class WorkerRole(StrEnum):
    extractor = "extractor"  # extracts samples' hidden states through an inference server
    ingest = "ingest"  # reads datasets into runs


class WorkerState(StrEnum):
    idle = "idle"
    busy = "busy"  # extracting ``sample`` of ``run``
    backoff = "backoff"  # the inference server or the disk failed; waiting before the next try
    stopped = "stopped"


def _encode(value: Any) -> str:
    """Text for Redis. A str is kept as given: a JSON field may be handed over already encoded."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, RunOptions):
        return value.to_json()
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def _decode(kind: Any, raw: str) -> Any:
    """``raw`` as ``kind`` (the field's type without its ``| None``); ValueError if it is not one."""
    origin = typing.get_origin(kind) or kind
    if origin is RunOptions:
        return RunOptions.from_json(raw)
    if origin in (list, dict):
        value = json.loads(raw)
        if not isinstance(value, origin):
            raise ValueError(f"{raw[:40]!r} is not a JSON {origin.__name__}")
        item = typing.get_args(kind)[-1] if typing.get_args(kind) else None
        if origin is list and item in (int, float):
            return [item(v) for v in value]
        return value
    if origin is int:
        return int(float(raw))  # HINCRBY and Lua write integers; a float here is a writer's rounding
    return origin(raw)


def _number(value: Any, kind: type) -> Any:
    """A JSON record's optional number as ``kind``; None when absent or not a number (a bad value reads as unset)."""
    try:
        return None if value is None else kind(value)
    except (TypeError, ValueError):
        return None


def _int_list(value: Any) -> list[int] | None:
    """A JSON record's optional list of integers; None when absent or not one."""
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        return None
    return value


def _value_type(hint: Any) -> Any:
    """``int | None`` -> ``int``: every record field is optional, so that partial records are updates."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


class HashRecord:
    """The Redis side of a record stored as a hash, one field per attribute."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]  # every record is a dataclass: ``fields`` reads its fields

    def to_redis(self) -> dict[str, str]:
        return {f.name: _encode(v) for f in fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_redis(cls, raw: dict[str, str]) -> Self:
        hints = typing.get_type_hints(cls)
        parsed = {}
        for f in fields(cls):
            text = raw.get(f.name)
            if text in (None, ""):
                continue
            try:
                parsed[f.name] = _decode(_value_type(hints[f.name]), text)
            except (ValueError, TypeError):
                continue
        return cls(**parsed)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunMeta(HashRecord):
    """The run's settings (written once by ingest), its stage, flags (unix s, set once each) and ingest figures."""

    run_id: str | None = None
    created_at: float | None = None
    stage: Stage | None = None
    error: str | None = None
    """Why the run failed, when it did."""
    dataset: str | None = None
    model: str | None = None
    model_dir: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None
    aux_layer_ids: list[int] | None = None
    """The target's layers whose hidden states the drafter reads (EAGLE-3), as ingest expects the server to capture
    them; what was captured is ``captured_layers``."""
    captured_layers: list[int] | None = None
    """The layers the run's stored hidden states were captured at (the dumps' ``aux_layer_ids``): set once, by the
    first dump checked; a dump of other layers is refused. The drafter's config.json records these."""
    options: RunOptions | None = None
    """The options the run was started with; ingest fixes its ``max_tokens`` and ``store_dtype``."""
    regenerate_input: str | None = None
    """The prompts or conversations a run that starts with regeneration was given; ``dataset`` is then the
    regenerated file, once written."""
    regenerated_at: float | None = None
    """When the regenerated file was written."""
    ingest_cursor: dict | None = None
    """Where ingest last flushed: a resumed ingest starts there."""
    ingest_deaths: int | None = None
    """Times the process ingesting the run died."""
    extraction_started_at: float | None = None
    ingested_at: float | None = None
    total: int | None = None
    """Samples in the run; unset while ingest is still counting them."""
    total_tokens: int | None = None
    bad_lines: int | None = None
    truncated: int | None = None
    loss_tokens: int | None = None
    extraction_complete: float | None = None
    """When the last sample got its outcome; set once, by the mark that gave it."""
    gpus_released: float | None = None
    """When the inference service stopped, leaving its GPUs to the trainer."""
    released_gpus: list[str] | None = None
    """The GPUs the stopped server could use, in the host's numbering (shared/gpus.py); empty: none."""
    eval_request: str | None = None
    """The evaluation the trainer left to the evaluation service (services/trainer/evaluator.py), as JSON: the run
    waits in ``evaluating`` for it; None: the trainer evaluates, or no evaluation."""
    eval_attempts: int | None = None
    """Evaluations the evaluation service started for the run (one whose evaluator died is claimed again)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainProgress(HashRecord):
    """The trainer's progress (rank 0), its heartbeat, and the trainings started for the run. Whether it waits,
    trains or is done is the run's stage, not a field here."""

    step: int | None = None
    total_steps: int | None = None
    epoch: int | None = None
    epochs: int | None = None
    loss: float | None = None
    acc: list[float] | None = None
    """Top-1 accuracy of each draft position (training-time-test step) in the newest logged step, over every loss
    position (with the OOV mask on, one whose target token is outside the draft vocabulary counts as a miss)."""
    lr: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    heldout_loss: float | None = None
    heldout_acc: list[float] | None = None
    train_samples: int | None = None
    heldout_samples: int | None = None
    draft_vocab_size: int | None = None
    ttt_steps: int | None = None
    world_size: int | None = None
    device: str | None = None
    last_checkpoint: str | None = None
    drafter_dir: str | None = None
    started_at: float | None = None
    updated_at: float | None = None
    finished_at: float | None = None
    beat_at: float | None = None
    """The trainer process's heartbeat: one that dies or hangs shows as ``trainer_lost``."""
    host: str | None = None
    pid: int | None = None
    follow_attempts: int | None = None
    """Trainings the trainer service started for the run, resumptions included."""
    selection: str | None = None
    """Which kept epoch's drafter the run exported and on what figure (``--select-by``, ``selection.py``); None:
    the last one, nothing chosen."""
    unreadable_samples: int | None = None
    """Samples whose stored file the trainer could not read (truncated, a bad header), each counted once: skipped,
    each one's error among the run's errors."""

    @property
    def accuracy(self) -> float | None:
        """Top-1 accuracy of the first draft position: the figure the status shows."""
        return self.acc[0] if self.acc else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtractionCounts(HashRecord):
    """A run's extraction counters (the hash ``RunKeys(run).counts``). Written field by field by the marks' Lua
    scripts and HINCRBY, so that a retried job never counts twice; read whole, as this record."""

    done: int = 0
    failed: int = 0
    tokens: int = 0
    """Tokens of the stored samples."""
    bytes: int = 0
    """Bytes of the stored samples' files."""
    retries: int = 0
    errors: int = 0
    """Errors recorded (a sample may fail several times before it is given up)."""
    last_done_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RegenCounts(HashRecord):
    """A regeneration's plan and counters (the hash ``RunKeys(run).regen``): the plan writes ``total``, ``batches``
    and ``started_at`` (``total`` last: the commit point); the marks' Lua script the rest."""

    total: int | None = None
    """Prompts in the input; None until the plan is written."""
    batches: int = 0
    done: int = 0
    failed: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    retries: int = 0
    started_at: float | None = None
    last_done_at: float | None = None
    complete: float | None = None
    """When the last prompt got its outcome."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalResult(HashRecord):
    """Speculative decoding with the run's drafter. The evaluation also runs on its own (``eaglet eval``), outside
    the run's stages, so it keeps its own ``state``: running, done or failed."""

    state: str | None = None
    error: str | None = None
    prompts: int | None = None
    k: int | None = None
    max_new_tokens: int | None = None
    prompts_done: int | None = None
    accept_length: float | None = None
    accept_rate: list[float] | None = None
    """Acceptance rate of each draft position."""
    rounds: int | None = None
    new_tokens: int | None = None
    target_s: float | None = None
    spec_s: float | None = None
    speedup: float | None = None
    target_tok_s: float | None = None
    spec_tok_s: float | None = None
    mismatches: int | None = None
    predicted_accept_length: float | None = None
    """What the run's held-out accuracy per draft position predicts at this ``k`` (shared/acceptance.py): served
    far below it, the engine is not running the drafter as trained."""
    engine: str | None = None
    """The engine that decoded: ``reference`` (eaglet's own speculative decoding) or ``sglang`` (the target alone,
    then with the drafter, each in its own SGLang server; services/trainer/served.py)."""
    engine_flags: str | None = None
    """The flags of the server that served the drafter (``sglang``): the chain, the drafter, the extra flags."""
    target_quantization: str | None = None
    """How the engine quantized the target (``fp8``); None: as stored. The drafter is never quantized."""
    started_at: float | None = None
    updated_at: float | None = None
    finished_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerBeat:
    """A worker's state at ``ts``. ``instance`` is unique per process: a worker restarted under the
    same name is a new instance, so the jobs the old one had started are known to be abandoned."""

    worker: str
    state: WorkerState
    ts: float
    instance: str = ""
    role: WorkerRole = WorkerRole.extractor
    host: str = ""
    pid: int | None = None
    inference_url: str = ""
    run: str = ""
    sample: str = ""
    detail: str = ""
    """Why it is in backoff."""
    disk_free: int | None = None
    """Free bytes of the data volume as the worker sees it."""
    disk_total: int | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Where its recent samples' time went, in mean seconds per stage."""
    samples_per_s: float | None = None
    """Samples it stored per second over its last minute: summed per inference server in the status."""
    tokens_per_s: float | None = None

    def lost(self, now: float, lost_after_s: float) -> bool:
        """No heartbeat for ``lost_after_s``: the worker died or hangs. One that stopped cleanly is not lost."""
        return now - self.ts > lost_after_s and self.state != WorkerState.stopped

    def to_redis(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_redis(cls, value: str) -> Self:
        raw = json.loads(value)
        return cls(
            worker=str(raw.get("worker") or ""),
            state=WorkerState(raw.get("state") or WorkerState.idle),
            ts=float(raw.get("ts") or 0),
            instance=str(raw.get("instance") or ""),
            role=WorkerRole(raw.get("role") or WorkerRole.extractor),
            host=str(raw.get("host") or ""),
            pid=raw.get("pid"),
            inference_url=str(raw.get("inference_url") or ""),
            run=str(raw.get("run") or ""),
            sample=str(raw.get("sample") or ""),
            detail=str(raw.get("detail") or ""),
            disk_free=raw.get("disk_free"),
            disk_total=raw.get("disk_total"),
            stage_seconds={str(k): float(v) for k, v in (raw.get("stage_seconds") or {}).items()},
            samples_per_s=_number(raw.get("samples_per_s"), float),
            tokens_per_s=_number(raw.get("tokens_per_s"), float),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class InferenceBeat:
    """An inference server's health at ``ts``, as the workers that use it report it."""

    url: str
    ok: bool
    ts: float
    detail: str = ""
    host: str = ""
    """The host of the workers that report it (``EAGLET_HOST_NAME``): one URL may name a server on every host."""
    model: str = ""
    """The model the server says it serves (its path's last part)."""
    hidden_size: int | None = None
    num_layers: int | None = None
    aux_layer_ids: list[int] | None = None
    """The layers it captures, from the server, else from the newest dump its workers stored."""
    dump_wait_fraction: float | None = None
    """Share of the recent time the server's forwards waited for its dump writer (the worst writer process):
    back-pressure from the dump folder (shared/dumpwriter.py). None: no writer figures seen."""
    dump_queued_bytes: int | None = None
    dump_cap_bytes: int | None = None

    def to_redis(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_redis(cls, value: str) -> Self:
        raw = json.loads(value)
        return cls(
            url=str(raw.get("url") or ""),
            ok=bool(raw.get("ok")),
            ts=float(raw.get("ts") or 0),
            detail=str(raw.get("detail") or ""),
            host=str(raw.get("host") or ""),
            model=str(raw.get("model") or ""),
            hidden_size=_number(raw.get("hidden_size"), int),
            num_layers=_number(raw.get("num_layers"), int),
            aux_layer_ids=_int_list(raw.get("aux_layer_ids")),
            dump_wait_fraction=_number(raw.get("dump_wait_fraction"), float),
            dump_queued_bytes=_number(raw.get("dump_queued_bytes"), int),
            dump_cap_bytes=_number(raw.get("dump_cap_bytes"), int),
        )


class GpuRole(StrEnum):
    inference = "inference"  # the inference service's supervisor, for its server's GPUs
    trainer = "trainer"  # the trainer (rank 0), for the GPUs of its host it trains on


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuStat:
    """One GPU as NVML reads it."""

    index: int
    name: str = ""
    utilization: float | None = None
    """Percent of the last sample period in which a kernel ran (NVML's GPU utilization)."""
    memory_used: int | None = None
    memory_total: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuBeat:
    """The GPUs one process uses, at ``ts``. ``gpus`` is None where they cannot be read (``detail`` says why)."""

    role: GpuRole
    host: str
    ts: float
    pid: int | None = None
    run: str = ""
    """The run a trainer trains; empty for an inference server, which serves every run."""
    gpus: list[GpuStat] | None = None
    detail: str = ""

    def to_redis(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_redis(cls, value: str) -> Self:
        raw = json.loads(value)
        gpus = raw.get("gpus")
        return cls(
            role=GpuRole(raw.get("role") or GpuRole.inference),
            host=str(raw.get("host") or ""),
            ts=float(raw.get("ts") or 0),
            pid=_number(raw.get("pid"), int),
            run=str(raw.get("run") or ""),
            gpus=None
            if not isinstance(gpus, list)
            else [
                GpuStat(
                    index=int(g.get("index", i)),
                    name=str(g.get("name") or ""),
                    utilization=_number(g.get("utilization"), float),
                    memory_used=_number(g.get("memory_used"), int),
                    memory_total=_number(g.get("memory_total"), int),
                )
                for i, g in enumerate(gpus)
                if isinstance(g, dict)
            ],  # fmt: skip
            detail=str(raw.get("detail") or ""),
        )
