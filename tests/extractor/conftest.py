"""Fixtures of the extractor tests."""

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import uvicorn

from eaglet.services.inference.batcher import Batcher
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.inference.server import create_app
from eaglet.shared.dumpwriter import DumpWriter
from eaglet.shared.redisserver import free_port


@contextmanager
def _serve(engine: ReferenceEngine, dump_dir: Path) -> Iterator[str]:
    port = free_port()
    app = create_app(engine, Batcher(engine, DumpWriter(dump_dir)))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def serve_reference() -> Callable[[ReferenceEngine, Path], AbstractContextManager[str]]:
    """``with serve_reference(engine, dump_dir) as url``: the reference server on ``engine``, over real HTTP from a
    thread of this process (so a test may set the engine up as no setting of the server's own does)."""
    return _serve
