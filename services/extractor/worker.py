"""Entry point of an extractor worker: ``python -m eaglet.services.extractor.worker``.

Listens to the queue of every run that is extracting, in RQ burst mode, looking again for new runs whenever the
queues run dry (a run's ingest queues its samples as it reads them). A heartbeat thread reports the worker's state,
its inference server's health and the data volume's free space to Redis, and sweeps for the jobs of dead workers.
The process loop is the shared one (shared/workerloop.py): this module gives it the queues and the jobs' extractor.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from redis import Redis
from rq import Queue

from eaglet.services.extractor.extract import Extractor
from eaglet.services.extractor.reaper import Reaper
from eaglet.shared import heartbeats, keys
from eaglet.shared.dumpwriter import read_writer_stats
from eaglet.shared.keys import queue_name
from eaglet.shared.records import ACTIVE_STAGES, WorkerRole
from eaglet.shared.runstate import RunState
from eaglet.shared.store import partial_path, sample_path
from eaglet.shared.workerloop import WorkerProcess, WorkerService, run_worker

log = logging.getLogger(__name__)
STAGE_EMA = 0.1  # weight of the newest sample in the stage averages: about the last 20 samples count
RATE_WINDOW_S = 60.0  # the worker's samples/s and tokens/s are taken over its last minute
MODEL_INFO_EVERY_S = 60.0  # the server's model is asked again this often (a restarted server may serve another)


@dataclass
class Throughput:
    """The samples this worker stored lately, for its heartbeat: where its time goes and how fast it goes."""

    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds of each stage of a stored sample, averaged over the recent ones."""
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


def make_reaper(extractor: Extractor, process: WorkerProcess) -> Reaper:
    def sample_id_of(run_id: str, index: int) -> str:
        return extractor.sample_set(run_id)[index].sample_id

    def remove_partial(run_id: str, index: int, instance: str) -> None:
        path = sample_path(extractor.data_dir, run_id, sample_id_of(run_id, index))
        partial_path(path, instance).unlink(missing_ok=True)

    return Reaper(
        redis=process.redis,
        rq_redis=process.rq_redis,
        instance=process.instance,
        lost_after_s=process.settings.lost_after_s,
        max_lost=process.settings.max_attempts,
        sample_id_of=sample_id_of,
        partial_of=remove_partial,
        current_rq_worker=lambda: process.status.rq_worker,
    )


class ExtractorService(WorkerService):
    """The run queues' worker: one ``Extractor`` (connections, the runs' sample sets) for all its jobs."""

    role = WorkerRole.extractor
    burst_help = "exit when no run has work left"
    burst_waits = True  # while a run extracts, a dead worker's sample may come back to its queue
    max_jobs = 1000  # a new run's queue is listened to within a thousand jobs

    def __init__(self, process: WorkerProcess) -> None:
        super().__init__(process)
        settings = process.settings
        settings.dump_dir.mkdir(parents=True, exist_ok=True)
        # Workers scale by process (one per sample in flight), so each checks its dumps on one thread: torch's
        # default of a thread per core would put cores × workers threads on the host's cores.
        torch.set_num_threads(1)
        self.throughput = Throughput()
        self.extractor = Extractor.from_settings(
            settings,
            process.redis,
            worker=process.name,
            instance=process.instance,
            on_state=process.status.set,
            on_stored=self.throughput.add_stored,
        )
        self.reaper = make_reaper(self.extractor, process)
        # A probe slower than a heartbeat is an unhealthy server, and must not make this worker's beats late.
        self.http = httpx.Client(base_url=settings.inference_url, timeout=min(5.0, settings.heartbeat_interval_s))
        self.model: dict = {}
        self.model_at = -MODEL_INFO_EVERY_S
        log.info("%s: extracting for %s, dumps in %s", process.name, settings.inference_url, settings.dump_dir)

    def queues(self) -> list[Queue]:
        """Each extracting run's queue, oldest run first."""
        return [Queue(queue_name(r), connection=self.process.rq_redis) for r in active_runs(self.process.redis)]

    def job_context(self) -> Extractor:
        return self.extractor

    def beat(self) -> dict[str, Any]:
        samples_per_s, tokens_per_s = self.throughput.rates()
        return {
            "inference_url": self.process.settings.inference_url,
            "stage_seconds": self.throughput.stage_seconds,
            "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s,
        }

    def after_beat(self, judge_others: bool) -> None:
        """Reports the server as this worker sees it (its newest dump tells what the server captures); sweeps."""
        settings, redis = self.process.settings, self.process.redis
        writers = read_writer_stats(settings.dump_dir, max_age_s=settings.lost_after_s)
        health = _probe(self.http)
        if health["ok"] and (not self.model or time.monotonic() - self.model_at >= MODEL_INFO_EVERY_S):
            self.model, self.model_at = _model_info(self.http) or self.model, time.monotonic()
        heartbeats.report_inference(
            redis,
            settings.inference_url,
            host=settings.status_host,
            **health,
            **_with_dump(self.model, self.extractor.captured),
            writers=writers,
        )
        if judge_others:
            swept = self.reaper.sweep(active_runs(redis))
            if any(swept.values()):
                log.warning("%s: jobs of dead workers: %s", self.process.name, swept)


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
    return run_worker(ExtractorService, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
