"""The extraction queue: one RQ job per sample index, one queue per run.

Jobs are named by import path, so this module (and the gateway that calls it) never imports the
extractor. A sample's job id is fixed by run and index: enqueuing it twice replaces, never duplicates, it.
"""

import hashlib
from collections.abc import Iterable

from redis import Redis
from rq import Callback, Queue

from eaglet.shared.keys import CONTROL_QUEUE, RunKeys, queue_name

EXTRACT_JOB = "eaglet.services.extractor.jobs.extract_sample"
EXTRACT_FAILED = "eaglet.services.extractor.jobs.on_extract_failure"  # records a crashed job's sample as failed
INGEST_JOB = "eaglet.services.ingest.jobs.ingest_run"
BATCH = 1000


def job_id(run_id: str, what: str | int) -> str:
    """RQ allows only [A-Za-z0-9_-] in job ids; run ids may hold '.', so they are hashed."""
    return f"{hashlib.sha1(run_id.encode()).hexdigest()[:16]}-{what}"


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
                job_id=job_id(run_id, index),
                timeout=job_timeout,
                result_ttl=0,
                failure_ttl=7 * 86400,
                on_failure=Callback(EXTRACT_FAILED),
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
        INGEST_JOB, run_id, dataset, options, job_id=job_id(run_id, "ingest"), job_timeout=24 * 3600, result_ttl=86400
    )
    return job.id


def failed_indexes(redis: Redis, run_id: str) -> list[int]:
    """The sample indexes recorded as failed (a hash of failures: small, it holds only failures)."""
    return sorted(int(i) for i in redis.hkeys(RunKeys(run_id).failures))


def cancel(redis: Redis, run_id: str) -> int:
    """Drops the run's queued jobs; returns how many were dropped. Jobs in flight finish and see the stage."""
    return run_queue(redis, run_id).empty()
