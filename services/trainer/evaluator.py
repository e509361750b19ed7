"""What follows training: the drafter chosen among the kept epochs (``--select-by``) and evaluated in the run's
engine, by the trainer itself or by the evaluation service.

    python -m eaglet.services.trainer.evaluator

The trainer's image has no SGLang; the inference image has it. So with ``EAGLET_EVAL_SERVICE`` the trainer, once
trained, leaves the rest to this service (compose's gpu profile runs it in the inference image, on the GPUs the
trainer has just given up): it writes what it would have done as the run's ``eval_request`` and the run waits in
``evaluating``. This loop claims such a run with a Redis lock (SET NX with a TTL renewed while it works, as the
trainer service's), beats the run's trainer heartbeat meanwhile (the stage's owner is alive), chooses and evaluates,
and finishes the run, or fails it with the reason. A run whose evaluator died is claimed again once its lock
expires, at most ``EAGLET_EVAL_MAX_ATTEMPTS`` times. SIGTERM stops an evaluation where it is (its SGLang servers
with it) and gives the run back at once, uncounted: a stopped container's run is the next evaluator's.
"""

import json
import logging
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import Field
from redis import Redis
from redis.exceptions import RedisError

from eaglet.services.trainer import selection
from eaglet.services.trainer.evaluate import EvalSettings, evaluate_run, positions, served_config
from eaglet.services.trainer.follow import RENEW, UNLOCK, follow_runs, touch
from eaglet.shared import keys
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.keys import RunKeys
from eaglet.shared.logs import setup_logging
from eaglet.shared.records import TrainProgress
from eaglet.shared.runoptions import RunOptions, SelectBy
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.store import drafter_dir
from eaglet.shared.target import resolve_model_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalRequest:
    """What follows training, as ``eaglet train`` was asked: held-out prompts (None: no evaluation), the reference
    engine's draft tokens a round, the decoding's length and prompt count, the checkpoint choice."""

    prompts: str | None
    k: int = 4
    max_new_tokens: int = 128
    num_prompts: int = 0
    select_by: SelectBy = "last"
    top: int = 2

    @property
    def wanted(self) -> bool:
        return self.prompts is not None or self.select_by != "last"


def after_training(state: RunState, settings: Settings, target_dir: Path, request: EvalRequest) -> None:
    """The drafter chosen among the kept epochs, exported, then evaluated in the run's ``eval_engine``."""
    engine = (state.meta().options or RunOptions()).eval_engine
    served = served_config(EvalSettings()) if engine == "sglang" else None
    evaluation = dict(
        data_dir=settings.data_dir, target_dir=target_dir, k=request.k, max_new_tokens=request.max_new_tokens,
        num_prompts=request.num_prompts, served=served,
    )  # fmt: skip
    drafter = drafter_dir(settings.data_dir, state.run_id)
    prompts = Path(request.prompts) if request.prompts is not None else None
    decoded: dict[str, dict] = {}  # each served candidate's figures, by its folder
    winner = None
    if request.select_by != "last":

        def serve(folder: Path) -> float | None:  # a candidate decoded, no record written: the winner's comes next
            assert prompts is not None  # --select-by served is refused without prompts
            figures = evaluate_run(redis=None, run_id=state.run_id, prompts=prompts, drafter_path=folder, **evaluation)
            decoded[str(folder)] = figures
            return figures["accept_length"]

        report = selection.select(state, drafter.parent, drafter, request.select_by, request.top,
                                  positions(drafter, request.k, served), serve)  # fmt: skip
        winner = next(c["drafter"] for c in report["candidates"] if c["epoch"] == report["chosen_epoch"])
    if prompts is not None:
        state.start_evaluating()
        # the served winner was decoded on these prompts already: its figures are recorded, not decoded again
        evaluate_run(redis=state.redis, run_id=state.run_id, prompts=prompts, decoded=decoded.get(winner or ""),
                     **evaluation)  # fmt: skip


class EvaluatorSettings(EvalSettings):
    eval_poll_s: float = Field(5.0, gt=0)
    """Seconds between looks at the runs."""

    eval_lock_ttl_s: float = Field(60.0, gt=0)
    """An evaluator that stops renewing its lock for this long is taken for dead and its run is claimed again."""

    eval_max_attempts: int = Field(3, ge=1)
    """Evaluations started for one run before this loop leaves it alone."""

    eval_alive_file: Path | None = None
    """Touched on every turn of the loop and while an evaluation runs: the container's healthcheck reads it."""


def next_run(redis: Redis, settings: EvaluatorSettings, owner: str) -> str | None:
    """Claims the oldest run waiting for the evaluation service, if any, and returns its id."""
    for run_id in redis.zrange(keys.RUNS, 0, -1):
        state = RunState(redis, run_id)
        if state.stage() != Stage.evaluating:
            continue
        meta = state.meta()
        if not meta.eval_request:
            continue
        lock = RunKeys(run_id).eval_lock
        if (meta.eval_attempts or 0) >= settings.eval_max_attempts:
            if not redis.exists(lock):  # the last evaluator died too: the run fails rather than waits forever
                state.fail(f"evaluation: {meta.eval_attempts} evaluators claimed the run and none finished it "
                           f"(EAGLET_EVAL_MAX_ATTEMPTS={settings.eval_max_attempts}); their logs say why")  # fmt: skip
            continue
        if redis.set(lock, owner, nx=True, px=int(settings.eval_lock_ttl_s * 1000)):
            return run_id
    return None


class Stopped(BaseException):
    """SIGTERM during an evaluation: a BaseException, so no ``except Exception`` on the way takes it for a failure."""


def evaluate_claimed(
    redis: Redis, settings: EvaluatorSettings, run_id: str, owner: str, stopping: threading.Event | None = None
) -> bool:
    """Chooses and evaluates the claimed run's drafter and finishes the run (True), or fails it with the reason;
    on SIGTERM (in the main thread) it stops, sets ``stopping`` and gives the run back as it found it."""
    state = RunState(redis, run_id)
    attempt = state.add_eval_attempt()
    done = threading.Event()

    def stop(*_) -> None:
        raise Stopped

    # the evaluation unwinds (each `serving` stops its server on the way out); the service loop then ends
    earlier = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None

    def hold() -> None:  # the lock renewed and the stage's heartbeat beaten until the work ends
        ttl_ms = int(settings.eval_lock_ttl_s * 1000)
        while not done.wait(min(settings.eval_lock_ttl_s / 4, settings.heartbeat_interval_s)):
            touch(settings.eval_alive_file)
            try:
                if not redis.eval(RENEW, 1, RunKeys(run_id).eval_lock, owner, ttl_ms):
                    log.warning("run %s: lost the evaluation lock (expired); evaluating on", run_id)
                state.update_train(TrainProgress(beat_at=time.time()))
            except RedisError:  # Redis restarting: renew next time
                log.warning("run %s: could not renew the evaluation lock", run_id, exc_info=True)

    holder = threading.Thread(target=hold, daemon=True, name="eval-lock")
    holder.start()
    try:
        meta = state.meta()
        request = EvalRequest(**json.loads(meta.eval_request or "{}"))
        log.info("run %s: evaluating, attempt %d: %s", run_id, attempt, asdict(request))
        model = meta.model_dir or settings.model
        after_training(state, settings, resolve_model_dir(model, settings.model_cache_dir), request)
        state.finish()
        return True
    except Stopped:
        log.warning("run %s: stopped (SIGTERM) during the evaluation; the run goes back to the evaluation service",
                    run_id)  # fmt: skip
        state.add_eval_attempt(-1)
        if stopping is not None:
            stopping.set()
        return True
    except Exception as e:
        log.error("run %s: evaluation failed", run_id, exc_info=True)
        state.fail(f"evaluation: {type(e).__name__}: {e}")
        return False
    finally:
        if earlier is not None:
            signal.signal(signal.SIGTERM, earlier)
        done.set()
        holder.join(10)
        redis.eval(UNLOCK, 1, RunKeys(run_id).eval_lock, owner)


def main() -> int:
    settings = EvaluatorSettings()
    setup_logging()
    redis = connect(settings.redis_url)
    return follow_runs(
        "evaluating those the trainers leave to this service",
        lambda owner: next_run(redis, settings, owner),
        lambda run, owner, stopping: evaluate_claimed(redis, settings, run, owner, stopping),
        settings.eval_alive_file, settings.eval_poll_s,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
