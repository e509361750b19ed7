"""Fixtures every test may use: a real Redis server of the tests' own, the bundled model, a tiny Llama."""

from pathlib import Path

import pytest
from redis import Redis

from eaglet.shared.redisserver import RedisServer, free_port
from eaglet.shared.target import make_tiny_llama, resolve_model_dir

ROOT = Path(__file__).resolve().parents[1]
MODEL_CACHE = ROOT / "var" / "models"  # reused across test runs: the conversion takes ~25 s


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis(redis_server) -> Redis:
    conn = Redis.from_url(redis_server.url, decode_responses=True)
    conn.flushall()
    yield conn
    conn.flushall()
    conn.close()


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test: two cores are shared with other test runs, and one thread is deterministic."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
