"""Extraction jobs whose worker died: queued again, or given up once the sample has killed its worker too often.

A ``SimpleWorker`` killed with SIGKILL leaves its job in RQ's StartedJobRegistry until the job's timeout
plus a minute has passed (an hour with ours); only then does RQ call it abandoned, run the failure
callback and move it to the FailedJobRegistry. That is far too long to leave a sample, and the callback
would record it as failed. So live workers sweep the registries of active runs themselves, judging a
job's worker by eaglet's own heartbeats: the RQ worker name of the job's execution (RQ's record of this run
of it) carries the process's instance id (``<name>:<instance>:<n>``), and a worker whose heartbeat is stale,
missing, or from another instance (restarted under the same name) is dead. The sweeper that removes the
registry entry (an atomic ZREM) owns the job: it clears the sample's in-flight entry and its partial file,
then queues it again, unless the sample's worker has died ``max_lost`` times, in which case the sample is
recorded as failed.

A worker that listens to several queues takes a job with LPOP, and puts it in the started registry only
a moment later: killed in between, the job is in no queue and no registry, and RQ never sees it again. A sweep
cut short by a Redis outage after its ZREM leaves the same, with the sample still recorded in flight. Those are
found when a run has nothing queued or started for ``lost_after_s`` yet samples without an outcome: the done
and failed bitmaps are read once (total/8 bytes) and the missing samples queued again. In-flight records do
not hold that back: a running job is in the started registry for as long as its sample is in flight, so with
nothing started they are stale.

Regeneration batches (services/regenerate/) run on the same queues: one whose worker died is queued
again the same way; the prompts it finished are kept in its result file and not asked again.

Samples that RQ found abandoned first (a worker that is not eaglet's, or no sweeper for an hour) are
noted by the failure callback in ``RunKeys.abandoned`` and queued again from the FailedJobRegistry here.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from redis import Redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.utils import parse_composite_key

from eaglet.shared import heartbeats
from eaglet.shared.jobqueue import (
    REGEN_JOB,
    enqueue_batches,
    enqueue_samples,
    execution_of,
    job_id,
    owner_alive,
    owner_of,
    run_queue,
    running_worker,
)
from eaglet.shared.keys import RunKeys, queue_name
from eaglet.shared.records import ExtractionCounts, Stage, WorkerBeat
from eaglet.shared.regeneration import Progress, requeue_batch
from eaglet.shared.runstate import RunState

log = logging.getLogger(__name__)


@dataclass
class Reaper:
    """Sweeps with the worker's two connections: ``redis`` (text, run state) and ``rq_redis`` (RQ's bytes)."""

    redis: Redis
    rq_redis: Redis
    instance: str  # this process: its own jobs are alive whatever its heartbeat says, but for those of its
    lost_after_s: float
    max_lost: int
    sample_id_of: Callable[[str, int], str]  # (run, index) -> sample id, for the failure record
    partial_of: Callable[[str, int, str], None]  # (run, index, instance): removes that instance's temp file
    current_rq_worker: Callable[[], str]  # ...earlier RQ workers, ended mid-job by a Redis outage: the current one
    _idle_since: dict[str, float] = field(default_factory=dict)  # run -> when it was first seen with nothing running

    def sweep(self, run_ids: list[str]) -> dict[str, int]:
        """One pass over the runs' started jobs; returns how many were queued again and failed."""
        outcome = {"requeued": 0, "failed": 0}
        beats = heartbeats.workers(self.redis)
        now = time.time()
        for run_id in run_ids:
            registry = StartedJobRegistry(queue_name(run_id), connection=self.rq_redis)
            for entry in self.rq_redis.zrange(registry.key, 0, -1):
                what = self._check(run_id, registry, entry.decode(), beats, now)
                if what in outcome:
                    outcome[what] += 1
            for what in self._requeue_rq_abandoned(run_id):
                outcome[what] += 1
            for what in self._requeue_lost(run_id, registry):
                outcome[what] += 1
        return outcome

    def _requeue_lost(self, run_id: str, registry: StartedJobRegistry) -> list[str]:
        k = RunKeys(run_id)
        meta = RunState(self.redis, run_id).meta()
        if meta.stage == Stage.regenerating:
            return self._requeue_lost_batches(run_id, registry)
        total = meta.total
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(k.counts)
        pipe.scard(k.abandoned)
        raw_counts, abandoned = pipe.execute()
        counts = ExtractionCounts.from_redis(raw_counts)
        busy = run_queue(self.rq_redis, run_id).count or self.rq_redis.zcard(registry.key)
        if total is None or counts.done + counts.failed >= total or busy or abandoned:
            self._idle_since.pop(run_id, None)
            return []
        since = self._idle_since.setdefault(run_id, time.monotonic())
        if time.monotonic() - since < self.lost_after_s:
            return []  # a job may be between LPOP and the started registry in a live worker: look again later
        self._idle_since.pop(run_id, None)
        scratch = f"{k.done}:or:{time.time_ns()}"
        pipe = self.rq_redis.pipeline()
        pipe.bitop("OR", scratch, k.done, k.failed)
        pipe.get(scratch)
        pipe.delete(scratch)
        bitmap = pipe.execute()[1] or b""
        bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8))[:total]  # Redis bitmaps are big-endian
        missing = np.flatnonzero(bits == 0).tolist() + list(range(len(bits), total))
        return [self._abandoned(run_id, int(i), "its job was lost (a worker died as it took it)") for i in missing]

    def _requeue_lost_batches(self, run_id: str, registry: StartedJobRegistry) -> list[str]:
        """Batches that no queue, registry or worker holds while the regeneration is unfinished: lost between a
        worker's LPOP and RQ's started registry, as samples can be. Queued again (one bit per batch to read)."""
        progress = Progress(self.redis, run_id)
        busy = run_queue(self.rq_redis, run_id).count or self.rq_redis.zcard(registry.key)
        if busy or not progress.planned():
            self._idle_since.pop(run_id, None)
            return []
        since = self._idle_since.setdefault(run_id, time.monotonic())
        if time.monotonic() - since < self.lost_after_s:
            return []
        self._idle_since.pop(run_id, None)
        # None unfinished: the job that gave the last prompt its outcome died before it moved the run on; any batch's
        # job, run again, finds every prompt done and moves it.
        lost = progress.unfinished_batches() or [0]
        enqueue_batches(self.rq_redis, run_id, lost)
        log.warning("run %s: regeneration batches %s were lost (a worker died as it took them); queued again",
                    run_id, lost[:20])  # fmt: skip
        return ["requeued"] * len(lost)

    def _check(
        self, run_id: str, registry: StartedJobRegistry, entry: str, beats: dict[str, WorkerBeat], now: float
    ) -> str:
        jid, _ = parse_composite_key(entry)
        try:
            job = Job.fetch(jid, connection=self.rq_redis)
        except NoSuchJobError:
            return "gone"
        if job.func_name == REGEN_JOB:
            return self._check_batch(registry, entry, job, beats)
        run, index = job.args
        execution = execution_of(self.rq_redis, entry)
        began = job.started_at or (execution.created_at if execution else None)
        started = began.timestamp() if began else now
        if now - started > self.lost_after_s and RunState(self.redis, run).has_outcome(int(index)):
            # Its sample was marked, but RQ could not record the job's end (Redis went away in between): a
            # stale entry, whoever owns it, that would hold the run's lost-job check below forever.
            if self.rq_redis.zrem(registry.key, entry):
                job.delete()
            return "stale"
        worker = running_worker(execution, job)
        owner = owner_of(worker)
        # A Redis outage ends this process's RQ worker mid-job and the next burst runs under a new name: the job
        # it held would look alive (same instance) until RQ's job timeout, and hold the run open that long.
        ended_here = (
            owner is not None
            and owner[1] == self.instance
            and worker != self.current_rq_worker()
            and now - started > self.lost_after_s
        )
        if owner is None or (
            not ended_here and owner_alive(owner, beats, lost_after_s=self.lost_after_s, instance=self.instance)
        ):
            return "alive"
        if not self.rq_redis.zrem(registry.key, entry):
            return "taken"  # another worker's sweep got it first
        name, instance = owner
        what = self._abandoned(run, int(index), f"worker {name} died while extracting it", instance)
        if what != "requeued":
            job.delete()  # finished or given up: nothing will run it again
        return what

    def _check_batch(self, registry: StartedJobRegistry, entry: str, job: Job, beats: dict[str, WorkerBeat]) -> str:
        """A regeneration batch whose worker died: queued again (its finished prompts are in its file, kept)."""
        owner = owner_of(running_worker(execution_of(self.rq_redis, entry), job))
        if owner is None or owner_alive(owner, beats, lost_after_s=self.lost_after_s, instance=self.instance):
            return "alive"
        if not self.rq_redis.zrem(registry.key, entry):
            return "taken"
        job.delete()
        run_id, batch, _ = job.args
        why = f"worker {owner[0]} died while regenerating it"
        RunState(self.redis, run_id).record_error(-1, "", f"regeneration batch {batch}: {why}", "reaper")
        return requeue_batch(self.redis, self.rq_redis, run_id, int(batch), why, self.max_lost)

    def _abandoned(self, run_id: str, index: int, why: str, instance: str = "") -> str:
        state = RunState(self.redis, run_id)
        state.end_attempt(index)
        if instance:
            self.partial_of(run_id, index, instance)
        if state.has_outcome(index):
            return "finished"  # killed after its mark, before RQ recorded the job's end
        sample_id = self.sample_id_of(run_id, index)
        lost = state.record_lost(index)
        if lost >= self.max_lost:
            state.mark_failed(index, sample_id, f"{why}, {lost} times: given up", "reaper")
            log.warning("run %s sample %d: %s, %d times: recorded as failed", run_id, index, why, lost)
            return "failed"
        state.record_error(index, sample_id, f"{why}; queued again", "reaper")
        enqueue_samples(self.rq_redis, run_id, [index])
        log.warning("run %s sample %d: %s; queued again", run_id, index, why)
        return "requeued"

    def _requeue_rq_abandoned(self, run_id: str) -> list[str]:
        k = RunKeys(run_id)
        registry = FailedJobRegistry(queue_name(run_id), connection=self.rq_redis)
        outcomes = []
        for raw in self.redis.smembers(k.abandoned):
            index, jid = int(raw), job_id(run_id, raw)
            if self.rq_redis.zscore(registry.key, jid) is None:
                if not self.rq_redis.exists(Job.key_for(jid)):
                    self.redis.srem(k.abandoned, raw)  # gone for good: nothing to queue
                continue  # RQ's cleanup has not stored the failure yet: next sweep
            if not self.redis.srem(k.abandoned, raw):
                continue  # another worker's sweep got it first
            state = RunState(self.redis, run_id)
            if state.has_outcome(index):
                registry.remove(jid, delete_job=True)
                continue
            lost = state.record_lost(index)
            if lost >= self.max_lost:
                why = f"its worker died while extracting it (found abandoned by RQ), {lost} times: given up"
                state.mark_failed(index, self.sample_id_of(run_id, index), why, "reaper")
                outcomes.append("failed")
                continue
            try:
                registry.requeue(jid)  # RQ's own way out of its failed registry: status and queue reset
            except (InvalidJobOperation, NoSuchJobError):
                enqueue_samples(self.rq_redis, run_id, [index])
            state.record_error(index, self.sample_id_of(run_id, index), "found abandoned by RQ; queued again", "reaper")
            outcomes.append("requeued")
        return outcomes
