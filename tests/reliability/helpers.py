"""Fixtures and checks of the fault tests: real Redis, real servers, real worker processes, real faults.

``check_outcome`` is the one definition of "nothing lost" every fault test ends with: each sample done
exactly once or failed with a reason, the counters equal to the bitmaps and to the files, no partial
file, nothing in flight, the completion flag set once.
"""

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import uvicorn
from redis import Redis

from eaglet.services.gateway.main import create_app
from eaglet.services.gateway.settings import GatewaySettings
from eaglet.shared import keys
from eaglet.shared.config import Settings
from eaglet.shared.jobqueue import run_queue
from eaglet.shared.keys import RunKeys
from eaglet.shared.records import ExtractionCounts
from eaglet.shared.redisserver import free_port
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import open_sample, sample_is_complete, sample_path, samples_dir

log = logging.getLogger(__name__)
TOKEN = "reliability-token-5f0c1e2d9a7b4c3e"
HEARTBEAT_S = 0.5  # fast heartbeats: a killed worker is judged dead after 3 of them


def write_dataset(path: Path, n: int, prefix: str = "s", min_len: int = 8) -> None:
    """Pre-tokenized samples of 8-30 tokens: ingest is instant and every sample differs."""
    lines = []
    for i in range(n):
        ids = [(13 * i + 7 * j) % 800 + 20 for j in range(min_len + i % 23)]
        lines.append({"id": f"{prefix}-{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4)})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def env_of(settings: Settings, **extra: str) -> dict[str, str]:
    fields = ("redis_url", "data_dir", "dump_dir", "model", "inference_url", "heartbeat_interval_s", "dump_wait_s")
    env = {f"EAGLET_{name.upper()}": str(getattr(settings, name)) for name in fields}
    return {**env, "EAGLET_MAX_ATTEMPTS": str(settings.max_attempts), **extra}


def wait_for(
    what: str,
    predicate: Callable[[], object],
    timeout: float,
    every: float = 0.1,
    explain: Callable[[], object] | None = None,
) -> object:
    """``predicate``'s first true value; on timeout an AssertionError with ``explain()``'s picture of the state."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            picture = f"\n{json.dumps(explain(), indent=1, default=str)}" if explain else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{picture}")
        time.sleep(every)


def run_picture(redis: Redis, rq_redis: Redis, run_id: str) -> dict[str, object]:
    """Where a run's unfinished samples are: counts, in flight, RQ's queue and registries, the reaper's notes and
    the workers' heartbeats; what a stuck fault test prints."""
    k, queue = RunKeys(run_id), run_queue(rq_redis, run_id)
    return {
        "meta": redis.hgetall(k.meta),
        "counts": redis.hgetall(k.counts),
        "in_flight": redis.hgetall(k.inflight),
        "queued": queue.count,
        "started": [e.decode() for e in rq_redis.zrange(queue.started_job_registry.key, 0, -1)],
        "failed_jobs": [e.decode() for e in rq_redis.zrange(queue.failed_job_registry.key, 0, -1)],
        "abandoned": sorted(redis.smembers(k.abandoned)),
        "lost": redis.hgetall(k.lost),
        "errors": redis.lrange(k.errors, 0, 9),
        "workers": redis.hgetall(keys.WORKERS),
    }


class Events:
    """Counts the run events published while a test runs (the completion must be announced once)."""

    def __init__(self, redis: Redis):
        self.redis, self.seen = redis, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self.redis.pubsub()
                pubsub.subscribe(keys.EVENTS)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message and message["type"] == "message":
                        self.seen.append(json.loads(message["data"]))
            except Exception:  # Redis restarted under us: subscribe again
                time.sleep(0.2)

    def count(self, run_id: str, event: str) -> int:
        return sum(1 for e in self.seen if e["run"] == run_id and e["event"] == event)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def events(redis, redis_server):
    ev = Events(Redis.from_url(redis_server.url, decode_responses=True))
    time.sleep(0.3)  # subscribed before the run starts
    yield ev
    ev.close()


def check_outcome(redis: Redis, settings: Settings, run_id: str, n: int) -> ExtractionCounts:
    """Asserts that nothing was lost or doubled; returns the counts for the report."""
    state, k = RunState(redis, run_id), RunKeys(run_id)
    counts = state.counts()
    assert state.extraction_complete(), counts
    assert counts.done + counts.failed == n, counts
    assert redis.bitcount(k.done) == counts.done and redis.bitcount(k.failed) == counts.failed, counts
    redis.bitop("AND", f"{k.done}:both", k.done, k.failed)
    assert redis.bitcount(f"{k.done}:both") == 0, "a sample is both done and failed"
    redis.delete(f"{k.done}:both")
    assert redis.hlen(k.inflight) == 0, redis.hgetall(k.inflight)
    failures = {int(i): json.loads(v) for i, v in redis.hgetall(k.failures).items()}
    assert len(failures) == counts.failed and all(f["reason"] for f in failures.values()), failures
    samples = SampleSet(samples_dir(settings.data_dir, run_id))
    stored_bytes, stored_tokens = 0, 0
    for i in range(n):
        sample = samples[i]
        path = sample_path(settings.data_dir, run_id, sample.sample_id)
        if state.is_done(i):
            assert sample_is_complete(path, len(sample.input_ids)), f"sample {i}: done but no complete file"
            stored = open_sample(path)
            assert stored["input_ids"].tolist() == sample.input_ids.tolist(), f"sample {i}: someone else's file"
            assert stored_meta_sample(path) == sample.sample_id
            stored_bytes += path.stat().st_size
            stored_tokens += len(sample.input_ids)
        else:
            assert i in failures and not path.exists(), f"sample {i}: no outcome, or failed with a file"
    assert counts.bytes == stored_bytes and counts.tokens == stored_tokens, counts
    hidden = settings.data_dir / "runs" / run_id / "hidden"
    assert not list(hidden.rglob("*.tmp")), list(hidden.rglob("*.tmp"))
    assert run_queue(redis, run_id).count == 0
    return counts


def stored_meta_sample(path: Path) -> str:
    from eaglet.shared.store import read_metadata

    return read_metadata(path)["sample_id"]


def serve_gateway(settings: GatewaySettings) -> tuple[str, Callable[[], None]]:
    """The real gateway app under uvicorn in a thread, on a free loopback port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for("the gateway", lambda: server.started or not thread.is_alive(), 15, 0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def gateway_settings(redis_url: str, data_dir: Path, **overrides) -> GatewaySettings:
    datasets = data_dir.parent / "datasets"
    datasets.mkdir(parents=True, exist_ok=True)
    fields = dict(
        redis_url=redis_url,
        api_token=TOKEN,
        dataset_roots=[datasets],
        data_dir=data_dir,
        heartbeat_interval_s=HEARTBEAT_S,
    )
    return GatewaySettings(_env_file=None, **{**fields, **overrides})


@pytest.fixture
def settings(tmp_path, redis_server, reference_server) -> Settings:
    return Settings(
        _env_file=None,
        redis_url=redis_server.url,
        data_dir=tmp_path / "data",
        dump_dir=reference_server.dump_dir,
        model=str(reference_server.model_dir),
        inference_url=reference_server.url,
        heartbeat_interval_s=HEARTBEAT_S,
        dump_wait_s=10,
    )
