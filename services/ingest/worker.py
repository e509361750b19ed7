"""Entry point of an ingest worker: ``python -m eaglet.services.ingest.worker``.

Takes ingest jobs from the control queue (``POST /runs`` queues one per run), in RQ burst mode, polling
again whenever the queue runs dry. A heartbeat thread reports the worker's state to Redis and sweeps for
ingests whose worker died (services/ingest/resume.py), here rather than between jobs: an ingest
job holds its worker for as long as its dataset takes to read. The process loop is the shared one
(shared/workerloop.py): this module gives it the control queue.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from rq import Queue
from rq.job import Job

from eaglet.services.ingest.resume import resume_dead_ingests
from eaglet.shared.jobqueue import control_queue
from eaglet.shared.records import WorkerRole, WorkerState
from eaglet.shared.workerloop import WorkerProcess, WorkerService, run_worker

log = logging.getLogger(__name__)


class IngestService(WorkerService):
    """The control queue's worker: ingests, and the planning of regenerations."""

    role = WorkerRole.ingest
    burst_help = "exit when the control queue is empty"

    def __init__(self, process: WorkerProcess) -> None:
        super().__init__(process)
        log.info("%s: ingesting runs for %s into %s", process.name, process.settings.model, process.settings.data_dir)

    def queues(self) -> list[Queue]:
        return [control_queue(self.process.rq_redis)]

    @contextmanager
    def running(self, job: Job) -> Iterator[None]:
        """Says which run it is ingesting, for the heartbeat."""
        self.process.status.set(WorkerState.busy, str(job.args[0]) if job.args else "")
        try:
            yield
        finally:
            self.process.status.set(WorkerState.idle)

    def after_beat(self, judge_others: bool) -> None:
        if not judge_others:
            return
        settings = self.process.settings
        resumed = resume_dead_ingests(
            self.process.redis,
            self.process.rq_redis,
            instance=self.process.instance,
            lost_after_s=settings.lost_after_s,
            max_lost=settings.max_attempts,
        )
        if resumed:
            log.warning("%s: %d ingests of dead workers found", self.process.name, resumed)


def main(argv: list[str] | None = None) -> int:
    return run_worker(IngestService, argv, description=__doc__, prog="eaglet ingest-worker")


if __name__ == "__main__":
    raise SystemExit(main())
