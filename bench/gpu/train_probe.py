"""eaglet's trainer (``eaglet.services.trainer.main``), run as is, with its speed and peak GPU memory written down.

    python -m bench.gpu.train_probe --run RUN [trainer flags...]      (PROBE_OUT: where the JSON goes)

Takes the figures the trainer itself reports (the run's train hash in Redis: tokens/s over its last window,
loss, accuracy) and adds what it does not: wall time, torch's peak allocated and reserved GPU memory.
"""

import json
import os
import sys
import time

import torch
from redis import Redis

from eaglet.services.trainer import main as trainer_main
from eaglet.shared.config import Settings
from eaglet.shared.runstate import RunState


def run() -> int:
    argv = sys.argv[1:]
    run_id = argv[argv.index("--run") + 1]
    t = time.time()
    rc = trainer_main.main(argv)
    wall = time.time() - t
    redis = Redis.from_url(Settings().redis_url, decode_responses=True)
    out = {
        "rc": rc,
        "argv": argv,
        "wall_s": round(wall, 1),
        "train_hash": RunState(redis, run_id).train().to_redis(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else None,
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2) if torch.cuda.is_available() else None,
    }
    path = os.environ.get("PROBE_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(run())
