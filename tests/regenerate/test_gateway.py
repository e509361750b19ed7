"""A run started with regeneration through ``POST /runs``: an ingest worker plans it, an extractor worker answers
through an endpoint that wants a key; ``/runs/{id}``, ``/metrics``, the page and ``eaglet status`` show the stage;
the key is sent but never stored in Redis nor written to a log."""

import time

import httpx
from redis import Redis
from rich.console import Console

from eaglet.cli.stack import LocalStack
from eaglet.cli.status import render_run
from eaglet.shared.records import Stage
from eaglet.shared.runstate import RunState
from eaglet.shared.statusreport import RunReport
from tests.regenerate.conftest import ChatProxy, write_jsonl
from tests.reliability.helpers import TOKEN, env_of, gateway_settings, serve_gateway

SECRET = "sk-test-4e1f0c9d2b7a"


def test_post_runs_regenerates_with_a_key_from_the_environment(redis, settings, tmp_path, reference_server):
    proxy = ChatProxy(reference_server.url, key=SECRET)
    endpoint, stop_proxy = proxy.serve()
    url, stop_gateway = serve_gateway(gateway_settings(settings.redis_url, settings.data_dir))
    datasets = settings.data_dir.parent / "datasets"
    source = write_jsonl(datasets / "prompts.jsonl", [{"id": f"g{i}", "prompt": f"Name {i} trees."} for i in range(6)])
    options = {"regenerate": {"endpoint": endpoint, "api_key_env": "REGEN_TEST_KEY", "max_tokens": 8,
                              "batch_prompts": 2, "stop_after": True}}  # fmt: skip
    try:
        with LocalStack(tmp_path / "logs") as stack:
            env = {**env_of(settings), "REGEN_TEST_KEY": SECRET}
            stack.start("ingest", "eaglet.services.ingest.worker", "--name", "ingest", env=env)
            stack.start("w0", "eaglet.services.extractor.worker", "--name", "w0", env=env)
            client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            r = client.post("/runs", json={"run_id": "via-api", "dataset": str(source), "options": options})
            assert r.status_code == 202, r.text
            state = RunState(redis, "via-api")
            seen_running = False
            deadline = time.monotonic() + 120
            while state.stage() in (Stage.regenerating, Stage.ingesting):
                assert time.monotonic() < deadline, state.meta()
                run = client.get("/runs/via-api").json()["run"]
                seen_running |= run["stage"] == "regenerating" and run["regeneration"]["total"] == 6
                time.sleep(0.1)
            assert state.stage() == Stage.done, state.meta()
            report = RunReport.model_validate(client.get("/runs/via-api").json())
            metrics = client.get("/metrics").text
            page = client.get("/").text
            bad = client.post("/runs", json={"dataset": str(source), "options": {"regenerate": {"api_key_env": "x y"}}})
        logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
    finally:
        stop_gateway()
        stop_proxy()
    assert seen_running
    rg = report.run.regeneration
    assert (rg.total, rg.done, rg.failed) == (6, 6, 0) and rg.tokens_out > 0
    assert 'eaglet_regen_prompts_done_total{run="via-api"} 6.0' in metrics
    assert 'eaglet_stage{run="via-api",stage="regenerating"}' in metrics
    assert "regeneration" in page
    console = Console(record=True, width=200)
    console.print(render_run(report.run))
    text = console.export_text()
    assert "6 prompts regenerated in" in text and "0 failed" in text  # a finished stage by its totals
    assert bad.status_code == 422 and "api_key_env" in bad.text
    # The key went to the endpoint (it answers nothing without it), and nowhere else.
    raw = Redis.from_url(settings.redis_url)
    assert not any(SECRET.encode() in (raw.dump(k) or b"") for k in raw.keys("*")) and SECRET not in logs
