"""The hand-off from regeneration to ingest, when the worker that moved the run died before it queued the ingest:
the ingest workers' sweep queues it, once."""

from redis import Redis
from rq import Queue

from eaglet.services.ingest.resume import resume_dead_ingests
from eaglet.shared import jobqueue, keys
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runs import create_run
from eaglet.shared.runstate import RunState, Stage
from tests.regenerate.conftest import write_jsonl


def test_a_lost_handoff_is_queued_for_ingest_once(redis, redis_server, tmp_path):
    rq_redis = Redis.from_url(redis_server.url)
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    create_run(redis, "handoff", source, RunOptions(regenerate=RegenerateOptions()))
    assert RunState(redis, "handoff").finish_regeneration(str(tmp_path / "regenerated.jsonl"), stop=False)
    # The worker died here: the stage moved, no ingest was queued.
    sweep = dict(instance="sweeper", lost_after_s=0.0, max_lost=3)
    assert resume_dead_ingests(redis, rq_redis, **sweep) == 1
    [job] = Queue(keys.CONTROL_QUEUE, connection=rq_redis).jobs
    assert (job.func_name, job.args) == (jobqueue.INGEST_JOB, ("handoff",))
    assert resume_dead_ingests(redis, rq_redis, **sweep) == 0
    assert RunState(redis, "handoff").stage() == Stage.ingesting
