"""Checkpoint choice (``--select-by``): the trainer keeps each epoch's drafter and held-out figures, the hand-off
exports the winner as ``drafter/`` and says which, in ``selection.json``, the train record and the status."""

import json
import logging

import pytest

from eaglet.services.trainer import main as trainer_main
from eaglet.services.trainer import selection, train
from eaglet.services.trainer.checkpoint import HELDOUT
from eaglet.services.trainer.selection import Candidate
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.status import read_status
from eaglet.shared.store import drafter_dir, run_dir
from tests.trainer.fixtures import make_run
from tests.trainer.test_dflash import LAYERS


def cand(epoch: int, predicted: float | None, tmp_path) -> Candidate:
    return Candidate(epoch, 10 * epoch, tmp_path / f"e{epoch}", None, None, predicted=predicted)


def test_each_rule_picks_its_winner_and_only_the_top_predicted_are_served(tmp_path):
    found = [cand(1, 1.5, tmp_path), cand(2, 1.9, tmp_path), cand(3, 1.7, tmp_path), cand(4, None, tmp_path)]
    assert selection.choose(found, "last", 2, lambda _: pytest.fail("last serves nothing")).epoch == 4
    assert selection.choose(found, "predicted", 2, lambda _: pytest.fail("predicted serves nothing")).epoch == 2
    served = {tmp_path / "e2": 1.6, tmp_path / "e3": 1.8}
    asked = []

    def serve(folder):
        asked.append(folder)
        return served[folder]

    winner = selection.choose(found, "served", 2, serve)
    assert winner.epoch == 3 and winner.served == 1.8  # served beats predicted
    assert asked == [tmp_path / "e2", tmp_path / "e3"]  # the two best predicted, best first; epochs 1 and 4 not
    with pytest.raises(RuntimeError, match=r"none of epochs \[2\] was served"):
        selection.choose(found, "served", 1, lambda _: None)


def test_an_unreadable_epoch_is_left_out_naming_its_file(tmp_path, caplog):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    root = selection.epochs_dir(tmp_path)
    figures = drafter / HELDOUT
    figures.write_text(json.dumps({"step": 5, "heldout_acc": [0.5, 0.5], "heldout_loss": 2.0}))
    selection.keep(root, 1, drafter)
    figures.write_text(json.dumps({"step": 10, "heldout_acc": [0.6], "heldout_loss": 1.9}))
    selection.keep(root, 2, drafter)
    figures.unlink()
    selection.keep(root, 3, drafter)  # trained without a held-out split: a candidate with no prediction
    (root / "0002" / "drafter" / HELDOUT).write_text("{not json")
    with caplog.at_level(logging.ERROR):
        first, third = selection.candidates(root, 2)
    assert first.epoch == 1 and first.step == 5 and first.predicted == 1 + 0.5 + 0.25
    assert (first.drafter / "config.json").exists() and third.epoch == 3 and third.predicted is None
    assert str(root / "0002" / "drafter" / HELDOUT) in caplog.text


@pytest.fixture
def env(redis, tmp_path, monkeypatch):
    kw = redis.connection_pool.connection_kwargs
    monkeypatch.setenv("EAGLET_REDIS_URL", f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}")
    monkeypatch.setenv("EAGLET_DATA_DIR", str(tmp_path))


def train_args(run: str, model, *more: str) -> list[str]:
    return ["--run", run, "--model", str(model), "--loader-workers", "0", "--draft-vocab-size", "256",
            "--tokens-per-batch", "160", "--ttt-steps", "2", "--epochs", "3", "--heldout-fraction", "0.25",
            "--checkpoint-every", "1000", *more]  # fmt: skip


def test_served_selection_serves_the_top_epochs_and_exports_the_winner(redis, env, tmp_path, tiny_model_dir, caplog):
    make_run(redis, tmp_path, tiny_model_dir, "pick", n=12, options=RunOptions(select_by="served", select_top=2))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(2)))
    args = train_args("pick", tiny_model_dir, "--eval-prompts", str(prompts), "--eval-k", "2",
                      "--eval-max-new-tokens", "8")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="eaglet.services.trainer.evaluate"):
        assert trainer_main.main(args) == 0
    assert caplog.text.count("evaluating 2 prompts") == 2  # the top 2, the winner's figures recorded, not redone
    folder = run_dir(tmp_path, "pick")
    kept = sorted(p.name for p in selection.epochs_dir(folder).iterdir())
    assert kept == ["0001", "0002", "0003"]  # the run option asked for it; every epoch kept
    report = json.loads((folder / "selection.json").read_text())
    served = [c for c in report["candidates"] if c["served"] is not None]
    assert report["select_by"] == "served" and len(served) == 2
    winner = max(served, key=lambda c: (c["served"], c["predicted"], c["epoch"]))
    assert report["chosen_epoch"] == winner["epoch"]
    chosen = selection.epochs_dir(folder) / f"{winner['epoch']:04d}" / "drafter" / "model.safetensors"
    assert (drafter_dir(tmp_path, "pick") / "model.safetensors").read_bytes() == chosen.read_bytes()
    state = RunState(redis, "pick")
    progress = state.train()
    assert progress.selection == report["summary"] and progress.selection.startswith(f"epoch {winner['epoch']} of 3")
    assert progress.heldout_acc == winner["heldout_acc"]  # the record describes the exported drafter
    record = state.eval()
    assert record.state == "done" and record.accept_length == winner["served"]  # the winner's served figures
    assert record.predicted_accept_length == round(winner["predicted"], 4)
    [run] = [r for r in read_status(redis, config=StatusConfig()).runs if r.run_id == "pick"]
    assert run.training.selection == report["summary"]
    assert f"exported the drafter of {report['summary']}" in run.lines["training"]


def test_predicted_selection_needs_no_prompts_and_served_without_them_is_refused(redis, env, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "pred", n=12)
    with pytest.raises(SystemExit):
        trainer_main.main(train_args("pred", tiny_model_dir, "--select-by", "served"))
    assert trainer_main.main(train_args("pred", tiny_model_dir, "--select-by", "predicted")) == 0
    report = json.loads((run_dir(tmp_path, "pred") / "selection.json").read_text())
    best = max(report["candidates"], key=lambda c: (c["predicted"], c["epoch"]))
    assert report["chosen_epoch"] == best["epoch"] and all(c["served"] is None for c in report["candidates"])
    assert RunState(redis, "pred").eval().state is None  # no prompts: no evaluation


def test_a_dflash_run_is_chosen_at_its_blocks_positions(redis, env, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "dfl", n=12, layer_ids=LAYERS,
             options=RunOptions(method="dflash", aux_layer_ids=LAYERS))  # fmt: skip
    args = train_args("dfl", tiny_model_dir, "--select-by", "predicted", "--dflash-layers", "2", "--block-size", "4",
                      "--dflash-anchors", "64")  # fmt: skip
    assert trainer_main.main(args) == 0
    report = json.loads((run_dir(tmp_path, "dfl") / "selection.json").read_text())
    assert report["positions"] == 3 and len(report["candidates"]) == 3  # a block of 4: three drafted positions
    assert (drafter_dir(tmp_path, "dfl") / "config.json").read_text().count("DFlashDraftModel") == 1


def test_an_epoch_end_on_a_checkpoint_step_is_checkpointed_once(redis, env, tmp_path, tiny_model_dir, monkeypatch):
    make_run(redis, tmp_path, tiny_model_dir, "every", n=12)
    assert trainer_main.main(train_args("every", tiny_model_dir)) == 0
    per_epoch = (RunState(redis, "every").train().total_steps or 0) // 3
    passes = []
    real = train.heldout
    monkeypatch.setattr(train, "heldout", lambda s: passes.append(s.step) or real(s))  # counts, changes nothing
    make_run(redis, tmp_path, tiny_model_dir, "once", n=12)
    args = train_args("once", tiny_model_dir, "--keep-epochs", "--checkpoint-every", str(per_epoch))
    assert trainer_main.main(args) == 0
    assert passes == [per_epoch, 2 * per_epoch, 3 * per_epoch]  # not twice at the epochs' ends
    assert sorted(p.name for p in selection.epochs_dir(run_dir(tmp_path, "once")).iterdir()) == ["0001", "0002", "0003"]
