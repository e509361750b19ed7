"""The status figures of every run, computed in one place for the gateway, its metrics and ``eaglet status``.

Every figure comes from what the writers keep (``runstate.py``, ``heartbeats.py``): counters,
capped lists and small hashes, read in one pipelined round trip. Nothing here scans keys, bitmaps or files,
so a read costs the same at 1 K samples and at 10 M.
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from redis import Redis

from eaglet.shared import keys
from eaglet.shared.heartbeats import parse_inference, parse_workers
from eaglet.shared.keys import RunKeys
from eaglet.shared.layout import Layout, run_bytes_per_token
from eaglet.shared.records import (
    ACTIVE_STAGES,
    HEARTBEAT_INTERVAL_S,
    LOST_AFTER_BEATS,
    TRAINER_STAGES,
    EvalResult,
    GpuBeat,
    GpuRole,
    GpuStat,
    RunMeta,
    Stage,
    TrainProgress,
    WorkerBeat,
    WorkerRole,
)
from eaglet.shared.runstate import RECENT_CAP
from eaglet.shared.statustext import describe, duration

RATE_SAMPLES = 256
"""Newest completions read for the rates: when all of them lie inside the window, the window shrinks to the
time they span. Reading all RECENT_CAP entries costs ~5 ms of parsing per request for no better figure."""
AlertKind = Literal["stalled", "workers_lost", "trainer_lost", "disk", "error_rate"]


@dataclass(kw_only=True, slots=True)
class StatusConfig:
    """Thresholds of the figures and alerts. Built from settings by the entry points."""

    window_s: float = 60.0
    """Rates (samples/s, tokens/s) and the recent error rate are taken over this many seconds."""
    stall_factor: float = 5.0
    """Stalled: no completion for this many times the usual interval between completions..."""
    stall_min_s: float = 60.0
    """...and never for less than this (a run of a few slow samples is not stalled)."""
    lost_after_s: float = LOST_AFTER_BEATS * HEARTBEAT_INTERVAL_S
    """A worker whose heartbeat is older than this is lost (a few heartbeat intervals)."""
    forget_after_s: float = 300.0
    """A worker, server or GPU report silent for this long past ``lost_after_s`` leaves the tables (a dead worker is
    then only counted, in ``workers_gone``): what died minutes ago is the run's history, not its present."""
    eta_hold_min_s: float = 15.0
    """The ETA is withheld (the run is stalled) while no completion came for ``stall_factor`` times the usual
    interval, and never sooner than this or ``stall_min_s``: a batching server finishes many samples at once, then
    none for a few seconds. The stalled alert waits for ``stall_min_s``."""
    error_rate_threshold: float = 0.05
    """Alert when the share of failed attempts goes above this."""
    error_rate_min_attempts: int = 10
    """...once at least this many attempts were made: two errors in the first three samples are noise."""
    last_errors: int = 10
    """How many of the newest errors each run shows."""

    def __post_init__(self):
        for name in ("window_s", "stall_factor", "stall_min_s", "lost_after_s", "forget_after_s", "eta_hold_min_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"status config {name}={getattr(self, name)}: must be > 0")
        if not 0 <= self.error_rate_threshold <= 1:
            raise ValueError(f"error_rate_threshold={self.error_rate_threshold}: give a share between 0 and 1")


class ErrorEntry(BaseModel):
    index: int = Field(description="Sample index; -1 for an ingest error (a bad line)")
    sample_id: str = Field(description="Sample id, or file:line for an ingest error")
    reason: str
    worker: str = ""
    final: bool = Field(False, description="True if the sample was given up (recorded as failed)")
    ts: float


class Extraction(BaseModel):
    total: int | None = Field(description="Samples in the run; null while ingest is still counting them")
    done: int
    failed: int
    in_flight: int
    remaining: int | None
    percent: float | None = Field(description="Samples with an outcome (done or failed) over total, in %")
    samples_per_s: float = Field(description="Completions per second over the recent window")
    tokens_per_s: float
    eta_s: float | None = Field(
        description="Tokens of the samples left over tokens_per_s (samples differ in length, tokens are the work); "
        "null when unknown"
    )
    tokens_remaining: int | None = Field(None, description="Tokens of the samples without an outcome")
    stalled_since: float | None = Field(
        None,
        description="When the newest sample completed, while none has for longer than the usual interval "
        "allows: the ETA is withheld (null) until samples complete again",
    )
    error_rate: float | None = Field(description="Failed samples over samples with an outcome")
    recent_error_rate: float | None = Field(description="Errored attempts over all attempts in the recent window")
    recent_attempts: int = Field(description="Attempts (completions and errors) in the recent window")
    errors: int = Field(description="Errors recorded so far, transient ones and ingest errors included")
    retries: int
    started_at: float | None
    completed_at: float | None
    last_done_at: float | None
    seconds_since_last_done: float | None
    last_errors: list[ErrorEntry]
    wall_s: float | None = Field(None, description="From the start of extraction to its end, once complete")
    mean_samples_per_s: float | None = Field(None, description="Samples with an outcome over wall_s, once complete")
    mean_tokens_per_s: float | None = Field(None, description="Tokens stored over wall_s, once complete")


class Regeneration(BaseModel):
    total: int | None = Field(description="Prompts in the input; null while it is being cut into batches")
    done: int
    failed: int = Field(description="Prompts given up: bad lines, or the endpoint kept failing (see last_errors)")
    remaining: int | None
    percent: float | None
    prompts_per_s: float = Field(description="Prompts answered per second over the recent window")
    tokens_in: int = Field(description="Prompt tokens sent, every turn of every conversation")
    tokens_out: int = Field(description="Tokens the target wrote")
    tokens_out_per_s: float
    eta_s: float | None = Field(
        description="Prompts left over prompts_per_s: an answer's length is not known before it is written"
    )
    retries: int = Field(description="Requests tried again (429, 5xx, timeouts)")
    error_rate: float | None = Field(description="Failed prompts over prompts with an outcome")
    started_at: float | None
    completed_at: float | None = Field(description="When the regenerated file was written")
    last_done_at: float | None
    seconds_since_last_done: float | None
    stalled_since: float | None = Field(None, description="As extraction's: the ETA is withheld meanwhile")
    wall_s: float | None = Field(None, description="From the start of regeneration to the file, once written")
    mean_prompts_per_s: float | None = None
    mean_tokens_out_per_s: float | None = None


class Storage(BaseModel):
    bytes_written: int
    tokens_written: int
    bytes_per_token: float | None
    layout: str | None = Field(None, description="What the run keeps of the states: final state, aux states")
    expected_bytes_per_token: float | None = Field(
        None,
        description="The run's storage counted (eaglet/shared/layout.py): the projection's, until a sample is stored",
    )
    total_tokens: int | None = Field(description="Tokens of every ingested sample")
    projected_total_bytes: int | None = Field(
        description="bytes_per_token (else expected_bytes_per_token) x total_tokens"
    )
    projected_remaining_bytes: int | None = Field(description="What is still to be written")
    disk_free: int | None = Field(description="Free bytes on the data volume")
    disk_total: int | None


class Training(BaseModel):
    step: int | None
    total_steps: int | None
    percent: float | None
    loss: float | None
    accuracy: float | None = Field(description="Top-1 accuracy of the first draft position")
    accuracy_per_position: list[float] | None = Field(description="One accuracy per training-time-test step")
    tokens_per_s: float | None
    eta_s: float | None
    last_checkpoint: str | None
    state: str | None = Field(description="The trainer's state, from the run's stage: waiting, training, done, failed")
    error: str | None = Field(description="Why the training failed, when it did")
    seconds_since_update: float | None
    seconds_since_beat: float | None = Field(description="Age of the trainer process's heartbeat")


class Alert(BaseModel):
    kind: AlertKind
    message: str


class RunStatus(BaseModel):
    run_id: str
    stage: Stage
    created_at: float | None
    dataset: str | None
    model: str | None
    error: str | None = Field(description="Why the run failed, when it did")
    regeneration: Regeneration | None = Field(None, description="Only for a run that starts with regeneration")
    extraction: Extraction
    storage: Storage
    training: Training
    evaluation: dict[str, float | str] = Field(description="Acceptance length and friends, once evaluated")
    alerts: list[Alert]
    verdict: str = Field("", description="In a few words: running, stalled for 3 min ..., waiting for GPUs, "
                         "training, done, failed: reason")  # fmt: skip
    brief: str = Field("", description="The run in one line: done / total and percent, rates, errors and their "
                       "share, disk used and free, ETA, its GPUs, the verdict")  # fmt: skip
    lines: dict[str, str] = Field(
        default_factory=dict,
        description="One line of words per stage the run has: regeneration, extraction, "
        "storage, training, evaluation (what the page and `eaglet status` print)",
    )


class WorkerStatus(BaseModel):
    name: str
    state: str
    role: WorkerRole
    host: str
    pid: int | None
    inference_url: str
    run: str
    sample: str
    detail: str
    seconds_since_heartbeat: float
    lost: bool
    stage_seconds: dict[str, float] = Field(
        description="Mean seconds of each stage of its recent samples: prefill (waiting on the inference server), "
        "dump_wait, check, store. A worker mostly in prefill is waiting on the server; in store, on the disk"
    )


class InferenceStatus(BaseModel):
    url: str
    host: str = Field("", description="the host of the workers that use it (EAGLET_HOST_NAME)")
    ok: bool
    healthy: bool = Field(description="ok, and reported within the lost-after interval")
    detail: str
    model: str
    hidden_size: int | None = None
    num_layers: int | None = None
    aux_layer_ids: list[int] | None = Field(None, description="the layers it captures")
    seconds_since_report: float
    workers: int = Field(0, description="live extractor workers that use it")
    samples_per_s: float = Field(0.0, description="samples its live workers stored per second, over their last minute")
    tokens_per_s: float = 0.0
    dump_backpressure: float | None = Field(
        None, description="share of the recent time the server's forwards waited for its dump writer (0-1)"
    )
    dump_queued_bytes: int | None = None
    dump_cap_bytes: int | None = None


class GpuHostStatus(BaseModel):
    role: GpuRole = Field(description="inference: the inference supervisor's server; trainer: a trainer's")
    host: str
    pid: int | None
    run: str = Field(description="The run a trainer trains; empty for an inference server")
    gpus: list[GpuStat] | None = Field(description="Utilization (%) and memory (bytes) per GPU; null: unknown")
    detail: str = Field(description="Why the GPUs are unknown (no NVML here, a driver error)")
    seconds_since_report: float
    live: bool = Field(description="Reported within the lost-after interval")


class Cluster(BaseModel):
    workers: list[WorkerStatus] = Field(description="Live workers, and those lost within forget_after_s")
    workers_live: int
    workers_lost: int = Field(description="Lost workers listed in workers")
    workers_gone: int = Field(0, description="Workers lost longer ago than forget_after_s: counted, not listed")
    inference: list[InferenceStatus] = Field(description="Servers in service: their workers report them")
    inference_gone: list[InferenceStatus] = Field(
        default_factory=list,
        description="Servers out of service: no worker reported them within lost_after_s, or down while no run "
        "(of those read) regenerates or extracts: a finished run's",
    )
    gpus: list[GpuHostStatus] = Field(
        default_factory=list, description="The GPUs of each inference supervisor and trainer that reported lately"
    )
    disk_free: int | None
    disk_total: int | None


class StatusReport(BaseModel):
    generated_at: float
    runs_total: int
    offset: int
    limit: int
    runs: list[RunStatus] = Field(description="Newest first")
    cluster: Cluster


class RunReport(BaseModel):
    generated_at: float
    run: RunStatus
    cluster: Cluster


def read_status(
    redis: Redis,
    *,
    config: StatusConfig,
    offset: int = 0,
    limit: int = 20,
    now: float | None = None,
    local_disk: tuple[int, int] | None = None,
) -> StatusReport:
    """Every run, newest first, ``limit`` of them from ``offset``; two round trips whatever the run sizes."""
    head = redis.pipeline(transaction=False)
    head.zrevrange(keys.RUNS, offset, offset + limit - 1)
    head.zcard(keys.RUNS)
    run_ids, runs_total = head.execute()
    pipe = redis.pipeline(transaction=False)
    _queue_cluster(pipe)
    for run_id in run_ids:
        _queue_run(pipe, run_id, config)
    replies = pipe.execute()
    now = time.time() if now is None else now
    cluster = _cluster(*replies[:CLUSTER_REPLIES], config, now, local_disk)
    runs = [_run(run_id, replies[CLUSTER_REPLIES + i * RUN_REPLIES :], cluster, config, now)
            for i, run_id in enumerate(run_ids)]  # fmt: skip
    _set_aside_idle_servers(cluster, runs)
    return StatusReport(generated_at=now, runs_total=runs_total, offset=offset, limit=limit, runs=runs, cluster=cluster)


def read_run(
    redis: Redis,
    run_id: str,
    *,
    config: StatusConfig,
    now: float | None = None,
    local_disk: tuple[int, int] | None = None,
) -> RunReport | None:
    """One run's figures, or None if no such run is registered."""
    pipe = redis.pipeline(transaction=False)
    pipe.zscore(keys.RUNS, run_id)
    _queue_cluster(pipe)
    _queue_run(pipe, run_id, config)
    replies = pipe.execute()
    run_replies = replies[1 + CLUSTER_REPLIES :]
    if replies[0] is None and not run_replies[0]:
        return None
    now = time.time() if now is None else now
    cluster = _cluster(*replies[1 : 1 + CLUSTER_REPLIES], config, now, local_disk)
    run = _run(run_id, run_replies, cluster, config, now)
    _set_aside_idle_servers(cluster, [run])
    return RunReport(generated_at=now, run=run, cluster=cluster)


def _set_aside_idle_servers(cluster: Cluster, runs: list[RunStatus]) -> None:
    """A server that is down while no run needs one is a finished run's (stopped, its GPUs released to the
    trainer): out of service, not a server to worry about."""
    if any(r.stage in ACTIVE_STAGES for r in runs):
        return
    cluster.inference_gone = [s for s in cluster.inference if not s.healthy] + cluster.inference_gone
    cluster.inference = [s for s in cluster.inference if s.healthy]


CLUSTER_REPLIES = 3


def _queue_cluster(pipe) -> None:
    pipe.hgetall(keys.WORKERS)
    pipe.hgetall(keys.INFERENCE)
    pipe.hgetall(keys.GPUS)


RUN_REPLIES = 9


def _queue_run(pipe, run_id: str, config: StatusConfig) -> None:
    k = RunKeys(run_id)
    pipe.hgetall(k.meta)
    pipe.hgetall(k.counts)
    pipe.hlen(k.inflight)
    pipe.lrange(k.recent, 0, min(RATE_SAMPLES, RECENT_CAP) - 1)
    pipe.lrange(k.errors, 0, -1)  # capped by the writer (ERRORS_CAP)
    pipe.hgetall(k.train)
    pipe.hgetall(k.eval)
    pipe.hgetall(k.regen)
    pipe.lrange(k.regen_recent, 0, min(RATE_SAMPLES, RECENT_CAP) - 1)


def _float(d: dict, key: str) -> float | None:
    value = d.get(key)
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _int(d: dict, key: str) -> int | None:
    value = _float(d, key)
    return None if value is None else int(value)


def _cluster(
    workers: dict, inference: dict, gpus: dict, config: StatusConfig, now: float, local_disk: tuple[int, int] | None
) -> Cluster:
    forget_after = config.lost_after_s + config.forget_after_s
    every = [(beat, max(0.0, now - beat.ts), beat.lost(now, config.lost_after_s), name)
             for name, beat in sorted(parse_workers(workers).items())]  # fmt: skip
    rows = [row for row in every if not row[2] or row[1] <= forget_after]
    servers, gone = [], []
    for health in sorted(parse_inference(inference).values(), key=lambda h: (h.host, h.url)):
        age = max(0.0, now - health.ts)
        users = [b for b, _, lost, _ in rows if not lost and (b.host, b.inference_url) == (health.host, health.url)]
        (servers if age <= config.lost_after_s else gone).append(  # no report: no worker uses it any more
            InferenceStatus(
                url=health.url,
                host=health.host,
                ok=health.ok,
                healthy=health.ok and age <= config.lost_after_s,
                detail=health.detail,
                model=health.model,
                hidden_size=health.hidden_size,
                num_layers=health.num_layers,
                aux_layer_ids=health.aux_layer_ids,
                seconds_since_report=age,
                workers=len(users),
                samples_per_s=sum(b.samples_per_s or 0.0 for b in users),
                tokens_per_s=sum(b.tokens_per_s or 0.0 for b in users),
                dump_backpressure=health.dump_wait_fraction,
                dump_queued_bytes=health.dump_queued_bytes,
                dump_cap_bytes=health.dump_cap_bytes,
            )
        )
    # The data volume as the freshest live worker sees it; the gateway's own view if no worker reports one.
    disk = next(((b.disk_free, b.disk_total) for b, _, lost, _ in sorted(rows, key=lambda r: r[1])
                 if not lost and b.disk_free is not None), local_disk)  # fmt: skip
    return Cluster(
        workers=[_worker(name, beat, age, lost) for beat, age, lost, name in rows],
        workers_live=sum(not lost for _, _, lost, _ in rows),
        workers_lost=sum(lost for _, _, lost, _ in rows),
        workers_gone=len(every) - len(rows),
        inference=servers,
        inference_gone=gone,
        gpus=_gpu_hosts(gpus, config, now, forget_after),
        disk_free=disk[0] if disk else None,
        disk_total=disk[1] if disk else None,
    )


def _gpu_hosts(raw: dict, config: StatusConfig, now: float, forget_after: float) -> list[GpuHostStatus]:
    hosts = []
    for value in raw.values():
        try:
            beat = GpuBeat.from_redis(value)
        except (ValueError, TypeError):  # one bad report must not break the status
            continue
        age = max(0.0, now - beat.ts)
        if age <= forget_after:
            hosts.append(
                GpuHostStatus(
                    role=beat.role,
                    host=beat.host,
                    pid=beat.pid,
                    run=beat.run,
                    gpus=beat.gpus,
                    detail=beat.detail,
                    seconds_since_report=age,
                    live=age <= config.lost_after_s,
                )
            )
    return sorted(hosts, key=lambda h: (h.role, h.host, h.pid or 0))


def _worker(name: str, beat: WorkerBeat, age: float, lost: bool) -> WorkerStatus:
    return WorkerStatus(
        name=name,
        state=beat.state,
        role=beat.role,
        host=beat.host,
        pid=beat.pid,
        inference_url=beat.inference_url,
        run=beat.run,
        sample=beat.sample,
        detail=beat.detail,
        seconds_since_heartbeat=age,
        lost=lost,
        stage_seconds=beat.stage_seconds,
    )


def _run(run_id: str, replies: list, cluster: Cluster, config: StatusConfig, now: float) -> RunStatus:
    raw_meta, counts, in_flight, recent, errors, raw_train, raw_eval, regen, regen_recent = replies[:RUN_REPLIES]
    meta, progress, result = (
        RunMeta.from_redis(raw_meta),
        TrainProgress.from_redis(raw_train),
        EvalResult.from_redis(raw_eval),
    )
    stage = meta.stage or Stage.ingesting
    completions = _parse_recent(recent)
    extraction = _extraction(meta, counts, in_flight, completions, errors, config, now)
    answered = _parse_recent(regen_recent)  # "ts tokens_out tokens_in" per prompt: the same shape
    storage = _storage(meta, counts, cluster)
    run = RunStatus(
        run_id=run_id,
        stage=stage,
        created_at=meta.created_at,
        dataset=meta.dataset,
        model=meta.model,
        error=meta.error,
        regeneration=_regeneration(meta, regen, answered, config, now) if meta.regenerate_input else None,
        extraction=extraction,
        storage=storage,
        training=_training(stage, meta, progress, now),
        evaluation=_evaluation(result),
        alerts=[],
    )
    run.alerts = _alerts(run, answered if stage == Stage.regenerating else completions, cluster, config, now)
    run.verdict, run.brief, run.lines = describe(run, meta, progress, result, cluster, now)
    return run


def _rates(
    completions: list[tuple[float, int, int]], started: float | None, config: StatusConfig, now: float, gap_s: float
):
    """(completions/s, their tokens/s) over the recent window, or over the newest ones read when they all lie in
    it, or since ``started`` when that is later, or since the end of a gap longer than ``gap_s`` (a stall: the
    rate before it says nothing of the rate after); and the completions in the window."""
    in_window = [c for c in completions if c[0] >= now - config.window_s]
    counted = in_window
    span = config.window_s if started is None else min(config.window_s, now - started)
    if len(completions) >= min(RATE_SAMPLES, RECENT_CAP) and len(in_window) == len(completions):
        span = now - completions[-1][0]  # more completions than we read lie in the window: rate over those read
    gap = next((i for i in range(len(in_window) - 1) if in_window[i][0] - in_window[i + 1][0] > gap_s), None)
    if gap is not None:  # the first completion after the stall waited through it: counted from, not counted
        counted, span = in_window[:gap], now - in_window[gap][0]
    span = max(span, 1e-9)
    return len(counted) / span, sum(c[1] for c in counted) / span, in_window


def _stalled_since(
    completions: list[tuple[float, int, int]], since: float, config: StatusConfig, now: float
) -> tuple[float | None, float]:
    """When the stage stalled (``since``: its newest completion, or its start) if nothing completed for longer
    than the usual interval allows, else None; and that allowance, the gap that cuts the rates."""
    usual, floor = _usual_interval(completions), min(config.stall_min_s, config.eta_hold_min_s)
    hold = max(config.stall_factor * usual, floor) if usual else _stall_limit(None, config)  # never past the alert's
    return (since if now - since > hold else None), hold


def _wall(started: float | None, completed: float | None) -> float | None:
    return completed - started if started is not None and completed is not None else None


def _mean(amount: int, wall: float | None) -> float | None:
    return amount / wall if wall else None


def _regeneration(
    meta: RunMeta, raw: dict, answered: list[tuple[float, int, int]], config: StatusConfig, now: float
) -> Regeneration:
    total, done, failed = _int(raw, "total"), _int(raw, "done") or 0, _int(raw, "failed") or 0
    remaining = max(0, total - done - failed) if total is not None else None
    started = _float(raw, "started_at") or meta.created_at
    last_done = _float(raw, "last_done_at")
    stalled, hold = _stalled_since(answered, last_done or started or now, config, now)
    if remaining == 0 or meta.regenerated_at is not None:
        stalled = None
    prompts_per_s, tokens_per_s, _ = _rates(answered, started, config, now, hold)
    wall, tokens_out = _wall(started, meta.regenerated_at), _int(raw, "tokens_out") or 0
    return Regeneration(
        total=total,
        done=done,
        failed=failed,
        remaining=remaining,
        percent=100.0 * (done + failed) / total if total else None,
        prompts_per_s=prompts_per_s,
        tokens_in=_int(raw, "tokens_in") or 0,
        tokens_out=tokens_out,
        tokens_out_per_s=tokens_per_s,
        eta_s=remaining / prompts_per_s if remaining is not None and prompts_per_s > 0 and not stalled else None,
        retries=_int(raw, "retries") or 0,
        error_rate=failed / (done + failed) if done + failed else None,
        started_at=started,
        completed_at=meta.regenerated_at,
        last_done_at=last_done,
        seconds_since_last_done=now - last_done if last_done is not None else None,
        stalled_since=stalled,
        wall_s=wall,
        mean_prompts_per_s=_mean(done + failed, wall),
        mean_tokens_out_per_s=_mean(tokens_out, wall),
    )


def _parse_recent(recent: list[str]) -> list[tuple[float, int, int]]:
    """``"ts tokens bytes"`` per completion, newest first, as the writer pushes them."""
    out = []
    for entry in recent:
        ts, tokens, nbytes = entry.split()
        out.append((float(ts), int(tokens), int(nbytes)))
    return out


def _extraction(
    meta: RunMeta,
    counts: dict,
    in_flight: int,
    completions: list[tuple[float, int, int]],
    errors: list[str],
    config: StatusConfig,
    now: float,
) -> Extraction:
    total = meta.total
    done, failed = _int(counts, "done") or 0, _int(counts, "failed") or 0
    remaining = max(0, total - done - failed) if total is not None else None
    started = meta.extraction_started_at or meta.created_at
    cutoff = now - config.window_s
    last_done = _float(counts, "last_done_at")
    stalled, hold = _stalled_since(completions, last_done or started or now, config, now)
    if remaining == 0 or meta.stage not in ACTIVE_STAGES:
        stalled = None  # a finished extraction, or a run stopped or not yet extracting, is not stalled
    samples_per_s, tokens_per_s, in_window = _rates(completions, started, config, now, hold)
    tokens_done = _int(counts, "tokens") or 0
    tokens_left = _tokens_left(meta, remaining, tokens_done, failed)
    parsed_errors = [json.loads(e) for e in errors]
    recent_errors = sum(1 for e in parsed_errors if e.get("ts", 0) >= cutoff and e.get("index", -1) >= 0)
    attempts = recent_errors + len(in_window)
    wall = _wall(meta.extraction_started_at, meta.extraction_complete)
    return Extraction(
        total=total,
        done=done,
        failed=failed,
        in_flight=in_flight,
        remaining=remaining,
        percent=100.0 * (done + failed) / total if total else (100.0 if total == 0 else None),
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        eta_s=_eta(tokens_left, tokens_per_s, stalled),
        tokens_remaining=tokens_left,
        stalled_since=stalled,
        error_rate=failed / (done + failed) if done + failed else None,
        recent_error_rate=recent_errors / attempts if attempts else None,
        recent_attempts=attempts,
        errors=_int(counts, "errors") or 0,
        retries=_int(counts, "retries") or 0,
        started_at=meta.extraction_started_at,
        completed_at=meta.extraction_complete,
        last_done_at=last_done,
        seconds_since_last_done=now - last_done if last_done is not None else None,
        last_errors=[ErrorEntry(**e) for e in parsed_errors[: config.last_errors]],
        wall_s=wall,
        mean_samples_per_s=_mean(done + failed, wall),
        mean_tokens_per_s=_mean(tokens_done, wall),
    )


def _eta(tokens_left: int | None, tokens_per_s: float, stalled: float | None) -> float | None:
    """Seconds to the end; none while unknown or stalled (a rate from before a stall would only be a guess)."""
    if tokens_left == 0:
        return 0.0
    if tokens_left is None or tokens_per_s <= 0 or stalled is not None:
        return None
    return tokens_left / tokens_per_s


def _tokens_left(meta: RunMeta, remaining: int | None, tokens_done: int, failed: int) -> int | None:
    """Tokens of the samples without an outcome: the run's tokens (ingest counts them) less those stored, less the
    failed samples' at the run's mean (their own lengths are not counted)."""
    total, total_tokens = meta.total, meta.total_tokens
    if remaining is None or total_tokens is None or not total:
        return None
    if remaining == 0:
        return 0
    return max(0, round(total_tokens - tokens_done - failed * total_tokens / total))


def _storage(meta: RunMeta, counts: dict, cluster: Cluster) -> Storage:
    written, tokens = _int(counts, "bytes") or 0, _int(counts, "tokens") or 0
    total_tokens = meta.total_tokens
    per_token = written / tokens if tokens else None
    expected = None
    if meta.hidden_size and total_tokens:
        expected = run_bytes_per_token(
            meta.options, meta.hidden_size, (meta.loss_tokens or total_tokens) / total_tokens
        )
    rate = per_token if per_token is not None else expected
    projected = round(rate * total_tokens) if rate is not None and total_tokens is not None else None
    return Storage(
        bytes_written=written,
        tokens_written=tokens,
        bytes_per_token=per_token,
        layout=Layout.from_options(meta.options).name,
        expected_bytes_per_token=expected,
        total_tokens=total_tokens,
        projected_total_bytes=projected,
        projected_remaining_bytes=max(0, projected - written) if projected is not None else None,
        disk_free=cluster.disk_free,
        disk_total=cluster.disk_total,
    )


def _training(stage: Stage, meta: RunMeta, progress: TrainProgress, now: float) -> Training:
    step, total, started = progress.step, progress.total_steps, progress.started_at
    eta = progress.eta_s
    if eta is None and step and total is not None and started is not None:
        eta = (total - step) * (now - started) / step  # the mean step time so far
    state = _trainer_state(stage, progress)
    return Training(
        step=step,
        total_steps=total,
        percent=100.0 * step / total if step is not None and total else None,
        loss=progress.loss,
        accuracy=progress.accuracy,
        accuracy_per_position=progress.acc,
        tokens_per_s=progress.tokens_per_s,
        eta_s=eta,
        last_checkpoint=progress.last_checkpoint,
        state=state,
        error=meta.error if state == "failed" else None,
        seconds_since_update=now - progress.updated_at if progress.updated_at is not None else None,
        seconds_since_beat=now - progress.beat_at if progress.beat_at is not None else None,
    )


def _trainer_state(stage: Stage, progress: TrainProgress) -> str | None:
    """What the trainer is doing, as the run's stage says; a failed run failed in training if a trainer reported."""
    if stage == Stage.waiting_for_gpus:
        return "waiting"
    if stage in (Stage.training, Stage.evaluating):
        return "training"
    if stage == Stage.done or (stage == Stage.failed and progress.to_redis()):
        return str(stage)
    return None


def _evaluation(result: EvalResult) -> dict[str, float | str]:
    """Numbers as numbers; the rest (the state, per-position rates as JSON) as the text Redis holds."""
    fields = result.to_redis()
    return {k: v if (number := _float(fields, k)) is None else number for k, v in fields.items()}


def _usual_interval(completions: list[tuple[float, int, int]], n: int = 100) -> float | None:
    """Mean time between the newest ``n`` completions: what "no completion for a while" is judged against."""
    newest = completions[:n]
    if len(newest) < 2:
        return None
    return (newest[0][0] - newest[-1][0]) / (len(newest) - 1)


def _alerts(
    run: RunStatus, completions: list[tuple[float, int, int]], cluster: Cluster, config: StatusConfig, now: float
) -> list[Alert]:
    """``completions``: those of the run's current stage (answered prompts while it regenerates, else samples)."""
    alerts = []
    ex, rg = run.extraction, run.regeneration
    regenerating = run.stage == Stage.regenerating and rg is not None and rg.remaining != 0
    extracting = run.stage in ACTIVE_STAGES and ex.remaining != 0 and run.stage != Stage.regenerating
    if regenerating:
        usual = _usual_interval(completions)
        since = rg.last_done_at or rg.started_at or run.created_at or now
        limit = _stall_limit(usual, config)
        if now - since > limit:
            alerts.append(Alert(kind="stalled", message=(
                f"no prompt regenerated for {duration(now - since)} (limit {duration(limit)})")))  # fmt: skip
    if extracting:
        usual = _usual_interval(completions)
        since = ex.last_done_at or ex.started_at or run.created_at or now
        limit = _stall_limit(usual, config)
        if now - since > limit:
            hint = "" if ex.total is not None else (
                f"; its ingest has not finished: if the process running `eaglet ingest` died, "
                f"`eaglet ingest --run {run.run_id} --resume` takes it up where it last flushed")  # fmt: skip
            alerts.append(Alert(kind="stalled", message=(
                f"no sample completed for {duration(now - since)} (limit {duration(limit)}){hint}")))  # fmt: skip
    if run.stage in ACTIVE_STAGES:
        lost = [w.name for w in cluster.workers if w.lost and w.run in ("", run.run_id)]
        if lost:
            alerts.append(Alert(kind="workers_lost", message=f"{len(lost)} worker(s) lost: {', '.join(lost[:8])}"))
        elif (extracting or regenerating) and not any(
            w.role == WorkerRole.extractor and not w.lost for w in cluster.workers
        ):
            alerts.append(Alert(kind="workers_lost", message="no live worker: start extractor workers"))
    tr = run.training
    if run.stage in TRAINER_STAGES and (tr.seconds_since_beat is None or tr.seconds_since_beat > config.lost_after_s):
        age = "no heartbeat" if tr.seconds_since_beat is None else f"heartbeat {tr.seconds_since_beat:.0f} s old"
        resume = f" (it resumes from {tr.last_checkpoint})" if tr.last_checkpoint else ""
        alerts.append(Alert(kind="trainer_lost", message=(
            f"the trainer is {run.stage} but has {age}: it died or hangs; start it again{resume}")))  # fmt: skip
    st = run.storage
    if (
        st.projected_remaining_bytes is not None
        and st.disk_free is not None
        and st.projected_remaining_bytes > st.disk_free
    ):
        alerts.append(Alert(kind="disk", message=(
            f"projected {st.projected_total_bytes / 1e9:.1f} GB in all, {st.projected_remaining_bytes / 1e9:.1f} GB "
            f"still to write, but only {st.disk_free / 1e9:.1f} GB free")))  # fmt: skip
    rate = _alert_error_rate(ex, config)
    if rate is not None:
        alerts.append(
            Alert(kind="error_rate", message=f"error rate {rate:.1%} above {config.error_rate_threshold:.1%}")
        )
    if (
        rg is not None
        and rg.error_rate is not None
        and rg.done + rg.failed >= config.error_rate_min_attempts
        and rg.error_rate > config.error_rate_threshold
    ):
        given_up = f"regeneration: {rg.error_rate:.1%} of prompts given up"
        alerts.append(Alert(kind="error_rate", message=f"{given_up}, above {config.error_rate_threshold:.1%}"))
    return alerts


def _stall_limit(usual: float | None, config: StatusConfig) -> float:
    """Seconds without a completion after which a stage is stalled."""
    return max(config.stall_factor * usual, config.stall_min_s) if usual else config.stall_factor * config.stall_min_s


def _alert_error_rate(ex: Extraction, config: StatusConfig) -> float | None:
    """The overall or the recent error rate when it is above the threshold over enough attempts, else None."""
    overall = ex.error_rate if ex.done + ex.failed >= config.error_rate_min_attempts else None
    recent = ex.recent_error_rate if ex.recent_attempts >= config.error_rate_min_attempts else None
    above = [r for r in (recent, overall) if r is not None and r > config.error_rate_threshold]
    return above[0] if above else None


def disk_usage(path: Path) -> tuple[int, int] | None:
    """Free and total bytes of the volume holding ``path``; None where it is not mounted here."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
