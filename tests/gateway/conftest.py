"""Fixtures of the gateway tests: a real gateway on a free port (uvicorn in a thread) over the tests' own Redis,
and a run driven through the real writers with its ground truth. Test modules get them as fixtures only."""

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
from redis import Redis

from eaglet.services.gateway.main import create_app
from eaglet.services.gateway.settings import GatewaySettings
from eaglet.shared.heartbeats import WorkerState, beat, report_inference
from eaglet.shared.redisserver import free_port
from eaglet.shared.runstate import RunState

TOKEN = "test-token-0123456789abcdef"


@dataclass
class Gateway:
    url: str
    settings: GatewaySettings
    datasets: Path

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)


def serve(settings: GatewaySettings):
    """Starts uvicorn in a thread; returns (url, stop)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def gateway_settings(redis_url: str, datasets: Path, **overrides) -> GatewaySettings:
    fields = dict(
        redis_url=redis_url,
        api_token=TOKEN,
        dataset_roots=[datasets],
        data_dir=datasets.parent / "data",
        heartbeat_interval_s=0.2,
        lost_heartbeats=3,
        stall_factor=5,
        stall_min_s=0.3,
        status_window_s=60,
    )
    return GatewaySettings(_env_file=None, **{**fields, **overrides})


@dataclass
class Truth:
    """What the writers were told, kept by the test: the figures the gateway must report."""

    total: int = 0
    total_tokens: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    nbytes: int = 0
    errors: int = 0
    retries: int = 0
    in_flight: dict = field(default_factory=dict)  # index -> worker
    errors_newest_first: list = field(default_factory=list)  # (index, sample_id, reason)
    worker_sample: dict = field(default_factory=dict)


def sample_tokens(index: int) -> int:
    return 100 + (index * 37) % 400


BYTES_PER_TOKEN = 4 * 2 * 64  # four bf16 states of H=64


class FakeRun:
    """Drives one run through the real writers (RunState, heartbeats) from a background thread.

    Sample i: started by worker i % 3; every 10th (i % 10 == 3) fails once (a transient error) and is
    retried; every 13th (i % 13 == 5) is given up; the rest are done. Two samples are in flight at once.
    ``lock`` is held for each step, so a test that takes it sees the state and the truth in agreement.
    """

    bytes_per_token = BYTES_PER_TOKEN

    def __init__(self, redis: Redis, run_id: str, total: int, workers: int = 3, step_s: float = 0.004):
        self.redis = redis
        self.run_id = run_id
        self.state = RunState(redis, run_id)
        self.truth = Truth(total=total, total_tokens=sum(sample_tokens(i) for i in range(total)))
        self.workers = [f"w{n}" for n in range(workers)]
        self.step_s = step_s
        self.lock = threading.Lock()
        self.paused = threading.Event()  # completions stop, heartbeats go on
        self.silent: set[str] = set()  # workers whose heartbeats stopped
        self.finished = threading.Event()
        self._next = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def ingest(self, bad_line: str = "data.jsonl:7") -> None:
        if not self.state.exists():  # a run is created once; a test may have created it to see it ingesting
            self.state.create(dataset="/datasets/data.jsonl", model="tiny")
        self.state.record_error(-1, bad_line, "not JSON: Expecting value", "ingest", final=True)
        self._error(-1, bad_line, "not JSON: Expecting value")
        self.state.start_extraction()  # as ingest does: the first samples are queued before the total is known
        self.state.set_total(self.truth.total, self.truth.total_tokens)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.finished.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _error(self, index: int, sample_id: str, reason: str) -> None:
        self.truth.errors += 1
        self.truth.errors_newest_first.insert(0, (index, sample_id, reason))

    def _beat(self) -> None:
        for w in self.workers:
            if w not in self.silent:
                sample = self.truth.worker_sample.get(w, "")
                state = WorkerState.busy if sample else WorkerState.idle
                beat(self.redis, w, state=state, host="h", pid=1, inference_url="http://inf:1", run=self.run_id,
                     sample=sample, disk_free=10**12, disk_total=2 * 10**12)  # fmt: skip
        report_inference(self.redis, "http://inf:1", ok=True, model="tiny")

    def _finish(self, index: int) -> None:
        t, sid, worker = self.truth, f"s{index}", self.truth.in_flight.pop(index)
        t.worker_sample.pop(worker, None)
        if index % 13 == 5:
            self.state.mark_failed(index, sid, f"dump of {sid}: 3 tokens, expected {sample_tokens(index)}", worker)
            self._error(index, sid, f"dump of {sid}: 3 tokens, expected {sample_tokens(index)}")
            t.failed += 1
            return
        if index % 10 == 3:
            self.state.record_error(index, sid, "inference timeout", worker)
            self._error(index, sid, "inference timeout")
            self.state.start_attempt(index, worker)
            t.retries += 1
        tokens = sample_tokens(index)
        self.state.mark_done(index, tokens, tokens * BYTES_PER_TOKEN)
        t.done, t.tokens, t.nbytes = t.done + 1, t.tokens + tokens, t.nbytes + tokens * BYTES_PER_TOKEN

    def step(self) -> None:
        t = self.truth
        if self._next < t.total:
            index, worker = self._next, self.workers[self._next % len(self.workers)]
            self.state.start_attempt(index, worker)
            t.in_flight[index] = worker
            t.worker_sample[worker] = f"s{index}"
            self._next += 1
        if len(t.in_flight) > 2 or (self._next >= t.total and t.in_flight):
            self._finish(min(t.in_flight))

    def _loop(self) -> None:
        while not self.finished.is_set():
            with self.lock:
                if not self.paused.is_set():
                    self.step()
                self._beat()
            time.sleep(self.step_s)


@pytest.fixture
def start_gateway(redis, redis_server, tmp_path):
    """Starts gateways with settings overridden; stops them at the end."""
    stops = []

    def start(**overrides) -> Gateway:
        datasets = tmp_path / "datasets"
        datasets.mkdir(exist_ok=True)
        settings = gateway_settings(redis_server.url, datasets, **overrides)
        url, stop = serve(settings)
        stops.append(stop)
        return Gateway(url=url, settings=settings, datasets=datasets)

    yield start
    for stop in stops:
        stop()


@pytest.fixture
def gateway(start_gateway) -> Gateway:
    return start_gateway()


@pytest.fixture
def fake_run(redis):
    """Makes runs driven from a background thread; stops their threads at the end."""
    made: list[FakeRun] = []

    def make(run_id: str, total: int) -> FakeRun:
        made.append(FakeRun(redis, run_id, total))
        return made[-1]

    yield make
    for fake in made:
        fake.stop()
