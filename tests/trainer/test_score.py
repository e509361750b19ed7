"""``score``: the held-out figures of a saved drafter, by the trainer's own math, whoever saved it."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.services.trainer import score
from eaglet.services.trainer.checkpoint import CheckpointError, load_drafter
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.score import ScoreError, score_drafter
from eaglet.services.trainer.train import train
from eaglet.shared.runstate import RunState
from eaglet.shared.store import drafter_dir
from tests.trainer.fixtures import make_run
from tests.trainer.test_train import _url, small

SETTINGS = dict(ttt_steps=3, tokens_per_batch=160, heldout_fraction=0.3)  # the training's own (``small``)


@pytest.fixture
def trained(redis, tmp_path, tiny_model_dir) -> dict:
    """A run trained for a few steps: its final figures, as the trainer wrote them."""
    make_run(redis, tmp_path, tiny_model_dir, "sc", n=16)
    final = train(redis=redis, run_id="sc", data_dir=tmp_path, target_dir=tiny_model_dir,
                  cfg=small(max_steps=4, heldout_fraction=0.3), env=Dist())  # fmt: skip
    return final


def foreign_copy(folder: Path, out: Path) -> Path:
    """The drafter as another trainer saves it: a config.json of standard keys alone (no ``eaglet`` section, no
    ``head_dim`` nor ``target_hidden_size``), its weights plus a token embedding of its own."""
    config = json.loads((folder / "config.json").read_text())
    out.mkdir()
    keep = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "draft_vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
            "num_hidden_layers", "rope_scaling", "eagle_config")  # fmt: skip
    (out / "config.json").write_text(json.dumps({k: config[k] for k in keep}))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["embed_tokens.weight"] = torch.randn(config["vocab_size"], config["hidden_size"])
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_score_of_the_trained_drafter_is_the_trainers_heldout_figures(trained, redis, tmp_path, tiny_model_dir):
    figures = score_drafter(data_dir=tmp_path, run_id="sc", target_dir=tiny_model_dir,
                            drafter_dir=drafter_dir(tmp_path, "sc"), redis=redis, **SETTINGS)  # fmt: skip
    assert figures["heldout_loss"] == pytest.approx(trained["heldout_loss"], abs=1e-5)
    assert figures["heldout_acc"] == pytest.approx(trained["heldout_acc"], abs=1e-4)
    progress = RunState(redis, "sc").train()
    assert figures["samples"] == progress.heldout_samples > 0
    assert figures["tokens"] > figures["samples"]
    assert (figures["ttt_steps"], figures["draft_vocab_size"], figures["oov_mask"]) == (3, 512, False)


def test_a_drafter_saved_by_another_trainer_scores_the_same(trained, redis, tmp_path, tiny_model_dir, monkeypatch):
    ours = drafter_dir(tmp_path, "sc")
    theirs = foreign_copy(ours, tmp_path / "theirs")
    embed = torch.zeros(1, 1)
    a, b = load_drafter(ours, embed), load_drafter(theirs, embed)
    assert a.cfg == b.cfg
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    # the command: both drafters, the run's target from its record, figures as JSON on stdout and in the file
    monkeypatch.setenv("EAGLET_REDIS_URL", _url(redis))
    monkeypatch.setenv("EAGLET_DATA_DIR", str(tmp_path))
    out = tmp_path / "scores.json"
    args = ["--run", "sc", "--drafter", f"eaglet={ours}", "--drafter", f"other={theirs}", "--out", str(out),
            "--ttt-steps", "3", "--tokens-per-batch", "160", "--heldout-fraction", "0.3"]  # fmt: skip
    assert score.main(args) == 0
    scores = json.loads(out.read_text())
    assert set(scores) == {"eaglet", "other"} and scores["eaglet"] == scores["other"]
    assert scores["other"]["heldout_loss"] == pytest.approx(trained["heldout_loss"], abs=1e-5)
    assert scores["other"]["heldout_acc"] == pytest.approx(trained["heldout_acc"], abs=1e-4)


def test_bad_drafters_and_runs_are_named(trained, redis, tmp_path, tiny_model_dir):
    ours = drafter_dir(tmp_path, "sc")
    kw = dict(data_dir=tmp_path, target_dir=tiny_model_dir, redis=redis, **SETTINGS)
    bare = tmp_path / "bare"
    shutil.copytree(ours, bare)
    (bare / "config.json").unlink()
    with pytest.raises(ScoreError, match=f"{re.escape(str(bare))}: no config.json"):
        score_drafter(run_id="sc", drafter_dir=bare, **kw)

    other_vocab = foreign_copy(ours, tmp_path / "vocab")
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    with safe_open(str(other_vocab / "model.safetensors"), framework="pt") as f:  # a drafter of a larger vocabulary
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["t2d"] = torch.cat([tensors["t2d"], torch.zeros(64, dtype=torch.bool)])
    save_file(tensors, str(other_vocab / "model.safetensors"))
    with pytest.raises(
        ScoreError, match=f"{re.escape(str(other_vocab))}: .*vocab_size {config['vocab_size'] + 64} but the target's"
    ):
        score_drafter(run_id="sc", drafter_dir=other_vocab, **kw)

    scaled = foreign_copy(ours, tmp_path / "scaled")
    (scaled / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ScoreError, match=f"{re.escape(str(scaled))}: config.json declares rope_scaling"):
        score_drafter(run_id="sc", drafter_dir=scaled, **kw)

    missing = r"\['midlayer\.mlp\.up_proj\.weight'\] missing"
    misshaped = r"norm\.weight is \[63\], expected \[64\]"
    for name, change, error in (
        ("missing", lambda t: t.pop("midlayer.mlp.up_proj.weight"), missing),
        ("misshaped", lambda t: t.update({"norm.weight": t["norm.weight"][:-1]}), misshaped),
    ):
        broken = foreign_copy(ours, tmp_path / name)
        with safe_open(str(broken / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        change(tensors)
        save_file(tensors, str(broken / "model.safetensors"))
        with pytest.raises(CheckpointError, match=f"{re.escape(str(broken))}: .*{error}"):
            load_drafter(broken, torch.zeros(1, 1))

    with pytest.raises(ScoreError, match="run sc: no extracted held-out samples"):
        score_drafter(run_id="sc", drafter_dir=ours, **{**kw, "heldout_fraction": 0.0})
