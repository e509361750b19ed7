"""The process loop of an RQ worker, written once: the extractor and ingest workers are this loop, each with its own
queues and jobs (a ``WorkerService``).

The loop runs RQ's in-process worker in bursts, looking at the service's queues again between them (a run's queue
appears when its extraction starts); waits out a Redis outage, then goes on with the same clients; stops warmly on
SIGTERM, after the job in hand; in burst mode, ends once the service has no work left. A heartbeat thread reports
the worker's status to Redis and lets the service do its own part of each beat, sweeping for the work of dead
workers among it: there, not between jobs, since a busy worker's RQ loop may not come back for a thousand jobs.

A job finds what its worker's service gives it (the extractor's ``Extractor``) with ``job_context``: the loop sets
it while its RQ worker works, as RQ sets the current job; and its process's settings and clients with ``job_process``.
"""

import argparse
import functools
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar, TypeVar

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job

from . import heartbeats
from .config import Settings
from .connections import connect, connect_raw
from .jobqueue import rq_worker_name
from .logs import setup_logging
from .records import WorkerRole, WorkerState

log = logging.getLogger(__name__)
IDLE_POLL_S = 1.0
REDIS_BACKOFF_S = (1, 2, 5)
T = TypeVar("T")

_job_context: ContextVar[object] = ContextVar("eaglet_job_context")
_job_process: ContextVar["WorkerProcess"] = ContextVar("eaglet_job_process")


def job_context(kind: type[T]) -> T | None:
    """What the worker loop running this job gives its service's jobs, if it is a ``kind``; None outside such a
    loop (a job run by a plain ``rq worker``, a failure callback run by another process's registry cleanup)."""
    value = _job_context.get(None)
    return value if isinstance(value, kind) else None


@dataclass
class WorkerStatus:
    """What the worker is doing, for its heartbeat: written by the loop and the service's jobs, read by the heartbeat
    thread. Each field is replaced whole, so the thread reads without a lock."""

    state: str = WorkerState.idle
    run: str = ""
    sample: str = ""
    detail: str = ""
    rq_worker: str = ""
    """The RQ worker this process runs now, the ``worker_name`` of its jobs: a new one each burst."""

    def set(self, state: str, run: str = "", sample: str = "", detail: str = "") -> None:
        self.state, self.run, self.sample, self.detail = state, run, sample, detail


@dataclass(frozen=True)
class WorkerProcess:
    """One worker process as its service sees it: its names, settings, connections and status."""

    name: str
    instance: str
    """Unique per process: the name may be reused by the next one (a restarted container)."""
    settings: Settings
    redis: Redis
    """Run state, records and heartbeats: text."""
    rq_redis: Redis
    """RQ's pickled jobs: bytes."""
    status: WorkerStatus

    @classmethod
    def from_settings(cls, settings: Settings, name: str | None = None) -> "WorkerProcess":
        # RQ stores pickled bytes; run state is text. Two clients on the same server.
        return cls(
            name=name or f"{settings.status_host}:{os.getpid()}",
            instance=uuid.uuid4().hex[:12],
            settings=settings,
            redis=connect(settings.redis_url),
            rq_redis=connect_raw(settings.redis_url),
            status=WorkerStatus(),
        )


def job_process() -> WorkerProcess:
    """The process running this job, with its settings and clients, for every job it runs. A job run outside the
    worker loop (a plain ``rq worker``, a failure callback run by another process's registry cleanup) gets one built
    from the environment, once a process."""
    return _job_process.get(None) or _process_from_environment()


@functools.cache
def _process_from_environment() -> WorkerProcess:
    return WorkerProcess.from_settings(Settings())


class WorkerService:
    """A service's part of the loop: its queues, what its jobs get, its part of each heartbeat. The loop makes one
    per process, after its connections and before its heartbeat thread starts."""

    role: ClassVar[WorkerRole]
    burst_help: ClassVar[str]
    """``--burst``'s help: when this service has no work left."""
    burst_waits: ClassVar[bool] = False
    """In burst mode, whether a burst that found no job waits for more (its queues may get work back while they
    exist) rather than ending the worker."""
    max_jobs: ClassVar[int | None] = None
    """Jobs per RQ worker, hence between two looks at ``queues``; None: until its queues run dry."""

    def __init__(self, process: WorkerProcess) -> None:
        self.process = process

    def queues(self) -> list[Queue]:
        """The queues to work now, in order; none: nothing to listen to yet (a burst worker ends)."""
        raise NotImplementedError

    def job_context(self) -> object:
        """What this service's jobs get from ``job_context`` while its RQ worker works."""
        return None

    def running(self, job: Job) -> AbstractContextManager[None]:
        """What this service does around each job its process runs: by default, nothing."""
        return nullcontext()

    def beat(self) -> dict[str, Any]:
        """This service's fields of the worker's heartbeat (``heartbeats.beat``'s keywords): by default, those of a
        worker that talks to no inference server."""
        return {"inference_url": ""}

    def after_beat(self, judge_others: bool) -> None:
        """This service's own duties in each beat, after the worker's; ``judge_others``: Redis has answered for long
        enough that old heartbeats mean dead workers, whose work may be taken up."""


class _RQWorker(SimpleWorker):
    """RQ's in-process worker, running each job inside its service's ``running``, and telling the loop of a warm stop
    asked of it (its SIGTERM/SIGINT handler replaces the loop's while it works)."""

    service: WorkerService
    stop_asked = False
    """Not the loop's stop event: the heartbeat must go on until the job in hand is over."""

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_asked = True
        super().request_stop(signum, frame)

    def execute_job(self, job: Job, queue: Queue) -> Any:
        with self.service.running(job):
            return super().execute_job(job, queue)


@contextmanager
def _giving(context: object) -> Iterator[None]:
    token = _job_context.set(context)
    try:
        yield
    finally:
        _job_context.reset(token)


def _heartbeat(process: WorkerProcess, service: WorkerService, stop: threading.Event) -> None:
    settings, status = process.settings, process.status
    # Others' heartbeats are judged only once Redis has answered for a while: right after an outage every heartbeat
    # is old, and the workers are not dead.
    redis_ok_since = time.monotonic()
    while not stop.is_set():
        try:
            usage = shutil.disk_usage(settings.data_dir)
            heartbeats.beat(
                process.redis,
                process.name,
                role=service.role,
                state=WorkerState(status.state),
                host=settings.status_host,
                pid=os.getpid(),
                run=status.run,
                sample=status.sample,
                detail=status.detail,
                disk_free=usage.free,
                disk_total=usage.total,
                instance=process.instance,
                **service.beat(),
            )
            service.after_beat(judge_others=time.monotonic() - redis_ok_since > settings.lost_after_s)
        except Exception:  # the heartbeat must outlive a Redis restart: log, wait, beat again
            log.warning("%s: heartbeat failed", process.name, exc_info=True)
            redis_ok_since = time.monotonic()
        stop.wait(settings.heartbeat_interval_s)


def _work(process: WorkerProcess, service: WorkerService, stop: threading.Event, burst: bool) -> None:
    """RQ bursts until SIGTERM (or, in burst mode, no work left)."""
    failures, n = 0, 0
    while not stop.is_set():
        try:
            queues = service.queues()
            if not queues:
                failures = 0
                if burst:
                    break
                stop.wait(IDLE_POLL_S)
                continue
            n += 1
            worker = _RQWorker(
                queues, connection=process.rq_redis, name=rq_worker_name(process.name, process.instance, n)
            )
            worker.service = service
            process.status.rq_worker = worker.name
            with _giving(service.job_context()):
                worked = worker.work(burst=True, logging_level="WARNING", max_jobs=service.max_jobs)
            failures = 0
        except (RedisConnectionError, RedisTimeoutError) as e:
            # The process boundary: Redis restarted or unreachable. Wait, then reconnect (the clients do).
            delay = REDIS_BACKOFF_S[min(failures, len(REDIS_BACKOFF_S) - 1)]
            failures += 1
            log.warning("%s: Redis unreachable (%s); again in %ds", process.name, e, delay, exc_info=failures == 1)
            process.status.set(WorkerState.backoff, detail=f"redis unreachable: {e}")
            stop.wait(delay)
            continue
        process.status.set(WorkerState.idle)
        if worker.stop_asked:
            break
        if not worked:
            if burst and not service.burst_waits:
                break
            stop.wait(IDLE_POLL_S)


def run_worker(
    service_class: type[WorkerService], argv: list[str] | None, *, description: str, prog: str | None = None
) -> int:
    """A worker process of ``service_class`` from the command line (``--name``, ``--burst``); returns its exit code."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--name", help="worker name (default: host:pid)")
    parser.add_argument("--burst", action="store_true", help=service_class.burst_help)
    args = parser.parse_args(argv)
    settings = Settings()
    setup_logging()
    process = WorkerProcess.from_settings(settings, args.name)
    name = process.name
    _job_process.set(process)  # SimpleWorker runs its jobs in this thread
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # the heartbeat reports its free space from the start
    service = service_class(process)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=_heartbeat, args=(process, service, stop), daemon=True).start()
    try:
        _work(process, service, stop, args.burst)
    except StopRequested:  # SIGTERM while idle between bursts: RQ's handler is still installed
        log.info("%s: stopping", name)
    finally:
        stop.set()
        try:
            heartbeats.forget(process.redis, name)
        except (RedisConnectionError, RedisTimeoutError):
            log.warning("%s: could not remove my heartbeat (Redis unreachable); it will age out", name)
    return 0
