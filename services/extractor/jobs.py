"""The RQ jobs of an extractor worker. Arguments are ids; everything else is resolved here.

A job gets its worker's ``Extractor`` (connections, caches), built once per process by the worker's service, through
the worker loop's job context. A plain ``rq worker`` on these queues works too: its process builds one from the
environment on its first job.
"""

import functools
import logging
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.exceptions import AbandonedJobError

from eaglet.services.extractor.extract import Extractor
from eaglet.shared.keys import RunKeys
from eaglet.shared.runstate import RunState
from eaglet.shared.workerloop import job_context, job_process

log = logging.getLogger(__name__)
REDIS_BACKOFF_S = (1, 2, 5, 10)


def extract_sample(run_id: str, index: int) -> str:
    """Extracts one sample. A Redis outage is waited out here: extraction is idempotent (a stored file is
    found and marked), so the job starts over rather than failing with its sample stored but unmarked."""
    extractor = job_context(Extractor) or _from_environment()
    deadline = time.monotonic() + extractor.max_transient_s
    tries = 0
    while True:
        try:
            outcome = extractor.extract(run_id, index)
            break
        except (RedisConnectionError, RedisTimeoutError) as e:
            if time.monotonic() > deadline:
                raise
            delay = REDIS_BACKOFF_S[min(tries, len(REDIS_BACKOFF_S) - 1)]
            log.warning("%s: run %s sample %d: Redis unreachable (%s); again in %ds", extractor.worker, run_id,
                        index, e, delay)  # fmt: skip
            extractor.report("backoff", run_id, "", f"redis unreachable: {e}")
            time.sleep(delay)
            tries += 1
    log.info("%s: run %s sample %d: %s", extractor.worker, run_id, index, outcome)
    return outcome


def on_extract_failure(job, connection, exc_type, exc_value, traceback) -> None:
    """A job that raised (a bug, a timeout): its sample is recorded as failed, never silently lost.

    A job RQ found abandoned (its worker died) is not the sample's fault: it is noted for the reaper,
    which queues it again (services/extractor/reaper.py)."""
    run_id, index = job.args
    extractor = job_context(Extractor)  # none where another process's cleanup found the job abandoned
    redis = extractor.redis if extractor else job_process().redis
    if exc_type is AbandonedJobError:
        log.warning("run %s sample %s: RQ found job %s abandoned by %s", run_id, index, job.id, job.worker_name)
        RunState(redis, run_id).end_attempt(int(index))
        redis.sadd(RunKeys(run_id).abandoned, int(index))
        return
    reason = f"job {job.id} crashed: {exc_type.__name__}: {exc_value}"
    RunState(redis, run_id).mark_failed(int(index), "", reason, job.worker_name or "")


@functools.cache
def _from_environment() -> Extractor:
    """The extractor of a process that runs these jobs outside the worker loop: one, from its environment."""
    process = job_process()
    return Extractor.from_settings(process.settings, process.redis, worker=process.name)
