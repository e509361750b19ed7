"""The gateway: wires settings, Redis and the routers. ``uvicorn eaglet.services.gateway.main:app`` or
``python -m eaglet.services.gateway.main``; settings come from ``EAGLET_*``. Stateless: run as many as you like."""

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from functools import partial

import uvicorn
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

from eaglet.services.gateway.collector import StatusCollector
from eaglet.services.gateway.recorder import Recorder
from eaglet.services.gateway.routers import metrics, page, runs, status
from eaglet.services.gateway.settings import GatewaySettings
from eaglet.shared.connections import connect, connect_raw
from eaglet.shared.logs import setup_logging
from eaglet.shared.status import disk_usage

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    redis = connect(settings.redis_url)
    queue_redis = connect_raw(settings.redis_url)  # RQ's jobs are pickled bytes

    config, local_disk = settings.status_config(), partial(disk_usage, settings.data_dir)
    recorder = Recorder(redis, config, max_runs=settings.status_max_runs,
                        interval_s=settings.series_interval_s, local_disk=local_disk)  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        recording = asyncio.create_task(recorder.run_forever())
        yield
        recording.cancel()
        with suppress(asyncio.CancelledError):
            await recording
        redis.close()
        queue_redis.close()

    app = FastAPI(
        title="eaglet gateway",
        summary="Status and control of eaglet runs: extraction, storage, training, alerts.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.redis = redis
    app.state.queue_redis = queue_redis
    app.state.status_config = config
    app.state.metrics = CollectorRegistry(auto_describe=False)
    app.state.metrics.register(StatusCollector(redis, app.state.status_config, settings.status_max_runs, local_disk))
    for module in (page, status, runs, metrics):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=page.STATIC), name="static")  # the page's script and its chart library
    return app


app = create_app()
KEEP_ALIVE_S = 75
"""Idle connections are kept this long: past the 60 s of common load balancers and the 5 s of HTTP clients' pools, so
a client that polls /status never sends on a connection the gateway has just closed (uvicorn's default, 5 s, is
exactly httpx's: under load a request then meets a closed connection, as a 32-client /status test did)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet gateway", description=__doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    setup_logging()
    settings = GatewaySettings(**{k: v for k, v in vars(args).items() if v is not None})
    log.info("gateway: listening on %s:%d, %d process(es)", settings.host, settings.port, settings.gateway_workers)
    server = {"host": settings.host, "port": settings.port, "log_level": "info", "timeout_keep_alive": KEEP_ALIVE_S}
    if settings.gateway_workers > 1:  # each process builds its app from the environment, as ``app`` above
        uvicorn.run("eaglet.services.gateway.main:app", workers=settings.gateway_workers, **server)
    else:
        uvicorn.run(create_app(settings), **server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
