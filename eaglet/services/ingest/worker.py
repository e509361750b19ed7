"""Entry point of an ingest worker: ``python -m eaglet.services.ingest.worker``.

Takes ingest jobs from the control queue (``POST /runs`` queues one per run), in RQ burst mode, polling
again whenever the queue runs dry. A heartbeat thread reports the worker's state to Redis and sweeps for
ingests whose worker died (eaglet/services/ingest/resume.py), here rather than between jobs: an ingest
job holds its worker for as long as its dataset takes to read.
"""

import argparse
import logging
import os
import shutil
import socket
import threading
from dataclasses import dataclass

from redis import Redis
from rq import SimpleWorker
from rq.job import Job
from rq.queue import Queue

from eaglet.services.ingest.resume import resume_dead_ingests
from eaglet.shared import heartbeats
from eaglet.shared.config import Settings
from eaglet.shared.heartbeats import WorkerRole, WorkerState
from eaglet.shared.jobqueue import control_queue, rq_worker_name
from eaglet.shared.workerloop import Heartbeat, connect, identity, run_worker

log = logging.getLogger(__name__)


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


def heartbeat(redis: Redis, rq_redis: Redis, settings: Settings, name: str, instance: str, status: Status) -> Heartbeat:
    """Beats as an ingest worker, and resumes the ingests of dead workers."""
    lost_after_s = settings.lost_after_s

    def beat() -> None:
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

    def sweep() -> None:
        resumed = resume_dead_ingests(
            redis, rq_redis, instance=instance, lost_after_s=lost_after_s, max_lost=settings.max_attempts
        )
        if resumed:
            log.warning("%s: %d ingests of dead workers found", name, resumed)

    return Heartbeat(beat, sweep, interval_s=settings.heartbeat_interval_s, sweep_after_s=lost_after_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet ingest-worker", description=__doc__)
    parser.add_argument("--name", help="worker name (default: host:pid)")
    parser.add_argument("--burst", action="store_true", help="exit when the control queue is empty")
    args = parser.parse_args(argv)
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name, instance = identity(args.name)
    rq_redis, redis = connect(settings.redis_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # the heartbeat reports its free space from the start
    status = Status()
    log.info("%s: ingesting runs for %s into %s", name, settings.model, settings.data_dir)

    def make_worker(n: int) -> IngestWorker:
        worker = IngestWorker([control_queue(rq_redis)], connection=rq_redis, name=rq_worker_name(name, instance, n))
        worker.status = status
        return worker

    run_worker(
        redis,
        name,
        threading.Event(),
        make_worker,
        heartbeat(redis, rq_redis, settings, name, instance, status),
        burst=args.burst,
        more_may_come=False,  # no ingest job queues another: an empty control queue ends a burst
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
