"""A short training's loss curve, step by step, at a fixed seed: what two trainers (before and after a change, or
``--compile off`` and ``on``) are compared on, with ``comparecurves.py``.

    GPUBENCH_SCRIPT=losscurve.py bash bench/gpu/run.sh "" losscurve losscurve-b           (bench/gpu/README.md)

Phases (through harness.py's runner; results in $OUT/<phase>.json):
  losscurve     LOSSCURVE_STEPS (40) optimizer steps of the real trainer (``train()`` with its loader) with the
                trainer flags LOSSCURVE_FLAGS, on a synthetic run of LOSSCURVE_SHAPE (smol) written as trainspeed.py
                writes its rows' runs: LOSSCURVE_SAMPLES (16) samples of exactly LOSSCURVE_T (2048) tokens, the
                same on every call (their seed is the length); the trainer's seed 0
  losscurve-b   the same with LOSSCURVE_FLAGS_B
LOSSCURVE_BACKEND (inductor) is what a compiled step's graphs go to: aot_eager for a CPU record (inductor's C++
builds take minutes a graph on a small CPU).
Each record holds every step's loss, per-step losses and accuracies, gradient norm and learning rate, as the
trainer's metrics.jsonl has them, and the graphs torch.compile made during the training (``compiled_graphs``: 0
with --compile off). The run is removed behind it; the target stays.
"""

import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
from torch._dynamo.utils import counters

from bench.gpu import harness as P
from bench.gpu import trainspeed as TS
from eaglet.services.trainer import compiled
from eaglet.services.trainer.distributed import init_distributed
from eaglet.services.trainer.train import train
from eaglet.shared.logs import setup_logging
from eaglet.shared.store import checkpoints_dir, run_dir

STEPS = int(os.environ.get("LOSSCURVE_STEPS", "40"))
SHAPE = os.environ.get("LOSSCURVE_SHAPE", "smol")
T = int(os.environ.get("LOSSCURVE_T", "2048"))
SAMPLES = int(os.environ.get("LOSSCURVE_SAMPLES", "16"))
compiled.BACKEND = os.environ.get("LOSSCURVE_BACKEND", compiled.BACKEND)
STEP_FIELDS = ("step", "loss", "step_losses", "acc", "grad_norm", "lr")


def run_phase(phase: str, flags_env: str) -> None:
    flags = os.environ.get(flags_env, "")
    cfg = replace(TS.trainer_config(flags), max_steps=STEPS, tokens_per_batch=T, max_len=T, heldout_fraction=0.0,
                  checkpoint_every=10 * STEPS, seed=0)  # fmt: skip
    text = TS.SHAPES[SHAPE].text
    folder = TS.ensure_target(SHAPE)
    run_id = f"losscurve-{SHAPE}-{T}"
    shutil.rmtree(run_dir(TS.DATA, run_id), ignore_errors=True)  # a killed call's leftovers would be resumed from
    vocab = min(cfg.draft_vocab_size, text["vocab_size"])
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    R = P.RESULTS[phase] = {"flags": flags, "flags_env": flags_env, "shape": SHAPE, "T": T, "samples": SAMPLES,
                            "config": asdict(cfg), "torch": torch.__version__, "compile_backend": str(compiled.BACKEND),
                            "device": device}  # fmt: skip
    try:
        TS.write_samples(folder, text, run_id, T, SAMPLES, vocab)
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        train(redis=None, run_id=run_id, data_dir=TS.DATA, target_dir=folder, cfg=cfg, env=init_distributed())
        R["train_wall_s"] = round(time.perf_counter() - start, 1)
        R["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs
        rows = [json.loads(x) for x in (checkpoints_dir(TS.DATA, run_id) / "metrics.jsonl").read_text().splitlines()]
        R["steps"] = [{k: r[k] for k in STEP_FIELDS} for r in rows]
        R["done"] = len(R["steps"]) == STEPS
    finally:
        shutil.rmtree(run_dir(TS.DATA, run_id), ignore_errors=True)
    P.log(f"{phase}: {len(R['steps'])} steps, loss {R['steps'][0]['loss']:.4f} -> {R['steps'][-1]['loss']:.4f}")


def estimate_s() -> float:
    """The samples, the trainer's start and compile, the steps at the shape's known rate."""
    shape = TS.SHAPES[SHAPE]
    return TS.START_S + TS.COMPILE_S + TS.STEP_COMPILE_S + STEPS * T / shape.tokens_per_s + 10


PHASES: dict[str, Callable[[], None]] = {
    "losscurve": functools.partial(run_phase, "losscurve", "LOSSCURVE_FLAGS"),
    "losscurve-b": functools.partial(run_phase, "losscurve-b", "LOSSCURVE_FLAGS_B"),
}

if __name__ == "__main__":
    setup_logging()
    from bench.gpu import phases

    estimates = {**phases.ESTIMATE_S, **dict.fromkeys(PHASES, estimate_s)}
    raise SystemExit(P.main({**phases.PHASES, **PHASES}, estimates))
