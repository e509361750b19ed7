"""Run state in Redis: the one source of truth for progress.

Done and failed marks are bits by sample index, so a retried or duplicated job never counts twice.
The mark that gives the last sample its outcome sets ``extraction_complete`` in the same Lua script,
hence exactly once, and publishes an event. Every read the status needs is O(1) in the samples.

The run's stage moves only through the transitions below (``finish_regeneration``, ``start_extraction``,
``wait_for_gpus``, ``start_training``, ``start_evaluating``, ``finish``, ``fail``, ``cancel``), each checked against
the stage it finds, atomically: a run that is done, failed or cancelled stays so. The meta, train and eval hashes are
read and written as records (shared/records.py).
"""

import json
import time
from collections.abc import Iterable
from typing import Any

from redis import Redis

from . import keys
from .keys import RunKeys
from .records import (
    FINISHED_STAGES,
    GPUS_RELEASED,
    EvalResult,
    ExtractionCounts,
    RunMeta,
    Stage,
    TrainProgress,
)

RECENT_CAP = 2000
ERRORS_CAP = 100


# Shared tail of both marks: if every sample now has an outcome, set the flag once and announce it.
_COMPLETE = """
local function complete_if_last(meta, counts, now, channel, run_id)
  local total = tonumber(redis.call('HGET', meta, 'total') or '-1')
  local n = tonumber(redis.call('HGET', counts, 'done') or '0') + tonumber(redis.call('HGET', counts, 'failed') or '0')
  if total >= 0 and n >= total and redis.call('HSETNX', meta, 'extraction_complete', now) == 1 then
    if redis.call('HGET', meta, 'stage') == 'extracting' then redis.call('HSET', meta, 'stage', 'extracted') end
    redis.call('PUBLISH', channel, cjson.encode({run = run_id, event = 'extraction_complete', ts = tonumber(now)}))
    return 2
  end
  return 1
end
"""

# KEYS: meta counts done failed failures recent inflight; ARGV: index tokens bytes now channel run_id cap
# Returns 0 if already done (nothing counted), 1 if counted, 2 if it completed the run.
MARK_DONE = (
    _COMPLETE
    + """
redis.call('HDEL', KEYS[7], ARGV[1])
if redis.call('SETBIT', KEYS[3], ARGV[1], 1) == 1 then return 0 end
if redis.call('GETBIT', KEYS[4], ARGV[1]) == 1 then
  redis.call('SETBIT', KEYS[4], ARGV[1], 0)
  redis.call('HINCRBY', KEYS[2], 'failed', -1)
  redis.call('HDEL', KEYS[5], ARGV[1])
end
redis.call('HINCRBY', KEYS[2], 'done', 1)
redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'bytes', ARGV[3])
redis.call('HSET', KEYS[2], 'last_done_at', ARGV[4])
redis.call('LPUSH', KEYS[6], ARGV[4] .. ' ' .. ARGV[2] .. ' ' .. ARGV[3])
redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[7]) - 1)
return complete_if_last(KEYS[1], KEYS[2], ARGV[4], ARGV[5], ARGV[6])
"""
)

# KEYS: meta counts done failed failures inflight; ARGV: index failure_json now channel run_id
# Returns 0 if the sample already has an outcome, 1 if counted, 2 if it completed the run.
MARK_FAILED = (
    _COMPLETE
    + """
redis.call('HDEL', KEYS[6], ARGV[1])
if redis.call('GETBIT', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('SETBIT', KEYS[4], ARGV[1], 1) == 1 then return 0 end
redis.call('HSET', KEYS[5], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], 'failed', 1)
return complete_if_last(KEYS[1], KEYS[2], ARGV[3], ARGV[4], ARGV[5])
"""
)

# KEYS: meta counts; ARGV: total total_tokens now channel run_id
# Ingest queues samples as it reads them, so some may be done before the total is known: check here too.
SET_TOTAL = (
    _COMPLETE
    + """
redis.call('HSET', KEYS[1], 'total', ARGV[1], 'total_tokens', ARGV[2], 'ingested_at', ARGV[3])
if redis.call('HGET', KEYS[1], 'stage') == 'ingesting' then redis.call('HSET', KEYS[1], 'stage', 'extracting') end
return complete_if_last(KEYS[1], KEYS[2], ARGV[3], ARGV[4], ARGV[5])
"""
)

# KEYS: meta counts failed failures; ARGV: index...
# Failed samples become pending again, so the run is not complete until they have a new outcome.
# Refused (returns -1) once the trainer has started: it trains on what was complete.
REOPEN_FAILED = """
local stage = redis.call('HGET', KEYS[1], 'stage')
if stage ~= 'extracting' and stage ~= 'extracted' then return -1 end
local n = 0
for _, index in ipairs(ARGV) do
  if redis.call('SETBIT', KEYS[3], index, 0) == 1 then
    redis.call('HDEL', KEYS[4], index)
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'failed', -n)
  redis.call('HDEL', KEYS[1], 'extraction_complete')
  redis.call('HSET', KEYS[1], 'stage', 'extracting')
end
return n
"""

# KEYS: meta; ARGV: stage event_json n allowed_1..allowed_n field_1 value_1...
# Moves the stage (and sets the fields) only from one of the allowed stages; returns {moved, stage before}.
MOVE_STAGE = """
local before = redis.call('HGET', KEYS[1], 'stage') or 'ingesting'
local n = tonumber(ARGV[3])
for i = 4, 3 + n do
  if ARGV[i] == before then
    redis.call('HSET', KEYS[1], 'stage', ARGV[1])
    for j = 4 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[j], ARGV[j + 1]) end
    redis.call('PUBLISH', KEYS[2], ARGV[2])
    return {1, before}
  end
end
return {0, before}
"""

UNFINISHED = tuple(s for s in Stage if s not in FINISHED_STAGES)
TRAINER_RUNNING = (Stage.training, Stage.evaluating)


EARLIER_EVALS = 8
"""Earlier evaluations a run keeps (``RunKeys.evals``), newest first; ``/status`` lists them all."""


class StageRefused(RuntimeError):
    """The run's stage does not allow the move (a cancelled run is never trained on)."""

    def __init__(self, run_id: str, to: Stage, stage: Stage):
        super().__init__(f"run {run_id} is {stage}: it can not move to {to}")
        self.stage = stage


class RunExists(ValueError):
    """The run id is taken: runs are never overwritten."""


class RunState:
    """Writes of one run's state. Takes its Redis connection; never reaches for a global one."""

    def __init__(self, redis: Redis, run_id: str):
        if not redis.get_connection_kwargs().get("decode_responses"):
            raise TypeError("RunState needs a Redis client with decode_responses=True (run state is text)")
        self.redis = redis
        self.run_id = run_id
        self.keys = RunKeys(run_id)
        self._mark_done = redis.register_script(MARK_DONE)
        self._mark_failed = redis.register_script(MARK_FAILED)
        self._set_total = redis.register_script(SET_TOTAL)
        self._reopen_failed = redis.register_script(REOPEN_FAILED)
        self._move_stage = redis.register_script(MOVE_STAGE)

    def create(self, stage: Stage = Stage.ingesting, **meta: Any) -> None:
        """Registers the run (stage ``ingesting``, or ``regenerating`` for a run that starts by regenerating its
        dataset) with the ``RunMeta`` fields given, claiming its id (``RunExists`` if taken); ``total`` is set by
        ``set_total`` once ingest is done."""
        now = time.time()
        record = RunMeta(run_id=self.run_id, created_at=now, stage=stage, **meta)
        # The claim is atomic, so two gateway replicas (or a gateway and a terminal) never create the same run twice.
        if self.exists() or not self.redis.zadd(keys.RUNS, {self.run_id: now}, nx=True):
            raise RunExists(f"run {self.run_id!r} exists already; pick another id")
        pipe = self.redis.pipeline()
        pipe.hset(self.keys.meta, mapping=record.to_redis())
        pipe.hset(self.keys.counts, mapping={"done": 0, "failed": 0, "tokens": 0, "bytes": 0, "retries": 0})
        pipe.execute()

    def exists(self) -> bool:
        return bool(self.redis.exists(self.keys.meta))

    def meta(self) -> RunMeta:
        return RunMeta.from_redis(self.redis.hgetall(self.keys.meta))

    def update_meta(self, meta: RunMeta) -> None:
        """Writes the fields set in ``meta``. The stage moves through the transitions, not through here."""
        fields = meta.to_redis()
        if "stage" in fields:
            raise ValueError("the stage moves through RunState's transitions (start_training, fail, ...)")
        if fields:
            self.redis.hset(self.keys.meta, mapping=fields)

    def claim_captured_layers(self, layers: list[int]) -> list[int] | None:
        """The run's captured layers: ``layers`` if none were set (the first dump checked sets them), else those set
        before, unchanged. One transaction: of workers racing with their first dumps, one sets them, all get them."""
        pipe = self.redis.pipeline()
        pipe.hsetnx(self.keys.meta, "captured_layers", RunMeta(captured_layers=layers).to_redis()["captured_layers"])
        pipe.hget(self.keys.meta, "captured_layers")
        _, raw = pipe.execute()
        return RunMeta.from_redis({"captured_layers": raw}).captured_layers

    def train(self) -> TrainProgress:
        return TrainProgress.from_redis(self.redis.hgetall(self.keys.train))

    def update_train(self, progress: TrainProgress) -> None:
        """Writes the fields set in ``progress``: the trainer reports a few at a time."""
        if fields := progress.to_redis():
            self.redis.hset(self.keys.train, mapping=fields)

    def add_train_attempt(self, delta: int = 1) -> int:
        """Counts a training started for the run (-1 takes one back); returns the count."""
        return int(self.redis.hincrby(self.keys.train, "follow_attempts", delta))

    def eval(self) -> EvalResult:
        return EvalResult.from_redis(self.redis.hgetall(self.keys.eval))

    def update_eval(self, result: EvalResult) -> None:
        if fields := result.to_redis():
            self.redis.hset(self.keys.eval, mapping=fields)

    def replace_eval(self, result: EvalResult) -> None:
        """Starts a new evaluation: the earlier one's figures move, in the same step, to the front of the run's
        capped list of earlier evaluations (a bf16 target's kept beside an fp8 one's)."""
        earlier = self.redis.hgetall(self.keys.eval)
        pipe = self.redis.pipeline()
        if earlier:
            pipe.lpush(self.keys.evals, json.dumps(earlier))
            pipe.ltrim(self.keys.evals, 0, EARLIER_EVALS - 1)
        pipe.delete(self.keys.eval)
        pipe.hset(self.keys.eval, mapping=result.to_redis())
        pipe.execute()

    def record_ingest_death(self) -> int:
        """The process ingesting the run died; returns how many times that has happened to it."""
        return int(self.redis.hincrby(self.keys.meta, "ingest_deaths", 1))

    def finish_regeneration(self, dataset: str, *, stop: bool) -> bool:
        """The regenerated file is written: the run goes on to ingest it as its dataset, or ends ``done`` if it was
        to stop there. False if the run had left ``regenerating`` (another worker moved it, or it was cancelled)."""
        to = Stage.done if stop else Stage.ingesting
        return self._move(to, (Stage.regenerating,), dataset=dataset, regenerated_at=time.time()) is not None

    def start_extraction(self) -> bool:
        """The first samples are queued; ingest goes on, so the total is not known yet. False if the run had
        left ``ingesting`` (extracting already, or cancelled meanwhile)."""
        return self._move(Stage.extracting, (Stage.ingesting,), extraction_started_at=time.time()) is not None

    def set_total(self, total: int, total_tokens: int) -> int:
        """Ingest is over: the run is counted against ``total``. Returns 2 if that completed it."""
        k = self.keys
        return int(
            self._set_total(keys=[k.meta, k.counts], args=[total, total_tokens, time.time(), keys.EVENTS, self.run_id])
        )

    def wait_for_gpus(self) -> None:
        """The trainer waits for the inference service to release its GPUs. StageRefused if the run finished."""
        self._move_or_refuse(Stage.waiting_for_gpus, UNFINISHED)

    def start_training(self) -> None:
        """From any unfinished stage: ``--allow-partial`` trains on a run still extracting, and a resumed trainer
        finds its run training or evaluating. StageRefused if the run finished (a cancelled run stays so)."""
        self._move_or_refuse(Stage.training, UNFINISHED)

    def start_evaluating(self) -> None:
        self._move_or_refuse(Stage.evaluating, TRAINER_RUNNING)

    def request_evaluation(self, request: str) -> None:
        """The trainer is done and leaves the evaluation (JSON ``request``) to the evaluation service: the run
        waits in ``evaluating`` until an evaluator finishes it."""
        self._move_or_refuse(Stage.evaluating, TRAINER_RUNNING, eval_request=request)

    def add_eval_attempt(self, by: int = 1) -> int:
        """Counts an evaluator's claim of the run (``by`` -1: one given back on a stop, not a failure)."""
        return int(self.redis.hincrby(self.keys.meta, "eval_attempts", by))

    def finish(self) -> None:
        """The drafter is trained (and evaluated, if asked)."""
        self._move_or_refuse(Stage.done, TRAINER_RUNNING)

    def fail(self, reason: str) -> Stage | None:
        """Ends the run as failed, with the reason ``/status`` shows. Returns the stage it failed at, or None if
        the run had finished already (its first outcome stands)."""
        return self._move(Stage.failed, UNFINISHED, error=reason)

    def cancel(self) -> Stage | None:
        """Workers and the trainer see the stage and stop. Returns the stage it was cancelled at, or None if the
        run had finished already."""
        return self._move(Stage.cancelled, UNFINISHED)

    def release_gpus(self, now: float | None = None, gpus: list[str] | None = None) -> None:
        """The inference service stopped, freeing ``gpus``: the trainer waiting for them (``wait_for_gpus``) may
        start. The GPUs are recorded before the flag the trainer waits for."""
        for name, value in RunMeta(released_gpus=gpus).to_redis().items():
            self.redis.hsetnx(self.keys.meta, name, value)
        self.redis.hsetnx(self.keys.meta, GPUS_RELEASED, time.time() if now is None else now)

    def gpus_released(self) -> bool:
        return self.redis.hexists(self.keys.meta, GPUS_RELEASED)

    def _move(self, to: Stage, allowed: Iterable[Stage], **fields: Any) -> Stage | None:
        """Moves the stage to ``to`` if it is one of ``allowed``, setting the ``RunMeta`` fields given with it;
        returns the stage before, or None if it was not allowed."""
        names = [str(s) for s in allowed]
        pairs = [x for item in RunMeta(**fields).to_redis().items() for x in item]
        event = json.dumps({"run": self.run_id, "event": f"stage:{to}", "ts": time.time()})
        moved, before = self._move_stage(
            keys=[self.keys.meta, keys.EVENTS], args=[str(to), event, len(names), *names, *pairs]
        )
        return Stage(before) if moved else None

    def _move_or_refuse(self, to: Stage, allowed: tuple[Stage, ...], **fields: Any) -> None:
        if self._move(to, allowed, **fields) is None:
            raise StageRefused(self.run_id, to, self.stage())

    def stage(self) -> Stage:
        return Stage(self.redis.hget(self.keys.meta, "stage") or Stage.ingesting)

    def is_cancelled(self) -> bool:
        return self.stage() == Stage.cancelled

    def extraction_complete(self) -> bool:
        return self.redis.hexists(self.keys.meta, "extraction_complete")

    def publish(self, event: str) -> None:
        self.redis.publish(keys.EVENTS, json.dumps({"run": self.run_id, "event": event, "ts": time.time()}))

    def start_attempt(self, index: int, worker: str, instance: str = "") -> int:
        """Records the sample as in flight and returns this attempt's number (1, 2, ...)."""
        pipe = self.redis.pipeline()
        pipe.hincrby(self.keys.attempts, str(index), 1)
        record = {"worker": worker, "instance": instance, "started": time.time()}
        pipe.hset(self.keys.inflight, str(index), json.dumps(record))
        attempt = pipe.execute()[0]
        if attempt > 1:
            self.redis.hincrby(self.keys.counts, "retries", 1)
        return attempt

    def end_attempt(self, index: int) -> None:
        self.redis.hdel(self.keys.inflight, str(index))

    def is_done(self, index: int) -> bool:
        return bool(self.redis.getbit(self.keys.done, index))

    def has_outcome(self, index: int) -> bool:
        pipe = self.redis.pipeline(transaction=False)
        pipe.getbit(self.keys.done, index)
        pipe.getbit(self.keys.failed, index)
        return any(pipe.execute())

    def record_lost(self, index: int) -> int:
        """The worker extracting ``index`` died; returns how many times that has happened to this sample."""
        return int(self.redis.hincrby(self.keys.lost, str(index), 1))

    def mark_done(self, index: int, tokens: int, nbytes: int) -> int:
        k = self.keys
        return int(
            self._mark_done(
                keys=[k.meta, k.counts, k.done, k.failed, k.failures, k.recent, k.inflight],
                args=[index, tokens, nbytes, time.time(), keys.EVENTS, self.run_id, RECENT_CAP],
            )
        )

    def mark_failed(self, index: int, sample_id: str, reason: str, worker: str = "") -> int:
        k = self.keys
        failure = json.dumps(
            {"index": index, "sample_id": sample_id, "reason": reason, "worker": worker, "ts": time.time()}
        )
        self.record_error(index, sample_id, reason, worker, final=True)
        return int(
            self._mark_failed(
                keys=[k.meta, k.counts, k.done, k.failed, k.failures, k.inflight],
                args=[index, failure, time.time(), keys.EVENTS, self.run_id],
            )
        )

    def reopen_failed(self, indexes: list[int]) -> int:
        """Makes failed samples pending again before they are re-queued; returns how many, or -1 if the
        trainer has started (then the run's extraction stays as it was)."""
        k = self.keys
        return int(self._reopen_failed(keys=[k.meta, k.counts, k.failed, k.failures], args=[str(i) for i in indexes]))

    def record_error(self, index: int, sample_id: str, reason: str, worker: str = "", final: bool = False) -> None:
        """Keeps the newest errors, transient ones included, for ``/status``."""
        entry = {"index": index, "sample_id": sample_id, "reason": reason, "worker": worker, "final": final}
        pipe = self.redis.pipeline()
        pipe.lpush(self.keys.errors, json.dumps({**entry, "ts": time.time()}))
        pipe.ltrim(self.keys.errors, 0, ERRORS_CAP - 1)
        pipe.hincrby(self.keys.counts, "errors", 1)
        pipe.execute()

    def record_unreadable(self, index: int, sample_id: str, reason: str) -> int:
        """A stored sample the trainer could not read: counted once however often a training meets it (a resumed
        training, another process), its error kept among the run's errors (given up: ``final``) for ``/status``.
        Returns how many of the run's samples are unreadable so far."""
        pipe = self.redis.pipeline()
        pipe.sadd(self.keys.unreadable, index)
        pipe.scard(self.keys.unreadable)
        added, count = pipe.execute()
        if added:
            self.record_error(index, sample_id, reason, worker="trainer", final=True)
            self.update_train(TrainProgress(unreadable_samples=int(count)))
        return int(count)

    def counts(self) -> ExtractionCounts:
        return ExtractionCounts.from_redis(self.redis.hgetall(self.keys.counts))
