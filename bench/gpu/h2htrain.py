"""The head-to-head's trainers: eaglet's (``h2h-eaglet``) and SpecForge's (``h2h-specforge``) on the same stored
states, run side by side to the call's deadline, their estimates from their measured rates.
"""

import json
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

from bench.gpu import h2h
from bench.gpu import harness as P


class GpuMemory(P.Sampler):
    """Peak GPU memory in use on device 0 (nvidia-smi every 0.5 s), the same measure for both trainers."""

    peak_mib = 0

    def sample(self) -> None:
        self.peak_mib = max(self.peak_mib, P.gpu_memory_mib().get(0, 0))


def training_rows(run_id: str | None = None) -> list[tuple[int, str, int]]:
    """(index, sample_id, length) of the stored samples eaglet's trainer trains on (of h2h-extract's run unless
    ``run_id`` names another)."""
    from bench.gpu.specforge_features import training_split
    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import sample_path, samples_dir

    run_id = run_id or P.RESULTS["h2h-extract"]["run_id"]
    samples = SampleSet(samples_dir(P.DATA, run_id))
    rows = []
    for i in range(len(samples)):
        row = samples.index[i]
        sid = row["id"].decode()
        if sample_path(P.DATA, run_id, sid).exists():
            rows.append((i, sid, int(row["length"])))
    return training_split(rows, h2h.TRAINER_HELDOUT)


def run_trainer(
    R: dict, name: str, argv: list[str], pythonpath: str, env: dict, timeout: float, probe_dir: Path = P.OUT
) -> dict:
    """Runs a trainer process ``name`` to its end (or ``timeout``, or the call's deadline) and writes into the
    record ``R``: its command, wall time, exit code, log tail, peak GPU memory and its probe's JSON."""
    return run_trainers([(R, name, argv)], pythonpath, env, timeout, probe_dir)[0]


STOP_GRACE_S = 15  # a stopped trainer's checkpoint, within the call's margin past its deadline


def run_trainers(
    jobs: list[tuple[dict, str, list[str]]],
    pythonpath: str,
    env: dict,
    timeout: float,
    probe_dir: Path = P.OUT,
    own: dict[str, tuple[str, dict]] | None = None,
) -> list[dict]:
    """Trainer processes (record, name, argv) started together on the one GPU and waited for together, as
    ``run_trainer`` does for one; the peak GPU memory is theirs together. ``own``: a job's name -> its own
    (pythonpath, env), for another trainer's environment beside eaglet's."""
    own = own or {}
    timeout = min(timeout, h2h.time_left())
    t = time.time()
    with GpuMemory() as mem:
        for R, name, argv in jobs:
            R["cmd"] = " ".join(argv[1:])
            path, job_env = own.get(name, (pythonpath, env))
            P.start(name, argv, path, {**job_env, "PROBE_OUT": str(probe_dir / f"{name}-probe.json")})
        ended: dict[str, float] = {}
        while len(ended) < len(jobs) and time.time() - t < timeout:
            ended |= {n: time.time() for _, n, _ in jobs if n not in ended and P.PROCS[n].poll() is not None}
            time.sleep(0.5)
        cut = [n for _, n, _ in jobs if n not in ended and P.PROCS[n].poll() is None]
        for name in cut:  # all at once: each writes a checkpoint of its last step, then ends (exit 143)
            os.killpg(P.PROCS[name].pid, signal.SIGTERM)
        grace_end = time.time() + STOP_GRACE_S
        while time.time() < grace_end and any(P.PROCS[n].poll() is None for n in cut):
            time.sleep(0.2)
    for R, name, _ in jobs:
        proc = P.PROCS[name]
        P.stop(name, 0)  # what is left of it (the process group), at once
        R["rc"] = proc.wait()
        if name not in ended:
            R["error"] = f"timed out after {timeout:.0f}s"
        R["wall_s"] = round(ended.get(name, time.time()) - t, 1)
        R["log_tail"] = P.tail(name, 40)
        if R["rc"] not in (0, None) and "error" not in R:
            R["error"] = f"exit {R['rc']}: {(R['log_tail'].splitlines() or [''])[-1][:300]}"
        R["peak_gpu_GiB"] = round(mem.peak_mib / 1024, 2)
        probe = probe_dir / f"{name}-probe.json"
        R["probe"] = json.loads(probe.read_text()) if probe.exists() else None
    return [R for R, _, _ in jobs]


def specforge_batch(rows: list[tuple[int, str, int]]) -> tuple[int, int]:
    """eaglet's batches per epoch, and SpecForge's batch size giving the same samples per optimizer step as
    eaglet's length-grouped batches of 2,048 tokens."""
    from eaglet.services.trainer.data import Item, make_batches

    batches = len(make_batches([Item(i, sid, n) for i, sid, n in rows], h2h.TOKENS_PER_BATCH, 0, 0))
    return batches, max(1, round(len(rows) / max(batches, 1)))


# Rates measured on one H200 (2 epochs of 9,529 samples, 6.8 M tokens): eaglet's trainer 16,600 tokens/s and
# ~40 s to start; SpecForge about 3,350 of 3,812 steps in 396 s. A trainer runs to the end unless the call's time
# ends first: a phase is started only when its estimate from these rates fits the call.
EAGLET_TOKENS_PER_S, EAGLET_START_S = 16_600, 40


SPECFORGE_S_PER_STEP, SPECFORGE_START_S = 0.118, 60


TRAIN_TIMEOUT = float(os.environ.get("H2H_TRAIN_TIMEOUT", "1e9"))


def estimate_eaglet() -> float:
    rows = training_rows() if P.RESULTS.get("h2h-extract", {}).get("done") else []
    return h2h.EAGLET_START_S + sum(r[2] for r in rows) * h2h.EPOCHS / EAGLET_TOKENS_PER_S if rows else 300


def estimate_specforge() -> float:
    rows = training_rows() if P.RESULTS.get("h2h-extract", {}).get("done") else []
    if not rows:
        return 330
    _, batch_size = specforge_batch(rows)
    convert_s = sum(r[2] for r in rows) / 200_000  # torch.save of the states, 12 processes
    return h2h.SPECFORGE_START_S + convert_s + -(-len(rows) // batch_size) * h2h.EPOCHS * SPECFORGE_S_PER_STEP


def specforge_features(run_id: str, rows: list[tuple[int, str, int]], feats: Path, method: str = "eagle3") -> dict:
    """The stored samples ``rows`` of ``run_id`` as SpecForge's offline features for ``method`` under ``feats``
    (12 processes); what was written and in how long."""
    from bench.gpu.specforge_features import convert
    from eaglet.shared.store import sample_path

    feats.mkdir(parents=True, exist_ok=True)
    t = time.time()
    jobs = [(i, sid, str(sample_path(P.DATA, run_id, sid))) for i, sid, _ in rows]
    chunks = [jobs[k : k + 256] for k in range(0, len(jobs), 256)]
    with ProcessPoolExecutor(12) as ex:
        tokens = sum(ex.map(partial(convert, out_dir=str(feats), method=method), chunks))
    return {"samples": len(jobs), "tokens": tokens, "wall_s": round(time.time() - t, 1)}


def phase_eaglet() -> None:
    if h2h.done("h2h-eaglet"):
        return
    P.stop(h2h.SERVER)  # the GPU to the trainer alone
    rows = training_rows()
    run_id = P.RESULTS["h2h-extract"]["run_id"]
    argv = [sys.executable, "-m", "bench.gpu.train_probe", "--run", run_id, "--epochs", str(h2h.EPOCHS),
            "--checkpoint-every", "1000000"]  # fmt: skip
    R = run_trainer(P.RESULTS.setdefault("h2h-eaglet", {}), "h2h-eaglet", argv, P.PY_EAGLET,
                    P.eaglet_env(h2h.SMOL, P.SGL_PORT), TRAIN_TIMEOUT)  # fmt: skip
    train_hash = (R.get("probe") or {}).get("train_hash", {})
    R.update(epochs=h2h.EPOCHS, train_samples=len(rows), train_tokens=sum(r[2] for r in rows) * h2h.EPOCHS,
             optimizer_steps=train_hash.get("step"), trainer_reported_tokens_per_s=train_hash.get("tokens_per_s"),
             drafter_dir=train_hash.get("drafter_dir"))  # fmt: skip
    probe_wall = (R.get("probe") or {}).get("wall_s")  # the trainer's own run, as for SpecForge's
    R["tokens_per_s"] = round(R["train_tokens"] / probe_wall, 1) if R["rc"] == 0 and probe_wall else None
    R["done"] = R["rc"] == 0 and bool(R["drafter_dir"])


def phase_specforge() -> None:
    if h2h.done("h2h-specforge"):
        return
    from bench.gpu.specforge_features import run_config, target_view

    P.stop(h2h.SERVER)  # the GPU to the trainer alone
    R = P.RESULTS.setdefault("h2h-specforge", {})
    run_id = P.RESULTS["h2h-extract"]["run_id"]
    rows = training_rows()
    feats = h2h.H2H / "sf-features"
    R["convert"] = specforge_features(run_id, rows, feats)
    P.save("h2h-specforge")
    batches, batch_size = specforge_batch(rows)
    cfg = run_config(target_view(h2h.SMOL, P.MODELS / "smollm2-specforge"), feats, h2h.H2H / "sf-run",
                     epochs=h2h.EPOCHS, batch_size=batch_size, max_length=2048, lr=h2h.SPECFORGE_LR)  # fmt: skip
    (h2h.H2H / "sf-run").mkdir(parents=True, exist_ok=True)
    cfg_path = h2h.H2H / "sf-run" / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    drafter = h2h.H2H / "sf-drafter"
    argv = [sys.executable, "bench/gpu/specforge_train.py", str(cfg_path), str(drafter)]
    R["config"] = cfg
    R = run_trainer(R, "h2h-specforge", argv, h2h.PY_SPECFORGE, {}, TRAIN_TIMEOUT)
    R.update(epochs=h2h.EPOCHS, lr=h2h.SPECFORGE_LR or "its default", batch_size=batch_size,
             eaglet_batches_per_epoch=batches, train_samples=len(rows),
             train_tokens=sum(r[2] for r in rows) * h2h.EPOCHS,
             optimizer_steps=-(-len(rows) // batch_size) * h2h.EPOCHS,
             drafter_dir=str(drafter))  # fmt: skip
    ok = R["rc"] == 0 and (drafter / "config.json").exists()
    probe_wall = (R.get("probe") or {}).get("wall_s")
    R["tokens_per_s"] = round(R["train_tokens"] / probe_wall, 1) if ok and probe_wall else None
    R["done"] = ok
