"""Trainer entry point: waits for the run's extraction to complete (and, if asked, for the inference service to
release its GPUs), then trains the drafter.

    python -m eaglet.services.trainer.main --run RUN [options]
    torchrun --nproc-per-node 8 -m eaglet.services.trainer.main --run-id RUN [options]

It never trains on a partial run unless ``--allow-partial`` is given. GPU release is signalled by the field
``gpus_released`` (unix s) in the run's meta hash, set by whoever stops the inference service. No process touches
a GPU before that; then each checks that the GPUs it would use are among those the server released
(``released_gpus``): a trainer of M processes takes M of the N GPUs extraction ran on.
"""

import argparse
import ast
import contextlib
import dataclasses
import inspect
import itertools
import json
import logging
import os
import socket
import textwrap
import threading
import time
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import torch.distributed as dist
from redis.exceptions import RedisError

from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist, init_distributed
from eaglet.services.trainer.evaluate import EvalSettings
from eaglet.services.trainer.evaluator import EvalRequest, after_training
from eaglet.services.trainer.preemption import Preempted
from eaglet.services.trainer.train import train
from eaglet.shared import gpustats
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.gpus import SETTING, GpuHandoffError, check_handoff, cuda_devices, visible_gpus
from eaglet.shared.logs import setup_logging
from eaglet.shared.records import GPUS_RELEASED, LOST_AFTER_BEATS, GpuRole, TrainProgress
from eaglet.shared.runoptions import RunOptions, SelectBy
from eaglet.shared.runstate import RunState, StageRefused
from eaglet.shared.target import resolve_model_dir

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

Config = typing.TypeVar("Config", bound="DataclassInstance")


class RunCancelled(RuntimeError):
    """The run was cancelled while the trainer waited or trained."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eaglet train", description="Train the EAGLE-3 drafter of a run.")
    # torchrun reads an abbreviated --run as its own --run-path and stops: behind torchrun the id is --run-id
    p.add_argument("--run", "--run-id", dest="run", required=True, help="run id (--run-id behind torchrun)")
    p.add_argument("--allow-partial", action="store_true", help="train on the samples extracted so far, not waiting")
    p.add_argument("--wait-for-gpus", action="store_true", help=f"also wait for the run's {GPUS_RELEASED} flag")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between checks of the flags")
    p.add_argument("--model", help="target model directory (default: the run's model_dir, else EAGLET_MODEL)")
    add_config_flags(p, TrainConfig)
    p.add_argument("--eval-prompts", type=Path, help="JSONL of held-out prompts: run `eaglet eval` after training")
    p.add_argument("--eval-k", type=int, default=4, help="draft tokens per round in the evaluation")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--eval-num-prompts", type=int, default=0, help="0: all")
    p.add_argument("--select-by", choices=get_args(SelectBy),
                   help="the drafter exported: the last epoch's, the best predicted from held-out accuracy, or the "
                   "best served of --select-top (default: the run's select_by option, else last)")  # fmt: skip
    p.add_argument("--select-top", type=int, help="epochs serve-tested by --select-by served (default: the run's "
                   "select_top option, 2)")  # fmt: skip
    return p


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the config dataclass ``cls``: ``--field-name``, of the field's type and default, its
    docstring as help. A bool is ``--name``/``--no-name``; a ``Literal`` gives the choices."""
    docs, types, defaults = field_docs(cls), typing.get_type_hints(cls), cls()
    for f in dataclasses.fields(cls):
        kind = {"default": getattr(defaults, f.name), "help": docs[f.name].replace("%", "%%")}  # help is %-formatted
        if types[f.name] is bool:
            kind["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(types[f.name]) is typing.Literal:
            kind["choices"] = typing.get_args(types[f.name])
        else:
            kind["type"] = types[f.name]
        parser.add_argument("--" + f.name.replace("_", "-"), **kind)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, whitespace folded: the string right after the field."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef), f"{cls.__name__}: not defined by a class statement"
    body = node.body
    return {
        field.target.id: " ".join(doc.value.value.split())
        for field, doc in itertools.pairwise(body)
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    }  # fmt: skip


def config_from_args(cls: type[Config], args: argparse.Namespace) -> Config:
    """The config dataclass ``cls`` from the flags ``add_config_flags`` made; its checks run here."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def wait_for_start(state: RunState, *, allow_partial: bool, wait_for_gpus: bool, poll_s: float, announce: bool) -> None:
    """Blocks until the run's extraction is complete (unless ``allow_partial``), then, if asked, until the inference
    service has released its GPUs; the run shows ``waiting_for_gpus`` meanwhile when ``announce``."""
    if not allow_partial:
        wait_until(state, state.extraction_complete, lambda: describe_extraction(state), poll_s)
    if wait_for_gpus and not state.gpus_released():
        if announce:
            state.wait_for_gpus()
        gpus = f"the inference service to release its GPUs (field {GPUS_RELEASED} in {state.keys.meta})"
        wait_until(state, state.gpus_released, lambda: gpus, poll_s)


def wait_until(state: RunState, ready: Callable[[], bool], waiting_for: Callable[[], str], poll_s: float) -> None:
    """Polls ``ready`` every ``poll_s`` seconds, saying what it waits for every 30 s; RunCancelled if cancelled."""
    last_log = 0.0
    while not ready():
        if state.is_cancelled():
            raise RunCancelled(f"run {state.run_id} was cancelled")
        if time.time() - last_log > 30:
            log.info("run %s: waiting for %s", state.run_id, waiting_for())
            last_log = time.time()
        time.sleep(poll_s)


def describe_extraction(state: RunState) -> str:
    if not state.exists():
        return f"the run to be created (no {state.keys.meta}); --allow-partial does not help here"
    meta, counts = state.meta(), state.counts()
    total = "?" if meta.total is None else meta.total
    return (
        f"extraction to complete: {counts.done} done, {counts.failed} failed of {total} samples "
        f"(stage {meta.stage}); --allow-partial trains on what exists"
    )


def check_released_gpus(state: RunState, environ: Mapping[str, str]) -> None:
    """GpuHandoffError unless this host's trainer processes (torchrun's ``LOCAL_WORLD_SIZE``, one GPU each, in
    ``CUDA_VISIBLE_DEVICES`` order) would use GPUs the inference service released. Nothing to check when it
    released none (a server on CPU), or when this host has no GPU (the trainer runs on CPU)."""
    released = state.meta().released_gpus
    if not released:
        return
    local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    visible = visible_gpus(environ) or cuda_devices()
    if not visible:
        return
    where = f"field released_gpus in {state.keys.meta}"
    if len(visible) < local:
        raise GpuHandoffError(
            f"{local} trainer process(es) on this host but {len(visible)} GPU(s) visible ({','.join(visible)}); "
            f"the inference service released {','.join(released)} ({where}); set {SETTING} to at most "
            f"{min(len(visible), len(released))}"
        )
    check_handoff(visible[:local], released, where)


def heartbeat(state: RunState, interval_s: float, stop: threading.Event, host: str) -> None:
    """Beats in the run's train hash (``beat_at``) until stopped: a trainer that dies or hangs mid-run shows in
    ``/status`` as the ``trainer_lost`` alert, not as a run training forever. Each beat also publishes the GPUs of
    this host the trainer uses (NVML takes no GPU memory: reading it before the release is harmless)."""
    reader = gpustats.GpuReader(os.environ)
    with contextlib.suppress(RedisError):  # a report of this host's trainer that died before: gone
        gpustats.prune(state.redis, GpuRole.trainer, host, LOST_AFTER_BEATS * interval_s)

    def beat() -> None:
        state.update_train(TrainProgress(beat_at=time.time(), host=socket.gethostname(), pid=os.getpid()))
        gpustats.publish(state.redis, reader, role=GpuRole.trainer, host=host, run=state.run_id)

    gpustats.beat_until(stop, interval_s, beat, f"run {state.run_id}: trainer heartbeat")
    with contextlib.suppress(RedisError):  # the report ages out of the status by itself
        gpustats.forget(state.redis, GpuRole.trainer, host)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.select_by == "served" and args.eval_prompts is None:
        parser.error("--select-by served decodes each candidate: give --eval-prompts")
    if args.select_top is not None and args.select_top < 1:
        parser.error("--select-top: serve-test at least 1 epoch")
    cfg = config_from_args(TrainConfig, args)  # bad values fail here, before any waiting
    rank0 = int(os.environ.get("RANK", "0")) == 0  # torchrun's rank, read without touching a GPU
    setup_logging(logging.INFO if rank0 else logging.WARNING)
    settings = Settings()
    redis = connect(settings.redis_url)
    state = RunState(redis, args.run)
    stop_beat = threading.Event()
    if rank0:
        beat = threading.Thread(target=heartbeat, daemon=True, name="heartbeat",
                                args=(state, settings.heartbeat_interval_s, stop_beat,
                                      settings.status_host))  # fmt: skip
        beat.start()
    try:
        wait_for_start(
            state, allow_partial=args.allow_partial, wait_for_gpus=args.wait_for_gpus, poll_s=args.poll_s,
            announce=rank0,
        )  # fmt: skip
        if args.wait_for_gpus:
            check_released_gpus(state, os.environ)
        # Only now a GPU is touched: while the inference server runs, even a CUDA context would take its memory.
        env: Dist = init_distributed()
        model = args.model or state.meta().model_dir or settings.model
        target_dir = resolve_model_dir(model, settings.model_cache_dir)
        if env.main:
            state.start_training()
        options = state.meta().options or RunOptions()
        select_by, top = args.select_by or options.select_by, args.select_top or options.select_top
        if select_by == "served" and args.eval_prompts is None:
            raise ValueError("--select-by served decodes each candidate: give --eval-prompts")
        if select_by != "last":
            cfg = dataclasses.replace(cfg, keep_epochs=True)
        train(redis=redis, run_id=args.run, data_dir=settings.data_dir, target_dir=target_dir, cfg=cfg, env=env)
        request = EvalRequest(None if args.eval_prompts is None else str(args.eval_prompts), args.eval_k,
                              args.eval_max_new_tokens, args.eval_num_prompts, select_by, top)  # fmt: skip
        if env.main and request.wanted and EvalSettings().eval_service:  # the evaluator finishes the run
            state.request_evaluation(json.dumps(dataclasses.asdict(request)))
            log.info("run %s: trained; the evaluation service takes it from here", args.run)
        elif env.main:
            if request.wanted:
                after_training(state, settings, target_dir, request)
            state.finish()
        return 0
    except (RunCancelled, StageRefused) as e:
        log.warning("run %s: %s; not training", args.run, e)
        return 1
    except GpuHandoffError as e:
        log.error("run %s: %s", args.run, e)
        if rank0:
            state.fail(str(e))
        return 1
    except KeyboardInterrupt:
        log.warning("run %s: interrupted; the newest checkpoint resumes it", args.run)
        return 130
    except Preempted as e:  # SIGTERM: the run stays in its stage, for a rerun to resume
        log.warning("%s", e)
        return 143
    except Exception as e:
        log.error("run %s: training failed", args.run, exc_info=True)
        if rank0:
            state.fail(f"{type(e).__name__}: {e}")
        return 1
    finally:
        stop_beat.set()
        if rank0:
            beat.join(10)  # its GPU report removed before the process ends
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
