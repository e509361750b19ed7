"""Two training processes (torchrun, gloo on CPU) follow the same loss curve as one process on the same global batch.

Length-grouped batching cuts the samples into batches by the per-process token budget and then shuffles the batch
list, so in general the union of two processes' batches at a step is no batch one process would make. It is when
the budgets make one batch of the whole training split for one process and exactly two for two processes: every
step then trains on the whole split in both, and each epoch is one step. The loss is a mean over the global batch's
positions however they are split (the objective counts positions over all processes), so the two curves must agree
to float rounding."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import checkpoints_dir, drafter_dir, sample_path, samples_dir
from tests.trainer.fixtures import make_run

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 8  # one step each
SETTINGS = dict(ttt_steps=3, draft_vocab_size=512, lr=3e-3, warmup_ratio=0.1, heldout_fraction=0.2, epochs=EPOCHS,
                checkpoint_every=4, loader_workers=0, log_every=2,
                aux_noise=0.0)  # fmt: skip  # the noise is each process's own: two would not draw one's


def rows(data_dir: Path, run: str) -> list[dict]:
    return [json.loads(x) for x in (checkpoints_dir(data_dir, run) / "metrics.jsonl").read_text().splitlines()]


def budget(data_dir: Path, run: str) -> int:
    """A per-process token budget that cuts the training split into exactly two batches, and twice it into one."""
    train_items, _ = data.split_items(
        SampleSet(samples_dir(data_dir, run)), list(range(24)), SETTINGS["heldout_fraction"]
    )
    per_process = max(it.length for it in train_items) * ((len(train_items) + 1) // 2)
    assert len(data.make_batches(train_items, per_process, 0, 0)) == 2
    assert len(data.make_batches(train_items, 2 * per_process, 0, 0)) == 1
    return per_process


# DFlash: every block anchored (no draw of anchors that a batch's split would change), on three captured layers
METHODS = {
    "eagle3": ({}, None),
    "dflash": (dict(method="dflash", dflash_layers=2, block_size=4, dflash_anchors=4096), [2, 4, 5]),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", list(METHODS))
def test_two_processes_match_one_at_the_same_global_batch(redis, tmp_path, tiny_model_dir, method):
    extra, layer_ids = METHODS[method]
    settings = {**SETTINGS, **extra}
    make_run(redis, tmp_path, tiny_model_dir, "one", layer_ids=layer_ids)
    make_run(redis, tmp_path, tiny_model_dir, "two", layer_ids=layer_ids)
    per_process = budget(tmp_path, "two")

    kw = redis.connection_pool.connection_kwargs
    env = {**os.environ, "EAGLET_REDIS_URL": f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}",
           "EAGLET_DATA_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}  # fmt: skip
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "eaglet.services.trainer.main", "--run-id", "two", "--model", str(tiny_model_dir),
         f"--tokens-per-batch={per_process}", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    two_s = time.time() - started

    cfg = TrainConfig(**settings, tokens_per_batch=2 * per_process)
    solo = train(redis=redis, run_id="one", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())

    one, two = rows(tmp_path, "one"), rows(tmp_path, "two")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, EPOCHS + 1)), (one, two)
    for a, b in zip(one, two, strict=True):  # step by step: loss, per-step losses and accuracy, lr, grad norm
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
        assert b["step_losses"] == pytest.approx(a["step_losses"], rel=1e-4, abs=1e-6), (a, b)
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-4), (a, b)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    assert one[-1]["loss"] < one[0]["loss"]  # it trained

    duo = RunState(redis, "two").train()  # rank 0 alone reported, with the held-out figures of both processes
    assert duo.world_size == 2 and duo.step == EPOCHS and RunState(redis, "two").stage() == Stage.done
    assert duo.heldout_loss == pytest.approx(solo["heldout_loss"], rel=1e-4)
    assert duo.heldout_acc == pytest.approx(solo["heldout_acc"], abs=1e-4)
    assert (drafter_dir(tmp_path, "two") / "model.safetensors").is_file()
    states = sorted(p.name for p in checkpoints_dir(tmp_path, "two").glob("*.pt"))
    assert len(states) == 2, states  # step 4 and the end, each written once
    print(f"two processes: {two_s:.1f} s")


@pytest.mark.timeout(180)
def test_a_batch_one_process_cannot_read_is_skipped_by_both_in_lock_step(redis, tmp_path, tiny_model_dir):
    """One sample a batch and one sample's file truncated: the process that meets it has nothing to train on, and
    both skip that step (a host-side vote) instead of one waiting for the other's gradients forever."""
    make_run(redis, tmp_path, tiny_model_dir, "gap")
    train_items, _ = data.split_items(SampleSet(samples_dir(tmp_path, "gap")), list(range(24)), 0.2)
    path = sample_path(tmp_path, "gap", train_items[0].sample_id)
    path.write_bytes(path.read_bytes()[:-100])
    kw = redis.connection_pool.connection_kwargs
    env = {**os.environ, "EAGLET_REDIS_URL": f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}",
           "EAGLET_DATA_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "eaglet.services.trainer.main", "--run-id", "gap", "--model", str(tiny_model_dir),
         "--tokens-per-batch=40", "--ttt-steps=2", "--draft-vocab-size=256", "--epochs=1", "--heldout-fraction=0.2",
         "--loader-workers=1", "--max-unreadable=0.1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    state = RunState(redis, "gap")
    progress = state.train()
    assert state.stage() == Stage.done and progress.unreadable_samples == 1
    assert [r["step"] for r in rows(tmp_path, "gap")] == list(range(1, progress.total_steps + 1))
    assert train_items[0].sample_id in done.stderr and str(path) in done.stderr
