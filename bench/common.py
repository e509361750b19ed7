"""What every CPU benchmark shares: the machine and its load, result files (Redis: eaglet.shared.redisserver).

Results go to ``results/cpu-<name>.json`` with the date, the machine, the git revision and the load
average before and after: on a shared machine a figure means little without the load it was taken under.
"""

import json
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


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


def save_result(name: str, command: str, figures: dict, load_before: list[float]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"cpu-{name}.json"
    doc = {"name": name, "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine(),
           "load_before": load_before, "load_after": load(), "figures": figures}  # fmt: skip
    # paths inside the checkout (a drafter folder, a traceback's files) as the repo's own: no machine's folders
    out.write_text(json.dumps(doc, indent=2).replace(f"{ROOT}/", "") + "\n")
    return out
