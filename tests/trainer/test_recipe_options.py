"""The recipe's options beyond the defaults (a norm before fc, noise on the auxiliary states), and training
another drafter from the same extraction into a folder of its own."""

import json

import pytest
import torch
from safetensors import safe_open

from eaglet.services.trainer.checkpoint import load_drafter
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.model import Drafter, DrafterConfig
from eaglet.services.trainer.train import train
from eaglet.shared.store import drafter_dir
from tests.trainer.fixtures import make_run
from tests.trainer.test_train import small


def test_norm_before_fc_is_trained_saved_and_declared_for_the_engines(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "nf", n=12)
    train(redis=redis, run_id="nf", data_dir=tmp_path, target_dir=tiny_model_dir,
          cfg=small(max_steps=3, norm_before_fc=True), env=Dist())  # fmt: skip
    folder = drafter_dir(tmp_path, "nf")
    config = json.loads((folder / "config.json").read_text())
    # SGLang reads eagle_config's flag first, then the top level; vLLM the top level
    assert config["norm_before_fc"] is True and config["eagle_config"]["norm_before_fc"] is True
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        norm = f.get_tensor("input_norm.weight")
        assert norm.shape == (f.get_tensor("fc.weight").shape[1],)
    assert not torch.allclose(norm.float(), torch.ones_like(norm.float()))  # trained, not left at its init
    embed = torch.randn(config["vocab_size"], config["hidden_size"])
    assert load_drafter(folder, embed).input_norm is not None
    config.pop("eaglet")  # as another trainer writes it: the flag alone says the norm is there
    (folder / "config.json").write_text(json.dumps(config))
    assert load_drafter(folder, embed).cfg.norm_before_fc


def test_the_norm_makes_fc_see_states_of_any_scale():
    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=50, draft_vocab_size=50, norm_before_fc=True)  # fmt: skip
    d = Drafter(cfg, torch.randn(50, 16))
    aux = torch.randn(1, 4, 48)
    assert torch.allclose(d.fuse(aux * 1000), d.fuse(aux), atol=1e-4)
    plain = Drafter(DrafterConfig(**{**cfg.to_dict(), "norm_before_fc": False}), torch.randn(50, 16))
    assert plain.input_norm is None and not torch.allclose(plain.fuse(aux * 1000), plain.fuse(aux))


def test_aux_noise_changes_training_forwards_but_not_heldout_figures(redis, tmp_path, tiny_model_dir):
    from eaglet.services.trainer.train import make_objective

    make_run(redis, tmp_path, tiny_model_dir, "an", n=4)
    cfg = small(aux_noise=0.5)
    objective = make_objective(tiny_model_dir, torch.arange(512), cfg, Dist(), [1, 2, 3], None)
    ids = torch.randint(0, 500, (1, 12))
    mask = torch.ones(1, 12, dtype=torch.bool)
    hidden = torch.randn(1, 12, objective.drafter.cfg.hidden_size)
    aux = torch.randn(1, 12, 3 * objective.drafter.cfg.target_hidden_size)
    objective.eval()
    a, b = objective(ids, mask, hidden, aux)[0], objective(ids, mask, hidden, aux)[0]
    assert torch.equal(a, b)
    objective.train()
    assert not torch.equal(objective(ids, mask, hidden, aux)[0], objective(ids, mask, hidden, aux)[0])
    with pytest.raises(ValueError, match="aux_noise"):
        TrainConfig(aux_noise=-0.1)


def test_another_drafter_from_the_same_extraction_goes_to_its_own_folder(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "vr", n=12)
    train(redis=redis, run_id="vr", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=small(max_steps=2), env=Dist())
    own = (drafter_dir(tmp_path, "vr") / "model.safetensors").read_bytes()
    variant = tmp_path / "variants" / "noise"
    final = train(redis=None, run_id="vr", data_dir=tmp_path, target_dir=tiny_model_dir,
                  cfg=small(max_steps=3, aux_noise=0.05, log_every=1), env=Dist(), out_dir=variant)  # fmt: skip
    rows = [json.loads(x) for x in (variant / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] == [final["step"] - 2, 2, 3]  # fresh: the run's step 2 not resumed
    assert (variant / "drafter" / "model.safetensors").is_file() and list((variant / "checkpoints").glob("*.pt"))
    assert (drafter_dir(tmp_path, "vr") / "model.safetensors").read_bytes() == own
