"""Pipeline vs raw server, and the cost of the dump inside the server, side by side in one run (CPU, SmolLM2).

Starts a Redis of its own, two reference servers on the same model (one with dumps, one ``--no-dump``) and
extractor workers, then alternates phases over the same prompts (the demo conversations):

    raw       the --no-dump server alone: prompts sent straight to /generate, ``workers`` at a time
    capture   the dump server, eaglet rids (a dump is written per request; the client deletes it)
    pipeline  ingest -> queue -> workers -> dump server -> validate -> durable store -> Redis marks

in the order raw, capture, pipeline, raw, capture, pipeline, ..., raw (A/B/A: drift shows as a difference
between the raw phases). Also measures the data disk's sequential durable write bandwidth, so the pipeline is
compared with min(server tokens/s, disk bandwidth / bytes per token).

    python -m bench.pipeline                      # 30 conversations, 2 workers, 2 rounds: a few minutes
    python -m bench.pipeline --limit 300 --rounds 3 --workers 4
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from redis import Redis

from bench.common import load, save_result
from eaglet.cli.stack import LocalStack
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.config import Settings
from eaglet.shared.dumpfile import dump_path
from eaglet.shared.ids import make_rid
from eaglet.shared.redisserver import RedisServer, free_port
from eaglet.shared.runoptions import EVERY_STATE, RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import samples_dir

ROOT = Path(__file__).resolve().parents[1]


DATASET = ROOT / "data" / "demo" / "train.jsonl"


def disk_write_bandwidth(folder: Path, mib: int = 256, chunk_mib: int = 8) -> float:
    """Bytes/s of one sequential write of ``mib`` MiB with an fsync at the end (the disk's durable ceiling)."""
    path = folder / "disk-probe.bin"
    block = os.urandom(chunk_mib << 20)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(mib // chunk_mib):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t
    path.unlink()
    return (mib << 20) / seconds


def send_all(url: str, prompts: list[list[int]], rids: list[str | None], concurrency: int, dump_dir: Path | None):
    """Prefills every prompt, ``concurrency`` requests in flight; returns seconds. Dumps (if any) are deleted."""

    def one(client: httpx.Client, ids: list[int], rid: str | None) -> None:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        if rid is not None:
            body["rid"] = rid
        r = client.post("/generate", json=body)
        r.raise_for_status()
        assert r.json()["meta_info"]["prompt_tokens"] == len(ids)
        if dump_dir is not None:
            path = dump_path(dump_dir, rid)
            for _ in range(1000):  # the reference server writes before it answers; this is a guard
                if path.exists():
                    break
                time.sleep(0.002)
            path.unlink()

    with httpx.Client(base_url=url, timeout=600) as client:
        t = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda a: one(client, *a), zip(prompts, rids, strict=True)))
        return time.perf_counter() - t


def pipeline_phase(redis: Redis, settings: Settings, run_id: str, limit: int) -> tuple[float, int, int]:
    """Seconds from the ingest call to extraction_complete, tokens and bytes stored."""
    t = time.perf_counter()
    # every state kept (not the default layout): the figures compare with the server's bf16 dumps byte for byte
    options = RunOptions(max_tokens=2048, limit=limit, **EVERY_STATE)
    ingest_new_run(redis, settings, run_id, DATASET, options)
    state = RunState(redis, run_id)
    while not state.extraction_complete():
        time.sleep(0.02)
    seconds = time.perf_counter() - t
    counts = state.counts()
    if counts.failed:
        raise RuntimeError(f"run {run_id}: {counts.failed} samples failed")
    return seconds, int(counts.tokens), int(counts.bytes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=30, help="demo conversations per phase")
    p.add_argument("--workers", type=int, default=2, help="extractor workers (and raw client concurrency)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--folder", type=Path, help="data, dumps and logs (default: a temp folder under var/)")
    args = p.parse_args()
    load_before = load()
    (ROOT / "var").mkdir(exist_ok=True)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="bench-pipeline-", dir=ROOT / "var"))
    data_dir, dump_dir = folder / "data", folder / "dump"
    data_dir.mkdir(parents=True, exist_ok=True)
    redis_server = RedisServer(folder / "redis")
    redis_server.start()
    redis_url = redis_server.url
    ports = {"dump": free_port(), "nodump": free_port()}
    settings = Settings(redis_url=redis_url, data_dir=data_dir, dump_dir=dump_dir,
                        inference_url=f"http://127.0.0.1:{ports['dump']}")  # fmt: skip
    env = {"EAGLET_REDIS_URL": redis_url, "EAGLET_DATA_DIR": str(data_dir), "EAGLET_DUMP_DIR": str(dump_dir),
           "EAGLET_INFERENCE_URL": settings.inference_url}  # fmt: skip
    phases: list[dict] = []
    try:
        redis = Redis.from_url(redis_url, decode_responses=True)
        with LocalStack(folder / "logs", env=env) as stack:
            stack.start("inference", "eaglet.services.inference.main", "--port", str(ports["dump"]))
            stack.start(
                "inference-nodump", "eaglet.services.inference.main", "--port", str(ports["nodump"]), "--no-dump"
            )
            stack.wait_http("inference", f"{settings.inference_url}/health", timeout=300)
            stack.wait_http("inference-nodump", f"http://127.0.0.1:{ports['nodump']}/health", timeout=300)
            for i in range(args.workers):
                stack.start(f"worker-{i}", "eaglet.services.extractor.worker", "--name", f"bench-worker-{i}")
            time.sleep(5)  # the workers import torch and register before the first run is queued
            disk_bps = disk_write_bandwidth(data_dir)
            prompts: list[list[int]] = []
            bytes_per_token = 0.0
            order = ["raw", "capture", "pipeline"] * args.rounds + ["raw"]
            # The pipeline phase ingests; raw and capture need its token ids, so a first (untimed) ingest.
            seconds, tokens, nbytes = pipeline_phase(redis, settings, "warmup", args.limit)
            prompts = [s.input_ids.tolist() for s in SampleSet(samples_dir(data_dir, "warmup"))]
            send_all(f"http://127.0.0.1:{ports['nodump']}", prompts[:8], [None] * 8, args.workers, None)
            for n, kind in enumerate(order):
                row = {"phase": n, "kind": kind, "load": load()}
                if kind == "pipeline":
                    seconds, tokens, nbytes = pipeline_phase(redis, settings, f"p{n}", args.limit)
                    bytes_per_token = nbytes / tokens
                    row.update(bytes=nbytes, bytes_per_token=round(bytes_per_token, 1))
                else:
                    url = settings.inference_url if kind == "capture" else f"http://127.0.0.1:{ports['nodump']}"
                    rids = [make_rid(f"c{n}", f"s{i}", 1) for i in range(len(prompts))]
                    rids = rids if kind == "capture" else [None] * len(prompts)
                    tokens = sum(map(len, prompts))
                    seconds = send_all(url, prompts, rids, args.workers, dump_dir if kind == "capture" else None)
                row.update(seconds=round(seconds, 2), tokens=tokens, tokens_per_s=round(tokens / seconds, 1))
                phases.append(row)
                print(json.dumps(row), flush=True)
    finally:
        redis_server.stop()
    figures = summarize(phases, disk_bps, bytes_per_token)
    figures.update(phases=phases, workers=args.workers, conversations=args.limit)
    print(json.dumps({k: v for k, v in figures.items() if k != "phases"}, indent=1))
    cmd = " ".join(["python -m bench.pipeline", *sys.argv[1:]])
    print("wrote", save_result("pipeline", cmd, figures, load_before))
    if args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def summarize(phases: list[dict], disk_bps: float, bytes_per_token: float) -> dict:
    def rate(kind: str) -> float:
        return statistics.mean(r["tokens_per_s"] for r in phases if r["kind"] == kind)

    raw, capture, pipe = rate("raw"), rate("capture"), rate("pipeline")
    disk_tps = disk_bps / bytes_per_token
    bound = min(raw, disk_tps)
    raws = [r["tokens_per_s"] for r in phases if r["kind"] == "raw"]
    return {
        "raw_tokens_per_s": round(raw, 1),
        "capture_tokens_per_s": round(capture, 1),
        "pipeline_tokens_per_s": round(pipe, 1),
        "pipeline_over_raw": round(pipe / raw, 3),
        "capture_over_raw": round(capture / raw, 3),
        "raw_drift": round((max(raws) - min(raws)) / statistics.mean(raws), 3),
        "disk_write_MBps": round(disk_bps / 1e6, 1),
        "bytes_per_token": round(bytes_per_token, 1),
        "disk_bound_tokens_per_s": round(disk_tps, 1),
        "pipeline_over_min_server_disk": round(pipe / bound, 3),
    }


if __name__ == "__main__":
    sys.exit(main())
