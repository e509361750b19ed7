"""The ingest worker through real Redis and real processes: it takes a run's ingest job from the control queue
and ingests it; killed half way, another ingest worker's sweep queues the ingest again, which goes on from its
last flush."""

import json
import os
import signal
import subprocess
import sys
import time

from redis import Redis

from eaglet.cli.stack import LocalStack
from eaglet.shared import heartbeats
from eaglet.shared.heartbeats import WorkerRole
from eaglet.shared.jobqueue import enqueue_ingest, run_queue
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runs import create_run
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import samples_dir
from tests.conftest import ROOT


def env_for(redis_server, tmp_path, tiny_model_dir) -> dict[str, str]:
    return {"EAGLET_MODEL": str(tiny_model_dir), "EAGLET_REDIS_URL": redis_server.url,
            "EAGLET_DATA_DIR": str(tmp_path / "data"), "EAGLET_HEARTBEAT_INTERVAL_S": "0.5",
            "PYTHONPATH": str(ROOT)}  # fmt: skip


def write_conversations(path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": f"Answer {i}."}]
            f.write(json.dumps({"messages": turns}) + "\n")


def wait_for(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_ingest_worker_ingests_a_queued_run(redis, redis_server, tmp_path, tiny_model_dir):
    dataset = tmp_path / "chat.jsonl"
    write_conversations(dataset, 30)
    create_run(redis, "queued", dataset, RunOptions(max_tokens=64, limit=20))
    enqueue_ingest(Redis.from_url(redis_server.url), "queued")
    with LocalStack(tmp_path / "logs", env=env_for(redis_server, tmp_path, tiny_model_dir)) as stack:
        worker = stack.start("i0", "eaglet.services.ingest.worker", "--name", "i0", "--burst")
        assert worker.wait(120) == 0, (tmp_path / "logs" / "i0.log").read_text()[-2000:]
    meta = RunState(redis, "queued").meta()
    assert (meta.stage, meta.total, meta.bad_lines) == (Stage.extracting, 20, 0), meta
    assert meta.model_dir == str(tiny_model_dir) and meta.options is not None and meta.options.limit == 20
    assert run_queue(redis, "queued").count == 20  # every sample queued for the extractor workers


def test_a_dead_ingest_is_taken_up_by_another_ingest_workers_sweep(redis, redis_server, tmp_path, tiny_model_dir):
    n, dataset = 40_000, tmp_path / "big.jsonl"
    write_conversations(dataset, n)
    state = create_run(redis, "cut", dataset, RunOptions())
    enqueue_ingest(Redis.from_url(redis_server.url), "cut")
    with LocalStack(tmp_path / "logs", env=env_for(redis_server, tmp_path, tiny_model_dir)) as stack:
        stack.start("i0", "eaglet.services.ingest.worker", "--name", "i0")
        wait_for("a flush", lambda: state.meta().ingest_cursor, 120)
        stack.procs["i0"].send_signal(signal.SIGKILL)
        stack.procs["i0"].wait(10)
        cut = state.meta().ingest_cursor
        assert state.meta().total is None, "ingest ended before the kill: the test proved nothing"
        stack.start("i1", "eaglet.services.ingest.worker", "--name", "i1")
        wait_for("the ingest to end", lambda: state.meta().total is not None or state.stage() == Stage.failed, 300)
        assert heartbeats.workers(redis)["i1"].role == WorkerRole.ingest  # /status tells it from the extractors
    meta = state.meta()
    assert (meta.stage, meta.total, meta.ingest_deaths) == (Stage.extracting, n, 1), meta
    ids = [s.decode() for s in SampleSet(samples_dir(tmp_path / "data", "cut")).index["id"]]
    assert len(ids) == len(set(ids)) == n  # every line once: nothing lost at the cut, nothing doubled
    assert f"run cut: ingest taken up again at line {cut['lines']}" in (tmp_path / "logs" / "i1.log").read_text()


def test_eaglet_ingest_worker_is_a_command():
    done = subprocess.run(
        [sys.executable, "-m", "eaglet.cli.main", "ingest-worker", "--help"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "--burst" in done.stdout
