"""Who is alive: extractor workers and the inference servers they talk to.

Workers write a heartbeat every few seconds (``keys.WORKERS``, one hash field per worker) and the
health of their inference server (``keys.INFERENCE``, one field per server URL). Readers judge a
worker lost when its heartbeat is older than a few intervals; nothing here is ever scanned per sample.
"""

import json
import time
from enum import StrEnum

from redis import Redis

from eaglet.shared import keys


class WorkerState(StrEnum):
    idle = "idle"
    busy = "busy"  # extracting ``sample`` of ``run``
    backoff = "backoff"  # the inference server or the disk failed; waiting before the next try
    stopped = "stopped"


def beat(
    redis: Redis,
    worker: str,
    *,
    state: WorkerState,
    host: str,
    pid: int,
    inference_url: str,
    run: str = "",
    sample: str = "",
    detail: str = "",
    disk_free: int | None = None,
    disk_total: int | None = None,
    instance: str = "",
    stage_seconds: dict[str, float] | None = None,
) -> None:
    """Records one worker's state now. ``detail`` says why it is in backoff; disk figures are of the data volume;
    ``stage_seconds`` is where its recent samples' time went (see eaglet/services/extractor/extract.py).

    ``instance`` is unique per process: a worker restarted under the same name is a new instance, so the jobs
    the old one had started are known to be abandoned (see eaglet/services/extractor/reaper.py)."""
    record = {
        "worker": worker,
        "instance": instance,
        "state": state,
        "host": host,
        "pid": pid,
        "inference_url": inference_url,
        "run": run,
        "sample": sample,
        "detail": detail,
        "disk_free": disk_free,
        "disk_total": disk_total,
        "stage_seconds": stage_seconds or {},
        "ts": time.time(),
    }
    redis.hset(keys.WORKERS, worker, json.dumps(record))


def forget(redis: Redis, worker: str) -> None:
    """A worker that stops cleanly removes itself; one that dies is reported lost by its old heartbeat."""
    redis.hdel(keys.WORKERS, worker)


def report_inference(redis: Redis, url: str, *, ok: bool, detail: str = "", model: str = "") -> None:
    record = {"url": url, "ok": ok, "detail": detail, "model": model, "ts": time.time()}
    redis.hset(keys.INFERENCE, url, json.dumps(record))


def workers(redis: Redis) -> list[dict]:
    return [json.loads(v) for v in redis.hgetall(keys.WORKERS).values()]


def inference_servers(redis: Redis) -> list[dict]:
    return [json.loads(v) for v in redis.hgetall(keys.INFERENCE).values()]
