"""``eaglet ingest`` killed half way through a dataset, then ``eaglet ingest --run ID --resume``: every line once."""

import json
import os
import signal
import subprocess
import sys
import time

from eaglet.shared.alerts import StatusConfig
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.samples import SampleSet
from eaglet.shared.status import read_run
from eaglet.shared.store import samples_dir
from tests.conftest import ROOT


def test_a_killed_ingest_is_taken_up_with_resume(tmp_path, redis, redis_server, tiny_model_dir):
    n, dataset = 40_000, tmp_path / "big.jsonl"
    with open(dataset, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": f"#{i}"}]})
            )
            f.write("\n")
    env = {**os.environ, "EAGLET_MODEL": str(tiny_model_dir), "EAGLET_REDIS_URL": redis_server.url,
           "EAGLET_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)}  # fmt: skip
    eaglet = [sys.executable, "-m", "eaglet.cli.main", "ingest"]
    proc = subprocess.Popen([*eaglet, str(dataset), "--run", "cut"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    state = RunState(redis, "cut")
    deadline = time.monotonic() + 120
    while not (state.exists() and state.meta().ingest_cursor):
        assert proc.poll() is None and time.monotonic() < deadline, "no flush before the ingest ended"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert state.meta().total is None, "ingest ended before the kill: the test proved nothing"
    # Nothing completes (no worker here): /status says the run is stalled and how to take the ingest up.
    alerts = read_run(redis, "cut", config=StatusConfig(stall_min_s=0.01), now=time.time() + 1).run.alerts
    [stalled] = [a for a in alerts if a.kind == "stalled"]
    assert "eaglet ingest --run cut --resume" in stalled.message, stalled.message

    done = subprocess.run([*eaglet, "--run", "cut", "--resume"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"run cut: {n} samples" in done.stdout
    meta = state.meta()
    assert (meta.total, meta.bad_lines, meta.stage) == (n, 0, Stage.extracting)
    ids = [s.decode() for s in SampleSet(samples_dir(tmp_path / "data", "cut")).index["id"]]
    assert len(ids) == len(set(ids)) == n
    refused = subprocess.run([*eaglet, "--run", "cut", "--resume"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert refused.returncode != 0 and "has no ingest to take up" in refused.stderr
