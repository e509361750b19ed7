"""The process loop of an RQ worker (extractor and ingest alike): a heartbeat thread, RQ burst after burst with a
backoff while Redis is unreachable, and a stop on SIGTERM that takes the worker's heartbeat with it."""

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import SimpleWorker
from rq.exceptions import StopRequested

from eaglet.shared import heartbeats
from eaglet.shared.heartbeats import WorkerState

log = logging.getLogger(__name__)
IDLE_POLL_S = 1.0
REDIS_BACKOFF_S = (1, 2, 5)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)


@dataclass(frozen=True)
class Heartbeat:
    """What a worker's heartbeat thread does each interval: ``beat`` reports the worker, ``sweep`` recovers the work
    of dead workers. Sweeping is the heartbeat's, not the RQ loop's: a busy worker's loop may not come back between
    jobs for a long while."""

    beat: Callable[[], None]
    sweep: Callable[[], None]
    interval_s: float
    sweep_after_s: float
    """Redis must have answered this long before others' heartbeats are judged: right after an outage every
    heartbeat is old, and the workers are not dead."""

    def run(self, name: str, stop: threading.Event) -> None:
        redis_ok_since = time.monotonic()
        while not stop.is_set():
            try:
                self.beat()
                if time.monotonic() - redis_ok_since > self.sweep_after_s:
                    self.sweep()
            except Exception:  # the heartbeat must outlive a Redis restart: log, wait, beat again
                log.warning("%s: heartbeat failed", name, exc_info=True)
                redis_ok_since = time.monotonic()
            stop.wait(self.interval_s)


def connect(redis_url: str) -> tuple[Redis, Redis]:
    """The two clients of a worker on one server: RQ's (pickled bytes) and the run state's (text)."""
    rq_redis = Redis.from_url(redis_url, health_check_interval=30, retry_on_timeout=True)
    redis = Redis.from_url(redis_url, health_check_interval=30, retry_on_timeout=True, decode_responses=True)
    return rq_redis, redis


def identity(name: str | None) -> tuple[str, str]:
    """(name, instance): the name given (default host:pid) and an id of this process alone, since the name may
    be reused by the next process."""
    return name or f"{socket.gethostname()}:{os.getpid()}", uuid.uuid4().hex[:12]


def run_worker(
    redis: Redis,
    name: str,
    stop: threading.Event,
    make_worker: Callable[[int], SimpleWorker | None],
    heartbeat: Heartbeat,
    *,
    burst: bool,
    more_may_come: bool,
    max_jobs: int | None = None,
    on_state: Callable[[str, str], None] | None = None,
) -> None:
    """Runs RQ bursts until ``stop`` is set or SIGTERM arrives, then removes the worker's heartbeat.

    ``make_worker(n)`` makes the RQ worker of the n-th burst (a fresh name each: a burst cut short by a Redis outage
    may leave its name registered), or None while there is nothing to listen to. ``burst`` exits once there is no
    work: when ``make_worker`` has nothing to listen to, or, unless ``more_may_come`` (queues that may fill again
    while they are listened to), when a burst found no job. ``on_state(state, detail)`` hears of the backoff and of
    the idle state between bursts."""
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=heartbeat.run, args=(name, stop), daemon=True).start()
    failures, n = 0, 0
    try:
        while not stop.is_set():
            try:
                worker = make_worker(n + 1)
                if worker is None:  # nothing to listen to yet
                    failures = 0
                    if burst:
                        break
                    stop.wait(IDLE_POLL_S)
                    continue
                n += 1
                worked = worker.work(burst=True, logging_level="WARNING", max_jobs=max_jobs)
                failures = 0
            except REDIS_DOWN as e:
                # The process boundary: Redis restarted or unreachable. Wait, then reconnect (the clients do).
                delay = REDIS_BACKOFF_S[min(failures, len(REDIS_BACKOFF_S) - 1)]
                failures += 1
                log.warning("%s: Redis unreachable (%s); again in %ds", name, e, delay, exc_info=failures == 1)
                if on_state is not None:
                    on_state(WorkerState.backoff, f"redis unreachable: {e}")
                stop.wait(delay)
                continue
            if on_state is not None:
                on_state(WorkerState.idle, "")
            if worker._stop_requested:  # RQ's own SIGTERM/SIGINT handler asked for a warm stop
                break
            if not worked:
                if burst and not more_may_come:
                    break
                stop.wait(IDLE_POLL_S)
    except StopRequested:  # SIGTERM while idle between bursts: RQ's handler is still installed
        log.info("%s: stopping", name)
    finally:
        stop.set()
        try:
            heartbeats.forget(redis, name)
        except REDIS_DOWN:
            log.warning("%s: could not remove my heartbeat (Redis unreachable); it will age out", name)
