"""A run's figures over time, in bounded memory: one capped series per run and kind, in Redis.

A series holds at most ``SERIES_CAP`` points, whatever the run's length. A point is written only when it falls in a
later bucket of the series' interval than the newest one; when a write makes the series one point too long, every
other point is dropped and the interval doubles (or widens to the spacing of the points kept, if they were
sparser), in the same Lua script. So the whole run stays visible, from its first point to its newest, at a
resolution that halves as it grows: a 10-hour extraction sampled every 2 s keeps a point every 2-4 minutes.

    extraction   ExtractionPoint by unix time: the figures ``read_status`` computes, recorded by the gateway
                 (services/gateway/recorder.py) while the run ingests or extracts, and once when it ends
    training     TrainPoint by optimizer step: the trainer's progress report, recorded where it is written

A series can be closed: its final point (extraction complete, the last training step) is written whatever the
interval, once; an ordinary write opens it again (a reopened extraction, a resumed training).
"""

from pydantic import BaseModel, Field
from redis import Redis

from . import keys
from .keys import RunKeys
from .records import EvalResult, WorkerRole
from .statusreport import RunStatus, WorkerStatus

SERIES_CAP = 256
"""Points a series keeps at most (even: the newest point survives a halving)."""

# KEYS: points meta; ARGV: x point cap base_interval close
# Returns 1 if the point was written, 0 if it fell in the bucket of the newest point (or the series is closed).
APPEND = """
local x = tonumber(ARGV[1])
local cap = tonumber(ARGV[3])
local interval = tonumber(redis.call('HGET', KEYS[2], 'interval') or ARGV[4])
local last = tonumber(redis.call('HGET', KEYS[2], 'last') or '')
if ARGV[5] == '1' then
  if redis.call('HEXISTS', KEYS[2], 'closed') == 1 or (last and x <= last) then return 0 end
  redis.call('HSET', KEYS[2], 'closed', 1)
else
  if last and math.floor(x / interval) <= math.floor(last / interval) then return 0 end
  redis.call('HDEL', KEYS[2], 'closed')
end
if not last then redis.call('HSET', KEYS[2], 'first', ARGV[1], 'interval', interval) end
redis.call('HSET', KEYS[2], 'last', ARGV[1])
if redis.call('RPUSH', KEYS[1], ARGV[2]) > cap then
  local points = redis.call('LRANGE', KEYS[1], 0, -1)
  local kept = {}
  for i = 1, #points, 2 do kept[#kept + 1] = points[i] end
  redis.call('DEL', KEYS[1])
  redis.call('RPUSH', KEYS[1], unpack(kept))
  local first = tonumber(redis.call('HGET', KEYS[2], 'first'))
  redis.call('HSET', KEYS[2], 'interval', tostring(math.max(2 * interval, 2 * (x - first) / cap)))
end
return 1
"""


class ExtractionPoint(BaseModel):
    """The extraction figures of ``/status`` at ``t``, as ``read_status`` computed them then."""

    t: float = Field(description="Unix time of the figures")
    done: int
    failed: int
    total: int | None
    samples_per_s: float
    tokens_per_s: float
    bytes_written: int
    projected_total_bytes: int | None
    stage_seconds: dict[str, float] = Field(
        description="Mean over the run's live extractor workers (and idle ones) of their stage seconds: prefill "
        "(waiting on the inference server), dump_wait, check, store; empty before any has stored a sample"
    )


class TrainPoint(BaseModel):
    """The trainer's progress report at ``step``: the figures of the run's training record then."""

    step: int
    t: float
    loss: float
    acc: list[float] = Field(description="Top-1 accuracy of each draft position")
    tokens_per_s: float


class SeriesState(BaseModel):
    interval: float | None = Field(description="Spacing the series keeps now (seconds, or steps); null when empty")
    closed: bool = Field(description="The final point is written (until the series is written again)")


class ExtractionSeries(SeriesState):
    points: list[ExtractionPoint] = Field(description="Oldest first")


class TrainSeries(SeriesState):
    points: list[TrainPoint] = Field(description="Oldest first")


class Acceptance(BaseModel):
    state: str | None = Field(description="The evaluation's state: running, done, failed; null before one started")
    accept_length: float | None
    accept_rate: list[float] | None = Field(description="Acceptance rate of each draft position")


class RunSeries(BaseModel):
    run_id: str
    extraction: ExtractionSeries
    training: TrainSeries
    evaluation: Acceptance


class Series:
    """Writes one capped series of one run. Takes its Redis connection (``decode_responses=True``)."""

    def __init__(self, redis: Redis, points_key: str, meta_key: str, base_interval: float, cap: int = SERIES_CAP):
        if cap < 2 or cap % 2:
            raise ValueError(f"series cap {cap}: give an even number >= 2")
        if base_interval <= 0:
            raise ValueError(f"series interval {base_interval}: must be > 0")
        self.points_key, self.meta_key = points_key, meta_key
        self.base_interval, self.cap = base_interval, cap
        self._append = redis.register_script(APPEND)

    def append(self, x: float, point: BaseModel, *, close: bool = False) -> bool:
        """Writes ``point`` at ``x`` if it starts a new bucket of the interval, or, with ``close``, as the final
        point; True if written."""
        args = [repr(float(x)), point.model_dump_json(), self.cap, self.base_interval, int(close)]
        return bool(self._append(keys=[self.points_key, self.meta_key], args=args))


def extraction_series(redis: Redis, run_id: str, interval_s: float, cap: int = SERIES_CAP) -> Series:
    k = RunKeys(run_id)
    return Series(redis, k.extraction_series, k.extraction_series_meta, interval_s, cap)


def train_series(redis: Redis, run_id: str, cap: int = SERIES_CAP) -> Series:
    """By optimizer step; the base interval of one step keeps every report until the series is full."""
    k = RunKeys(run_id)
    return Series(redis, k.train_series, k.train_series_meta, 1, cap)


def read_series(redis: Redis, run_id: str) -> RunSeries | None:
    """Both series of the run and its evaluation's acceptance, in one round trip; None if no such run."""
    k = RunKeys(run_id)
    pipe = redis.pipeline(transaction=False)
    pipe.zscore(keys.RUNS, run_id)
    for key in (k.extraction_series, k.train_series):
        pipe.lrange(key, 0, -1)
    for key in (k.extraction_series_meta, k.train_series_meta, k.eval):
        pipe.hgetall(key)
    registered, extraction, training, extraction_meta, train_meta, raw_eval = pipe.execute()
    if registered is None:
        return None
    result = EvalResult.from_redis(raw_eval)
    return RunSeries(
        run_id=run_id,
        extraction=ExtractionSeries(
            **_state(extraction_meta), points=[ExtractionPoint.model_validate_json(p) for p in extraction]
        ),
        training=TrainSeries(**_state(train_meta), points=[TrainPoint.model_validate_json(p) for p in training]),
        evaluation=Acceptance(state=result.state, accept_length=result.accept_length, accept_rate=result.accept_rate),
    )


def _state(meta: dict[str, str]) -> dict:
    return {"interval": float(meta["interval"]) if "interval" in meta else None, "closed": "closed" in meta}


def extraction_point(run: RunStatus, workers: list[WorkerStatus], now: float) -> ExtractionPoint:
    """The point of ``run`` from its ``/status`` figures computed at ``now``."""
    ex, st = run.extraction, run.storage
    return ExtractionPoint(
        t=now,
        done=ex.done,
        failed=ex.failed,
        total=ex.total,
        samples_per_s=ex.samples_per_s,
        tokens_per_s=ex.tokens_per_s,
        bytes_written=st.bytes_written,
        projected_total_bytes=st.projected_total_bytes,
        stage_seconds=mean_stage_seconds(run.run_id, workers),
    )


def mean_stage_seconds(run_id: str, workers: list[WorkerStatus]) -> dict[str, float]:
    """Each stage's seconds averaged over the live extractor workers on the run, or idle, that have stored a
    sample (as the alerts count a run's workers)."""
    rows = [w.stage_seconds for w in workers
            if w.role == WorkerRole.extractor and not w.lost and w.run in ("", run_id) and w.stage_seconds]  # fmt: skip
    stages = sorted({s for row in rows for s in row})
    return {s: sum(row.get(s, 0.0) for row in rows) / len(rows) for s in stages}
