"""``eaglet status`` reads the same figures as the gateway, through the same code."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from eaglet.cli.status import main

ROOT = Path(__file__).resolve().parents[2]


def seed(fake_run):
    fake = fake_run("r1", total=40)
    fake.ingest()
    for _ in range(25):
        fake.step()
    fake._beat()
    return fake


def test_json_equals_the_gateway(gateway, fake_run, redis_server, capsys):
    fake = seed(fake_run)
    assert main(["r1", "--json", "--redis-url", redis_server.url]) == 0
    cli = json.loads(capsys.readouterr().out)
    http = gateway.client().get("/runs/r1").json()
    for part in ("extraction", "storage"):
        for key in (
            "total",
            "done",
            "failed",
            "in_flight",
            "errors",
            "retries",
            "bytes_written",
            "projected_total_bytes",
        ):
            if key in http["run"][part]:
                assert cli["run"][part][key] == http["run"][part][key], key
    assert cli["run"]["extraction"]["done"] == fake.truth.done
    assert [w["name"] for w in cli["cluster"]["workers"]] == ["w0", "w1", "w2"]


def test_table_and_unknown_run(fake_run, redis_server, capsys):
    seed(fake_run)
    assert main(["--redis-url", redis_server.url]) == 0
    out = capsys.readouterr().out
    assert "r1" in out and "extraction" in out and "w0" in out and "error" in out
    assert "inference servers" in out and "http://inf:1" in out and "tiny" in out  # the server and its model
    assert main(["nope", "--redis-url", redis_server.url]) == 1
    assert main(["--redis-url", "redis://127.0.0.1:1/0"]) == 2


def test_watch_redraws_until_interrupted(fake_run, redis_server, tmp_path):
    seed(fake_run)
    env = {**os.environ, "COLUMNS": "120", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}  # as in a terminal
    cmd = [sys.executable, "-c", "import sys; from eaglet.cli.status import main; sys.exit(main(sys.argv[1:]))"]
    proc = subprocess.Popen(
        [*cmd, "r1", "--watch", "--interval", "0.2", "--redis-url", redis_server.url],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "w"), text=True,
        # As from a terminal: a shell that starts the tests in the background leaves SIGINT ignored for its children.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(256), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120  # a loaded machine takes long to import; wait for two draws, not a fixed time
    while "".join(chunks).count("extraction") < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    reader.join(10)
    # stderr goes to a file: an unread pipe fills up and blocks the child (log lines on every redraw)
    out, err = "".join(chunks), (tmp_path / "stderr").read_text()
    assert proc.returncode == 0, err
    assert out.count("extraction") >= 2  # drawn, then redrawn
