"""Extraction on N GPUs, then training on M of them: the inference supervisor records the GPUs it releases, the
trainer waits for that release, checks the GPUs it would use against them, and torchrun starts M processes.

The GPUs themselves are a GPU machine's (``bench/gpu/handoff.sh``); here run the real supervisor and the real
trainer process on CPU, with the GPUs named by ``CUDA_VISIBLE_DEVICES`` as on a GPU host.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from eaglet.services.trainer.follow import FollowSettings, trainer_command, trainer_env
from eaglet.services.trainer.main import check_released_gpus, wait_for_start
from eaglet.shared.gpus import GpuHandoffError, parse_train_gpus, visible_gpus
from eaglet.shared.runstate import RunState, Stage


def test_train_gpus_is_a_count_or_a_list():
    assert parse_train_gpus("0") == (0, None) and parse_train_gpus("4") == (4, None)
    assert parse_train_gpus("4,5") == (2, ["4", "5"]) and parse_train_gpus("3,") == (1, ["3"])
    assert parse_train_gpus("GPU-1a2b, GPU-3c4d") == (2, ["GPU-1a2b", "GPU-3c4d"])
    for bad in ("four", "0,0", ",", "1,x"):
        with pytest.raises(ValueError, match="EAGLET_TRAIN_GPUS="):
            parse_train_gpus(bad)
    with pytest.raises(ValidationError, match="EAGLET_TRAIN_GPUS='two'"):
        FollowSettings(_env_file=None, train_gpus="two")


def test_torchrun_gets_m_processes_and_the_listed_gpus():
    four = FollowSettings(_env_file=None, train_gpus="4", release_gpus_when_done=True)
    command = trainer_command(four, "r1")
    assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node", "4"] and "--wait-for-gpus" in command
    assert "CUDA_VISIBLE_DEVICES" not in trainer_env(four, {"PATH": "/bin"})
    listed = FollowSettings(_env_file=None, train_gpus="4,5,6,7")
    assert trainer_command(listed, "r1")[:4] == ["torchrun", "--standalone", "--nproc-per-node", "4"]
    assert trainer_env(listed, {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}) == {
        "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # fmt: skip
    assert trainer_command(FollowSettings(_env_file=None, train_gpus="0"), "r1")[0] == sys.executable


def test_visible_gpus_come_from_the_environment():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0, 1"}) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "void"}) == []
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]


# Stands for SGLang: a launcher whose child (a scheduler) takes 2 s to exit after SIGTERM, holding its GPU meanwhile.
SCHEDULER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), sys.exit(0)))
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""
LAUNCHER = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); time.sleep(120)"
)


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no memory)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_supervisor_releases_its_gpus_once_no_run_extracts_and_the_trainer_takes_m_of_them(
    redis, redis_server, tmp_path
):
    ready, busy = RunState(redis, "ready"), RunState(redis, "busy")
    ready.create(stage=Stage.extracted, extraction_complete=time.time())
    busy.create(stage=Stage.extracting)
    env = {"EAGLET_REDIS_URL": redis_server.url, "EAGLET_RELEASE_GPUS_WHEN_DONE": "true",
           "EAGLET_RELEASE_POLL_S": "0.1", "EAGLET_RELEASE_STOP_TIMEOUT_S": "15", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    pid_file = tmp_path / "scheduler.pid"
    server = [sys.executable, "-c", LAUNCHER, SCHEDULER, str(pid_file)]
    supervisor = subprocess.Popen([sys.executable, "-m", "eaglet.services.inference.release", "--", *server], env=env)
    waits = dict(allow_partial=False, wait_for_gpus=True, poll_s=0.05, announce=True)
    trainer = threading.Thread(target=wait_for_start, args=(ready,), kwargs=waits, daemon=True)
    try:
        trainer.start()
        deadline = time.monotonic() + 60  # the supervisor and its server start (seconds on a busy machine)
        while not (pid_file.exists() and pid_file.read_text() and ready.stage() == Stage.waiting_for_gpus):
            assert time.monotonic() < deadline, "the server never started, or the trainer never waited"
            time.sleep(0.05)
        time.sleep(1.0)  # another run still extracts: the server keeps its GPUs, the trainer waits
        assert supervisor.poll() is None and trainer.is_alive() and not ready.gpus_released()
        assert ready.stage() == Stage.waiting_for_gpus
        scheduler = int(pid_file.read_text())
        busy.cancel()
        assert supervisor.wait(30) == 0  # exit 0: stay down, the GPUs are the trainer's
        assert not running(scheduler), "released while the server's scheduler still held its GPU"
        trainer.join(10)
        assert not trainer.is_alive()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    meta = ready.meta()
    assert meta.gpus_released is not None and meta.released_gpus == ["0", "1", "2", "3"]
    assert busy.meta().released_gpus is None  # cancelled, not waiting: nothing released to it

    # Training on 2 of the 4 (the first two, or two named ones) is allowed ...
    check_released_gpus(ready, {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LOCAL_WORLD_SIZE": "2"})
    check_released_gpus(ready, {"CUDA_VISIBLE_DEVICES": "2,3", "LOCAL_WORLD_SIZE": "2"})
    # ... a GPU the server did not hold is not, nor more GPUs than it released.
    with pytest.raises(GpuHandoffError, match=r"GPU\(s\) 4,5, which the inference service did not hold.*"
                       "EAGLET_TRAIN_GPUS=0,1"):  # fmt: skip
        check_released_gpus(ready, {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(GpuHandoffError, match="would use 6 GPUs.*released 4.*EAGLET_TRAIN_GPUS to at most 4"):
        check_released_gpus(ready, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5", "LOCAL_WORLD_SIZE": "6"})
    with pytest.raises(GpuHandoffError, match="3 trainer process.* but 2 GPU.*EAGLET_TRAIN_GPUS to at most 2"):
        check_released_gpus(ready, {"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_WORLD_SIZE": "3"})


def test_trainer_on_a_gpu_the_server_did_not_release_fails_the_run_with_the_reason(redis, redis_server, tmp_path):
    state = RunState(redis, "r-gpu")
    state.create(stage=Stage.extracted, extraction_complete=time.time())
    state.release_gpus(gpus=["0", "1"])
    env = {"EAGLET_REDIS_URL": redis_server.url, "EAGLET_DATA_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "2",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "eaglet.services.trainer.main", "--run-id", "r-gpu", "--wait-for-gpus",
                           "--poll-s", "0.1"], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    meta = state.meta()
    assert meta.stage == Stage.failed and "GPU(s) 2, which the inference service did not hold" in meta.error, meta
    assert "EAGLET_TRAIN_GPUS=0" in meta.error and "released 0,1" in meta.error
