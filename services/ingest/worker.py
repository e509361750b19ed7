"""Entry point of an ingest worker: ``python -m eaglet.services.ingest.worker``.

Takes ingest jobs from the control queue (``POST /runs`` queues one per run), in RQ burst mode, polling
again whenever the queue runs dry. A heartbeat thread reports the worker's state to Redis and sweeps for
ingests whose worker died (services/ingest/resume.py), here rather than between jobs: an ingest
job holds its worker for as long as its dataset takes to read.
"""

import argparse
import logging
import os
import shutil
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.queue import Queue

from eaglet.services.ingest.resume import resume_dead_ingests
from eaglet.shared import heartbeats
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect, connect_raw
from eaglet.shared.heartbeats import WorkerRole, WorkerState
from eaglet.shared.jobqueue import control_queue, rq_worker_name
from eaglet.shared.logs import setup_logging

log = logging.getLogger(__name__)
IDLE_POLL_S = 1.0
REDIS_BACKOFF_S = (1, 2, 5)


@dataclass
class Status:
    state: str = WorkerState.idle
    run: str = ""


class IngestWorker(SimpleWorker):
    """RQ's in-process worker that says which run it is ingesting, for the heartbeat."""

    status: Status

    def execute_job(self, job: Job, queue: Queue) -> bool:
        self.status.state, self.status.run = WorkerState.busy, str(job.args[0]) if job.args else ""
        try:
            return super().execute_job(job, queue)
        finally:
            self.status.state, self.status.run = WorkerState.idle, ""


def heartbeat_loop(
    redis: Redis, rq_redis: Redis, settings: Settings, name: str, instance: str, status: Status, stop: threading.Event
) -> None:
    lost_after_s = settings.lost_after_s
    # Others' heartbeats are judged only once Redis has answered for a while: right after an outage every
    # heartbeat is old, and the workers are not dead.
    redis_ok_since = time.monotonic()
    while not stop.is_set():
        try:
            usage = shutil.disk_usage(settings.data_dir)
            heartbeats.beat(
                redis,
                name,
                role=WorkerRole.ingest,
                state=WorkerState(status.state),
                host=socket.gethostname(),
                pid=os.getpid(),
                inference_url="",  # an ingest worker talks to no inference server
                run=status.run,
                disk_free=usage.free,
                disk_total=usage.total,
                instance=instance,
            )
            if time.monotonic() - redis_ok_since > lost_after_s:
                resumed = resume_dead_ingests(
                    redis, rq_redis, instance=instance, lost_after_s=lost_after_s, max_lost=settings.max_attempts
                )
                if resumed:
                    log.warning("%s: %d ingests of dead workers found", name, resumed)
        except Exception:  # the heartbeat must outlive a Redis restart: log, wait, beat again
            log.warning("%s: heartbeat failed", name, exc_info=True)
            redis_ok_since = time.monotonic()
        stop.wait(settings.heartbeat_interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet ingest-worker", description=__doc__)
    parser.add_argument("--name", help="worker name (default: host:pid)")
    parser.add_argument("--burst", action="store_true", help="exit when the control queue is empty")
    args = parser.parse_args(argv)
    settings = Settings()
    setup_logging()
    name = args.name or f"{socket.gethostname()}:{os.getpid()}"
    instance = uuid.uuid4().hex[:12]  # this process; the name may be reused by the next one
    # RQ stores pickled bytes; run state is text. Two clients on the same server.
    rq_redis = connect_raw(settings.redis_url)
    redis = connect(settings.redis_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # the heartbeat reports its free space from the start
    status, stop = Status(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    beat = threading.Thread(
        target=heartbeat_loop, args=(redis, rq_redis, settings, name, instance, status, stop), daemon=True
    )
    beat.start()
    log.info("%s: ingesting runs for %s into %s", name, settings.model, settings.data_dir)
    failures, n = 0, 0
    try:
        while not stop.is_set():
            try:
                n += 1
                worker = IngestWorker(
                    [control_queue(rq_redis)], connection=rq_redis, name=rq_worker_name(name, instance, n)
                )
                worker.status = status
                worked = worker.work(burst=True, logging_level="WARNING")
                failures = 0
            except (RedisConnectionError, RedisTimeoutError) as e:
                # Redis restarted or unreachable. Wait, then reconnect (the clients do).
                delay = REDIS_BACKOFF_S[min(failures, len(REDIS_BACKOFF_S) - 1)]
                failures += 1
                log.warning("%s: Redis unreachable (%s); again in %ds", name, e, delay, exc_info=failures == 1)
                stop.wait(delay)
                continue
            if worker._stop_requested or (args.burst and not worked):  # RQ's SIGTERM handler asked for a warm stop
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
