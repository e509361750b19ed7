"""The status figures of every run, computed in one place for the gateway, its metrics and ``eaglet status``.

Every figure comes from what the writers keep (``runstate.py``, ``heartbeats.py``): counters,
capped lists and small hashes, read in one pipelined round trip. Nothing here scans keys, bitmaps or files,
so a read costs the same at 1 K samples and at 10 M.
"""

import json
import os
import time
from pathlib import Path

from redis import Redis

from . import keys
from .alerts import StatusConfig, run_alerts, stall_limit, usual_interval
from .heartbeats import parse_inference, parse_workers
from .keys import RunKeys
from .layout import NUM_AUX, bytes_per_token
from .records import (
    ACTIVE_STAGES,
    EvalResult,
    ExtractionCounts,
    GpuBeat,
    RegenCounts,
    RunMeta,
    Stage,
    TrainProgress,
    WorkerBeat,
)
from .runoptions import EVERY_STATE, RunOptions
from .runstate import EARLIER_EVALS, RECENT_CAP
from .statusreport import (
    Cluster,
    ErrorEntry,
    Extraction,
    GpuHostStatus,
    InferenceStatus,
    Regeneration,
    RunReport,
    RunStatus,
    StatusReport,
    Storage,
    Training,
    WorkerStatus,
)
from .statustext import describe

RATE_SAMPLES = 256
"""Newest completions read for the rates: when all of them lie inside the window, the window shrinks to the
time they span. Reading all RECENT_CAP entries costs ~5 ms of parsing per request for no better figure."""


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
    workers, inference, gpus = replies[:CLUSTER_REPLIES]
    cluster = _cluster(workers, inference, gpus, config, now, local_disk)
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
    workers, inference, gpus = replies[1 : 1 + CLUSTER_REPLIES]
    cluster = _cluster(workers, inference, gpus, config, now, local_disk)
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


RUN_REPLIES = 10


def _queue_run(pipe, run_id: str, config: StatusConfig) -> None:
    k = RunKeys(run_id)
    pipe.hgetall(k.meta)
    pipe.hgetall(k.counts)
    pipe.hlen(k.inflight)
    pipe.lrange(k.recent, 0, min(RATE_SAMPLES, RECENT_CAP) - 1)
    pipe.lrange(k.errors, 0, -1)  # capped by the writer (ERRORS_CAP)
    pipe.hgetall(k.train)
    pipe.hgetall(k.eval)
    pipe.lrange(k.evals, 0, EARLIER_EVALS - 1)
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


def _cluster(
    workers: dict, inference: dict, gpus: dict, config: StatusConfig, now: float, local_disk: tuple[int, int] | None
) -> Cluster:
    forget_after = config.lost_after_s + config.forget_after_s
    every = [(beat, max(0.0, now - beat.ts), beat.lost(now, config.lost_after_s), name)
             for name, beat in sorted(parse_workers(workers).items())]  # fmt: skip
    rows = [row for row in every if not row[2] or row[1] <= forget_after]
    servers: list[InferenceStatus] = []
    gone: list[InferenceStatus] = []
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
    raw_meta, raw_counts, in_flight, recent, errors, raw_train, raw_eval, raw_evals, raw_regen, regen_recent = replies[
        :RUN_REPLIES
    ]
    earlier = [EvalResult.from_redis(json.loads(e)) for e in raw_evals]
    meta, counts, progress, result, regen = (
        RunMeta.from_redis(raw_meta),
        ExtractionCounts.from_redis(raw_counts),
        TrainProgress.from_redis(raw_train),
        EvalResult.from_redis(raw_eval),
        RegenCounts.from_redis(raw_regen),
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
        earlier_evaluations=[_evaluation(e) for e in earlier],
        alerts=[],
    )
    run.alerts = run_alerts(run, answered if stage == Stage.regenerating else completions, cluster, config, now)
    run.verdict, run.brief, run.lines = describe(run, meta, progress, result, cluster, now, earlier)
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
    usual, floor = usual_interval(completions), min(config.stall_min_s, config.eta_hold_min_s)
    hold = max(config.stall_factor * usual, floor) if usual else stall_limit(None, config)  # never past the alert's
    return (since if now - since > hold else None), hold


def _wall(started: float | None, completed: float | None) -> float | None:
    return completed - started if started is not None and completed is not None else None


def _mean(amount: int, wall: float | None) -> float | None:
    return amount / wall if wall else None


def _regeneration(
    meta: RunMeta, regen: RegenCounts, answered: list[tuple[float, int, int]], config: StatusConfig, now: float
) -> Regeneration:
    total, done, failed = regen.total, regen.done, regen.failed
    remaining = max(0, total - done - failed) if total is not None else None
    started = regen.started_at or meta.created_at
    last_done = regen.last_done_at
    stalled, hold = _stalled_since(answered, last_done or started or now, config, now)
    if remaining == 0 or meta.regenerated_at is not None:
        stalled = None
    prompts_per_s, tokens_per_s, _ = _rates(answered, started, config, now, hold)
    wall, tokens_out = _wall(started, meta.regenerated_at), regen.tokens_out
    return Regeneration(
        total=total,
        done=done,
        failed=failed,
        remaining=remaining,
        percent=100.0 * (done + failed) / total if total else None,
        prompts_per_s=prompts_per_s,
        tokens_in=regen.tokens_in,
        tokens_out=tokens_out,
        tokens_out_per_s=tokens_per_s,
        eta_s=remaining / prompts_per_s if remaining is not None and prompts_per_s > 0 and not stalled else None,
        retries=regen.retries,
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
    counts: ExtractionCounts,
    in_flight: int,
    completions: list[tuple[float, int, int]],
    errors: list[str],
    config: StatusConfig,
    now: float,
) -> Extraction:
    total = meta.total
    done, failed = counts.done, counts.failed
    remaining = max(0, total - done - failed) if total is not None else None
    started = meta.extraction_started_at or meta.created_at
    cutoff = now - config.window_s
    last_done = counts.last_done_at
    stalled, hold = _stalled_since(completions, last_done or started or now, config, now)
    if remaining == 0 or meta.stage not in ACTIVE_STAGES:
        stalled = None  # a finished extraction, or a run stopped or not yet extracting, is not stalled
    samples_per_s, tokens_per_s, in_window = _rates(completions, started, config, now, hold)
    tokens_done = counts.tokens
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
        errors=counts.errors,
        retries=counts.retries,
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


def _storage(meta: RunMeta, counts: ExtractionCounts, cluster: Cluster) -> Storage:
    written, tokens = counts.bytes, counts.tokens
    total_tokens = meta.total_tokens
    per_token = written / tokens if tokens else None
    options = meta.options or RunOptions(**EVERY_STATE)  # unreadable, or a record from before options were kept
    layout, expected = options.layout(), None
    if meta.hidden_size and total_tokens:
        # ``model`` counted as 2 bytes, a GPU server's dtype
        expected = bytes_per_token(meta.hidden_size, layout, options.store_dtype or "model",
                                   loss_fraction=(meta.loss_tokens or total_tokens) / total_tokens,
                                   num_aux=len(meta.aux_layer_ids or ()) or NUM_AUX)  # fmt: skip
    rate = per_token if per_token is not None else expected
    projected = round(rate * total_tokens) if rate is not None and total_tokens is not None else None
    return Storage(
        bytes_written=written,
        tokens_written=tokens,
        bytes_per_token=per_token,
        layout=layout.name,
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
        selection=progress.selection,
        state=state,
        error=meta.error if state == "failed" else None,
        unreadable_samples=progress.unreadable_samples or 0,
        seconds_since_update=now - progress.updated_at if progress.updated_at is not None else None,
        seconds_since_beat=now - progress.beat_at if progress.beat_at is not None else None,
        evaluation_attempts=(meta.eval_attempts or 0) if meta.eval_request and stage == Stage.evaluating else None,
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


def disk_usage(path: Path) -> tuple[int, int] | None:
    """Free and total bytes of the volume holding ``path``; None where it is not mounted here."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
