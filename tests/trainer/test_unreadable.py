"""A stored sample file that is corrupt on disk does not stop the training: it is skipped, named in the log and the
run's errors, counted in ``/status``; past ``--max-unreadable`` the run fails, saying so."""

import logging
import os

from eaglet.services.trainer import main as trainer_main
from eaglet.services.trainer.data import is_heldout
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.status import read_run
from eaglet.shared.store import sample_path
from tests.trainer.fixtures import make_run
from tests.trainer.test_train import _url, curve, small

HELDOUT = 0.2


def truncate(path, keep: float = 0.5) -> None:
    """Cuts the file as a full disk or a killed copy leaves it: its header intact, its tensors short."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def test_a_truncated_sample_is_skipped_named_and_shown_and_the_training_finishes(redis, tmp_path, tiny_model_dir,
                                                                                  caplog):  # fmt: skip
    make_run(redis, tmp_path, tiny_model_dir, "bad", n=24)
    ids = [f"s{i:04d}" for i in range(24)]
    train_id = next(i for i in ids if not is_heldout(i, HELDOUT))
    held_id = next(i for i in ids if is_heldout(i, HELDOUT))
    truncate(sample_path(tmp_path, "bad", train_id))
    with open(sample_path(tmp_path, "bad", held_id), "r+b") as f:  # a header that is not one
        f.write(b"\xff" * 16)
    # one sample a batch (the bad one's batch has nothing left to train on), read by the loader's worker processes
    cfg = small(epochs=2, tokens_per_batch=40, loader_workers=2, heldout_fraction=HELDOUT, max_unreadable=0.1)
    with caplog.at_level(logging.ERROR, logger="eaglet.services.trainer.unreadable"):
        final = train(redis=redis, run_id="bad", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    progress = RunState(redis, "bad").train()
    assert final["step"] == progress.total_steps and final["heldout_loss"] is not None
    assert len(curve(tmp_path, "bad")) == final["step"]
    logged = [r.getMessage() for r in caplog.records]
    for sample_id in (train_id, held_id):
        path = str(sample_path(tmp_path, "bad", sample_id))
        # each once, though met in both epochs and at each held-out evaluation
        assert sum(sample_id in m and path in m for m in logged) == 1, logged
    assert progress.unreadable_samples == 2
    report = read_run(redis, "bad", config=StatusConfig()).run
    assert report.training.unreadable_samples == 2
    errors = {e.sample_id: e for e in report.extraction.last_errors}
    assert set(errors) == {train_id, held_id}
    assert all(e.final and e.worker == "trainer" for e in errors.values())
    assert str(sample_path(tmp_path, "bad", train_id)) in errors[train_id].reason
    assert "bytes, the header describes" in errors[train_id].reason  # the store's own reason
    assert "header" in errors[held_id].reason


def test_more_unreadable_samples_than_allowed_fail_the_run_saying_so(redis, tmp_path, tiny_model_dir, monkeypatch):
    make_run(redis, tmp_path, tiny_model_dir, "worse", n=24)
    truncate(sample_path(tmp_path, "worse", "s0001"), keep=0.9)
    truncate(sample_path(tmp_path, "worse", "s0002"), keep=0.1)
    os.remove(sample_path(tmp_path, "worse", "s0003"))  # a file gone is unreadable too
    monkeypatch.setenv("EAGLET_REDIS_URL", _url(redis))
    monkeypatch.setenv("EAGLET_DATA_DIR", str(tmp_path))
    args = ["--run", "worse", "--model", str(tiny_model_dir), "--loader-workers", "0", "--draft-vocab-size", "256",
            "--tokens-per-batch", "160", "--ttt-steps", "2", "--heldout-fraction", "0", "--epochs", "1",
            "--max-unreadable", "0.05"]  # fmt: skip
    assert trainer_main.main(args) != 0
    state = RunState(redis, "worse")
    assert state.stage() == Stage.failed
    error = state.meta().error
    assert "TooManyUnreadable" in error and "more than --max-unreadable allows (1.2)" in error, error
    assert state.train().unreadable_samples == 2  # the second is one too many: the third is never reached
    report = read_run(redis, "worse", config=StatusConfig()).run
    assert report.training.state == "failed" and report.training.unreadable_samples == 2


def test_a_heldout_split_with_no_readable_sample_gives_no_figures_not_nan(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "blind", n=24)
    held = [f"s{i:04d}" for i in range(24) if is_heldout(f"s{i:04d}", HELDOUT)]
    assert held, "the split holds none out: the test would prove nothing"
    for sample_id in held:
        truncate(sample_path(tmp_path, "blind", sample_id))
    cfg = small(epochs=1, heldout_fraction=HELDOUT, max_unreadable=0.5)
    final = train(redis=redis, run_id="blind", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    progress = RunState(redis, "blind").train()
    assert final["step"] == progress.total_steps
    assert final["heldout_loss"] is None and final["heldout_acc"] is None
    assert progress.heldout_loss is None and progress.unreadable_samples == len(held)
