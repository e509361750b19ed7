"""Trainer entry point: waits for the run's extraction to complete (and, if asked, for the inference service to
release its GPUs), then trains the drafter.

    python -m eaglet.services.trainer.main --run RUN [options]
    torchrun --nproc-per-node 8 -m eaglet.services.trainer.main --run RUN [options]

It never trains on a partial run unless ``--allow-partial`` is given. GPU release is signalled by the field
``gpus_released`` (unix s) in the run's meta hash, set by whoever stops the inference service.
"""

import argparse
import logging
import os
import socket
import threading
import time
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from eaglet.services.trainer.train import Dist, TrainConfig, init_distributed, train
from eaglet.shared.config import Settings
from eaglet.shared.keys import RunKeys
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.target import resolve_model_dir

log = logging.getLogger(__name__)

GPUS_RELEASED = "gpus_released"


class RunCancelled(RuntimeError):
    """The run was cancelled while the trainer waited or trained."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="eaglet train", description="Train the EAGLE-3 drafter of a run.")
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--allow-partial", action="store_true", help="train on the samples extracted so far, not waiting")
    p.add_argument("--wait-for-gpus", action="store_true", help="also wait for the run's gpus_released flag")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between checks of the flags")
    p.add_argument("--model", help="target model directory (default: the run's model_dir, else EAGLET_MODEL)")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    p.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="0: the epochs decide")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="padded tokens per batch per process")
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--workers", type=int, default=d.workers, help="DataLoader processes (0: none)")
    p.add_argument("--attention", default=d.attention, choices=["auto", "math", "flex"])
    p.add_argument("--oov-mask", default=d.oov_mask, choices=["auto", "on", "off"])
    p.add_argument("--eval-prompts", type=Path, help="JSONL of held-out prompts: run `eaglet eval` after training")
    p.add_argument("--eval-k", type=int, default=4, help="draft tokens per round in the evaluation")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--eval-num-prompts", type=int, default=0, help="0: all")
    return p.parse_args(argv)


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size, epochs=args.epochs,
        max_steps=args.max_steps, max_tokens=args.max_tokens, max_len=args.max_len, lr=args.lr,
        warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip, checkpoint_every=args.checkpoint_every,
        heldout_fraction=args.heldout_fraction, seed=args.seed, workers=args.workers,
        attention=args.attention, oov_mask=args.oov_mask,
    )  # fmt: skip


def wait_for_start(
    redis: Redis, run_id: str, *, allow_partial: bool, wait_for_gpus: bool, poll_s: float, announce: bool
) -> None:
    """Blocks until the run's ``extraction_complete`` flag is set (and ``gpus_released`` if asked)."""
    state = RunState(redis, run_id)
    waits = [("extraction_complete", not allow_partial), (GPUS_RELEASED, wait_for_gpus)]
    for flag, needed in waits:
        last_log = 0.0
        while needed and not redis.hexists(RunKeys(run_id).meta, flag):
            if state.exists() and state.is_cancelled():
                raise RunCancelled(f"run {run_id} was cancelled")
            if flag == GPUS_RELEASED and announce and state.stage() != Stage.waiting_for_gpus:
                state.set_stage(Stage.waiting_for_gpus)
                redis.hset(RunKeys(run_id).train, mapping={"state": "waiting", "waiting_for": flag})
            if time.time() - last_log > 30:
                log.info("run %s: waiting for %s", run_id, describe_wait(redis, run_id, flag))
                last_log = time.time()
            time.sleep(poll_s)


def describe_wait(redis: Redis, run_id: str, flag: str) -> str:
    if flag == GPUS_RELEASED:
        return f"the inference service to release its GPUs (field {GPUS_RELEASED} in {RunKeys(run_id).meta})"
    meta, counts = redis.hgetall(RunKeys(run_id).meta), redis.hgetall(RunKeys(run_id).counts)
    if not meta:
        return f"the run to be created (no {RunKeys(run_id).meta}); --allow-partial does not help here"
    return (
        f"extraction to complete: {counts.get('done', 0)} done, {counts.get('failed', 0)} failed of "
        f"{meta.get('total', '?')} samples (stage {meta.get('stage')}); --allow-partial trains on what exists"
    )


def heartbeat(redis: Redis, run_id: str, interval_s: float, stop: threading.Event) -> None:
    """Beats in the run's train hash (``beat_at``) until stopped: a trainer that dies or hangs mid-run shows in
    ``/status`` as the ``trainer_lost`` alert, not as a run training forever."""
    key = RunKeys(run_id).train
    while not stop.is_set():
        try:
            redis.hset(key, mapping={"beat_at": time.time(), "host": socket.gethostname(), "pid": os.getpid()})
        except RedisError:
            log.warning("run %s: trainer heartbeat failed (Redis unreachable)", run_id)
        stop.wait(interval_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = train_config(args)  # bad values fail here, before any waiting
    env: Dist = init_distributed()
    logging.basicConfig(
        level=logging.INFO if env.main else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = Settings()
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    state = RunState(redis, args.run)
    stop_beat = threading.Event()
    if env.main:
        beat = threading.Thread(target=heartbeat, args=(redis, args.run, settings.heartbeat_interval_s, stop_beat),
                                daemon=True, name="heartbeat")  # fmt: skip
        beat.start()
    try:
        wait_for_start(
            redis, args.run, allow_partial=args.allow_partial, wait_for_gpus=args.wait_for_gpus,
            poll_s=args.poll_s, announce=env.main,
        )  # fmt: skip
        model = args.model or state.meta().get("model_dir") or settings.model
        target_dir = resolve_model_dir(model, settings.model_cache_dir)
        if env.main:
            state.set_stage(Stage.training)
        train(redis=redis, run_id=args.run, data_dir=settings.data_dir, target_dir=target_dir, cfg=cfg, env=env)
        if args.eval_prompts is not None and env.main:
            from eaglet.services.trainer.evaluate import evaluate_run

            state.set_stage(Stage.evaluating)
            evaluate_run(
                redis=redis, run_id=args.run, data_dir=settings.data_dir, target_dir=target_dir,
                prompts=args.eval_prompts, k=args.eval_k, max_new_tokens=args.eval_max_new_tokens,
                num_prompts=args.eval_num_prompts,
            )  # fmt: skip
        if env.main:
            redis.hset(RunKeys(args.run).train, "state", "done")
            state.set_stage(Stage.done)
        return 0
    except RunCancelled as e:
        log.warning("run %s: %s; not training", args.run, e)
        return 1
    except KeyboardInterrupt:
        log.warning("run %s: interrupted; the newest checkpoint resumes it", args.run)
        return 130
    except Exception as e:
        log.error("run %s: training failed", args.run, exc_info=True)
        if env.main:
            redis.hset(RunKeys(args.run).train, mapping={"state": "failed", "error": f"{type(e).__name__}: {e}"})
            state.set_stage(Stage.failed)
        return 1
    finally:
        stop_beat.set()


if __name__ == "__main__":
    raise SystemExit(main())
