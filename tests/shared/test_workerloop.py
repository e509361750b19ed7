"""The shared worker loop in-process, with a service of the test's own on a real Redis: a job gets what its service
gives it, a burst worker ends once its queue is dry, and a worker that stops takes its heartbeat with it."""

import signal

from redis import Redis
from rq import Queue

from eaglet.shared import heartbeats
from eaglet.shared.records import WorkerRole
from eaglet.shared.workerloop import WorkerService, WorkerStatus, job_context, run_worker

QUEUE = "eaglet:test:workerloop"


class StatusService(WorkerService):
    """Gives its jobs the process's status record."""

    role = WorkerRole.ingest
    burst_help = "exit when the queue is empty"

    def queues(self) -> list[Queue]:
        return [Queue(QUEUE, connection=self.process.rq_redis)]

    def job_context(self) -> WorkerStatus:
        return self.process.status


def test_a_job_gets_its_services_context_and_a_burst_worker_ends_when_dry(redis, redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_REDIS_URL", redis_server.url)
    monkeypatch.setenv("EAGLET_DATA_DIR", str(tmp_path / "data"))
    job = Queue(QUEUE, connection=Redis.from_url(redis_server.url)).enqueue(job_context, WorkerStatus)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert run_worker(StatusService, ["--name", "w", "--burst"], description="") == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    status = job.return_value()
    assert isinstance(status, WorkerStatus) and status.rq_worker.startswith("w:") and status.rq_worker.endswith(":1")
    assert "w" not in heartbeats.workers(redis)  # it stopped cleanly: gone, not lost
    assert job_context(WorkerStatus) is None  # outside a worker loop, a job gets nothing
