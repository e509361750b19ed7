"""eaglet's RQ queues: the control queue (one ingest job per run, one regeneration planning job per run that
starts with regeneration) and one queue per run (one job per sample index to extract, one per batch of prompts to
regenerate), and who owns a started job.

Jobs are named by import path, so this module (and the gateway that calls it) never imports the
services that run them. A sample's job id is fixed by run and index, a run's ingest job by run: enqueuing
one twice replaces, never duplicates, it.
"""

import hashlib
import time
from collections.abc import Iterable

from redis import Redis
from rq import Callback, Queue
from rq.executions import Execution
from rq.job import Job
from rq.utils import parse_composite_key

from .keys import CONTROL_QUEUE, RunKeys, queue_name
from .records import WorkerBeat, WorkerState

EXTRACT_JOB = "eaglet.services.extractor.jobs.extract_sample"
EXTRACT_FAILED = "eaglet.services.extractor.jobs.on_extract_failure"  # records a crashed job's sample as failed
INGEST_JOB = "eaglet.services.ingest.jobs.ingest_job"
REGEN_PLAN_JOB = "eaglet.services.regenerate.jobs.plan_job"  # cuts a run's input into batches, queues them
REGEN_JOB = "eaglet.services.regenerate.jobs.regenerate_batch"
REGEN_FAILED = "eaglet.services.regenerate.jobs.on_batch_failure"
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


def enqueue_ingest(redis: Redis, run_id: str) -> str:
    """Queues the ingest of a created run (its record holds the dataset and options); an ingest worker reads the
    dataset and queues its samples as it goes. Returns the job id."""
    job = control_queue(redis).enqueue(
        INGEST_JOB, run_id, job_id=job_id(run_id, "ingest"), job_timeout=24 * 3600, result_ttl=86400
    )
    return job.id


def enqueue_regeneration(redis: Redis, run_id: str) -> str:
    """Queues the planning of a run that starts with regeneration, for an ingest worker; returns the job id."""
    job = control_queue(redis).enqueue(
        REGEN_PLAN_JOB, run_id, job_id=job_id(run_id, "regen-plan"), job_timeout=3600, result_ttl=86400
    )
    return job.id


def enqueue_batches(redis: Redis, run_id: str, batches: Iterable[int], give_up: str = "", attempt: int = 0) -> int:
    """Queues regeneration batches on the run's queue, where the extractor workers take them; ``give_up``: the
    reason to record its unfinished prompts as failed, without asking the endpoint again. A batch queued again
    after a failure (``attempt`` > 0) gets a job id of its own: RQ is still filing the failed job under the old one."""
    jobs = [
        Queue.prepare_data(
            REGEN_JOB,
            args=(run_id, int(b), give_up),
            job_id=job_id(run_id, f"regen-{b}" + (f"-r{attempt}" if attempt else "")),
            timeout=24 * 3600,
            result_ttl=0,
            failure_ttl=7 * 86400,
            on_failure=Callback(REGEN_FAILED),
        )
        for b in batches
    ]
    return len(run_queue(redis, run_id).enqueue_many(jobs)) if jobs else 0


def failed_indexes(redis: Redis, run_id: str) -> list[int]:
    """The sample indexes recorded as failed (a hash of failures: small, it holds only failures)."""
    return sorted(int(i) for i in redis.hkeys(RunKeys(run_id).failures))


def cancel(redis: Redis, run_id: str) -> int:
    """Drops the run's queued jobs; returns how many were dropped. Jobs in flight finish and see the stage."""
    return run_queue(redis, run_id).empty()


def rq_worker_name(name: str, instance: str, n: int) -> str:
    """The name of the n-th RQ worker of a process: a sweep reads the job's owner back from it."""
    return f"{name}:{instance}:{n}"


def owner_of(rq_name: str) -> tuple[str, str] | None:
    """(worker name, instance) of an RQ worker name made by ``rq_worker_name``; None for other workers."""
    parts = rq_name.rsplit(":", 2)
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1]


def execution_of(rq_redis: Redis, entry: str) -> Execution | None:
    """RQ's record of the run of a job that a started-registry entry (``<job id>:<execution id>``) stands for;
    None once it has expired."""
    jid, execution_id = parse_composite_key(entry)
    try:
        return Execution.fetch(execution_id, jid, connection=rq_redis)
    except ValueError:
        return None


def running_worker(execution: Execution | None, job: Job) -> str:
    """The RQ worker running a started-registry entry's execution. RQ's SimpleWorker writes the execution (with its
    worker's name) and the registry entry in one step and the job's own worker name in a later one: a worker killed
    between the two leaves a job that names no worker, or the worker of an earlier attempt; so the execution's
    name first."""
    return (execution.worker_name if execution else "") or job.worker_name or ""


def owner_alive(owner: tuple[str, str], beats: dict[str, WorkerBeat], *, lost_after_s: float, instance: str) -> bool:
    """Whether the process that started a job still lives, judged by eaglet's heartbeats (``keys.WORKERS``, parsed):
    ``instance`` is the caller's own, alive whatever its heartbeat says; a heartbeat that is stale, stopped or of
    another instance (a worker restarted under the same name) means the owner died."""
    name, owner_instance = owner
    if owner_instance == instance:
        return True
    beat = beats.get(name)
    if beat is None or beat.instance != owner_instance or beat.state == WorkerState.stopped:
        return False
    return not beat.lost(time.time(), lost_after_s)
