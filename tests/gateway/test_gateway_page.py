"""The live page in a real headless Chromium: its DOM after the JS ran, and a screenshot of its bars."""

import shutil
import struct
import subprocess
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from eaglet.shared import keys
from eaglet.shared.heartbeats import WorkerState, beat, report_inference
from eaglet.shared.records import TrainProgress, WorkerBeat
from eaglet.shared.runstate import RunState, Stage

CHROMIUM = shutil.which("chromium")
GREEN, BLUE, RED = (0x2B, 0x8A, 0x3E), (0x19, 0x71, 0xC2), (0xE0, 0x31, 0x31)


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.fail("Debian's chromium is not installed: run `make test-system`")
    # Without the background-networking flags Chromium keeps calling out to hosts a closed network refuses.
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
             f"--user-data-dir={profile}", "--force-device-scale-factor=1", "--virtual-time-budget=4000"]  # fmt: skip
    return subprocess.run([CHROMIUM, *flags, *args, url], capture_output=True, text=True, timeout=60, check=True)


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Rows of RGB(A) pixels of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a, b = line[i - bpp] if i >= bpp else 0, prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


def longest_run(rows: list[bytes], bpp: int, color: tuple[int, int, int]) -> int:
    """The widest horizontal run of ``color`` in any row: a bar's fill, in pixels."""
    best = 0
    for row in rows:
        run = 0
        for x in range(0, len(row), bpp):
            run = run + 1 if tuple(row[x : x + 3]) == color else 0
            best = max(best, run)
    return best


class Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.attrs: list[dict] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.attrs.append(dict(attrs))

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture
def seeded(redis):
    """A run 60 % through extraction (one in five failed), training at 25 %, a lost worker, a live one."""
    state = RunState(redis, "demo-run")
    state.create(dataset="/datasets/chat.jsonl", model="tiny")
    state.start_extraction()
    state.set_total(100, 100 * 500)
    for i in range(60):
        state.start_attempt(i, "w-live")
        if i % 5 == 3:
            state.mark_failed(i, f"s{i}", f"<b>dump of s{i}</b>: 3 tokens, expected 500", "w-live")
        else:
            state.mark_done(i, 500, 500 * 512)
    now = time.time()
    state.update_train(TrainProgress(step=250, total_steps=1000, loss=1.25, updated_at=now))
    beat(redis, "w-live", state=WorkerState.busy, host="h1", pid=1, inference_url="http://inf:1", run="demo-run",
         sample="s60", disk_free=5 * 10**11, disk_total=10**12,
         stage_seconds={"prefill": 1.25, "dump_wait": 0.0, "check": 0.02, "store": 0.31},
         samples_per_s=2.5, tokens_per_s=1250.0)  # fmt: skip
    report_inference(redis, "http://inf:1", ok=True, host="h1", model="SmolLM2-135M-Instruct", hidden_size=576,
                     num_layers=30, aux_layer_ids=[2, 15, 27])  # fmt: skip
    gone = WorkerBeat(worker="w-gone", state=WorkerState.busy, ts=now - 60, run="demo-run", sample="s61")
    redis.hset(keys.WORKERS, "w-gone", gone.to_redis())
    old = WorkerBeat(worker="w-old", state=WorkerState.busy, ts=now - 3600, run="demo-run", sample="s7")
    redis.hset(keys.WORKERS, "w-old", old.to_redis())  # died an hour ago: counted, not listed
    return state


def test_page_shows_progress_rates_errors_workers_and_alerts(start_gateway, seeded, tmp_path):
    assert seeded.stage() == Stage.extracting
    gateway = start_gateway(heartbeat_interval_s=5)  # w-live stays live while Chromium starts
    url = f"{gateway.url}/?interval=0.5"
    dom = chromium(url, tmp_path / "profile-dom", "--dump-dom").stdout
    page = Collect()
    page.feed(dom)
    text = " ".join(page.text)
    bars = {a["class"]: a.get("data-percent") for a in page.attrs if a.get("class", "").startswith("bar ")}
    assert bars == {"bar extraction": "60.00", "bar training": "25.00"}
    assert "48 done, 12 failed of 100" in text and "ETA" in text and "samples/s" in text
    assert "<b>dump of s58</b>: 3 tokens, expected 500" in text  # shown as text, not markup
    assert "lost (busy)" in text and "w-live" in text and "500.0 GB free of 1.0 TB" in text
    assert "w-old" not in text and "lost: 1 more, silent for longer (not listed)" in text
    assert "1.25 / 0.02 / 0.31" in text  # where w-live's time goes: mostly waiting on the server
    # The servers table: the host, the model as the server named it, its shape and captured layers, its rate.
    assert "SmolLM2-135M-Instruct · hidden 576 · 30 layers · captures [2, 15, 27]" in text
    assert "1,250 tok/s · 2.5 samples/s · 1 worker(s)" in text
    assert {a.get("data-server") for a in page.attrs} >= {"h1 http://inf:1"}
    assert {a.get("data-kind") for a in page.attrs} >= {"workers_lost", "error_rate"}

    shot = tmp_path / "page.png"
    chromium(url, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1100,1400")
    width, bpp, rows = read_png(shot)
    assert width == 1100
    assert abs(longest_run(rows, bpp, GREEN) - 240) <= 2  # 60 % of the 400 px extraction bar
    assert abs(longest_run(rows, bpp, BLUE) - 100) <= 2  # 25 % of the training bar
    assert longest_run(rows, bpp, RED) > 100  # the alert banners
