"""The queues through real Redis: job ids fixed by run, the ingest job named by run only, job owners by heartbeat."""

import time
from dataclasses import replace

import pytest
from redis import Redis
from rq import Queue

from eaglet.shared import jobqueue, keys
from eaglet.shared.records import WorkerBeat, WorkerState


@pytest.fixture
def rq_redis(redis_server):
    conn = Redis.from_url(redis_server.url)
    yield conn
    conn.close()


def test_samples_are_queued_once_per_index(redis, rq_redis):
    assert jobqueue.enqueue_samples(rq_redis, "r.1", range(5)) == 5
    jobqueue.enqueue_samples(rq_redis, "r.1", [2, 3])
    queue = jobqueue.run_queue(rq_redis, "r.1")
    assert sorted(queue.fetch_job(j).args for j in set(queue.job_ids)) == [("r.1", i) for i in range(5)]
    assert all("." not in j for j in queue.job_ids)  # RQ refuses '.' in job ids: run ids are hashed
    redis.hset(keys.RunKeys("r.1").failures, mapping={"3": "{}", "1": "{}"})
    assert jobqueue.failed_indexes(redis, "r.1") == [1, 3]
    assert jobqueue.cancel(rq_redis, "r.1") >= 5 and queue.count == 0


def test_the_ingest_job_names_its_run_only(rq_redis):
    job_id = jobqueue.enqueue_ingest(rq_redis, "r1")
    assert jobqueue.enqueue_ingest(rq_redis, "r1") == job_id  # queued again (after its worker died): same job
    job = Queue(keys.CONTROL_QUEUE, connection=rq_redis).fetch_job(job_id)
    assert (job.func_name, job.args) == (jobqueue.INGEST_JOB, ("r1",))


def test_owner_of_reads_back_the_worker_name():
    assert jobqueue.owner_of(jobqueue.rq_worker_name("host:12", "abc", 7)) == ("host:12", "abc")
    assert jobqueue.owner_of("some-other-worker") is None


def test_an_owner_is_alive_while_its_instance_beats():
    now, owner = time.time(), ("w0", "i1")
    beat = WorkerBeat(worker="w0", instance="i1", state=WorkerState.busy, ts=now)
    assert jobqueue.owner_alive(owner, {"w0": beat}, lost_after_s=5, instance="me")
    assert jobqueue.owner_alive(owner, {}, lost_after_s=5, instance="i1")  # the caller itself
    for beats in (
        {},  # no heartbeat at all
        {"w0": replace(beat, ts=now - 60)},  # stale
        {"w0": replace(beat, instance="i2")},  # restarted under the same name
        {"w0": replace(beat, state=WorkerState.stopped)},
    ):
        assert not jobqueue.owner_alive(owner, beats, lost_after_s=5, instance="me"), beats
