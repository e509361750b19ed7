"""The gateway: wires settings, Redis and the routers. ``uvicorn eaglet.services.gateway.main:app`` or
``python -m eaglet.services.gateway.main``; settings come from ``EAGLET_*``. Stateless: run as many as you like."""

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from redis import Redis

from eaglet.services.gateway.collector import StatusCollector
from eaglet.services.gateway.routers import metrics, page, runs, status
from eaglet.services.gateway.settings import GatewaySettings
from eaglet.shared.status import disk_usage

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    redis = Redis.from_url(settings.redis_url, decode_responses=True, health_check_interval=30)
    queue_redis = Redis.from_url(settings.redis_url, health_check_interval=30)  # RQ's jobs are pickled bytes

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
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
    app.state.status_config = settings.status_config()
    app.state.metrics = CollectorRegistry(auto_describe=False)
    app.state.metrics.register(
        StatusCollector(redis, app.state.status_config, settings.status_max_runs, lambda: disk_usage(settings.data_dir))
    )
    for module in (page, status, runs, metrics):
        app.include_router(module.router)
    return app


app = create_app()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet gateway", description=__doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = GatewaySettings(**{k: v for k, v in vars(args).items() if v is not None})
    log.info("gateway: listening on %s:%d, %d process(es)", settings.host, settings.port, settings.gateway_workers)
    if settings.gateway_workers > 1:  # each process builds its app from the environment, as ``app`` above
        uvicorn.run("eaglet.services.gateway.main:app", host=settings.host, port=settings.port, log_level="info",
                    workers=settings.gateway_workers)  # fmt: skip
    else:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
