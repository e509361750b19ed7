"""The worker process loop without RQ: bursts until there is no work (as each worker defines it), a backoff while
Redis is unreachable, a fresh worker name per burst, the heartbeat gone on exit, sweeps only once Redis answers."""

import signal
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from eaglet.shared import heartbeats, workerloop
from eaglet.shared.heartbeats import WorkerState
from eaglet.shared.workerloop import Heartbeat, run_worker


class FakeWorker:
    """Stands in for an RQ worker: each burst works or not as scripted."""

    def __init__(self, worked: bool, stop_requested: bool = False):
        self.worked, self._stop_requested = worked, stop_requested

    def work(self, burst: bool, logging_level: str, max_jobs: int | None) -> bool:
        assert burst
        return self.worked


@pytest.fixture(autouse=True)
def sigterm():
    """run_worker installs its own SIGTERM handler: the test process gets its own back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(workerloop, "IDLE_POLL_S", 0.01)
    monkeypatch.setattr(workerloop, "REDIS_BACKOFF_S", (0.01,))


def quiet_heartbeat() -> Heartbeat:
    return Heartbeat(lambda: None, lambda: None, interval_s=0.01, sweep_after_s=60)


def scripted(script: list, made: list[int]):
    """A factory that hands out the scripted bursts in order (an exception is raised) and records each n."""

    def make_worker(n: int):
        made.append(n)
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    return make_worker


def test_a_burst_that_may_see_more_work_ends_only_when_nothing_is_left_to_listen_to(redis):
    made: list[int] = []
    script = [FakeWorker(True), FakeWorker(False), None]
    run_worker(redis, "w", threading.Event(), scripted(script, made), quiet_heartbeat(), burst=True, more_may_come=True)
    assert script == [] and made == [1, 2, 3]


def test_a_burst_that_found_no_job_ends_when_no_more_may_come(redis):
    made: list[int] = []
    script = [FakeWorker(True), FakeWorker(False), FakeWorker(True)]
    run_worker(
        redis, "w", threading.Event(), scripted(script, made), quiet_heartbeat(), burst=True, more_may_come=False
    )
    assert len(script) == 1 and made == [1, 2]


def test_redis_down_backs_off_then_goes_on_under_a_name_not_used_yet(redis):
    made: list[int] = []
    states: list[tuple[str, str]] = []
    script = [RedisConnectionError("gone"), None, FakeWorker(True), FakeWorker(False, stop_requested=True)]
    run_worker(
        redis, "w", threading.Event(), scripted(script, made), quiet_heartbeat(),
        burst=False, more_may_come=True, on_state=lambda state, detail: states.append((state, detail)),
    )  # fmt: skip
    assert made == [1, 1, 1, 2]  # neither the failed call nor "nothing to listen to" used up a name
    assert states == [(WorkerState.backoff, "redis unreachable: gone"), (WorkerState.idle, ""), (WorkerState.idle, "")]


def test_the_heartbeat_beats_while_the_worker_runs_and_is_forgotten_on_exit(redis):
    stop, beaten = threading.Event(), threading.Event()

    def beat() -> None:
        if not beaten.is_set():  # once: a beat racing the exit would bring the record back
            heartbeats.beat(redis, "w", state=WorkerState.idle, host="h", pid=1, inference_url="")
            beaten.set()

    def make_worker(n: int):
        assert beaten.wait(10), "no beat"
        assert "w" in heartbeats.workers(redis)
        return None

    run_worker(redis, "w", stop, make_worker, Heartbeat(beat, lambda: None, 0.01, 60), burst=True, more_may_come=True)
    assert stop.is_set() and "w" not in heartbeats.workers(redis)


def test_the_sweep_waits_until_redis_has_answered_for_a_while():
    stop, calls = threading.Event(), []
    failing = iter([True, False, False, False])

    def beat() -> None:
        calls.append("beat")
        if next(failing, False):
            raise RedisConnectionError("gone")

    def sweep() -> None:
        calls.append("sweep")
        stop.set()

    thread = threading.Thread(target=Heartbeat(beat, sweep, interval_s=0.02, sweep_after_s=0.05).run, args=("w", stop))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and calls[-1] == "sweep"
    assert calls.count("beat") >= 3  # the failed beat restarted the wait: no sweep right after it
