"""Many clients at once on loopback: 32 concurrent clients read /status 3,000 times from the gateway run as
its own processes, while a run progresses and workers beat. Every answer is a valid report and no client ever
sees the run go backwards. Latencies are logged, not asserted: speed is measured in
``bench/status_latency.py``, which offers a fixed request rate."""

import asyncio
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from eaglet.shared.heartbeats import WorkerState, beat, report_inference
from eaglet.shared.runstate import RunState
from tests.reliability.helpers import free_port, wait_for

log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CLIENTS, REQUESTS = 32, 3000


@pytest.fixture
def gateway_process(redis_server, tmp_path):
    """``python -m eaglet.services.gateway.main`` with two processes behind its port, as the compose stack runs it."""
    port = free_port()
    env = {**os.environ, "EAGLET_REDIS_URL": redis_server.url, "EAGLET_PORT": str(port), "EAGLET_API_TOKEN": "",
           "EAGLET_DATA_DIR": str(tmp_path), "EAGLET_GATEWAY_WORKERS": "2"}  # fmt: skip
    log_file = open(tmp_path / "gateway.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "eaglet.services.gateway.main"], cwd=ROOT, env=env, stdout=log_file,
                            stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for("the gateway", lambda: _up(url) or proc.poll() is not None, 60, 0.1)
    assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
    yield url
    proc.terminate()
    proc.wait(30)  # its two processes finish their requests first; on two busy cores that takes seconds


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/status", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def progress(redis, stop: threading.Event) -> None:
    """A run of 100 K samples progressing under the load, 8 workers beating: /status reads a live state."""
    state = RunState(redis, "load")
    state.create(dataset="d.jsonl", model="tiny")
    state.start_extraction()
    state.set_total(100_000, 100_000 * 2350)
    i = 0
    while not stop.is_set():
        state.start_attempt(i, f"w{i % 8}")
        state.mark_done(i, 2350, 2350 * 32768)
        if i % 50 == 7:
            state.record_error(i, f"s{i}", "transient: inference server unreachable", f"w{i % 8}")
        for w in range(8):
            beat(redis, f"w{w}", state=WorkerState.busy, host="h", pid=w, inference_url="http://inf",
                 run="load", sample=f"s{i}", disk_free=10**13, disk_total=2 * 10**13)  # fmt: skip
        report_inference(redis, "http://inf", ok=True)
        i += 1
        stop.wait(0.02)


async def closed_loop(url: str) -> tuple[list[float], list[str]]:
    """CLIENTS clients, each sending its next request when the last is answered, REQUESTS in all."""
    ms, errors, left = [], [], iter(range(REQUESTS))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=CLIENTS)) as client:

        async def one_client() -> None:
            last_done = 0
            for _ in left:
                t = time.perf_counter()
                try:
                    response = await client.get("/status")
                    response.raise_for_status()
                    [run] = response.json()["runs"]
                    done = run["extraction"]["done"]
                    assert run["run_id"] == "load" and done >= last_done, (run["run_id"], last_done, done)
                    last_done = done
                    ms.append((time.perf_counter() - t) * 1000)
                except (httpx.HTTPError, AssertionError, ValueError, KeyError) as e:
                    errors.append(f"{type(e).__name__}: {e}")

        await asyncio.gather(*(one_client() for _ in range(CLIENTS)))
    return ms, errors


@pytest.mark.timeout(900)
def test_status_under_many_concurrent_clients(redis, gateway_process):
    stop = threading.Event()
    writer = threading.Thread(target=progress, args=(redis, stop), daemon=True)
    writer.start()
    wait_for("the run", lambda: redis.exists(RunState(redis, "load").keys.meta), 10)
    started = time.perf_counter()
    try:
        ms, errors = asyncio.run(closed_loop(gateway_process))
        done_at_end = RunState(redis, "load").counts().done
    finally:
        stop.set()
        writer.join(10)
    elapsed = time.perf_counter() - started
    q = statistics.quantiles(ms, n=100) if len(ms) > 1 else [0] * 99
    log.warning("load: %d requests of /status from %d clients in %.1f s (%.0f/s), %d errors; p50 %.1f ms, "
                "p99 %.1f ms", len(ms) + len(errors), CLIENTS, elapsed, REQUESTS / elapsed, len(errors), q[49],
                q[98])  # fmt: skip
    assert not errors, errors[:5]
    assert len(ms) == REQUESTS
    assert done_at_end > 0, "the run did not progress under the load: the test read a still state"
