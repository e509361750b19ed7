"""Run control: the bearer token, body validation, dataset roots, cancel and retry through the real queue."""

import pytest
from redis import Redis
from rq import Queue

from eaglet.shared import jobqueue, keys
from eaglet.shared.keys import RunKeys
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState, Stage

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture
def queue_redis(redis_server):
    """RQ reads pickled jobs: a connection that leaves replies as bytes."""
    conn = Redis.from_url(redis_server.url)
    yield conn
    conn.close()


@pytest.fixture
def dataset(gateway):
    path = gateway.datasets / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return path


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}])
def test_control_needs_the_token(gateway, dataset, headers):
    client = gateway.client()
    for path in ("/runs", "/runs/r1/cancel", "/runs/r1/retry-failed"):
        r = client.post(path, json={"dataset": str(dataset)}, headers=headers)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"


def test_start_run_queues_the_ingest(gateway, redis, queue_redis, dataset):
    r = gateway.client(TOKEN).post(
        "/runs", json={"run_id": "r1", "dataset": str(dataset), "options": {"max_tokens": 512, "overlong": "truncate"}}
    )
    assert r.status_code == 202, r.text
    body = r.json()
    assert (body["run_id"], body["dataset"]) == ("r1", str(dataset.resolve()))
    job = Queue(keys.CONTROL_QUEUE, connection=queue_redis).fetch_job(body["job_id"])
    assert job.func_name == jobqueue.INGEST_JOB and job.args == ("r1",)
    # The run is created at once, with what its ingest needs: the dataset and the options, defaults filled in.
    meta = RunState(redis, "r1").meta()
    assert (meta.stage, meta.dataset) == (Stage.ingesting, str(dataset.resolve()))
    assert meta.options == RunOptions(max_tokens=512, overlong="truncate")
    assert redis.zscore(keys.RUNS, "r1") is not None
    again = gateway.client(TOKEN).post("/runs", json={"run_id": "r1", "dataset": str(dataset)})
    assert again.status_code == 409


def test_a_dflash_run_names_its_layers(gateway, redis, dataset):
    options = {"method": "dflash", "aux_layer_ids": [1, 9, 17, 25]}
    r = gateway.client(TOKEN).post("/runs", json={"run_id": "d1", "dataset": str(dataset), "options": options})
    assert r.status_code == 202, r.text
    assert RunState(redis, "d1").meta().options == RunOptions(method="dflash", aux_layer_ids=[1, 9, 17, 25])
    three = gateway.client(TOKEN).post("/runs", json={"dataset": str(dataset), "options": {"aux_layer_ids": [1, 9]}})
    assert three.status_code == 422 and "give 3 layer ids, not 2" in three.text  # EAGLE-3 reads three


def test_start_run_generates_an_id(gateway, dataset):
    r = gateway.client(TOKEN).post("/runs", json={"dataset": str(dataset)})
    assert r.status_code == 202 and r.json()["run_id"].startswith("run-")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"run_id": "../etc", "dataset": "x"}, "run_id"),
        ({"run_id": "a:b", "dataset": "x"}, "run_id"),
        ({}, "dataset"),
        ({"dataset": "DATASET", "options": {"overlong": "chop"}}, "overlong"),
        ({"dataset": "DATASET", "options": {"max_tokens": 1}}, "max_tokens"),
        ({"dataset": "DATASET", "options": {"max_tokens": "many"}}, "max_tokens"),
        ({"dataset": "DATASET", "options": {"limit": 0}}, "limit"),
        ({"dataset": "DATASET", "options": {"method": "medusa"}}, "method"),
        ({"dataset": "DATASET", "options": {"aux_layer_ids": "1,9"}}, "aux_layer_ids"),
        ({"dataset": "DATASET", "options": {"max_tokens": 512, "temperature": 1}}, "temperature"),
        ({"dataset": "DATASET", "priority": 1}, "priority"),
        ({"dataset": "/etc/passwd"}, "dataset"),
        ({"dataset": "DATASET/../../../etc/hostname"}, "dataset"),
        ({"dataset": "MISSING"}, "dataset"),
        ({"dataset": "ROOT"}, "dataset"),
    ],
)
def test_bad_bodies_name_the_field(gateway, dataset, body, field):
    subst = {"DATASET": str(dataset), "MISSING": str(gateway.datasets / "nope.jsonl"), "ROOT": str(gateway.datasets)}
    if "dataset" in body:
        for k, v in subst.items():
            body["dataset"] = body["dataset"].replace(k, v)
    r = gateway.client(TOKEN).post("/runs", json=body)
    assert r.status_code == 422, r.text
    assert any(d["loc"][-1] == field for d in r.json()["detail"]), r.json()


def test_symlink_out_of_the_roots_is_refused(gateway, tmp_path):
    outside = tmp_path / "secret.jsonl"
    outside.write_text("{}\n")
    (gateway.datasets / "link.jsonl").symlink_to(outside)
    r = gateway.client(TOKEN).post("/runs", json={"dataset": str(gateway.datasets / "link.jsonl")})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "dataset"]


def test_cancel_sets_the_stage_and_empties_the_queue(gateway, redis, queue_redis):
    state = RunState(redis, "r1")
    state.create()
    state.set_total(10, 1000)
    jobqueue.enqueue_samples(queue_redis, "r1", range(10))
    client = gateway.client(TOKEN)
    r = client.post("/runs/r1/cancel")
    assert r.status_code == 200, r.text
    assert r.json() == {"run_id": "r1", "stage": "cancelled", "dropped_jobs": 10}
    assert state.stage() == Stage.cancelled and jobqueue.run_queue(queue_redis, "r1").count == 0
    assert client.post("/runs/r1/cancel").status_code == 409
    assert client.post("/runs/nope/cancel").status_code == 404
    assert client.post("/runs/a..b/cancel").status_code == 422


def test_retry_failed_queues_the_failures_again(gateway, redis, queue_redis):
    state = RunState(redis, "r1")
    state.create()
    state.set_total(10, 1000)
    for i in range(10):
        state.start_attempt(i, "w")
        state.mark_failed(i, f"s{i}", "bad dump") if i in (2, 7) else state.mark_done(i, 100, 1000)
    assert state.stage() == Stage.extracted
    r = gateway.client(TOKEN).post("/runs/r1/retry-failed")
    assert r.status_code == 200 and r.json() == {"run_id": "r1", "queued": 2}
    queue = jobqueue.run_queue(queue_redis, "r1")
    assert sorted(queue.fetch_job(j).args for j in queue.job_ids) == [("r1", 2), ("r1", 7)]
    # Pending again: the run is not complete until the retried samples have a new outcome.
    assert state.stage() == Stage.extracting and not state.extraction_complete()
    assert state.counts().failed == 0 and redis.hlen(RunKeys("r1").failures) == 0
    assert redis.hget(RunKeys("r1").attempts, "2") == "1"  # attempt numbers go on: rids never repeat
    state.mark_done(2, 100, 1000)
    assert not state.extraction_complete()
    assert state.mark_done(7, 100, 1000) == 2 and state.stage() == Stage.extracted
    state.start_training()
    assert gateway.client(TOKEN).post("/runs/r1/retry-failed").status_code == 409


def test_reads_can_require_the_token(start_gateway, redis):
    RunState(redis, "r1").create()
    open_gateway, closed = start_gateway(), start_gateway(read_requires_token=True)
    for path in ("/status", "/runs/r1", "/metrics"):
        assert open_gateway.client().get(path).status_code == 200, path
        assert closed.client().get(path).status_code == 401, path
        assert closed.client("wrong").get(path).status_code == 401, path
        assert closed.client(TOKEN).get(path).status_code == 200, path
    assert closed.client().get("/").status_code == 200  # the page asks for the token itself


def test_control_is_off_without_a_token(start_gateway, redis):
    RunState(redis, "r1").create()
    r = start_gateway(api_token="").client("anything").post("/runs/r1/cancel")
    assert r.status_code == 403 and "EAGLET_API_TOKEN" in r.json()["detail"]


def test_openapi_documents_the_schema(gateway):
    spec = gateway.client().get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert {"StatusReport", "RunReport", "RunStatus", "Extraction", "Storage", "Training", "Alert"} <= set(schemas)
    assert spec["paths"]["/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/StatusReport"
    }
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
