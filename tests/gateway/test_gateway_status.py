"""/status and /runs/{id} against a run driven through the real writers: every poll equals the ground truth."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from eaglet.shared.records import EvalResult, TrainProgress
from eaglet.shared.runstate import Stage


def check_extraction(run: dict, fake, generated_at: float, started_at: float) -> None:
    t, ex, st = fake.truth, run["extraction"], run["storage"]
    assert (ex["total"], ex["done"], ex["failed"]) == (t.total, t.done, t.failed)
    assert ex["in_flight"] == len(t.in_flight)
    assert ex["remaining"] == t.total - t.done - t.failed
    assert ex["percent"] == pytest.approx(100 * (t.done + t.failed) / t.total)
    assert (ex["errors"], ex["retries"]) == (t.errors, t.retries)
    assert [(e["index"], e["sample_id"], e["reason"]) for e in ex["last_errors"]] == t.errors_newest_first[:10]
    # The whole run fits in the 60 s window: the rate is every completion over the time since extraction began.
    elapsed = generated_at - started_at
    assert ex["samples_per_s"] == pytest.approx(t.done / elapsed, rel=1e-6)
    assert ex["tokens_per_s"] == pytest.approx(t.tokens / elapsed, rel=1e-6)
    # Tokens left: the run's, less those stored, less the failed samples' at the run's mean length.
    left = 0 if t.done + t.failed == t.total else round(t.total_tokens - t.tokens - t.failed * t.total_tokens / t.total)
    assert ex["tokens_remaining"] == left
    if t.done:
        assert ex["eta_s"] == pytest.approx(left / (t.tokens / elapsed), rel=1e-6)
    if t.done + t.failed:
        assert ex["error_rate"] == pytest.approx(t.failed / (t.done + t.failed))
    assert (st["bytes_written"], st["tokens_written"], st["total_tokens"]) == (t.nbytes, t.tokens, t.total_tokens)
    if t.tokens:
        assert st["bytes_per_token"] == pytest.approx(fake.bytes_per_token)
        assert st["projected_total_bytes"] == t.total_tokens * fake.bytes_per_token
    assert (st["disk_free"], st["disk_total"]) == (10**12, 2 * 10**12)


def poll(client, fake) -> tuple[dict, dict]:
    """Both views of the run, taken while the writer waits, so they and the truth describe one moment."""
    with fake.lock:
        status = client.get("/status").json()
        one = client.get(f"/runs/{fake.run_id}").json()
    assert status["runs"][0]["run_id"] == fake.run_id
    return status, one


def metric_values(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def kinds(run: dict) -> set[str]:
    return {a["kind"] for a in run["alerts"]}


def test_figures_equal_the_truth_at_every_poll(gateway, redis, fake_run):
    fake = fake_run("r1", total=240)
    client = gateway.client()
    fake.state.create(dataset="/datasets/data.jsonl", model="tiny")
    assert client.get("/runs/r1").json()["run"]["stage"] == Stage.ingesting
    fake.ingest()
    started_at = fake.state.meta().extraction_started_at
    fake.start()
    polls, stage = 0, Stage.extracting
    deadline = time.time() + 60
    while stage != Stage.extracted and time.time() < deadline:
        status, one = poll(client, fake)
        for run, at in ((status["runs"][0], status["generated_at"]), (one["run"], one["generated_at"])):
            check_extraction(run, fake, at, started_at)
            assert "stalled" not in kinds(run) and "workers_lost" not in kinds(run)
        workers = {w["name"]: w for w in one["cluster"]["workers"]}
        assert {n: w["sample"] for n, w in workers.items()} == {w: fake.truth.worker_sample.get(w, "") for w in workers}
        assert all(not w["lost"] and w["seconds_since_heartbeat"] < 1 for w in workers.values())
        assert one["cluster"]["inference"][0]["healthy"]
        stage = one["run"]["stage"]
        polls += 1
        time.sleep(0.05)
    fake.stop()
    assert stage == Stage.extracted, "the run did not complete in time"
    assert polls >= 5
    final = client.get("/runs/r1").json()["run"]
    assert final["extraction"]["percent"] == 100 and final["extraction"]["eta_s"] == 0
    assert final["extraction"]["completed_at"] is not None
    metrics = metric_values(client.get("/metrics").text)
    assert metrics[("eaglet_samples_done_total", (("run", "r1"),))] == fake.truth.done
    assert metrics[("eaglet_samples_failed_total", (("run", "r1"),))] == fake.truth.failed
    assert metrics[("eaglet_bytes_written_total", (("run", "r1"),))] == fake.truth.nbytes
    assert metrics[("eaglet_samples", (("run", "r1"),))] == fake.truth.total
    assert metrics[("eaglet_stage", (("run", "r1"), ("stage", "extracted")))] == 1
    assert metrics[("eaglet_alert", (("kind", "error_rate"), ("run", "r1")))] == 1
    assert metrics[("eaglet_workers", (("liveness", "live"),))] == 3
    # 18 of 240 samples given up: 7.5 % is above the 5 % threshold.
    assert "error_rate" in kinds(final)


def test_stall_and_lost_workers_raise_alerts(gateway, redis, fake_run):
    fake = fake_run("r2", total=100_000)  # never finishes within the test
    fake.ingest()
    client = gateway.client()
    fake.start()
    time.sleep(0.5)
    assert "stalled" not in kinds(poll(client, fake)[1]["run"])
    fake.paused.set()  # writers stop completing, heartbeats go on: stalled, not lost
    deadline = time.time() + 10
    while "stalled" not in kinds(poll(client, fake)[1]["run"]):
        assert time.time() < deadline, "no stall alert"
        time.sleep(0.1)
    run = poll(client, fake)[1]["run"]
    assert "workers_lost" not in kinds(run)
    fake.paused.clear()
    deadline = time.time() + 10
    while "stalled" in kinds(poll(client, fake)[1]["run"]):
        assert time.time() < deadline, "the stall alert stayed after the writers resumed"
        time.sleep(0.05)
    fake.silent.add("w1")  # its process died: the heartbeat ages
    deadline = time.time() + 10
    while True:
        one = poll(client, fake)[1]
        if "workers_lost" in kinds(one["run"]):
            break
        assert time.time() < deadline, "no workers_lost alert"
        time.sleep(0.1)
    lost = [w["name"] for w in one["cluster"]["workers"] if w["lost"]]
    assert lost == ["w1"] and "w1" in next(a for a in one["run"]["alerts"] if a["kind"] == "workers_lost")["message"]
    fake.stop()


def test_disk_alert_when_projection_exceeds_free(gateway, redis, fake_run):
    fake = fake_run("r3", total=50)
    fake.ingest()
    for _ in range(10):
        fake.step()
    fake.workers = ["w0"]
    fake._beat()
    client = gateway.client()
    assert "disk" not in kinds(client.get("/runs/r3").json()["run"])
    remaining = (fake.truth.total_tokens - fake.truth.tokens) * fake.bytes_per_token
    from eaglet.shared.heartbeats import WorkerState, beat

    beat(
        redis,
        "w0",
        state=WorkerState.idle,
        host="h",
        pid=1,
        inference_url="",
        disk_free=remaining - 1,
        disk_total=10**9,
    )
    run = client.get("/runs/r3").json()["run"]
    assert run["storage"]["projected_remaining_bytes"] == remaining
    assert "disk" in kinds(run)


def test_status_lists_runs_newest_first_and_pages(gateway, redis):
    from eaglet.shared.runstate import RunState

    for n in range(5):
        RunState(redis, f"run{n}").create()
        time.sleep(0.002)
    client = gateway.client()
    page = client.get("/status", params={"limit": 2, "offset": 1}).json()
    assert page["runs_total"] == 5 and [r["run_id"] for r in page["runs"]] == ["run3", "run2"]
    assert client.get("/runs/nope").status_code == 404
    bad = client.get("/runs/..%2Fetc")
    assert bad.status_code in (404, 422)
    assert client.get("/status", params={"limit": 0}).status_code == 422


def test_training_and_evaluation_figures(gateway, redis):
    from eaglet.shared.runstate import RunState

    state = RunState(redis, "r4")
    state.create()
    state.start_training()
    now = time.time()
    state.update_train(TrainProgress(
        step=250, total_steps=1000, loss=1.5, acc=[0.625, 0.5, 0.25], tokens_per_s=12000.0,
        started_at=now - 50, updated_at=now, beat_at=now, last_checkpoint="checkpoints/step-200",
    ))  # fmt: skip
    state.update_eval(EvalResult(state="done", accept_length=3.25, accept_rate=[0.8, 0.5], prompts=4))
    run = gateway.client().get("/runs/r4").json()["run"]
    tr = run["training"]
    assert (tr["step"], tr["total_steps"], tr["percent"], tr["loss"], tr["accuracy"]) == (250, 1000, 25.0, 1.5, 0.625)
    assert tr["accuracy_per_position"] == [0.625, 0.5, 0.25] and tr["state"] == "training"
    assert tr["eta_s"] == pytest.approx(150, abs=2) and tr["last_checkpoint"] == "checkpoints/step-200"
    assert "trainer_lost" not in kinds(run)
    # Numbers as numbers, the rest as Redis holds it: the shape the page reads.
    assert run["evaluation"] == {"state": "done", "prompts": 4.0, "accept_length": 3.25, "accept_rate": "[0.8, 0.5]"}
    state.fail("RuntimeError: out of memory")
    tr = gateway.client().get("/runs/r4").json()["run"]["training"]
    assert (tr["state"], tr["error"]) == ("failed", "RuntimeError: out of memory")
