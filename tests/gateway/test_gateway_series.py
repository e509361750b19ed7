"""``GET /runs/{id}/series``: the run's figures over time, recorded by the gateway from the status figures."""

import time

import pytest

from eaglet.services.gateway.recorder import Recorder
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.heartbeats import WorkerState, beat
from eaglet.shared.records import EvalResult
from eaglet.shared.runstate import Stage
from eaglet.shared.status import read_run

STAGES = {"prefill": 0.5, "dump_wait": 0.01, "check": 0.02, "store": 0.25}


def wait_for_point(client, run_id: str, after: float, timeout: float = 10) -> dict:
    """The first recorded point later than ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        points = [p for p in client.get(f"/runs/{run_id}/series").json()["extraction"]["points"] if p["t"] > after]
        if points:
            return points[0]
        time.sleep(0.05)
    raise AssertionError(f"no point recorded after {after}")


def test_points_are_the_status_figures_of_their_moment(start_gateway, redis, fake_run):
    gateway = start_gateway(series_interval_s=0.2, heartbeat_interval_s=5)
    client = gateway.client()
    fake = fake_run("r1", total=400)
    fake.ingest()
    beat(redis, "w-timed", state=WorkerState.busy, host="h", pid=2, inference_url="http://inf:1", run="r1",
         stage_seconds=STAGES)  # fmt: skip
    fake.start()
    time.sleep(1.0)
    with fake.lock:
        fake.paused.set()
        paused_at = time.time()
    point = wait_for_point(client, "r1", paused_at)
    # Nothing moved since the pause: the status computed now for the point's moment is what was recorded.
    run = read_run(redis, "r1", config=gateway.settings.status_config(), now=point["t"]).run
    ex, st, t = run.extraction, run.storage, fake.truth
    assert (point["done"], point["failed"], point["total"]) == (ex.done, ex.failed, ex.total) == (t.done, t.failed, 400)
    assert (point["samples_per_s"], point["tokens_per_s"]) == (ex.samples_per_s, ex.tokens_per_s)
    assert point["samples_per_s"] > 0
    assert (point["bytes_written"], point["projected_total_bytes"]) == (st.bytes_written, st.projected_total_bytes)
    assert point["bytes_written"] == t.nbytes
    assert point["stage_seconds"] == pytest.approx(STAGES)  # the fake's workers have stored nothing: only w-timed

    fake.paused.clear()
    deadline = time.monotonic() + 30
    while not fake.state.extraction_complete():
        assert time.monotonic() < deadline, "the fake run did not finish"
        time.sleep(0.05)
    assert fake.state.stage() == Stage.extracted
    deadline = time.monotonic() + 10
    while not (series := client.get("/runs/r1/series").json()["extraction"])["closed"]:
        assert time.monotonic() < deadline, "no final point"
        time.sleep(0.05)
    done = [(p["done"], p["failed"]) for p in series["points"]]
    assert done == sorted(done) and done[-1] == (t.done, t.failed) and sum(done[-1]) == 400
    assert len(series["points"]) <= 256 and series["interval"] == 0.2


def test_the_series_endpoint_gives_training_and_acceptance(gateway, redis, fake_run):
    client = gateway.client()
    assert client.get("/runs/nope/series").status_code == 404
    assert client.get("/runs/..%2Fx/series").status_code in (404, 422)
    fake = fake_run("r2", total=10)
    fake.ingest()
    fake.state.update_eval(EvalResult(state="done", accept_length=1.75, accept_rate=[0.5, 0.25]))
    body = client.get("/runs/r2/series").json()
    assert body["evaluation"] == {"state": "done", "accept_length": 1.75, "accept_rate": [0.5, 0.25]}
    assert body["training"] == {"interval": None, "closed": False, "points": []}


def test_replicas_record_each_interval_once(redis, fake_run):
    fake = fake_run("r3", total=10)
    fake.ingest()
    replicas = [Recorder(redis, StatusConfig(), max_runs=10, interval_s=30, local_disk=lambda: None) for _ in "ab"]
    assert [r.record() for r in replicas] == [1, 0]  # the second finds the interval taken
