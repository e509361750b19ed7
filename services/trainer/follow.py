"""The trainer service: trains each run's drafter as soon as its extraction is complete, with no one at the keys.

    python -m eaglet.services.trainer.follow

It looks at the runs (``keys.RUNS``, oldest first) every few seconds. A run whose stage is ``extracted`` is
claimed with a Redis lock (SET NX with a TTL that this loop renews while the training runs), so several
trainer replicas never train one run twice, and trained by ``python -m eaglet.services.trainer.main --run RUN``
in a child process (``torchrun --standalone --nproc-per-node M`` when ``EAGLET_TRAIN_GPUS`` is M > 0 GPUs, or a
list of M GPUs, which the child then sees as ``CUDA_VISIBLE_DEVICES``; each process checks its GPU against those
the inference service released, see shared/gpus.py).
A run left in ``waiting_for_gpus``, ``training`` or ``evaluating`` whose lock has expired lost its trainer
(a killed container, an OOM kill): it is claimed again and resumes from its newest checkpoint, at most
``EAGLET_TRAIN_MAX_ATTEMPTS`` times in all; one the trainer left to the evaluation service (``eval_request``,
services/trainer/evaluator.py) is that service's.
"""

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import Field, field_validator
from redis import Redis
from redis.exceptions import RedisError

from eaglet.shared import keys
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.gpus import parse_train_gpus
from eaglet.shared.keys import RunKeys
from eaglet.shared.logs import setup_logging
from eaglet.shared.records import TRAINER_STAGES
from eaglet.shared.runstate import RunState, Stage

log = logging.getLogger(__name__)

CLAIMABLE = TRAINER_STAGES | {Stage.extracted}

# Renew or drop the lock only while it is still ours: after an expiry another replica may hold it.
RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class FollowSettings(Settings):
    train_gpus: str = "0"
    """Trainer processes (one per GPU) through torchrun: a number M (the first M GPUs) or a list of GPUs
    (``4,5,6,7``; one GPU: ``3,``); 0 trains in one plain process (CPU). After a GPU release they must be among
    the GPUs the inference server held."""

    @field_validator("train_gpus")
    @classmethod
    def _train_gpus(cls, value: str) -> str:
        parse_train_gpus(value)  # ValueError naming EAGLET_TRAIN_GPUS and what it takes
        return value

    train_args: str = ""
    """More ``eaglet.services.trainer.main`` options, shell-quoted, e.g. ``--epochs 2 --tokens-per-batch 16384``."""

    eval_prompts: str = ""
    """A JSONL of held-out prompts: evaluate each drafter's acceptance length after training. Empty: no evaluation."""

    follow_poll_s: float = Field(5.0, gt=0)
    """Seconds between looks at the runs."""

    train_lock_ttl_s: float = Field(60.0, gt=0)
    """A replica that stops renewing its lock for this long is taken for dead and its run is resumed."""

    train_max_attempts: int = Field(3, ge=1)
    """Trainings started for one run, resumptions included, before this loop leaves it alone."""

    follow_alive_file: Path | None = None
    """Touched on every turn of the loop (and while a training runs): the container's healthcheck reads it."""


def trainer_command(settings: FollowSettings, run_id: str) -> list[str]:
    args = ["-m", "eaglet.services.trainer.main", "--run-id", run_id]  # torchrun would take --run for its --run-path
    if settings.release_gpus_when_done:
        args.append("--wait-for-gpus")
    if settings.eval_prompts:
        args += ["--eval-prompts", settings.eval_prompts]
    args += shlex.split(settings.train_args)
    processes, _ = parse_train_gpus(settings.train_gpus)
    if processes > 0:
        return ["torchrun", "--standalone", "--nproc-per-node", str(processes), *args]
    return [sys.executable, *args]


def trainer_env(settings: FollowSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """The trainer's environment: ours, with the GPUs ``EAGLET_TRAIN_GPUS`` lists as its visible devices."""
    _, gpus = parse_train_gpus(settings.train_gpus)
    return {**environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else dict(environ)


def next_run(redis: Redis, settings: FollowSettings, owner: str) -> str | None:
    """Claims the oldest run that needs a trainer, if any, and returns its id."""
    for run_id in redis.zrange(keys.RUNS, 0, -1):
        state = RunState(redis, run_id)
        if state.stage() not in CLAIMABLE or (state.train().follow_attempts or 0) >= settings.train_max_attempts:
            continue
        if state.stage() == Stage.evaluating and state.meta().eval_request:  # trained: the evaluation service's now
            continue
        ttl_ms = int(settings.train_lock_ttl_s * 1000)
        if redis.set(RunKeys(run_id).train_lock, owner, nx=True, px=ttl_ms):
            return run_id
    return None


def train_run(redis: Redis, settings: FollowSettings, run_id: str, owner: str, stopping: threading.Event) -> int:
    """Runs the trainer for ``run_id`` to its end, renewing the lock meanwhile; returns its exit code."""
    state = RunState(redis, run_id)
    attempt = state.add_train_attempt()
    command = trainer_command(settings, run_id)
    log.info("run %s: training, attempt %d: %s", run_id, attempt, shlex.join(command))
    proc = subprocess.Popen(command, env=trainer_env(settings, os.environ))
    ttl_ms = int(settings.train_lock_ttl_s * 1000)
    renew_s = settings.train_lock_ttl_s / 4
    signalled = False
    try:
        while True:
            try:
                rc = proc.wait(renew_s)
                break
            except subprocess.TimeoutExpired:
                pass
            touch(settings.follow_alive_file)
            if stopping.is_set() and not signalled:
                # The container is stopping: the next trainer resumes from the checkpoint; not a failed attempt.
                proc.send_signal(signal.SIGTERM)
                state.add_train_attempt(-1)
                signalled = True
            try:
                if not redis.eval(RENEW, 1, RunKeys(run_id).train_lock, owner, ttl_ms):
                    log.warning("run %s: lost the training lock (expired); training on", run_id)
            except RedisError:  # Redis restarting: the training goes on; renew next time
                log.warning("run %s: could not renew the training lock", run_id, exc_info=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        redis.eval(UNLOCK, 1, RunKeys(run_id).train_lock, owner)
    log.info("run %s: trainer exited with %d (stage %s)", run_id, rc, state.stage())
    return rc


def touch(path: Path | None) -> None:
    if path is not None:
        path.touch()


def follow_runs(
    what: str, claim: Callable[[str], str | None], work: Callable[[str, str, threading.Event], bool],
    alive_file: Path | None, poll_s: float,
) -> int:  # fmt: skip
    """A service's loop until SIGTERM: ``claim(owner)`` a run (its id, or None), ``work(run, owner, stopping)`` on
    it (False: it failed, and the loop waits a turn rather than retry in a tight loop)."""
    owner = f"{socket.gethostname()}:{os.getpid()}"
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    log.info("%s: following the runs; %s", owner, what)
    while not stopping.is_set():
        touch(alive_file)
        try:
            run_id = claim(owner)
        except RedisError:  # Redis restarting: look again next time
            log.warning("%s: could not read the runs", owner, exc_info=True)
            run_id = None
        if run_id is None or not work(run_id, owner, stopping):
            stopping.wait(poll_s)
    return 0


def main() -> int:
    settings = FollowSettings()
    setup_logging()
    redis = connect(settings.redis_url)
    return follow_runs(
        f"training with {shlex.join(trainer_command(settings, 'RUN'))}",
        lambda owner: next_run(redis, settings, owner),
        lambda run, owner, stopping: train_run(redis, settings, run, owner, stopping) == 0,
        settings.follow_alive_file, settings.follow_poll_s,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
