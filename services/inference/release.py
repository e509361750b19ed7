"""The inference service's supervisor: runs the server, and hands its GPUs to the trainer when extraction is over.

    python -m eaglet.services.inference.release                      # the reference server
    python -m eaglet.services.inference.release -- python3 -m eaglet.services.inference.sglang_launch --model-path ...

The server runs as a child process, in a process group of its own. Every heartbeat interval the supervisor
publishes its server's GPUs (utilization and memory, read through NVML: shared/gpustats.py) in
``keys.GPUS``, so ``/status`` shows whether they are busy; "unknown" where there is no NVML. With
``EAGLET_RELEASE_GPUS_WHEN_DONE`` set, the supervisor watches the runs in Redis: once some run's extraction is
complete and waits for the GPUs, and no run is being ingested or extracted any more, it stops the server, records
on each waiting run the GPUs the server could use (``released_gpus``, see shared/gpus.py) and sets the meta
field ``gpus_released`` (unix s), and exits 0. The trainer (``--wait-for-gpus``) starts then. Exit 0 is the signal
to stay down: the container's restart policy is ``on-failure``. A server that dies by itself makes the supervisor
exit non-zero, so the restart policy brings both back.
"""

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial

from pydantic import Field
from redis import Redis
from redis.exceptions import RedisError

from eaglet.shared import gpustats, keys
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.gpus import visible_gpus
from eaglet.shared.logs import setup_logging
from eaglet.shared.records import ACTIVE_STAGES, GpuRole
from eaglet.shared.runstate import RunState, Stage

log = logging.getLogger(__name__)

WAITING = {Stage.extracted, Stage.waiting_for_gpus}


class ReleaseSettings(Settings):
    release_poll_s: float = Field(5.0, gt=0)
    """Seconds between looks at the runs."""

    release_stop_timeout_s: float = Field(60.0, gt=0)
    """How long the server gets to exit after SIGTERM, before SIGKILL."""


def runs_to_release(redis: Redis) -> list[str]:
    """The runs whose extraction is complete and that wait for the GPUs; none while any run still extracts."""
    waiting = []
    for run_id in redis.zrange(keys.RUNS, 0, -1):
        meta = RunState(redis, run_id).meta()
        if meta.stage is None or meta.stage in ACTIVE_STAGES:  # no stage yet: its ingest is queued, and needs us
            return []
        if meta.stage in WAITING and meta.extraction_complete is not None and meta.gpus_released is None:
            waiting.append(run_id)
    return waiting


def release(redis: Redis, run_ids: list[str], now: float, gpus: list[str]) -> None:
    for run_id in run_ids:
        RunState(redis, run_id).release_gpus(now, gpus)
        log.info("run %s: GPUs %s released for training", run_id, ",".join(gpus) or "(none)")


def stop(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM to the server's whole process group (SGLang runs its schedulers as children), then SIGKILL; returns
    once no process of the group is left: a scheduler still exiting still holds its GPU's memory."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("server pid %d: no exit %.0fs after SIGTERM; killing it", proc.pid, timeout)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if not group_gone(proc.pid, timeout):
        log.warning("server group %d: processes left %.0fs after the server exited; killing them", proc.pid, timeout)
        with contextlib.suppress(ProcessLookupError):  # the last one may have gone meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
        group_gone(proc.pid, timeout)
    return proc.returncode


def group_gone(pgid: int, timeout: float) -> bool:
    """Waits up to ``timeout`` for every process of the group to exit; False if some are left."""
    deadline = time.monotonic() + timeout
    while True:
        try:  # as a container's PID 1 we adopt the group's orphans: reap them, or they stay as zombies
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def supervise(
    proc: subprocess.Popen,
    redis: Redis | None,
    settings: ReleaseSettings,
    stopping: threading.Event,
    gpus: list[str] | None = None,
) -> int:
    """Runs until the server exits, the supervisor is stopped, or the GPUs (``gpus``: the server's) are released."""
    while True:
        if stopping.wait(settings.release_poll_s):
            return stop(proc, settings.release_stop_timeout_s)  # docker stop: the server's exit code is ours
        if proc.poll() is not None:
            log.error("server pid %d exited by itself with %s", proc.pid, proc.returncode)
            return proc.returncode or 1  # never 0: the restart policy must bring it back
        if redis is None:
            continue
        try:
            run_ids = runs_to_release(redis)
        except RedisError:  # Redis restarting: the server keeps serving; look again next time
            log.warning("could not read the runs from Redis; trying again", exc_info=True)
            continue
        if run_ids:
            log.info("extraction is over (%s waiting): stopping the server to free its GPUs", ", ".join(run_ids))
            stop(proc, settings.release_stop_timeout_s)
            release(redis, run_ids, time.time(), gpus or [])
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the server command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    command = command or [sys.executable, "-m", "eaglet.services.inference.main"]
    settings = ReleaseSettings()
    setup_logging()
    redis = connect(settings.redis_url)
    releasing = settings.release_gpus_when_done
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    gpus = visible_gpus(os.environ) if releasing else []  # the server inherits this environment, and these GPUs
    proc = subprocess.Popen(command, start_new_session=True)
    log.info("server pid %d: %s (GPU release %s)", proc.pid, " ".join(command),
             f"on, GPUs {','.join(gpus) or '(none)'}" if releasing else "off")  # fmt: skip
    host, reader, beating = settings.status_host, gpustats.GpuReader(os.environ), threading.Event()
    publish = partial(gpustats.publish, redis, reader, role=GpuRole.inference, host=host)
    with contextlib.suppress(RedisError):  # a Redis not up yet: the beats start when it is
        gpustats.prune(redis, GpuRole.inference, host, settings.lost_after_s)
    beat = threading.Thread(target=gpustats.beat_until, daemon=True, name="gpu-beat",
                            args=(beating, settings.heartbeat_interval_s, publish, "GPU report"))  # fmt: skip
    beat.start()
    try:
        return supervise(proc, redis if releasing else None, settings, stopping, gpus)
    finally:
        beating.set()
        beat.join(10)  # no report written after it is removed
        with contextlib.suppress(RedisError):  # the report ages out of the status by itself
            gpustats.forget(redis, GpuRole.inference, host)


if __name__ == "__main__":
    raise SystemExit(main())
