"""What a host's GPUs are doing: utilization and memory through NVML, for the heartbeats of the inference
supervisor and the trainer, so that the status that shows a run's progress also answers "is any GPU busy?".

NVML is the driver's own library (what ``nvidia-smi`` reads); ``nvidia-ml-py`` is NVIDIA's pure-Python binding to
it. Reading it takes no CUDA context and no GPU memory, so the trainer may read it while the server still holds
the GPUs. Where there is no binding or no driver the GPUs are unknown, and the reason says which.
"""

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

from redis import Redis
from redis.exceptions import RedisError

from . import keys
from .gpus import parse_gpu_list
from .records import GpuBeat, GpuRole, GpuStat

log = logging.getLogger(__name__)

try:
    import pynvml  # nvidia-ml-py
except ImportError:  # an install without it (it is a dependency): the GPUs read as unknown
    pynvml = None


class GpuReader:
    """Reads the GPUs a process started with ``env`` may use: ``CUDA_VISIBLE_DEVICES`` (indexes or UUIDs) when set,
    else every GPU NVML sees (in a container, the container's). NVML is initialised once, on the first read."""

    def __init__(self, env: Mapping[str, str]):
        self.wanted = parse_gpu_list(env["CUDA_VISIBLE_DEVICES"]) if "CUDA_VISIBLE_DEVICES" in env else None
        self._handles: list | None = None
        self._unknown = ""

    def read(self) -> tuple[list[GpuStat] | None, str]:
        """The GPUs now, or None and why they cannot be read (a few words, then the driver's own in brackets)."""
        if self._handles is None and not self._unknown:
            self._open()
        if self._unknown:
            return None, self._unknown
        try:
            return [self._stat(h) for h in self._handles or []], ""
        except pynvml.NVMLError as e:  # a GPU fell off the bus, the driver was unloaded: say so, try next time
            return None, f"NVML failed ({e})"

    def _open(self) -> None:
        if pynvml is None:
            self._unknown = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
            if self.wanted is None:
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            else:
                self._handles = [_handle(g) for g in self.wanted]
        except pynvml.NVMLError as e:
            self._unknown = f"no NVML here ({e})"

    @staticmethod
    def _stat(handle) -> GpuStat:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return GpuStat(
            index=pynvml.nvmlDeviceGetIndex(handle),
            name=name.decode() if isinstance(name, bytes) else name,  # bytes from older drivers' bindings
            utilization=float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            memory_used=int(memory.used),
            memory_total=int(memory.total),
        )


def _handle(gpu: str):
    return pynvml.nvmlDeviceGetHandleByIndex(int(gpu)) if gpu.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(gpu)


def beat_field(role: GpuRole, host: str, pid: int) -> str:
    """The field of one process's GPUs in ``keys.GPUS``: several servers or trainers may share a host."""
    return f"{role} {host} {pid}"


def publish(redis: Redis, reader: GpuReader, *, role: GpuRole, host: str, run: str = "") -> None:
    """Records the GPUs ``reader`` sees now, as this process's (``beat_field``)."""
    gpus, detail = reader.read()
    record = GpuBeat(role=role, host=host, ts=time.time(), pid=os.getpid(), run=run, gpus=gpus, detail=detail)
    redis.hset(keys.GPUS, beat_field(role, host, os.getpid()), record.to_redis())


def forget(redis: Redis, role: GpuRole, host: str) -> None:
    """A process that stops cleanly removes its GPUs; one that dies leaves a report that ages out of the status."""
    redis.hdel(keys.GPUS, beat_field(role, host, os.getpid()))


def prune(redis: Redis, role: GpuRole, host: str, older_than_s: float) -> None:
    """Removes the reports of this host's processes of ``role`` silent for ``older_than_s`` (ones that died): a
    restarted process adds a report of its own, and the hash would keep one per death."""
    for name, value in redis.hgetall(keys.GPUS).items():
        if name.startswith(f"{role} {host} ") and time.time() - GpuBeat.from_redis(value).ts > older_than_s:
            redis.hdel(keys.GPUS, name)


def beat_until(stop: threading.Event, interval_s: float, beat: Callable[[], None], what: str) -> None:
    """Calls ``beat`` every ``interval_s`` until ``stop``; a Redis that does not answer is logged once per outage,
    and never stops the process it reports on."""
    failing = False
    while not stop.is_set():
        try:
            beat()
            failing = False
        except RedisError as e:
            if not failing:
                log.warning("%s: cannot write to Redis (%s); trying again every %.0f s", what, e, interval_s)
            failing = True
        stop.wait(interval_s)
