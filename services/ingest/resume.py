"""Ingests whose process died: queued again, to be taken up from their last flush, or given up. The planning of a
regeneration whose process died is queued again too: it starts over, as it is idempotent; and so is the ingest of a
run whose regeneration was finished by a worker that died before it queued the ingest.

An ingest job runs for as long as its dataset takes to read (hours for a large one). Its worker killed, RQ
would call the job abandoned only once its timeout had passed; so live ingest workers sweep the control
queue's started registry themselves, judging each job's worker by eaglet's heartbeats (as the extractor's
reaper does for samples, see shared/jobqueue.py ``owner_alive``). The sweeper whose ZREM removes the
entry owns the job: it queues the ingest again (the job takes it up from the cursor in the run's record),
unless the run's ingest has died ``max_lost`` times, in which case the run ends failed, saying why.
"""

import logging
import time

from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.utils import parse_composite_key

from eaglet.services.ingest.jobs import fail_ingest
from eaglet.shared import heartbeats, keys
from eaglet.shared.jobqueue import (
    INGEST_JOB,
    REGEN_PLAN_JOB,
    enqueue_ingest,
    enqueue_regeneration,
    execution_of,
    job_id,
    owner_alive,
    owner_of,
    running_worker,
)
from eaglet.shared.keys import CONTROL_QUEUE
from eaglet.shared.records import FINISHED_STAGES, Stage
from eaglet.shared.runstate import RunState

log = logging.getLogger(__name__)


def resume_dead_ingests(redis: Redis, rq_redis: Redis, *, instance: str, lost_after_s: float, max_lost: int) -> int:
    """One pass over the control queue's started jobs with the worker's two connections (``redis`` text,
    ``rq_redis`` RQ's bytes); ``instance`` is the sweeping process. Returns how many dead ingests it found."""
    registry = StartedJobRegistry(CONTROL_QUEUE, connection=rq_redis)
    beats = heartbeats.workers(redis)
    found = 0
    for entry in rq_redis.zrange(registry.key, 0, -1):
        jid, _ = parse_composite_key(entry.decode())
        try:
            job = Job.fetch(jid, connection=rq_redis)
        except NoSuchJobError:
            continue
        owner = owner_of(running_worker(execution_of(rq_redis, entry.decode()), job))
        if job.func_name not in (INGEST_JOB, REGEN_PLAN_JOB) or owner is None:
            continue
        if owner_alive(owner, beats, lost_after_s=lost_after_s, instance=instance):
            continue
        if not rq_redis.zrem(registry.key, entry):
            continue  # another worker's sweep got it first
        found += 1
        job.delete()
        state = RunState(redis, job.args[0])
        if job.func_name == REGEN_PLAN_JOB:  # planning is idempotent: it starts over
            if state.stage() == Stage.regenerating:
                enqueue_regeneration(rq_redis, state.run_id)
            continue
        _take_up(state, owner[0], rq_redis, max_lost)
    return found + _queue_lost_handoffs(redis, rq_redis, lost_after_s)


def _queue_lost_handoffs(redis: Redis, rq_redis: Redis, lost_after_s: float) -> int:
    """Runs that regeneration handed to ingest whose ingest was never queued: the worker that moved the stage died
    before it queued the job. One meta read per registered run: O(runs), never O(samples)."""
    found = 0
    for run_id in redis.zrange(keys.RUNS, 0, -1):
        meta = RunState(redis, run_id).meta()
        handed = meta.stage == Stage.ingesting and meta.regenerated_at is not None
        if (
            not handed
            or meta.total is not None
            or meta.ingest_cursor
            or time.time() - meta.regenerated_at < lost_after_s
        ):
            continue
        if Job.exists(job_id(run_id, "ingest"), connection=rq_redis):
            continue  # queued, running, or done and kept for its result
        enqueue_ingest(rq_redis, run_id)
        log.warning("run %s: its regenerated dataset was never queued for ingest; queued now", run_id)
        found += 1
    return found


def _take_up(state: RunState, worker: str, rq_redis: Redis, max_lost: int) -> None:
    meta = state.meta()
    if meta.total is not None or meta.stage in FINISHED_STAGES:
        return  # it had finished, or the run is over
    why = f"ingest of {meta.dataset} died with worker {worker}"
    deaths = state.record_ingest_death()
    if deaths >= max_lost:
        fail_ingest(state, f"{why}, {deaths} times: given up; start the run again under a new id")
        return
    state.record_error(-1, "", f"{why}; taken up again from its last flush", "ingest")
    enqueue_ingest(rq_redis, state.run_id)
    log.warning("run %s: %s; queued again", state.run_id, why)
