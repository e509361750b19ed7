"""Workers killed with SIGKILL during a run: their jobs are queued again and nothing is lost or doubled."""

import json
import logging
import random
import signal
import time

import pytest
from redis import Redis
from rq import Queue
from rq.executions import Execution

from eaglet.cli.stack import LocalStack
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared import heartbeats, keys
from eaglet.shared.heartbeats import WorkerState
from eaglet.shared.jobqueue import cancel, enqueue_ingest, rq_worker_name, run_queue
from eaglet.shared.runoptions import EVERY_STATE, RunOptions
from eaglet.shared.runs import create_run
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import samples_dir
from tests.reliability.faulty_server import FaultyServer
from tests.reliability.helpers import check_outcome, env_of, free_port, wait_for, write_dataset

log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow
KILLS = 12


def requeued_errors(redis, run_id: str) -> list[dict]:
    errors = [json.loads(e) for e in redis.lrange(RunState(redis, run_id).keys.errors, 0, -1)]
    return [e for e in errors if "died while extracting" in e["reason"]]


def test_workers_killed_at_random_moments_lose_nothing(redis, settings, tmp_path, events):
    n, run_id = 150, "chaos"
    settings = settings.model_copy(update={"max_attempts": 8})  # a sample hit by several kills is still done
    write_dataset(tmp_path / "data.jsonl", n, min_len=200)
    rng = random.Random(20240607)
    names = ["w0", "w1", "w2"]
    kills, busy_kills, renamed = 0, 0, 0
    with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
        for name in names:
            stack.start(name, "eaglet.services.extractor.worker", "--name", name)
        ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
        state = RunState(redis, run_id)
        # Kills are paced by the run's progress, not by the clock, so a fast machine sees as many as a slow one:
        # kill i lands once i / KILLS of the first n - 20 samples are done, late ones catch up a poll at a time.
        marks = [i * (n - 20) // KILLS for i in range(KILLS)]
        deadline = time.monotonic() + 240
        while not state.extraction_complete():
            assert time.monotonic() < deadline, f"not complete: {state.counts()}"
            time.sleep(rng.uniform(0.05, 0.3))
            if kills >= KILLS or state.counts().done < marks[kills]:
                continue
            # Mostly a worker with a sample in flight (by the run state), sometimes any: a kill may land
            # anywhere in a job, between jobs, or while the worker is still starting.
            holding = [json.loads(v)["worker"] for v in redis.hvals(state.keys.inflight)]
            holding = [w for w in holding if w in names]
            name = rng.choice(holding) if holding and rng.random() < 0.8 else rng.choice(names)
            beat = heartbeats.workers(redis).get(name)
            stack.procs[name].send_signal(signal.SIGKILL)
            stack.procs[name].wait(10)
            kills += 1
            busy_kills += name in holding or (beat is not None and beat.state == WorkerState.busy)
            if kills % 2:  # restarted under the same name: a new instance
                stack.start(name, "eaglet.services.extractor.worker", "--name", name)
            else:  # replaced by a worker of another name: the old one's heartbeat goes stale
                renamed += 1
                names[names.index(name)] = new = f"{name}r{kills}"
                stack.start(new, "eaglet.services.extractor.worker", "--name", new)
        counts = check_outcome(redis, settings, run_id, n)
    requeued = requeued_errors(redis, run_id)
    log.warning(
        "worker kills: %d SIGKILLs (%d of a worker holding a sample, %d replaced under a new name); "
        "%d abandoned jobs queued again; done %d, failed %d, retries %d",
        kills, busy_kills, renamed, len(requeued), counts.done, counts.failed, counts.retries,
    )  # fmt: skip
    # Only a machine that finishes the last 20 samples within a poll's time could end the run before the last kill.
    assert kills >= KILLS - 1, f"only {kills} kills landed before the run ended"
    assert counts.failed == 0 and counts.done == n
    assert requeued, "no kill hit a job in flight: the test proved nothing"
    assert events.count(run_id, "extraction_complete") == 1


def test_a_sample_that_kills_its_worker_every_time_ends_failed_with_the_reason(
    redis, settings, tmp_path, tiny_model_dir, events
):
    """The prefill of sample p-3 never returns; each time its worker is seen on it, the worker is killed."""
    engine = ReferenceEngine(tiny_model_dir, device="cpu")
    server = FaultyServer(engine, tmp_path / "dump", lambda sample_id, attempt: "hang" if sample_id == "p-3" else None)
    port = free_port()
    stop_server = server.serve(port)
    settings = settings.model_copy(
        update={"inference_url": f"http://127.0.0.1:{port}", "dump_dir": tmp_path / "dump", "max_attempts": 3}
    )
    n, run_id = 8, "poison"
    write_dataset(tmp_path / "data.jsonl", n, prefix="p")
    kills = 0
    try:
        with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
            stack.start("w0", "eaglet.services.extractor.worker", "--name", "w0")
            ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
            state = RunState(redis, run_id)
            deadline = time.monotonic() + 120
            while not state.extraction_complete():
                assert time.monotonic() < deadline, f"not complete: {state.counts()}"
                beat = heartbeats.workers(redis).get("w0")
                busy = beat is not None and beat.sample == "p-3" and beat.state == WorkerState.busy
                if busy and server.hanging.is_set():
                    server.hanging.clear()
                    stack.procs["w0"].send_signal(signal.SIGKILL)
                    stack.procs["w0"].wait(10)
                    kills += 1
                    stack.start("w0", "eaglet.services.extractor.worker", "--name", "w0")
                time.sleep(0.05)
            counts = check_outcome(redis, settings, run_id, n)
    finally:
        stop_server()
    failure = json.loads(redis.hget(state.keys.failures, "3"))
    log.warning("poison sample: %d kills; failure: %s", kills, failure["reason"])
    assert (counts.done, counts.failed) == (n - 1, 1)
    assert kills == 3 and "died while extracting it, 3 times: given up" in failure["reason"]
    assert failure["sample_id"] == "p-3"
    assert events.count(run_id, "extraction_complete") == 1


@pytest.mark.parametrize("in_flight", [False, True], ids=["lpop", "in-flight"])
def test_a_job_in_no_queue_and_no_registry_is_found(redis, settings, tmp_path, events, in_flight):
    """lpop: the worker's LPOP happened, its started-registry entry never did: the job is in no queue and no
    registry. in-flight: the same, with the sample still recorded in flight, as a sweep leaves it that took a dead
    worker's job out of the started registry (its ZREM) and was then cut short by a Redis outage; that moment cannot
    be hit on purpose, so its state is made directly (the in-flight record of a worker that is gone)."""
    n, run_id = 6, "lost"
    write_dataset(tmp_path / "data.jsonl", n, prefix="l")
    ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
    rq_redis = Redis.from_url(settings.redis_url)
    queue = run_queue(rq_redis, run_id)
    job, _ = Queue.dequeue_any([queue], None, connection=rq_redis)
    taken = job.args[1]  # and the worker that took it dies here
    state = RunState(redis, run_id)
    if in_flight:
        state.start_attempt(taken, "gone", "0123456789ab")
    with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
        stack.start("w0", "eaglet.services.extractor.worker", "--name", "w0")
        wait_for("the run to complete", state.extraction_complete, 60)
    counts = check_outcome(redis, settings, run_id, n)
    assert counts.done == n
    lost = [json.loads(e) for e in redis.lrange(state.keys.errors, 0, -1) if "job was lost" in e]
    assert [e["index"] for e in lost] == [taken]
    assert events.count(run_id, "extraction_complete") == 1


def test_a_worker_killed_between_its_started_entry_and_its_jobs_start_loses_nothing(redis, settings, tmp_path, events):
    """RQ's SimpleWorker records a job's execution (its worker's name) with the started-registry entry, and the job's
    own worker name and start a step later: killed in between, the entry's job names no worker. The moment is a few
    instructions wide, so its state is made with RQ's own calls for those two steps' first (the dead worker's
    execution); the sweep must judge the entry by the execution's worker, or it holds the run open forever."""
    n, run_id = 6, "unstarted"
    write_dataset(tmp_path / "data.jsonl", n, prefix="u")
    ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
    rq_redis = Redis.from_url(settings.redis_url)
    job, _ = Queue.dequeue_any([run_queue(rq_redis, run_id)], None, connection=rq_redis)
    with rq_redis.pipeline() as pipe:
        Execution.create(job, 3600, pipeline=pipe, worker_name=rq_worker_name("gone", "0123456789ab", 1))
        pipe.execute()
    job.refresh()
    assert job.worker_name is None and rq_redis.zcard(job.started_job_registry.key) == 1
    state = RunState(redis, run_id)
    with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
        stack.start("w0", "eaglet.services.extractor.worker", "--name", "w0")
        wait_for("the run to complete", state.extraction_complete, 60)
    assert check_outcome(redis, settings, run_id, n).done == n
    requeued = requeued_errors(redis, run_id)
    assert [(e["index"], e["reason"]) for e in requeued] == [
        (job.args[1], "worker gone died while extracting it; queued again")
    ]
    assert events.count(run_id, "extraction_complete") == 1


@pytest.mark.parametrize("max_attempts", [4, 1])
def test_an_ingest_whose_worker_dies_is_taken_up_where_it_stopped(redis, settings, tmp_path, max_attempts):
    """POST /runs queues the ingest on the control queue; its ingest worker is SIGKILLed while it reads. Another
    ingest worker's sweep queues the ingest again and it goes on from its last flush: every line ingested once, no
    sample lost or doubled. With no attempt left the run ends failed, saying why, and drops what was queued."""
    n, dataset = 60_000, tmp_path / "big.jsonl"
    conversation = {"messages": [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": ""}]}
    with open(dataset, "w") as f:
        for i in range(n):  # chat-templated lines: long enough to be caught half way
            conversation["messages"][1]["content"] = f"Answer number {i}."
            f.write(json.dumps(conversation) + "\n")
    rq_redis = Redis.from_url(settings.redis_url)
    settings = settings.model_copy(update={"max_attempts": max_attempts})
    with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
        stack.start("w0", "eaglet.services.ingest.worker", "--name", "w0")
        wait_for("w0's heartbeat", lambda: redis.hexists(keys.WORKERS, "w0"), 60)
        state = create_run(redis, "half", dataset, RunOptions(**EVERY_STATE))
        enqueue_ingest(rq_redis, "half")
        wait_for("samples queued while ingest reads", lambda: state.meta().ingest_cursor, 120)
        stack.procs["w0"].send_signal(signal.SIGKILL)
        stack.procs["w0"].wait(10)
        cut = state.meta().ingest_cursor
        assert state.meta().total is None, "ingest ended before the kill: the test proved nothing"
        stack.start("w1", "eaglet.services.ingest.worker", "--name", "w1")
        if max_attempts == 1:
            wait_for("the run to end failed", lambda: state.stage() == Stage.failed, 120)
        else:
            wait_for("the ingest to end", lambda: state.meta().total is not None or state.stage() == Stage.failed, 300)
        meta = state.meta()
        if max_attempts > 1:  # extracting 60,000 samples is not this test's business
            state.cancel()
            cancel(rq_redis, "half")
    if max_attempts == 1:
        assert meta.error == (f"ingest of {dataset} died with worker w0, 1 times: given up; start the run again "
                                 "under a new id")  # fmt: skip
        assert run_queue(rq_redis, "half").count == 0
        return
    assert (meta.total, meta.bad_lines) == (n, 0), meta
    ids = [s.decode() for s in SampleSet(samples_dir(settings.data_dir, "half")).index["id"]]
    assert len(ids) == len(set(ids)) == n  # every line once: nothing lost at the cut, nothing doubled
    errors = [json.loads(e)["reason"] for e in redis.lrange(state.keys.errors, 0, -1)]
    assert f"ingest of {dataset} died with worker w0; taken up again from its last flush" in errors
    # Taken up from the cursor the kill left, not from the top (which would also give every line once).
    assert f"run half: ingest taken up again at line {cut['lines']}" in (tmp_path / "logs" / "w1.log").read_text()
    log.warning("ingest killed at line %d (%d samples flushed), taken up again: %d samples", cut["lines"],
                cut["samples"], len(ids))  # fmt: skip
