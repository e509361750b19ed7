"""Security: run control needs the token (compared in constant time), ids never become paths unchecked,
Redis and inference are not published and Redis needs a password, and no secret reaches a log."""

import hmac
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from redis import Redis

from eaglet.cli.stack import LocalStack
from eaglet.services.gateway import deps
from eaglet.services.gateway.main import create_app
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.dumpfile import dump_path
from eaglet.shared.ids import UnsafeName, make_rid
from eaglet.shared.redisserver import RedisServer, free_port
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.store import run_dir, sample_path
from tests.reliability.helpers import TOKEN, env_of, gateway_settings, wait_for, write_dataset

ROOT = Path(__file__).resolve().parents[2]
CONTROL = [("POST", "/runs", {"dataset": "x.jsonl"}), ("POST", "/runs/r1/cancel", None),
           ("POST", "/runs/r1/retry-failed", None)]  # fmt: skip


@pytest.fixture
def client(redis, redis_server, tmp_path):
    with TestClient(create_app(gateway_settings(redis_server.url, tmp_path / "data"))) as c:
        yield c


@pytest.mark.parametrize("method, path, body", CONTROL)
@pytest.mark.parametrize("token", [None, "", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper()])
def test_run_control_is_401_without_the_token(client, method, path, body, token):
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", response.text


def test_the_token_is_compared_in_constant_time(client, monkeypatch):
    calls, original = [], hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(deps.hmac, "compare_digest", recording)
    assert client.post("/runs/r1/cancel", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.post("/runs/r1/cancel", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    assert calls == [(b"nope", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


@pytest.mark.parametrize("bad", ["..", "../x", "a/b", "/abs", "a\x00b", ".hidden", "", "a" * 129, "x\n", "ü"])
def test_ids_never_become_paths_unchecked(bad, tmp_path):
    makers = [lambda: run_dir(tmp_path, bad), lambda: sample_path(tmp_path, "run", bad),
              lambda: make_rid(bad, "s", 1), lambda: make_rid("r", bad, 1)]  # fmt: skip
    for make in makers:
        with pytest.raises(UnsafeName):
            make()


@pytest.mark.parametrize("rid", ["", "../x", "eaglet:a/b:1", "/abs", "x\x00y", ".x", "eaglet:..:s:1", "a" * 301])
def test_rids_never_become_dump_paths_unchecked(rid, tmp_path):
    with pytest.raises(UnsafeName):
        dump_path(tmp_path, rid)


def test_compose_keeps_redis_and_inference_private():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    published = {name for name, s in services.items() if s.get("ports")}
    # The gateway, and Grafana in the optional monitoring profile; both on the loopback unless told otherwise.
    assert published == {"gateway", "grafana"}, f"only the gateway and Grafana may publish a port: {published}"
    assert services["grafana"]["profiles"] == ["monitoring"]
    for name in published:
        bind = f"${{EAGLET_{name.upper()}_BIND:-127.0.0.1}}:"
        assert all(p.startswith(bind) for p in services[name]["ports"]), (name, services[name]["ports"])
    redis = services["redis"]
    command = " ".join(redis["command"])
    assert "--requirepass" in command and "${EAGLET_REDIS_PASSWORD:?" in command, command
    for name, service in services.items():
        url = (service.get("environment") or {}).get("EAGLET_REDIS_URL")
        assert url is None or ":${EAGLET_REDIS_PASSWORD:?" in url, (name, url)


@pytest.mark.slow
def test_no_secret_in_any_log(redis, settings, tmp_path, reference_server):
    """The whole stack against a Redis that needs a password: the password and the token appear in no log."""
    password, gateway_port = "s3cret-redis-pass-9c1d", free_port()
    with RedisServer(tmp_path / "redis", password=password, appendonly=False) as server:
        settings = settings.model_copy(update={"redis_url": server.url})
        secured = Redis.from_url(server.url, decode_responses=True)
        env = env_of(settings, EAGLET_API_TOKEN=TOKEN, EAGLET_PORT=str(gateway_port))
        write_dataset(tmp_path / "data.jsonl", 4)
        with LocalStack(tmp_path / "logs", env=env) as stack:
            stack.start("worker", "eaglet.services.extractor.worker", "--name", "w0")
            stack.start("gateway", "eaglet.services.gateway.main")
            gateway = f"http://127.0.0.1:{gateway_port}"
            stack.wait_http("gateway", f"{gateway}/status", timeout=60)
            ingest_new_run(secured, settings, "sec", tmp_path / "data.jsonl", RunOptions())
            wait_for("the run", RunState(secured, "sec").extraction_complete, 60)
            for token in (TOKEN, "wrong-" + TOKEN):
                httpx.post(f"{gateway}/runs/sec/retry-failed", headers={"Authorization": f"Bearer {token}"})
            status = httpx.get(f"{gateway}/status").text
            time.sleep(1)
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")}
    assert logs and all(logs.values())
    for secret in (password, TOKEN):
        assert secret not in status
        leaked = [name for name, text in logs.items() if secret in text]
        assert not leaked, f"secret found in {leaked}"
