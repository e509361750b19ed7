"""What every CPU benchmark shares: the machine and its load, a Redis of its own, result files.

Results go to ``bench/results/cpu-<name>.json`` with the date, the machine, the git revision and the load
average before and after: on a shared machine a figure means little without the load it was taken under.
"""

import json
import os
import platform
import shutil
import socket
import subprocess
import time
from pathlib import Path

from redis import Redis

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "git": rev.strip()}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def start_redis(folder: Path, *, appendonly: bool = True) -> tuple[subprocess.Popen, str]:
    """A redis-server of the benchmark's own, AOF on with the default everysec fsync (as compose runs it)."""
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "yes" if appendonly else "no", "--dir", str(folder)],
                            stdout=subprocess.DEVNULL)  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            if Redis.from_url(url).ping():
                return proc, url
        except Exception:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def save_result(name: str, command: str, figures: dict, load_before: list[float]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"cpu-{name}.json"
    doc = {"name": name, "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine(),
           "load_before": load_before, "load_after": load(), "figures": figures}  # fmt: skip
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out
