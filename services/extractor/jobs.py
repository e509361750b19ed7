"""The RQ jobs of an extractor worker. Arguments are ids; everything else is resolved here.

The worker process sets up one ``Extractor`` (connections, caches) with ``configure``; a plain
``rq worker`` on these queues works too and builds one from the environment on its first job.
"""

import logging
import os
import socket

import httpx
from redis import Redis

from services.extractor.extract import Extractor
from shared.config import Settings
from shared.runstate import RunState

log = logging.getLogger(__name__)
_extractor: Extractor | None = None  # one per worker process, set up by the worker's entry point


def configure(extractor: Extractor) -> None:
    global _extractor
    _extractor = extractor


def extract_sample(run_id: str, index: int) -> str:
    extractor = _extractor or _from_environment()
    outcome = extractor.extract(run_id, index)
    log.info("%s: run %s sample %d: %s", extractor.worker, run_id, index, outcome)
    return outcome


def on_extract_failure(job, connection, exc_type, exc_value, traceback) -> None:
    """A job that raised (a bug, a timeout): its sample is recorded as failed, never silently lost."""
    run_id, index = job.args
    reason = f"job {job.id} crashed: {exc_type.__name__}: {exc_value}"
    redis = _extractor.redis if _extractor else Redis.from_url(Settings().redis_url, decode_responses=True)
    RunState(redis, run_id).mark_failed(int(index), "", reason, job.worker_name or "")


def _from_environment() -> Extractor:
    settings = Settings()
    extractor = Extractor(
        redis=Redis.from_url(settings.redis_url, decode_responses=True),
        http=httpx.Client(base_url=settings.inference_url, timeout=settings.request_timeout_s),
        data_dir=settings.data_dir,
        dump_dir=settings.dump_dir,
        worker=f"{socket.gethostname()}:{os.getpid()}",
        dump_wait_s=settings.dump_wait_s,
        max_attempts=settings.max_attempts,
    )
    configure(extractor)
    return extractor
