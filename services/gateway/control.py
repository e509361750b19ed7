"""Run control: start, cancel and retry runs. Takes its Redis connections and plain values, never settings.

RQ pickles its jobs, so it gets a connection of its own that leaves replies as bytes (``queue_redis``);
run state is read and written as text. A run is created and its first job queued by the shared core's
``queue_run`` (shared/runs.py), as ``eaglet regenerate`` and the demo do.
"""

import logging
import secrets
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis import Redis

from eaglet.shared import jobqueue, keys, runs
from eaglet.shared.ids import check_id
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState, Stage

log = logging.getLogger(__name__)

RETRYABLE = (Stage.extracting, Stage.extracted)


class RunNotFound(LookupError):
    """No run of that id is registered."""


class DatasetRefused(ValueError):
    """The dataset path is missing, not a file, or outside every allowed dataset root."""


class WrongStage(ValueError):
    """The run's stage does not allow the action (cancel a finished run, retry one that is training)."""


class StartRun(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(min_length=1, description="A JSONL file under one of the gateway's dataset roots")
    run_id: str | None = Field(None, description="1-128 of [A-Za-z0-9._-]; generated when null")
    options: RunOptions = Field(
        default_factory=RunOptions,
        description="How the dataset is ingested; with 'regenerate', its assistant turns are first written again by "
        "the target (prompts or conversations in, the regenerated conversations ingested in the same run)",
    )

    @field_validator("run_id")
    @classmethod
    def _safe_id(cls, value: str | None) -> str | None:
        return None if value is None else check_id(value, "run id")


class RunStarted(BaseModel):
    run_id: str
    dataset: str
    job_id: str


class Cancellation(BaseModel):
    run_id: str
    stage: Stage
    dropped_jobs: int


class RetryQueued(BaseModel):
    run_id: str
    queued: int


def new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def resolve_dataset(dataset: str, roots: list[Path]) -> Path:
    """The dataset's real path (symlinks resolved), if it is a file under one of ``roots``."""
    path = Path(dataset)
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError, ValueError) as e:  # ValueError: an embedded NUL byte
        raise DatasetRefused(f"dataset {dataset!r}: no such file") from e
    if not real.is_file():
        raise DatasetRefused(f"dataset {dataset!r}: not a file; give a JSONL file")
    if not any(real.is_relative_to(root.resolve()) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise DatasetRefused(f"dataset {dataset!r} is outside the dataset roots ({allowed}): put it under one")
    return real


def start_run(redis: Redis, queue_redis: Redis, *, run_id: str, dataset: Path, options: RunOptions) -> RunStarted:
    """Creates the run (``RunExists`` if the id is taken) and queues its first job (``runs.queue_run``)."""
    job_id = runs.queue_run(redis, queue_redis, run_id=run_id, dataset=dataset, options=options)
    return RunStarted(run_id=run_id, dataset=str(dataset), job_id=job_id)


def _existing(redis: Redis, run_id: str) -> RunState:
    state = RunState(redis, run_id)
    if not state.exists() and redis.zscore(keys.RUNS, run_id) is None:
        raise RunNotFound(f"no run {run_id!r}")
    return state


def cancel_run(redis: Redis, queue_redis: Redis, run_id: str) -> Cancellation:
    """Marks the run cancelled (workers see it and stop) and drops its queued jobs."""
    state = _existing(redis, run_id)
    stage = state.cancel()
    if stage is None:
        raise WrongStage(f"run {run_id!r} is {state.stage()} already: nothing to cancel")
    dropped = jobqueue.cancel(queue_redis, run_id)
    log.info("run %s: cancelled at stage %s, %d queued jobs dropped", run_id, stage, dropped)
    return Cancellation(run_id=run_id, stage=Stage.cancelled, dropped_jobs=dropped)


def retry_failed(redis: Redis, queue_redis: Redis, run_id: str) -> RetryQueued:
    """Makes the failed samples pending again (the run is not complete until they have a new outcome)
    and queues them. Attempt numbers keep counting, so a retry's request ids never repeat an old one."""
    state = _existing(redis, run_id)
    stage = state.stage()
    if stage not in RETRYABLE:
        raise WrongStage(f"run {run_id!r} is {stage}: failed samples are retried while extracting or extracted")
    indexes = jobqueue.failed_indexes(redis, run_id)
    for start in range(0, len(indexes), jobqueue.BATCH):
        if state.reopen_failed(indexes[start : start + jobqueue.BATCH]) < 0:
            raise WrongStage(f"run {run_id!r}: training has started; failed samples can no longer be retried")
    queued = jobqueue.enqueue_samples(queue_redis, run_id, indexes)
    log.info("run %s: %d failed samples queued again", run_id, queued)
    return RetryQueued(run_id=run_id, queued=queued)
