"""The GPUs' use in the status: read through NVML by the inference supervisor (a real process) and the trainer's
heartbeat, published in Redis, shown by ``/status``'s figures and its brief line; "unknown" where there is no NVML.

This machine has no NVIDIA driver: the "NVML absent" cases are real. The "NVML present" cases use a stand-in
``pynvml`` module (FAKE_NVML below), the one thing here that is not real: NVML itself cannot be had without a GPU.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eaglet.services.gateway.collector import StatusCollector
from eaglet.services.trainer.main import heartbeat
from eaglet.shared import gpustats, keys
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.records import GpuBeat, GpuRole, GpuStat
from eaglet.shared.runstate import RunState
from eaglet.shared.status import read_run, read_status
from tests.conftest import ROOT

# A stand-in for NVML (not NVIDIA's code): two GPUs, the second busy, with the calls and errors GpuReader uses.
FAKE_NVML = """
class NVMLError(Exception):
    pass

class _Util:
    def __init__(self, gpu): self.gpu = gpu

class _Memory:
    def __init__(self, used, total): self.used, self.total = used, total

GPUS = [("NVIDIA H200", 0, 1 * 2**30), ("NVIDIA H200", 97, 120 * 2**30)]

def nvmlInit(): pass
def nvmlDeviceGetCount(): return len(GPUS)
def nvmlDeviceGetHandleByIndex(i):
    if not 0 <= i < len(GPUS): raise NVMLError("Invalid Argument")
    return i
def nvmlDeviceGetHandleByUUID(uuid): raise NVMLError("Not Found")
def nvmlDeviceGetIndex(h): return h
def nvmlDeviceGetName(h): return GPUS[h][0]
def nvmlDeviceGetUtilizationRates(h): return _Util(GPUS[h][1])
def nvmlDeviceGetMemoryInfo(h): return _Memory(GPUS[h][2], 141 * 2**30)
"""
CONFIG = StatusConfig(lost_after_s=10.0)


@pytest.fixture
def fake_nvml(tmp_path, monkeypatch) -> Path:
    """The stand-in module, importable by this process (in place of nvidia-ml-py) and by its children."""
    folder = tmp_path / "fake-nvml"
    folder.mkdir()
    (folder / "pynvml.py").write_text(FAKE_NVML)
    spec = importlib.util.spec_from_file_location("pynvml", folder / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(gpustats, "pynvml", module)
    return folder


def test_without_the_binding_the_gpus_are_unknown(monkeypatch):
    monkeypatch.setattr(gpustats, "pynvml", None)
    assert gpustats.GpuReader({}).read() == (None, "nvidia-ml-py is not installed")


def test_without_a_driver_the_gpus_are_unknown_and_say_why():
    try:
        gpustats.pynvml.nvmlInit()
        pytest.skip("this machine has NVML: the real reading is checked on GPU machines")
    except gpustats.pynvml.NVMLError:
        pass
    gpus, detail = gpustats.GpuReader({}).read()
    assert gpus is None and detail.startswith("no NVML here (") and "Not Found" in detail


def test_a_reader_takes_the_visible_gpus_only(fake_nvml):
    assert gpustats.GpuReader({"CUDA_VISIBLE_DEVICES": "1"}).read() == (
        [GpuStat(index=1, name="NVIDIA H200", utilization=97.0, memory_used=120 * 2**30, memory_total=141 * 2**30)],
        "",
    )
    assert len(gpustats.GpuReader({}).read()[0]) == 2  # none named: every GPU NVML sees
    assert gpustats.GpuReader({"CUDA_VISIBLE_DEVICES": ""}).read() == ([], "")  # none visible: no GPU to read
    gpus, detail = gpustats.GpuReader({"CUDA_VISIBLE_DEVICES": "GPU-4d1c"}).read()
    assert gpus is None and detail == "no NVML here (Not Found)"


def supervisor(redis_server, env: dict[str, str], log: Path) -> subprocess.Popen:
    """The real inference supervisor, over a stand-in server process (a sleep): what it reports is its own."""
    command = [sys.executable, "-m", "eaglet.services.inference.release", "--", sys.executable, "-c",
               "import time; time.sleep(120)"]  # fmt: skip
    env = {**os.environ, "EAGLET_REDIS_URL": redis_server.url, "EAGLET_HEARTBEAT_INTERVAL_S": "0.2",
           "EAGLET_HOST_NAME": "gpu-host-1", "PYTHONPATH": str(ROOT), **env}  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_for_report(redis, pid: int) -> None:
    deadline = time.monotonic() + 60
    while not any(name.endswith(f" {pid}") for name in redis.hkeys(keys.GPUS)):
        assert time.monotonic() < deadline, "the supervisor published no GPU report"
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # as docker stop: it stops its server, then removes its report
    proc.wait(30)


@pytest.mark.parametrize("nvml", ["absent", "present"])
def test_the_inference_supervisor_publishes_its_gpus_in_the_status(redis, redis_server, tmp_path, request, nvml):
    state = RunState(redis, "r1")
    state.create(dataset="/d.jsonl", model="tiny")
    state.start_extraction()
    state.set_total(10, 100)
    env = {}
    if nvml == "present":  # the supervisor imports the stand-in in place of nvidia-ml-py
        env = {"PYTHONPATH": f"{request.getfixturevalue('fake_nvml')}{os.pathsep}{ROOT}", "CUDA_VISIBLE_DEVICES": "0,1"}
    died = GpuBeat(role=GpuRole.inference, host="gpu-host-1", ts=time.time() - 60, pid=1, detail="no NVML here")
    redis.hset(keys.GPUS, gpustats.beat_field(GpuRole.inference, "gpu-host-1", 1), died.to_redis())
    proc = supervisor(redis_server, env, tmp_path / "supervisor.log")
    try:
        wait_for_report(redis, proc.pid)
        report = read_run(redis, "r1", config=CONFIG)
        [host] = report.cluster.gpus
        assert (host.role, host.host, host.run, host.live, host.pid) == ("inference", "gpu-host-1", "", True, proc.pid)
        if nvml == "absent":
            assert host.gpus is None and host.detail.startswith("no NVML here (")
            assert " · GPUs unknown (no NVML here) · running" in report.run.brief
        else:
            assert [(g.index, g.utilization) for g in host.gpus] == [(0, 0.0), (1, 97.0)]
            collected = StatusCollector(redis, CONFIG, 10, lambda: None).collect()
            metrics = {(m.name.removeprefix("eaglet_gpu_"), s.labels["gpu"]): s.value
                       for m in collected if m.name.startswith("eaglet_gpu_") for s in m.samples}  # fmt: skip
            assert metrics == {("utilization_percent", "0"): 0.0, ("utilization_percent", "1"): 97.0,
                               ("memory_used_bytes", "0"): 2**30, ("memory_used_bytes", "1"): 120 * 2**30}  # fmt: skip
            assert " · GPUs 2 × 48.5 % busy, 129.9 GB / 302.8 GB · running" in report.run.brief
    finally:
        stop(proc)
    assert not redis.hlen(keys.GPUS), "a supervisor that stopped cleanly left its report, or kept one of the dead"


def test_the_trainer_heartbeat_publishes_its_gpus_while_it_trains(redis, fake_nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    state = RunState(redis, "r2")
    state.create(dataset="/d.jsonl", model="tiny")
    state.start_extraction()
    state.set_total(1, 10)
    state.mark_done(0, 10, 100)
    state.start_training()
    stop_beat = threading.Event()
    beating = threading.Thread(target=heartbeat, args=(state, 0.1, stop_beat, "train-host"))
    beating.start()
    try:
        wait_for_report(redis, os.getpid())
        report = read_status(redis, config=CONFIG)
        [host] = report.cluster.gpus
        assert (host.role, host.host, host.run) == (GpuRole.trainer, "train-host", "r2")
        assert [g.index for g in host.gpus] == [1]
        assert " · GPUs 1 × 97.0 % busy, 128.8 GB / 151.4 GB · training" in report.runs[0].brief
    finally:
        stop_beat.set()
        beating.join(10)
    assert not redis.hlen(keys.GPUS)
