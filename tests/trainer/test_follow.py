"""The trainer service as compose runs it (a real process): it claims an extracted run, trains it in a child
process and leaves it done, then stops on SIGTERM."""

import os
import subprocess
import sys
import time

from eaglet.shared.runstate import RunState, Stage
from tests.trainer.fixtures import make_run


def test_the_trainer_service_trains_an_extracted_run(redis, redis_server, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "fol", n=6)
    args = (f"--model {tiny_model_dir} --loader-workers 0 --draft-vocab-size 256 --tokens-per-batch 160 "
            "--ttt-steps 2 --max-steps 2 --heldout-fraction 0")  # fmt: skip
    env = {**os.environ, "EAGLET_REDIS_URL": redis_server.url, "EAGLET_DATA_DIR": str(tmp_path),
           "EAGLET_TRAIN_GPUS": "0", "EAGLET_TRAIN_ARGS": args, "EAGLET_FOLLOW_POLL_S": "0.2",
           "EAGLET_FOLLOW_ALIVE_FILE": str(tmp_path / "alive"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    state = RunState(redis, "fol")
    proc = subprocess.Popen([sys.executable, "-m", "eaglet.services.trainer.follow"], env=env)
    try:
        deadline = time.time() + 120
        while state.stage() != Stage.done and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert state.stage() == Stage.done, state.meta().error
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert state.train().follow_attempts == 1 and state.train().step == 2 and (tmp_path / "alive").exists()
    assert redis.get(state.keys.train_lock) is None
