"""Entry point of an extractor worker: ``python -m services.extractor.worker``.

Listens to the control queue (ingest jobs) and to the queue of every run that is extracting, in
RQ burst mode, looking again for new runs whenever the queues run dry. A heartbeat thread reports
the worker's state, its inference server's health and the data volume's free space to Redis.
"""

import argparse
import logging
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass

import httpx
from redis import Redis
from rq import Queue, SimpleWorker

from services.extractor import jobs
from services.extractor.extract import Extractor
from shared import heartbeats, keys
from shared.config import Settings
from shared.heartbeats import WorkerState
from shared.keys import CONTROL_QUEUE, RunKeys, queue_name
from shared.runstate import Stage

log = logging.getLogger(__name__)
ACTIVE = {Stage.ingesting, Stage.extracting}
IDLE_POLL_S = 1.0


@dataclass
class Status:
    state: str = WorkerState.idle
    run: str = ""
    sample: str = ""
    detail: str = ""

    def set(self, state: str, run: str, sample: str, detail: str) -> None:
        self.state, self.run, self.sample, self.detail = state, run, sample, detail


def active_queues(redis: Redis, rq_redis: Redis) -> list[Queue]:
    """The control queue, then each extracting run's queue, oldest run first."""
    names = [CONTROL_QUEUE]
    for run_id in redis.zrange(keys.RUNS, 0, -1):
        if redis.hget(RunKeys(run_id).meta, "stage") in ACTIVE:
            names.append(queue_name(run_id))
    return [Queue(name, connection=rq_redis) for name in names]


def heartbeat_loop(redis: Redis, settings: Settings, name: str, status: Status, stop: threading.Event) -> None:
    http = httpx.Client(base_url=settings.inference_url, timeout=5)
    while not stop.is_set():
        try:
            usage = shutil.disk_usage(settings.data_dir)
            heartbeats.beat(
                redis,
                name,
                state=WorkerState(status.state),
                host=socket.gethostname(),
                pid=os.getpid(),
                inference_url=settings.inference_url,
                run=status.run,
                sample=status.sample,
                detail=status.detail,
                disk_free=usage.free,
                disk_total=usage.total,
            )
            heartbeats.report_inference(redis, settings.inference_url, **_probe(http))
        except Exception:  # the heartbeat must outlive a Redis restart: log, wait, beat again
            log.warning("%s: heartbeat failed", name, exc_info=True)
        stop.wait(settings.heartbeat_interval_s)


def _probe(http: httpx.Client) -> dict:
    try:
        r = http.get("/health")
        return {"ok": r.status_code == 200, "detail": f"HTTP {r.status_code}"}
    except httpx.HTTPError as e:
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", help="worker name (default: host:pid)")
    parser.add_argument("--burst", action="store_true", help="exit when no run has work left")
    args = parser.parse_args(argv)
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.name or f"{socket.gethostname()}:{os.getpid()}"
    # RQ stores pickled bytes; run state is text. Two clients on the same server.
    rq_redis = Redis.from_url(settings.redis_url, health_check_interval=30, retry_on_timeout=True)
    redis = Redis.from_url(settings.redis_url, health_check_interval=30, retry_on_timeout=True, decode_responses=True)
    status = Status()
    settings.dump_dir.mkdir(parents=True, exist_ok=True)
    jobs.configure(
        Extractor(
            redis=redis,
            http=httpx.Client(base_url=settings.inference_url, timeout=settings.request_timeout_s),
            data_dir=settings.data_dir,
            dump_dir=settings.dump_dir,
            worker=name,
            dump_wait_s=settings.dump_wait_s,
            max_attempts=settings.max_attempts,
            on_state=status.set,
        )
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    beat = threading.Thread(target=heartbeat_loop, args=(redis, settings, name, status, stop), daemon=True)
    beat.start()
    log.info("%s: extracting for %s, dumps in %s", name, settings.inference_url, settings.dump_dir)
    try:
        while not stop.is_set():
            queues = active_queues(redis, rq_redis)
            worker = SimpleWorker(queues, connection=rq_redis, name=f"{name}:{time.monotonic_ns()}")
            worked = worker.work(burst=True, logging_level="WARNING", max_jobs=1000)
            status.set(WorkerState.idle, "", "", "")
            if worker._stop_requested:  # RQ's own SIGTERM/SIGINT handler asked for a warm stop
                break
            if not worked:
                if args.burst and not any(q.name != CONTROL_QUEUE for q in queues):
                    break
                stop.wait(IDLE_POLL_S)
    finally:
        stop.set()
        heartbeats.forget(redis, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
