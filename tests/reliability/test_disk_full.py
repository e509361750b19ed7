"""The data volume fills up mid-run (a real tmpfs of a few MB): extraction pauses with a /status alert,
leaves no partial file, and resumes by itself when space comes back."""

import errno
import json
import logging
import os
import subprocess
import time

import httpx
import pytest

from eaglet.cli.stack import LocalStack
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from tests.reliability.helpers import check_outcome, env_of, gateway_settings, serve_gateway, wait_for, write_dataset

log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow


@pytest.fixture
def small_volume(tmp_path):
    """A 6 MiB tmpfs. Mounting needs root (tests run as root here and in CI): no mount is a failure, not a skip."""
    mount = tmp_path / "volume"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the disk-full test (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path) -> int:
    """Writes until the volume is full; returns the bytes written."""
    n = 0
    with open(path, "wb") as f:
        try:
            while True:
                n += f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return n


def test_disk_full_pauses_with_an_alert_and_resumes(redis, redis_server, settings, small_volume, tmp_path, events):
    n, run_id = 60, "disk"
    settings = settings.model_copy(update={"data_dir": small_volume / "data"})
    write_dataset(tmp_path / "data.jsonl", n, prefix="d", min_len=60)
    ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions())
    state = RunState(redis, run_id)
    url, stop_gateway = serve_gateway(gateway_settings(redis_server.url, settings.data_dir))
    gateway = httpx.Client(base_url=url, timeout=10)
    try:
        with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
            stack.start("w0", "eaglet.services.extractor.worker", "--name", "w0")
            wait_for("a few samples", lambda: state.counts().done >= 5, 60, 0.01)
            filler = small_volume / "filler"
            filled = fill(filler)
            before = state.counts().done

            def alerted() -> dict | None:
                report = gateway.get("/status").json()
                [run] = [r for r in report["runs"] if r["run_id"] == run_id]
                kinds = {a["kind"] for a in run["alerts"]}
                waiting = [w for w in report["cluster"]["workers"] if w["state"] == "backoff"]
                return run if "disk" in kinds and waiting and "No space left" in waiting[0]["detail"] else None

            run = wait_for("the disk alert and a worker in backoff", alerted, 60, 0.2)
            time.sleep(3)  # extraction stays paused while the disk is full
            paused_at = state.counts().done
            assert paused_at <= before + 1, "samples were completed on a full disk"
            hidden = settings.data_dir / "runs" / run_id / "hidden"
            assert not list(hidden.rglob("*.tmp")), "partial files left on the full disk"
            os.unlink(filler)
            wait_for("the run to complete", state.extraction_complete, 120)
    finally:
        stop_gateway()
    counts = check_outcome(redis, settings, run_id, n)
    assert (counts.done, counts.failed) == (n, 0), counts
    errors = [json.loads(e)["reason"] for e in redis.lrange(state.keys.errors, 0, -1)]
    full = [e for e in errors if "No space left" in e]
    log.warning("disk full: %d bytes of filler; alert %r; %d ENOSPC retries; done %d, failed %d", filled,
                [a["message"] for a in run["alerts"] if a["kind"] == "disk"][0], len(full), counts.done,
                counts.failed)  # fmt: skip
    assert full and events.count(run_id, "extraction_complete") == 1
