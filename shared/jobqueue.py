"""The extraction queue: one RQ job per sample index, one queue per run.

Jobs are named by import path, so this module (and the gateway that calls it) never imports the
extractor. Job ids are ``<run>:<index>``: enqueuing a sample twice replaces, never duplicates, its job.
"""

from collections.abc import Iterable

from redis import Redis
from rq import Queue

from shared.keys import CONTROL_QUEUE, RunKeys, queue_name

EXTRACT_JOB = "services.extractor.jobs.extract_sample"
INGEST_JOB = "services.ingest.jobs.ingest_run"
BATCH = 1000


def run_queue(redis: Redis, run_id: str) -> Queue:
    return Queue(queue_name(run_id), connection=redis)


def control_queue(redis: Redis) -> Queue:
    return Queue(CONTROL_QUEUE, connection=redis)


def enqueue_samples(redis: Redis, run_id: str, indexes: Iterable[int], *, job_timeout: int = 3600) -> int:
    """Queues extraction of the given sample indexes, in batches; returns how many were queued."""
    queue = run_queue(redis, run_id)
    n, batch = 0, []
    for index in indexes:
        batch.append(
            Queue.prepare_data(
                EXTRACT_JOB,
                args=(run_id, int(index)),
                job_id=f"{run_id}:{index}",
                timeout=job_timeout,
                result_ttl=0,
                failure_ttl=7 * 86400,
            )
        )
        if len(batch) == BATCH:
            n += len(queue.enqueue_many(batch))
            batch = []
    if batch:
        n += len(queue.enqueue_many(batch))
    return n


def enqueue_ingest(redis: Redis, run_id: str, dataset: str, options: dict) -> str:
    """Queues ingestion of a dataset as a new run; a worker ingests it, then queues its samples."""
    job = control_queue(redis).enqueue(
        INGEST_JOB, run_id, dataset, options, job_id=f"ingest:{run_id}", job_timeout=24 * 3600, result_ttl=86400
    )
    return job.id


def failed_indexes(redis: Redis, run_id: str) -> list[int]:
    """The sample indexes recorded as failed (a hash of failures: small, it holds only failures)."""
    return sorted(int(i) for i in redis.hkeys(RunKeys(run_id).failures))


def cancel(redis: Redis, run_id: str) -> int:
    """Drops the run's queued jobs; returns how many were dropped. Jobs in flight finish and see the stage."""
    return run_queue(redis, run_id).empty()
