"""Regeneration under real faults: workers killed with SIGKILL mid-stage, and an endpoint answering 429 and 500 at
random. Nothing is lost, nothing is answered twice, and ``/status`` agrees with the result files at every poll."""

import json
import random
import signal
import time

import pytest
from redis import Redis
from rq.job import Job
from rq.registry import StartedJobRegistry

from eaglet.cli.stack import LocalStack
from eaglet.services.regenerate.results import batch_path, output_path
from eaglet.shared.config import StatusSettings
from eaglet.shared.jobqueue import owner_of
from eaglet.shared.keys import queue_name
from eaglet.shared.records import Stage
from eaglet.shared.regeneration import Progress
from eaglet.shared.status import read_run
from tests.regenerate.conftest import ChatProxy, start_run, start_workers, wait_regenerated, write_jsonl

pytestmark = pytest.mark.slow


def prompts(n: int) -> list[dict]:
    return [{"id": f"q{i:03d}", "prompt": f"Question {i}: what comes after {i * 7}?"} for i in range(n)]


def batch_entries(redis, settings, run_id: str) -> list[dict]:
    """Every complete line of every batch file, as written (duplicates kept: the test looks for them)."""
    entries = []
    for b in range(Progress(redis, run_id).batches()):
        path = batch_path(settings.data_dir, run_id, b)
        if path.exists():
            entries += [json.loads(line) for line in path.read_bytes().split(b"\n") if line.endswith(b"}")]
    return entries


def batch_holders(run_id: str, settings) -> list[str]:
    """Workers that hold a started batch job, by RQ's started registry."""
    rq_redis = Redis.from_url(settings.redis_url)
    registry = StartedJobRegistry(queue_name(run_id), connection=rq_redis)
    jobs = [j for j in Job.fetch_many(registry.get_job_ids(), connection=rq_redis) if j is not None]
    return sorted({owner[0] for j in jobs if (owner := owner_of(j.worker_name or ""))})


def check_complete(redis, settings, run_id: str, n: int) -> None:
    """Each prompt answered exactly once, in the input's order; counters equal to the files."""
    entries = batch_entries(redis, settings, run_id)
    indexes = [e["index"] for e in entries]
    assert sorted(indexes) == list(range(n)), "a prompt lost or answered twice"
    written = [json.loads(line) for line in output_path(settings.data_dir, run_id).read_text().splitlines()]
    assert [c["id"] for c in written] == [f"q{i:03d}" for i in range(n)]
    assert all(c["messages"][-1]["role"] == "assistant" for c in written)
    counts = Progress(redis, run_id).counts()
    assert (counts.done, counts.failed, counts.total) == (n, 0, n), counts
    assert counts.tokens_out == sum(e["tokens_out"] for e in entries)


def test_workers_killed_mid_stage_lose_and_double_nothing(redis, settings, tmp_path):
    n, run_id = 40, "regen-kills"
    settings = settings.model_copy(update={"max_attempts": 10})  # a batch hit by several kills is still done
    source = write_jsonl(tmp_path / "prompts.jsonl", prompts(n))
    rng = random.Random(7)
    names, kills = ["k0", "k1", "k2"], 0
    with LocalStack(tmp_path / "logs") as stack:
        start_workers(stack, settings, names)
        state = start_run(redis, settings.redis_url, run_id, source, max_tokens=24, batch_prompts=4, concurrency=2,
                          stop_after=True)  # fmt: skip
        deadline = time.monotonic() + 240
        while state.stage() == Stage.regenerating:
            assert time.monotonic() < deadline, Progress(redis, run_id).counts()
            time.sleep(rng.uniform(0.3, 1.0))
            done = Progress(redis, run_id).counts().done
            if kills >= 6 or done >= n - 4:
                continue
            holding = batch_holders(run_id, settings)  # a kill lands on a worker with answers in flight
            if not holding:
                continue
            name = rng.choice(holding)
            stack.procs[name].send_signal(signal.SIGKILL)
            stack.procs[name].wait(10)
            kills += 1
            start_workers(stack, settings, [name])  # a new instance under the same name
        assert wait_regenerated(state, 5) == Stage.done
    assert kills >= 3, f"only {kills} kills landed before the stage ended"
    check_complete(redis, settings, run_id, n)
    errors = [json.loads(e)["reason"] for e in redis.lrange(f"eaglet:run:{run_id}:errors", 0, -1)]
    assert any("died while regenerating it" in e for e in errors), errors  # a batch's job taken from a dead worker


def test_an_endpoint_answering_429_and_500_is_retried_until_done(redis, settings, tmp_path, reference_server):
    n, run_id = 24, "regen-flaky"
    flaky = ChatProxy(reference_server.url, fault_rate=0.4)
    endpoint, stop = flaky.serve()
    source = write_jsonl(tmp_path / "prompts.jsonl", prompts(n))
    config, polls = StatusSettings().status_config(), 0
    try:
        with LocalStack(tmp_path / "logs") as stack:
            start_workers(stack, settings, ["f0", "f1"])
            state = start_run(redis, settings.redis_url, run_id, source, endpoint=endpoint, max_tokens=16,
                              batch_prompts=5, concurrency=2, max_tries=30, stop_after=True)  # fmt: skip
            deadline = time.monotonic() + 180
            while state.stage() == Stage.regenerating:
                assert time.monotonic() < deadline
                before = batch_entries(redis, settings, run_id)
                rg = read_run(redis, run_id, config=config).run.regeneration
                after = batch_entries(redis, settings, run_id)
                # A result is fsynced before it is counted: the count lies between the files read around it, less
                # at most the answers in flight (2 workers x concurrency 2) that were written but not yet counted.
                assert len(before) - 4 <= rg.done <= len(after), (len(before), rg.done, len(after))
                assert rg.failed == 0 and rg.total in (None, n)
                polls += 1
                time.sleep(0.1)
    finally:
        stop()
    assert sum(flaky.faults.values()) >= 5 and polls >= 3, (flaky.faults, polls)
    check_complete(redis, settings, run_id, n)
    rg = read_run(redis, run_id, config=config).run.regeneration
    assert rg.done == n and rg.retries == sum(flaky.faults.values())  # every fault was tried again, once
