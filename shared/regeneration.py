"""A regeneration's progress in Redis: its batches, and done and failed marks by prompt index.

As for extraction: the marks are bits, so a batch run twice (its worker died) never counts a prompt twice; the mark
that gives the last prompt its outcome sets ``complete`` in the same Lua script. Counters and a capped list of
recent completions give ``/status`` its figures in O(1).
"""

import json
import logging
import time
from dataclasses import asdict, dataclass

from redis import Redis

from .jobqueue import enqueue_batches
from .keys import RunKeys
from .records import RegenCounts
from .runstate import RECENT_CAP

log = logging.getLogger(__name__)
# KEYS: regen done failed recent; ARGV: index outcome tokens_in tokens_out retries now cap
# Returns 0 if the prompt had an outcome already, 1 if counted, 2 if it was the last one.
MARK = """
if redis.call('GETBIT', KEYS[2], ARGV[1]) == 1 or redis.call('GETBIT', KEYS[3], ARGV[1]) == 1 then return 0 end
if ARGV[2] == 'done' then
  redis.call('SETBIT', KEYS[2], ARGV[1], 1)
  redis.call('HINCRBY', KEYS[1], 'done', 1)
  redis.call('HINCRBY', KEYS[1], 'tokens_in', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'tokens_out', ARGV[4])
  redis.call('HSET', KEYS[1], 'last_done_at', ARGV[6])
  redis.call('LPUSH', KEYS[4], ARGV[6] .. ' ' .. ARGV[4] .. ' ' .. ARGV[3])
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[7]) - 1)
else
  redis.call('SETBIT', KEYS[3], ARGV[1], 1)
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
end
redis.call('HINCRBY', KEYS[1], 'retries', ARGV[5])
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '-1')
local n = tonumber(redis.call('HGET', KEYS[1], 'done') or '0') + tonumber(redis.call('HGET', KEYS[1], 'failed') or '0')
if total >= 0 and n >= total then
  redis.call('HSETNX', KEYS[1], 'complete', ARGV[6])
  return 2
end
return 1
"""


@dataclass(frozen=True)
class Batch:
    """A contiguous range of the input's prompts: ``count`` non-blank lines from byte ``offset`` (line ``line``);
    its first prompt is the input's ``prompt``-th (0-based), the index its marks are kept under."""

    offset: int
    line: int
    prompt: int
    count: int


class Progress:
    def __init__(self, redis: Redis, run_id: str):
        self.redis = redis
        self.keys = RunKeys(run_id)
        self._mark = redis.register_script(MARK)

    def planned(self) -> bool:
        return self.redis.hexists(self.keys.regen, "total")

    def plan(self, batches: list[Batch], total: int) -> None:
        """Records the batches, then the total: the total is the commit point (a planner that died before it
        leaves no plan, and the next one starts over)."""
        pipe = self.redis.pipeline()
        pipe.delete(self.keys.regen_batches)
        for start in range(0, len(batches), 1000):
            pipe.rpush(self.keys.regen_batches, *(json.dumps(asdict(b)) for b in batches[start : start + 1000]))
        pipe.hset(self.keys.regen, mapping={"total": total, "batches": len(batches), "started_at": time.time()})
        pipe.execute()

    def batches(self) -> int:
        return self.counts().batches

    def batch(self, n: int) -> Batch:
        return Batch(**json.loads(self.redis.lindex(self.keys.regen_batches, n)))

    def mark(self, index: int, outcome: str, tokens_in: int = 0, tokens_out: int = 0, retries: int = 0) -> int:
        k = self.keys
        return int(
            self._mark(
                keys=[k.regen, k.regen_done, k.regen_failed, k.regen_recent],
                args=[index, outcome, tokens_in, tokens_out, retries, time.time(), RECENT_CAP],
            )
        )

    def has_outcome(self, index: int) -> bool:
        pipe = self.redis.pipeline(transaction=False)
        pipe.getbit(self.keys.regen_done, index)
        pipe.getbit(self.keys.regen_failed, index)
        return any(pipe.execute())

    def finish_batch(self, n: int) -> None:
        self.redis.setbit(self.keys.regen_batch_done, n, 1)

    def unfinished_batches(self) -> list[int]:
        """Batches whose job has not run to its end (one bit per batch: small)."""
        n = self.batches()
        pipe = self.redis.pipeline(transaction=False)
        for b in range(n):
            pipe.getbit(self.keys.regen_batch_done, b)
        return [b for b, bit in enumerate(pipe.execute()) if not bit]

    def record_lost(self, n: int) -> int:
        """The worker running batch ``n`` died; returns how many times that has happened to it."""
        return int(self.redis.hincrby(self.keys.regen_lost, str(n), 1))

    def complete(self) -> bool:
        return self.redis.hexists(self.keys.regen, "complete")

    def counts(self) -> RegenCounts:
        return RegenCounts.from_redis(self.redis.hgetall(self.keys.regen))


def requeue_batch(redis: Redis, rq_redis: Redis, run_id: str, batch: int, why: str, max_lost: int) -> str:
    """A batch whose job died (its worker killed, or the job crashed): queued again, its finished prompts kept; after
    ``max_lost`` deaths its unfinished prompts are given up (recorded failed, with ``why``) by one last job."""
    lost = Progress(redis, run_id).record_lost(batch)
    if lost >= max_lost:
        reason = f"{why}, {lost} times: given up"
        enqueue_batches(rq_redis, run_id, [batch], give_up=reason, attempt=lost)
        log.warning("run %s regeneration batch %d: %s", run_id, batch, reason)
        return "failed"
    enqueue_batches(rq_redis, run_id, [batch], attempt=lost)
    log.warning("run %s regeneration batch %d: %s; queued again", run_id, batch, why)
    return "requeued"
