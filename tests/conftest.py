"""Fixtures every test may use: a real Redis server of the tests' own, the bundled model, a tiny Llama."""

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from redis import Redis

from eaglet.shared.target import make_tiny_llama, resolve_model_dir

ROOT = Path(__file__).resolve().parents[1]
MODEL_CACHE = ROOT / "var" / "models"  # reused across test runs: the conversion takes ~25 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server on a free port, with AOF on, that a test can stop and restart.

    AOF is fsync'd every second, as the compose stack runs it: an fsync per write would make the whole suite
    wait on the disk. The test that SIGKILLs Redis asks for an fsync per write itself."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: run `make redis` (installs Debian's redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
            + ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if Redis.from_url(self.url).ping():
                    return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server) -> Redis:
    conn = Redis.from_url(redis_server.url, decode_responses=True)
    conn.flushall()
    yield conn
    conn.flushall()
    conn.close()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model_dir("smollm2", MODEL_CACHE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


class Server:
    def __init__(self, stack, url: str, dump_dir: Path, model_dir: Path):
        self.stack, self.url, self.dump_dir, self.model_dir = stack, url, dump_dir, model_dir


@pytest.fixture(scope="session")
def reference_server(tmp_path_factory, tiny_model_dir):
    """The real reference inference server on the tiny Llama, over real HTTP, in its own process."""
    from eaglet.cli.stack import LocalStack

    folder = tmp_path_factory.mktemp("reference-server")
    port = free_port()
    env = {"EAGLET_DUMP_DIR": str(folder / "dump"), "EAGLET_MODEL": str(tiny_model_dir)}
    with LocalStack(folder / "logs", env=env) as stack:
        stack.start("inference", "eaglet.services.inference.main", "--port", str(port))
        stack.wait_http("inference", f"http://127.0.0.1:{port}/health", timeout=120)
        yield Server(stack, f"http://127.0.0.1:{port}", folder / "dump", tiny_model_dir)
