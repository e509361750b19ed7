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
    objective.noise_seed = 1
    noisy = objective(ids, mask, hidden, aux)[0]
    assert not torch.equal(noisy, a)
    assert torch.equal(noisy, objective(ids, mask, hidden, aux)[0])  # a step's noise is its seed's: resumable
    objective.noise_seed = 2  # the next step's
    assert not torch.equal(noisy, objective(ids, mask, hidden, aux)[0])
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


def test_muon_trains_the_matrices_and_adamw_the_rest_and_resumes(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "mu", n=12)
    cfg = small(max_steps=4, optimizer="muon", checkpoint_every=2, log_every=1)
    train(redis=None, run_id="mu", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist(),
          out_dir=tmp_path / "muon")  # fmt: skip
    saved = torch.load(sorted((tmp_path / "muon" / "checkpoints").glob("*.pt"))[-1], weights_only=False)
    muon, adamw = saved["optimizer"]["muon"], saved["optimizer"]["adamw"]
    assert muon["state"] and adamw["state"]  # both stepped
    assert all(s["momentum_buffer"].ndim == 2 for s in muon["state"].values())
    assert {s["exp_avg"].ndim for s in adamw["state"].values()} == {1, 2}  # the norms and the LM head
    # the schedule reaches the Muon groups too: the last step's learning rate is the cosine's end, in both
    assert {g["lr"] for g in muon["param_groups"] + adamw["param_groups"]} == {saved["scheduler"]["_last_lr"][0]}
    rows = [json.loads(x) for x in (tmp_path / "muon" / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    # resumed with AdamW from a Muon checkpoint: refused, saying which it was
    with pytest.raises(ValueError, match="another --optimizer"):
        train(redis=None, run_id="mu", data_dir=tmp_path, target_dir=tiny_model_dir,
              cfg=small(max_steps=6, checkpoint_every=2), env=Dist(), out_dir=tmp_path / "muon")  # fmt: skip
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="sgd")


def test_heldout_figures_keep_nothing_for_backward(redis, tmp_path, tiny_model_dir):
    """The held-out pass at a checkpoint builds no autograd graph: one kept alive by its running sums held every
    held-out batch's activations at once (seen as an out-of-memory at the checkpoint on the GPU)."""
    from eaglet.services.trainer import data
    from eaglet.services.trainer.objective import heldout_figures
    from eaglet.services.trainer.train import make_objective
    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import samples_dir

    make_run(redis, tmp_path, tiny_model_dir, "hg", n=6)
    cfg = small()
    objective = make_objective(tiny_model_dir, torch.arange(512), cfg, Dist(), [1, 2, 3], None)
    samples = SampleSet(samples_dir(tmp_path, "hg"))
    items, _ = data.split_items(samples, list(range(len(samples))), 0.0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        figures = heldout_figures(objective, items, data_dir=tmp_path, run_id="hg", tokens_per_batch=64,
                                  max_len=cfg.max_len, device=torch.device("cpu"))  # fmt: skip
    assert figures["samples"] == 6 and figures["heldout_loss"] > 0
    assert saved == []
    objective.train()
    loss = objective(*[torch.randint(0, 500, (1, 8)), torch.ones(1, 8, dtype=torch.bool),
                       torch.randn(1, 8, objective.drafter.cfg.hidden_size),
                       torch.randn(1, 8, 3 * objective.drafter.cfg.target_hidden_size)])[0]  # fmt: skip
    assert loss.requires_grad  # training forwards still build their graph
