"""Who is alive: the workers (extractor and ingest) and the inference servers the extractors talk to.

Workers write a heartbeat every few seconds (``keys.WORKERS``, one hash field per worker); extractors also write
the health of their inference server (``keys.INFERENCE``, one field per host and server URL: on several hosts the
same URL, ``http://inference:30000``, names a server on each). Readers judge a
worker lost when its heartbeat is older than ``LOST_AFTER_BEATS`` intervals (``WorkerBeat.lost``); nothing here
is ever scanned per sample. The values are the records of shared/records.py.
"""

import time
from dataclasses import replace

from redis import Redis

from . import keys
from .dumpwriter import WriterStats
from .records import InferenceBeat, WorkerBeat, WorkerRole, WorkerState


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
    role: WorkerRole = WorkerRole.extractor,
    stage_seconds: dict[str, float] | None = None,
    samples_per_s: float | None = None,
    tokens_per_s: float | None = None,
) -> None:
    """Records one worker's state now (the fields are those of ``WorkerBeat``)."""
    record = WorkerBeat(
        worker=worker,
        state=state,
        ts=time.time(),
        instance=instance,
        role=role,
        host=host,
        pid=pid,
        inference_url=inference_url,
        run=run,
        sample=sample,
        detail=detail,
        disk_free=disk_free,
        disk_total=disk_total,
        stage_seconds=stage_seconds or {},
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
    )
    redis.hset(keys.WORKERS, worker, record.to_redis())


def forget(redis: Redis, worker: str) -> None:
    """A worker that stops cleanly removes itself; one that dies is reported lost by its old heartbeat."""
    redis.hdel(keys.WORKERS, worker)


def report_inference(
    redis: Redis,
    url: str,
    *,
    ok: bool,
    detail: str = "",
    host: str = "",
    model: str = "",
    hidden_size: int | None = None,
    num_layers: int | None = None,
    aux_layer_ids: list[int] | None = None,
    writers: list[WriterStats] | None = None,
) -> None:
    """Records a server's health and model as the worker on ``host`` sees it; ``writers``: the figures its dump
    writer processes published (back-pressure)."""
    record = InferenceBeat(
        url=url, ok=ok, ts=time.time(), detail=detail, host=host, model=model, hidden_size=hidden_size,
        num_layers=num_layers, aux_layer_ids=aux_layer_ids,
    )  # fmt: skip
    if writers:
        record = replace(
            record,
            dump_wait_fraction=max(w.wait_fraction for w in writers),
            dump_queued_bytes=sum(w.queued_bytes for w in writers),
            dump_cap_bytes=sum(w.cap_bytes for w in writers),
        )
    redis.hset(keys.INFERENCE, server_field(host, url), record.to_redis())


def server_field(host: str, url: str) -> str:
    """The field of one server in ``keys.INFERENCE``: its URL, after its host when the workers name one."""
    return f"{host} {url}" if host else url


def parse_workers(raw: dict[str, str]) -> dict[str, WorkerBeat]:
    """An ``HGETALL`` of ``keys.WORKERS`` (read in a caller's pipeline) as beats by worker name."""
    return {name: WorkerBeat.from_redis(value) for name, value in raw.items()}


def parse_inference(raw: dict[str, str]) -> dict[str, InferenceBeat]:
    """An ``HGETALL`` of ``keys.INFERENCE`` as reports by ``server_field``."""
    return {url: InferenceBeat.from_redis(value) for url, value in raw.items()}


def workers(redis: Redis) -> dict[str, WorkerBeat]:
    return parse_workers(redis.hgetall(keys.WORKERS))


def inference_servers(redis: Redis) -> dict[str, InferenceBeat]:
    return parse_inference(redis.hgetall(keys.INFERENCE))
