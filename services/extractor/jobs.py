"""The RQ jobs of an extractor worker. Arguments are ids; everything else is resolved here.

The worker process sets up one ``Extractor`` (connections, caches) with ``configure``; a plain
``rq worker`` on these queues works too and builds one from the environment on its first job.
"""

import logging
import os
import socket
import time

import httpx
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.exceptions import AbandonedJobError

from eaglet.services.extractor.extract import Extractor
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.keys import RunKeys
from eaglet.shared.runstate import RunState

log = logging.getLogger(__name__)
_extractor: Extractor | None = None  # one per worker process, set up by the worker's entry point


def configure(extractor: Extractor) -> None:
    global _extractor
    _extractor = extractor


REDIS_BACKOFF_S = (1, 2, 5, 10)


def extract_sample(run_id: str, index: int) -> str:
    """Extracts one sample. A Redis outage is waited out here: extraction is idempotent (a stored file is
    found and marked), so the job starts over rather than failing with its sample stored but unmarked."""
    extractor = _extractor or _from_environment()
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
    redis = _extractor.redis if _extractor else connect(Settings().redis_url)
    if exc_type is AbandonedJobError:
        log.warning("run %s sample %s: RQ found job %s abandoned by %s", run_id, index, job.id, job.worker_name)
        RunState(redis, run_id).end_attempt(int(index))
        redis.sadd(RunKeys(run_id).abandoned, int(index))
        return
    reason = f"job {job.id} crashed: {exc_type.__name__}: {exc_value}"
    RunState(redis, run_id).mark_failed(int(index), "", reason, job.worker_name or "")


def _from_environment() -> Extractor:
    settings = Settings()
    extractor = Extractor(
        redis=connect(settings.redis_url),
        http=httpx.Client(base_url=settings.inference_url, timeout=settings.request_timeout_s),
        data_dir=settings.data_dir,
        dump_dir=settings.dump_dir,
        worker=f"{socket.gethostname()}:{os.getpid()}",
        dump_wait_s=settings.dump_wait_s,
        max_attempts=settings.max_attempts,
        store_dtype=settings.store_dtype,
    )
    configure(extractor)
    return extractor
