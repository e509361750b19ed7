"""A bounded load on loopback: 200 requests/s of /status for 3 s against the gateway run as its own process."""

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.heartbeats import WorkerState, beat

ROOT = Path(__file__).resolve().parents[2]
RPS, SECONDS = 200, 3


@pytest.fixture
def gateway_process(redis_server, tmp_path):
    """``python -m services.gateway.main``, the entry point a deployment runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "EAGLET_REDIS_URL": redis_server.url, "EAGLET_PORT": str(port), "EAGLET_API_TOKEN": ""}
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway.main"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 30
    while True:
        try:
            if httpx.get(f"{url}/status", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.time() < deadline, f"gateway did not start: {proc.stderr.read()}"
        time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


async def open_loop(url: str) -> tuple[list[float], int]:
    """Request i leaves at t0 + i/RPS whatever the answers before it, so a slow server shows in the latencies."""
    ms, errors = [], 0
    # A generous timeout: on a busy machine the queue of an open loop drains slowly, but it drains.
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=64)) as client:

        async def one(at: float) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            t = time.perf_counter()
            try:
                (await client.get("/status")).raise_for_status()
                ms.append((time.perf_counter() - t) * 1000)
            except httpx.HTTPError:
                errors += 1

        t0 = time.perf_counter() + 0.1
        await asyncio.gather(*(one(t0 + i / RPS) for i in range(RPS * SECONDS)))
    return ms, errors


def test_status_under_200_rps(gateway_process, redis, fake_run, record_property):
    fake = fake_run("load", total=5000)
    fake.ingest()
    for _ in range(1000):
        fake.step()
    for i in range(64):
        beat(redis, f"w{i}", state=WorkerState.busy, host="h", pid=i, inference_url="http://inf:1", run="load",
             sample=f"s{i}", disk_free=10**12, disk_total=2 * 10**12)  # fmt: skip
    ms, errors = asyncio.run(open_loop(gateway_process))
    q = statistics.quantiles(ms, n=100, method="inclusive")
    record_property("status_p50_ms", round(q[49], 2))
    record_property("status_p99_ms", round(q[98], 2))
    print(f"/status at {RPS} rps for {SECONDS} s: p50 {q[49]:.1f} ms, p99 {q[98]:.1f} ms, {errors} errors")
    assert errors == 0 and len(ms) == RPS * SECONDS
