"""The inference server and Redis killed and restarted mid-run: workers and gateway wait, reconnect, finish."""

import functools
import json
import logging
import signal
import time

import httpx
import pytest
import torch
from redis import Redis

from eaglet.cli.stack import LocalStack
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.runoptions import EVERY_STATE, RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import open_sample, sample_path, samples_dir
from tests.reliability.helpers import (
    check_outcome,
    env_of,
    free_port,
    gateway_settings,
    run_picture,
    serve_gateway,
    wait_for,
    write_dataset,
)

log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow


def test_inference_server_killed_and_restarted_mid_run(redis, settings, tmp_path, tiny_model_dir, events):
    n, run_id, restarts = 80, "infer", 2
    port = free_port()
    settings = settings.model_copy(update={"inference_url": f"http://127.0.0.1:{port}", "dump_dir": tmp_path / "dump"})
    write_dataset(tmp_path / "data.jsonl", n, prefix="i", min_len=200)
    server_env = {"EAGLET_DUMP_DIR": str(settings.dump_dir), "EAGLET_MODEL": str(tiny_model_dir)}
    with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:

        def start_server() -> None:
            stack.start("inference", "eaglet.services.inference.main", "--port", str(port), env=server_env)
            stack.wait_http("inference", f"{settings.inference_url}/health", timeout=120)

        start_server()
        for i in range(2):
            stack.start(f"w{i}", "eaglet.services.extractor.worker", "--name", f"w{i}")
        ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
        state = RunState(redis, run_id)
        for k in range(restarts):
            wait_for("progress", lambda k=k: state.counts().done >= (k + 1) * n // (restarts + 2), 120, 0.02)
            stack.procs["inference"].send_signal(signal.SIGKILL)
            stack.procs["inference"].wait(10)
            time.sleep(2)
            start_server()
        wait_for("the run to complete", state.extraction_complete, 180)
        alive = {name: proc.poll() is None for name, proc in stack.procs.items()}
    counts = check_outcome(redis, settings, run_id, n)
    assert (counts.done, counts.failed) == (n, 0), counts
    assert all(alive.values()), alive
    reasons = [json.loads(e)["reason"] for e in redis.lrange(state.keys.errors, 0, -1)]
    transient = [r for r in reasons if "transient" in r]
    assert transient, "no request met the dead server: the test proved nothing"
    engine = ReferenceEngine(tiny_model_dir, device="cpu")
    samples = SampleSet(samples_dir(settings.data_dir, run_id))
    for i in range(n):  # no dump from before a crash was taken for another request
        sample = samples[i]
        stored = open_sample(sample_path(settings.data_dir, run_id, sample.sample_id))
        [expected] = engine.prefill([sample.input_ids.tolist()])
        torch.testing.assert_close(stored["hidden_states"], expected.states["hidden_states"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            stored["aux_hidden_states"], expected.states["aux_hidden_states"], atol=1e-5, rtol=1e-4
        )
    log.warning("inference restarts: %d SIGKILLs; %d transient errors, retries %d; done %d, failed %d",
                restarts, len(transient), counts.retries, counts.done, counts.failed)  # fmt: skip
    assert events.count(run_id, "extraction_complete") == 1


def test_redis_killed_and_restarted_mid_run(redis, redis_server, settings, tmp_path, events):
    n, run_id, outage_s = 120, "redis", 6.0
    write_dataset(tmp_path / "data.jsonl", n, prefix="r", min_len=200)
    gateway_url, stop_gateway = serve_gateway(gateway_settings(redis_server.url, settings.data_dir))
    status = httpx.Client(base_url=gateway_url, timeout=10)
    outages = []
    try:
        with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
            for i in range(2):
                stack.start(f"w{i}", "eaglet.services.extractor.worker", "--name", f"w{i}")
            ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
            state = RunState(redis, run_id)
            for k, kill in enumerate((True, False)):  # SIGKILL, then a clean stop
                wait_for("progress", lambda k=k: state.counts().done >= (k + 1) * n // 4, 120, 0.02)
                redis.config_set("appendfsync", "always")  # what a SIGKILL must not lose: every write before it
                before = state.counts()
                redis_server.stop(kill=kill)
                time.sleep(outage_s)
                redis_server.start()
                after = state.counts()  # what the AOF gave back: counters agree with the bitmaps, nothing lost
                assert after.done >= before.done, f"lost across the restart: {before} -> {after}"
                assert after.done == redis.bitcount(state.keys.done), after
                outages.append(before.done)
                # The gateway answers again by itself, with the same figures.
                report = wait_for("/status", lambda: _status(status), 30)
                [run] = [r for r in report["runs"] if r["run_id"] == run_id]
                assert run["extraction"]["done"] >= before.done
            rq_redis = Redis.from_url(redis_server.url)
            picture = functools.partial(run_picture, redis, rq_redis, run_id)
            wait_for("the run to complete", state.extraction_complete, 240, explain=picture)
            alive = {name: proc.poll() is None for name, proc in stack.procs.items()}
            report = wait_for("/status", lambda: _status(status), 30)
    finally:
        stop_gateway()
    counts = check_outcome(redis, settings, run_id, n)
    assert (counts.done, counts.failed) == (n, 0), counts
    assert all(alive.values()), alive
    [run] = [r for r in report["runs"] if r["run_id"] == run_id]
    assert (run["extraction"]["done"], run["extraction"]["failed"]) == (n, 0)
    assert run["storage"]["bytes_written"] == counts.bytes
    log.warning("redis restarts: %d (SIGKILL at %d done, clean stop at %d done), %.0fs down each; "
                "done %d, failed %d, retries %d", len(outages), *outages, outage_s, counts.done,
                counts.failed, counts.retries)  # fmt: skip
    assert events.count(run_id, "extraction_complete") == 1


def _status(client: httpx.Client) -> dict | None:
    try:
        response = client.get("/status")
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None
