"""Entry point of an extractor worker: ``python -m eaglet.services.extractor.worker``.

Listens to the queue of every run that is extracting, in RQ burst mode, looking again for new runs
whenever the queues run dry (a run's ingest queues its samples as it reads them). A heartbeat thread reports
the worker's state, its inference server's health and the data volume's free space to Redis.
"""

import argparse
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested

from eaglet.services.extractor import jobs
from eaglet.services.extractor.extract import Extractor
from eaglet.services.extractor.reaper import Reaper
from eaglet.shared import heartbeats, keys
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect, connect_raw
from eaglet.shared.dumpwriter import read_writer_stats
from eaglet.shared.heartbeats import WorkerState
from eaglet.shared.jobqueue import rq_worker_name
from eaglet.shared.keys import queue_name
from eaglet.shared.logs import setup_logging
from eaglet.shared.records import ACTIVE_STAGES
from eaglet.shared.runstate import RunState
from eaglet.shared.store import partial_path, sample_path

log = logging.getLogger(__name__)
IDLE_POLL_S = 1.0
REDIS_BACKOFF_S = (1, 2, 5)
STAGE_EMA = 0.1  # weight of the newest sample in the stage averages: about the last 20 samples count
RATE_WINDOW_S = 60.0  # the worker's samples/s and tokens/s are taken over its last minute
MODEL_INFO_EVERY_S = 60.0  # the server's model is asked again this often (a restarted server may serve another)


@dataclass
class Status:
    state: str = WorkerState.idle
    run: str = ""
    sample: str = ""
    detail: str = ""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds of each stage of a stored sample, averaged over the recent ones: where this worker's time goes."""

    def set(self, state: str, run: str, sample: str, detail: str) -> None:
        self.state, self.run, self.sample, self.detail = state, run, sample, detail

    started: float = field(default_factory=time.monotonic)
    stored: deque[tuple[float, int]] = field(default_factory=deque)
    """(monotonic s, tokens) of each sample stored in the last RATE_WINDOW_S: a minute of samples, bounded."""

    def add_stored(self, tokens: int, timings: dict[str, float]) -> None:
        old = self.stage_seconds
        # A new dict each time, swapped in whole: the heartbeat thread reads it without a lock.
        self.stage_seconds = {k: v if k not in old else old[k] + STAGE_EMA * (v - old[k]) for k, v in timings.items()}
        self.stored.append((time.monotonic(), tokens))  # deque appends and pops are atomic: no lock either

    def rates(self) -> tuple[float, float]:
        """Samples/s and tokens/s stored over the last RATE_WINDOW_S (or since the worker started, if later)."""
        now = time.monotonic()
        while self.stored and self.stored[0][0] < now - RATE_WINDOW_S:
            self.stored.popleft()
        span = max(min(RATE_WINDOW_S, now - self.started), 1e-9)
        recent = list(self.stored)
        return len(recent) / span, sum(tokens for _, tokens in recent) / span


def active_runs(redis: Redis) -> list[str]:
    """Runs that are ingesting or extracting, oldest first."""
    return [r for r in redis.zrange(keys.RUNS, 0, -1) if RunState(redis, r).stage() in ACTIVE_STAGES]


def active_queues(redis: Redis, rq_redis: Redis, runs: list[str] | None = None) -> list[Queue]:
    """Each extracting run's queue, oldest run first."""
    return [Queue(queue_name(r), connection=rq_redis) for r in (active_runs(redis) if runs is None else runs)]


def make_reaper(extractor: Extractor, rq_redis: Redis, settings: Settings) -> Reaper:
    def sample_id_of(run_id: str, index: int) -> str:
        return extractor.sample_set(run_id)[index].sample_id

    def remove_partial(run_id: str, index: int, instance: str) -> None:
        path = sample_path(extractor.data_dir, run_id, sample_id_of(run_id, index))
        partial_path(path, instance).unlink(missing_ok=True)

    return Reaper(
        redis=extractor.redis,
        rq_redis=rq_redis,
        instance=extractor.instance,
        lost_after_s=settings.lost_after_s,
        max_lost=settings.max_attempts,
        sample_id_of=sample_id_of,
        partial_of=remove_partial,
    )


def heartbeat_loop(
    redis: Redis,
    settings: Settings,
    name: str,
    status: Status,
    stop: threading.Event,
    instance: str = "",
    reaper: Reaper | None = None,
    extractor: Extractor | None = None,
) -> None:
    """Beats, and sweeps for jobs of dead workers: here, not between jobs, since a busy worker's RQ loop
    may not come back for a thousand jobs. ``extractor``: its newest dump tells what the server captures."""
    # A probe slower than a heartbeat is an unhealthy server, and must not make this worker's beats late.
    http = httpx.Client(base_url=settings.inference_url, timeout=min(5.0, settings.heartbeat_interval_s))
    # Others' heartbeats are judged only once Redis has answered for a while: right after an outage
    # every heartbeat is old, and the workers are not dead.
    redis_ok_since = time.monotonic()
    host = settings.status_host
    model, model_at = {}, -MODEL_INFO_EVERY_S
    while not stop.is_set():
        try:
            usage = shutil.disk_usage(settings.data_dir)
            samples_per_s, tokens_per_s = status.rates()
            heartbeats.beat(
                redis,
                name,
                state=WorkerState(status.state),
                host=host,
                pid=os.getpid(),
                inference_url=settings.inference_url,
                run=status.run,
                sample=status.sample,
                detail=status.detail,
                disk_free=usage.free,
                disk_total=usage.total,
                instance=instance,
                stage_seconds=status.stage_seconds,
                samples_per_s=samples_per_s,
                tokens_per_s=tokens_per_s,
            )
            writers = read_writer_stats(settings.dump_dir, max_age_s=settings.lost_after_s)
            health = _probe(http)
            if health["ok"] and (not model or time.monotonic() - model_at >= MODEL_INFO_EVERY_S):
                model, model_at = _model_info(http) or model, time.monotonic()
            captured = extractor.captured if extractor is not None else None
            heartbeats.report_inference(
                redis, settings.inference_url, host=host, **health, **_with_dump(model, captured), writers=writers
            )
            if reaper is not None and time.monotonic() - redis_ok_since > reaper.lost_after_s:
                swept = reaper.sweep(active_runs(redis))
                if any(swept.values()):
                    log.warning("%s: jobs of dead workers: %s", name, swept)
        except Exception:  # the heartbeat must outlive a Redis restart: log, wait, beat again
            log.warning("%s: heartbeat failed", name, exc_info=True)
            redis_ok_since = time.monotonic()
        stop.wait(settings.heartbeat_interval_s)


def _probe(http: httpx.Client) -> dict:
    try:
        r = http.get("/health")
        return {"ok": r.status_code == 200, "detail": f"HTTP {r.status_code}"}
    except httpx.HTTPError as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}


def _model_info(http: httpx.Client) -> dict:
    """The server's model from ``/get_model_info``: SGLang names it by path; the reference server adds hidden size,
    layers and captured layer ids. Empty when it does not answer: its health is ``/health``'s alone."""
    try:
        r = http.get("/get_model_info")
        info = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # ValueError: a body that is not JSON
        return {}
    if not isinstance(info, dict):
        return {}
    layers = info.get("aux_layer_ids")
    return {
        "model": Path(str(info.get("model_path") or "")).name,
        "hidden_size": info.get("hidden_size") if isinstance(info.get("hidden_size"), int) else None,
        "num_layers": info.get("num_layers") if isinstance(info.get("num_layers"), int) else None,
        "aux_layer_ids": layers if isinstance(layers, list) and all(isinstance(v, int) for v in layers) else None,
    }


def _with_dump(model: dict, captured: tuple[int, list[int]] | None) -> dict:
    """What the server does not say (SGLang: hidden size, captured layers), from the newest dump checked."""
    if captured is None:
        return model
    hidden_size, layers = captured
    return {**model, "hidden_size": model.get("hidden_size") or hidden_size,
            "aux_layer_ids": model.get("aux_layer_ids") or layers}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", help="worker name (default: host:pid)")
    parser.add_argument("--burst", action="store_true", help="exit when no run has work left")
    args = parser.parse_args(argv)
    settings = Settings()
    setup_logging()
    name = args.name or f"{settings.status_host}:{os.getpid()}"
    instance = uuid.uuid4().hex[:12]  # this process; the name may be reused by the next one
    # RQ stores pickled bytes; run state is text. Two clients on the same server.
    rq_redis = connect_raw(settings.redis_url)
    redis = connect(settings.redis_url)
    status = Status()
    settings.dump_dir.mkdir(parents=True, exist_ok=True)
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # the heartbeat reports its free space from the start
    # Workers scale by process (one per sample in flight), so each checks its dumps on one thread: torch's
    # default of a thread per core would put cores × workers threads on the host's cores.
    torch.set_num_threads(1)
    extractor = Extractor(
        redis=redis,
        http=httpx.Client(base_url=settings.inference_url, timeout=settings.request_timeout_s),
        data_dir=settings.data_dir,
        dump_dir=settings.dump_dir,
        worker=name,
        instance=instance,
        dump_wait_s=settings.dump_wait_s,
        max_attempts=settings.max_attempts,
        store_dtype=settings.store_dtype,
        on_state=status.set,
        on_stored=status.add_stored,
    )
    jobs.configure(extractor)
    reaper = make_reaper(extractor, rq_redis, settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    beat = threading.Thread(
        target=heartbeat_loop, args=(redis, settings, name, status, stop, instance, reaper, extractor), daemon=True
    )
    beat.start()
    log.info("%s: extracting for %s, dumps in %s", name, settings.inference_url, settings.dump_dir)
    failures, n = 0, 0
    try:
        while not stop.is_set():
            try:
                queues = active_queues(redis, rq_redis)
                if not queues:  # no run is extracting: nothing to listen to yet
                    failures = 0
                    if args.burst:
                        break
                    stop.wait(IDLE_POLL_S)
                    continue
                n += 1
                worker = SimpleWorker(queues, connection=rq_redis, name=rq_worker_name(name, instance, n))
                reaper.current_rq_worker = worker.name
                worked = worker.work(burst=True, logging_level="WARNING", max_jobs=1000)
                failures = 0
            except (RedisConnectionError, RedisTimeoutError) as e:
                # The process boundary: Redis restarted or unreachable. Wait, then reconnect (the clients do).
                delay = REDIS_BACKOFF_S[min(failures, len(REDIS_BACKOFF_S) - 1)]
                failures += 1
                log.warning("%s: Redis unreachable (%s); again in %ds", name, e, delay, exc_info=failures == 1)
                status.set(WorkerState.backoff, "", "", f"redis unreachable: {e}")
                stop.wait(delay)
                continue
            status.set(WorkerState.idle, "", "", "")
            if worker._stop_requested:  # RQ's own SIGTERM/SIGINT handler asked for a warm stop
                break
            if not worked:
                stop.wait(IDLE_POLL_S)
    except StopRequested:  # SIGTERM while idle between bursts: RQ's handler is still installed
        log.info("%s: stopping", name)
    finally:
        stop.set()
        try:
            heartbeats.forget(redis, name)
        except (RedisConnectionError, RedisTimeoutError):
            log.warning("%s: could not remove my heartbeat (Redis unreachable); it will age out", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
