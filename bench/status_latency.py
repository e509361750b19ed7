"""Latency of ``GET /status`` over a 1 M-sample run and 64 workers, and under a steady load.

Seeds only what the writers keep (shared/runstate.py, shared/heartbeats.py): done and failed bitmaps,
counters, the attempts hash (one field per sample started: 1 M fields), the capped ``recent`` and
``errors`` lists, in-flight samples, worker heartbeats and inference health. Then starts the gateway as
its own process (``python -m eaglet.services.gateway.main``) and measures /status one request at a time, then
at a fixed request rate from an async client.

    python -m bench.status_latency                 # starts a redis-server of its own on a free port
    python -m bench.status_latency --samples 10000000 --rps 500
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from redis import Redis

from eaglet.shared.heartbeats import WorkerState, beat, report_inference
from eaglet.shared.keys import RunKeys
from eaglet.shared.records import RunMeta
from eaglet.shared.redisserver import RedisServer, free_port
from eaglet.shared.runstate import ERRORS_CAP, RECENT_CAP, RunState

ROOT = Path(__file__).resolve().parents[1]


def seed(redis: Redis, run_id: str, samples: int, workers: int) -> None:
    """A run 90 % extracted, 0.5 % failed, with everything the writers keep for it."""
    k, now = RunKeys(run_id), time.time()
    done, failed = samples * 9 // 10, samples // 200
    state = RunState(redis, run_id)
    state.create(dataset="/datasets/big.jsonl", model="bench", hidden_size=7168, num_layers=61)
    state.start_extraction()
    state.update_meta(RunMeta(total=samples, total_tokens=samples * 2350, extraction_started_at=now - 3600))
    redis.hset(k.counts, mapping={"done": done, "failed": failed, "tokens": done * 2350, "bytes": done * 2350 * 57344,
                                  "errors": failed * 2, "retries": failed, "last_done_at": now})  # fmt: skip
    redis.setrange(k.done, 0, b"\xff" * (done // 8))  # the first 90 % done, bit by bit
    redis.setbit(k.failed, samples - 1, 1)
    pipe = redis.pipeline(transaction=False)
    for i in range(done // 8 * 8, done // 8 * 8 + failed):
        pipe.setbit(k.failed, i, 1)
        pipe.hset(k.failures, str(i), json.dumps({"index": i, "sample_id": f"s{i}", "reason": "bad dump", "ts": now}))
    pipe.execute()
    for start in range(0, samples, 50_000):  # one attempts field per sample started
        redis.hset(k.attempts, mapping={str(i): 1 for i in range(start, min(samples, start + 50_000))})
    redis.lpush(k.recent, *[f"{now - i * 0.1:.3f} 2350 134758400" for i in range(RECENT_CAP)][::-1])
    errors = [json.dumps({"index": i, "sample_id": f"s{i}", "reason": "inference timeout after 600 s",
                          "worker": "w0", "final": False, "ts": now - i}) for i in range(ERRORS_CAP)]  # fmt: skip
    redis.lpush(k.errors, *errors[::-1])
    redis.hset(
        k.inflight, mapping={str(done + i): json.dumps({"worker": f"w{i}", "started": now}) for i in range(workers)}
    )
    for i in range(workers):
        beat(redis, f"w{i}", state=WorkerState.busy, host=f"host{i // 8}", pid=1000 + i,
             inference_url=f"http://host{i // 8}:30000", run=run_id, sample=f"s{done + i}",
             disk_free=4 * 10**12, disk_total=8 * 10**12)  # fmt: skip
    for h in range(max(1, workers // 8)):
        report_inference(redis, f"http://host{h}:30000", ok=True, model="bench")


def start_gateway(redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "EAGLET_REDIS_URL": redis_url, "EAGLET_PORT": str(port), "EAGLET_HOST": "127.0.0.1"}
    proc = subprocess.Popen([sys.executable, "-m", "eaglet.services.gateway.main"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/openapi.json", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("gateway did not start")


def percentiles(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"n": len(ms), "p50_ms": round(q[49], 2), "p99_ms": round(q[98], 2), "max_ms": round(max(ms), 2)}


def sequential(url: str, path: str, n: int) -> dict[str, float]:
    ms = []
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(n):
            t = time.perf_counter()
            client.get(path).raise_for_status()
            ms.append((time.perf_counter() - t) * 1000)
    return percentiles(ms)


async def steady_load(url: str, path: str, rps: float, seconds: float) -> dict[str, float]:
    """Open loop: request i leaves at t0 + i/rps whatever the answers before it, so a slow server shows up."""
    ms, errors = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=httpx.Limits(max_connections=64)) as client:

        async def one(at: float) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            t = time.perf_counter()
            try:
                (await client.get(path)).raise_for_status()
                ms.append((time.perf_counter() - t) * 1000)
            except httpx.HTTPError:
                errors += 1

        t0 = time.perf_counter() + 0.1
        await asyncio.gather(*(one(t0 + i / rps) for i in range(int(rps * seconds))))
        elapsed = time.perf_counter() - t0
    return {**percentiles(ms), "errors": errors, "achieved_rps": round(len(ms) / elapsed, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--requests", type=int, default=500, help="sequential requests per endpoint")
    p.add_argument("--rps", type=float, default=200)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--redis-url", help="an existing Redis (it is flushed!); default: start one of our own")
    args = p.parse_args()
    random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        redis_server = None if args.redis_url else RedisServer(Path(tmp), appendonly=False)
        if redis_server:
            redis_server.start()
        redis_url = args.redis_url or redis_server.url
        gateway = None
        try:
            redis = Redis.from_url(redis_url, decode_responses=True)
            redis.flushdb()
            t = time.perf_counter()
            seed(redis, "bench", args.samples, args.workers)
            info = redis.info("memory")
            print(f"seeded {args.samples:,} samples, {args.workers} workers in {time.perf_counter() - t:.1f} s; "
                  f"redis uses {info['used_memory_human']}, {redis.dbsize()} keys")  # fmt: skip
            gateway, url = start_gateway(redis_url)
            sequential(url, "/status", 50)  # warm-up
            results = {
                "status_sequential": sequential(url, "/status", args.requests),
                "run_sequential": sequential(url, "/runs/bench", args.requests),
                "metrics_sequential": sequential(url, "/metrics", max(50, args.requests // 5)),
                "status_load": asyncio.run(steady_load(url, "/status", args.rps, args.seconds)),
            }
            for name, figures in results.items():
                print(f"{name:20s} {json.dumps(figures)}")
            return 0
        finally:
            if gateway:
                gateway.terminate()
                gateway.wait(10)
            if redis_server:
                redis_server.stop()


if __name__ == "__main__":
    sys.exit(main())
