"""One recipe of eaglet's trainer on a stored run, trained into a folder of its own (``train(out_dir=...)``): the
run's own drafter and records stay as they are. Wall time, tokens/s and torch's peak GPU memory written down.

    python -m bench.gpu.ablate --run RUN --out DIR [trainer flags...]      (PROBE_OUT: where the JSON goes)

A SIGTERM stops it at the next step with a checkpoint (exit 143); the same command resumes it from there.

ABLATE_GPU_SHARE: the fraction of the GPU's memory this process may hold (0: no limit).

The trainer flags are the trainer's own (``eaglet train --help``); the target is the run's model (``--model``).
"""

import argparse
import json
import os
import time

import torch

from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import init_distributed
from eaglet.services.trainer.main import add_config_flags, config_from_args
from eaglet.services.trainer.preemption import Preempted
from eaglet.services.trainer.train import train
from eaglet.shared.config import Settings
from eaglet.shared.logs import setup_logging
from eaglet.shared.target import resolve_model_dir


def run() -> int:
    p = argparse.ArgumentParser(prog="ablate.py", description="One trainer recipe on a stored run.")
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True, help="the recipe's folder: checkpoints, curves, drafter")
    p.add_argument("--model", help="target model directory (default: EAGLET_MODEL)")
    add_config_flags(p, TrainConfig)
    args = p.parse_args()
    setup_logging()  # the trainer's progress lines (tokens/s of each report window) in the process's log
    cfg = config_from_args(TrainConfig, args)
    settings = Settings()
    target = resolve_model_dir(args.model or settings.model, settings.model_cache_dir)
    share = float(os.environ.get("ABLATE_GPU_SHARE", "0"))
    if share and torch.cuda.is_available():
        # beside other recipes on the one GPU: this process's cache is freed before it takes more than its share,
        # and a recipe that needs more fails alone instead of starving the others
        torch.cuda.set_per_process_memory_fraction(share)
    t = time.time()
    try:
        final = train(redis=None, run_id=args.run, data_dir=settings.data_dir, target_dir=target, cfg=cfg,
                      env=init_distributed(), out_dir=args.out)  # fmt: skip
    except Preempted as e:  # the call's time is up: the checkpoint just written resumes it in the next call
        print(e, flush=True)
        return 143
    wall = time.time() - t
    cuda = torch.cuda.is_available()
    out = {
        "wall_s": round(wall, 1),
        "config": {k: v for k, v in vars(args).items() if k not in ("run", "out", "model")},
        "final": final,
        "drafter_dir": os.path.join(args.out, "drafter"),
        "peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }
    if os.environ.get("PROBE_OUT"):
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
