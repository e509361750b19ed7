"""The DFlash drafter: training's packed blocks see what decoding gives a block, the trainer learns and writes the
drafter SGLang loads, the CPU evaluation decodes with it and emits the target's greedy text."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from eaglet.services.trainer import data
from eaglet.services.trainer.checkpoint import is_dflash, load_dflash
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.dflash import DFlashConfig, DFlashDrafter
from eaglet.services.trainer.dflash_objective import DFlashObjective
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.evaluate import run_eval
from eaglet.services.trainer.speculative import dflash_generate, greedy_generate
from eaglet.services.trainer.train import train
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.store import checkpoints_dir, drafter_dir
from tests.trainer.fixtures import make_run

LAYERS = [2, 4, 5]  # capture ids of the tiny Llama's 6 layers: DFlash's target_layer_ids [1, 3, 4]


def tiny_drafter(seed: int = 0, block_size: int = 4) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=120, num_target_layers=8, target_layer_ids=[1, 4, 6],
                       block_size=block_size, mask_token_id=119)  # fmt: skip
    return DFlashDrafter(cfg, torch.randn(120, 32, dtype=torch.float64)).double().eval()


def test_a_packed_training_block_is_the_block_decoding_drafts():
    """Blocks of two documents packed in one row, under training's mask, give the hidden states that one block
    drafted alone gets from the context decoding holds: the tokens of its document before its anchor."""
    drafter = tiny_drafter()
    objective = DFlashObjective(drafter, torch.randn(120, 32, dtype=torch.float64), TrainConfig(block_size=4))
    lengths = (11, 17)
    samples = [{"input_ids": torch.randint(0, 119, (n,)), "loss_mask": torch.ones(n, dtype=torch.bool),
                "aux_hidden_states": torch.randn(n, 96, dtype=torch.float64),
                "hidden_states": torch.randn(n, 32, dtype=torch.float64)} for n in lengths]  # fmt: skip
    b = data.collate(samples, 100, 0)
    anchors, _ = data.BlockRule(4, 64).rows(b, seed=0)
    captured = {}
    original = DFlashDrafter.forward

    def keep(self, *args):
        captured["out"] = original(self, *args)
        return captured["out"]

    DFlashDrafter.forward = keep  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            objective.eval()(*objective.inputs({**b, "anchors": anchors, "labels": torch.ones(len(anchors), 3).bool()}))
    finally:
        DFlashDrafter.forward = original  # type: ignore[method-assign]
    packed = captured["out"].view(len(anchors), 4, -1)
    ids, aux, pos, docs = b["input_ids"][0], b["aux_hidden_states"][0], b["position_ids"][0], b["document_ids"][0]
    for a, p in enumerate(anchors.tolist()):
        start = p - int(pos[p])  # the document's first row
        context = drafter.context_kv(aux[None, start:p], pos[None, start:p])
        block = drafter.block_ids(ids[p : p + 1])
        alone = drafter(block, pos[p] + torch.arange(4)[None], context)[0]
        torch.testing.assert_close(packed[a], alone, msg=f"anchor {p} of document {int(docs[p])}")
    assert {int(docs[p]) for p in anchors} == {0, 1}
    assert all(int(pos[p]) >= 1 for p in anchors)  # every block has context


def test_block_rule_picks_loss_positions_with_context_and_marks_labels_inside_the_document():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1]]).bool()
    docs = torch.tensor([[0] * 5 + [1] * 5])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    anchors, labels = data.BlockRule(3, 100).rows({"loss_mask": mask, "document_ids": docs, "position_ids": pos}, 0)
    assert anchors.tolist() == [1, 2, 3, 6, 7, 8]  # p + 1 a loss position of p's document, p not a document's first
    assert labels.tolist() == [[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 0]]
    few, _ = data.BlockRule(3, 2).rows({"loss_mask": mask, "document_ids": docs, "position_ids": pos}, 0)
    assert len(few) == 2 and few.tolist() == sorted(few.tolist()) and set(few.tolist()) <= set(anchors.tolist())


def small(**kw) -> TrainConfig:
    base = dict(method="dflash", dflash_layers=2, block_size=4, dflash_anchors=64, tokens_per_batch=160,
                lr=3e-3, warmup_ratio=0.1, loader_workers=0, heldout_fraction=0.2, checkpoint_every=1000,
                log_every=5)  # fmt: skip
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("store", ["final", "topk"])
def test_the_trainer_learns_a_dflash_drafter_and_writes_it_as_sglang_loads_it(redis, tmp_path, tiny_model_dir, store):
    from eaglet.shared.layout import Layout

    layout = Layout(final="topk", topk=8) if store == "topk" else Layout()
    make_run(redis, tmp_path, tiny_model_dir, "d1", layer_ids=LAYERS, layout=layout)
    final = train(redis=redis, run_id="d1", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=small(epochs=8),
                  env=Dist())  # fmt: skip
    rows = [json.loads(x) for x in (checkpoints_dir(tmp_path, "d1") / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    progress = RunState(redis, "d1").train()
    assert len(progress.acc) == 3 and len(final["heldout_acc"]) == 3  # one figure per drafted block position
    folder = drafter_dir(tmp_path, "d1")
    config = json.loads((folder / "config.json").read_text())
    assert is_dflash(folder) and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in LAYERS]
    assert config["dflash_config"]["block_size"] == 4 and config["num_hidden_layers"] == 2
    assert config["num_target_layers"] == 6 and config["tie_word_embeddings"] is False
    mask = config["dflash_config"]["mask_token_id"]
    assert 0 <= mask < config["vocab_size"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.mlp.down_proj.weight"} <= names  # fmt: skip
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's, in the engine


def test_scaled_inputs_train_on_each_features_rms_and_are_folded_into_fc_as_served(redis, tmp_path, tiny_model_dir):
    from eaglet.services.trainer.checkpoint import load_latest_state
    from eaglet.services.trainer.data import load_sample, split_items
    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import sample_path, samples_dir

    make_run(redis, tmp_path, tiny_model_dir, "d5", layer_ids=LAYERS)
    train(redis=redis, run_id="d5", data_dir=tmp_path, target_dir=tiny_model_dir,
          cfg=small(max_steps=3, dflash_scale_inputs=True), env=Dist())  # fmt: skip
    saved = load_latest_state(checkpoints_dir(tmp_path, "d5"))
    shape = DFlashConfig(**saved["drafter_config"])
    live = DFlashDrafter(shape, torch.zeros(shape.vocab_size, shape.hidden_size))
    live.load_state_dict(saved["model"])
    # the scale is each feature's RMS over the training samples (the tiny run's fit under SCALE_TOKENS), their first
    # tokens left out
    train_items, _ = split_items(SampleSet(samples_dir(tmp_path, "d5")), list(range(24)), small().heldout_fraction)

    def aux(item) -> torch.Tensor:  # read as the trainer reads them, in bf16
        return load_sample(sample_path(tmp_path, "d5", item.sample_id), torch.bfloat16)["aux_hidden_states"][1:]

    rows = torch.cat([aux(it) for it in train_items]).float()
    assert torch.allclose(live.input_scale, 1 / rows.pow(2).mean(0).sqrt(), rtol=1e-4)
    assert live.input_scale.std() > 0  # the features' scales differ: not the identity
    served = load_dflash(drafter_dir(tmp_path, "d5"), torch.zeros(shape.vocab_size, shape.hidden_size))
    assert torch.equal(served.input_scale, torch.ones_like(served.input_scale))  # folded into fc
    aux, pos = rows[None, :20], torch.arange(20)[None]
    for (k1, v1), (k2, v2) in zip(live.context_kv(aux, pos), served.context_kv(aux, pos), strict=True):
        assert torch.allclose(k1, k2, atol=2e-2) and torch.allclose(v1, v2, atol=2e-2)  # bf16 weights served


def test_the_trainer_follows_the_runs_own_method(redis, tmp_path, tiny_model_dir):
    """A run ingested with ``--method dflash`` trains a DFlash drafter under the trainer's default ``auto``."""
    make_run(redis, tmp_path, tiny_model_dir, "d4", layer_ids=LAYERS,
             options=RunOptions(method="dflash", aux_layer_ids=LAYERS))  # fmt: skip
    train(redis=redis, run_id="d4", data_dir=tmp_path, target_dir=tiny_model_dir,
          cfg=small(method="auto", max_steps=2), env=Dist())  # fmt: skip
    assert is_dflash(drafter_dir(tmp_path, "d4"))
    make_run(redis, tmp_path, tiny_model_dir, "e4")  # a run that names no method: EAGLE-3
    train(redis=redis, run_id="e4", data_dir=tmp_path, target_dir=tiny_model_dir,
          cfg=small(method="auto", max_steps=2, ttt_steps=2, draft_vocab_size=256), env=Dist())  # fmt: skip
    assert not is_dflash(drafter_dir(tmp_path, "e4"))


def test_a_resumed_dflash_training_continues_from_its_checkpoint(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "d2", layer_ids=LAYERS)
    train(redis=redis, run_id="d2", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=small(max_steps=4),
          env=Dist())  # fmt: skip
    again = train(redis=redis, run_id="d2", data_dir=tmp_path, target_dir=tiny_model_dir,
                  cfg=small(max_steps=4), env=Dist())  # fmt: skip
    assert again["step"] == 4  # nothing left: the checkpoint's step, shape and mask token taken up
    # a checkpoint written before fc's inputs could be scaled resumes unscaled
    from eaglet.services.trainer.checkpoint import load_latest_state, save_state

    old = load_latest_state(checkpoints_dir(tmp_path, "d2"))
    del old["model"]["input_scale"]
    save_state(checkpoints_dir(tmp_path, "d2"), 4, old, keep=3)  # in place of the newest
    again = train(redis=redis, run_id="d2", data_dir=tmp_path, target_dir=tiny_model_dir,
                  cfg=small(max_steps=5), env=Dist())  # fmt: skip
    assert again["step"] == 5
    with pytest.raises(ValueError, match="dflash drafter, resumed as eagle3"):
        train(redis=redis, run_id="d2", data_dir=tmp_path, target_dir=tiny_model_dir,
              cfg=small(method="eagle3", max_steps=4), env=Dist())  # fmt: skip


def test_dflash_decoding_emits_the_targets_greedy_text(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "d3", layer_ids=LAYERS)
    train(redis=redis, run_id="d3", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=small(epochs=6), env=Dist())
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    embed = target.get_input_embeddings().weight.detach()
    drafter = load_dflash(drafter_dir(tmp_path, "d3"), embed.float()).eval()
    prompts = [[200 + (i * 3) % 60 for i in range(12)], [230, 231, 232, 233, 234, 235, 236]]
    for ids in prompts:
        x = torch.tensor([ids])
        got, stats = dflash_generate(target, drafter, x, 24, set())
        assert got == greedy_generate(target, x, 24, set())
        assert stats.rounds == len(stats.accepted) and all(0 <= a <= 3 for a in stats.accepted)

    class Tok:
        eos_token_id = None

    figures = run_eval(target, drafter, Tok(), prompts, k=3, max_new_tokens=24, layer_ids=[])
    assert figures["mismatches"] == 0 and len(figures["accept_rate"]) == 3
    assert 1 <= figures["accept_length"] <= 4


def test_a_dflash_drafter_is_accepted_on_its_texts_as_often_as_its_objective_scores_it(redis, tmp_path, tiny_model_dir):
    """Decoded as trained: on the texts it trained on (the tiny target is random, so only those are learnable), the
    reference engine accepts the drafts about as often as the objective's accuracy per position there predicts. A
    drafter decoded against other states, positions or tokens than those it trained on is accepted near never."""
    from eaglet.services.trainer.objective import heldout_figures
    from eaglet.services.trainer.train import start
    from eaglet.shared.acceptance import predicted_accept_length

    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[200 + (i * 7 + j) % 60 for j in range(6)] for i in range(12)]
    # the target's own greedy text: what decoding will verify against
    texts = [target.generate(torch.tensor([p]), max_new_tokens=34, do_sample=False)[0].tolist() for p in prompts]
    make_run(redis, tmp_path, tiny_model_dir, "d5", layer_ids=LAYERS, texts=texts)
    cfg = small(max_steps=60, heldout_fraction=0.0)
    train(redis=redis, run_id="d5", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    s = start(redis, "d5", tmp_path, tiny_model_dir, cfg, Dist())  # the finished training, resumed: its objective
    scored = heldout_figures(s.objective, s.train_items, data_dir=tmp_path, run_id="d5", tokens_per_batch=160,
                             max_len=cfg.max_len, device=torch.device("cpu"))  # fmt: skip
    predicted = predicted_accept_length(scored["heldout_acc"], 3)
    drafter = load_dflash(drafter_dir(tmp_path, "d5"), target.get_input_embeddings().weight.detach().float()).eval()

    class Tok:
        eos_token_id = None

    # decoded from where the trained answers start (make_run's loss mask: after the first third), to their end
    starts = [text[: len(text) // 3] for text in texts]
    figures = run_eval(target, drafter, Tok(), starts, k=3, max_new_tokens=27, layer_ids=[])
    assert figures["mismatches"] == 0
    assert predicted > 1.2 and figures["accept_length"] >= 0.8 * predicted, (figures["accept_length"], predicted)
