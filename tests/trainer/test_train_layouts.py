"""Training on the storage layouts: the loss-positions layout gives the very figures of the full one, the top-k loss
equals the full KL when the top-k holds the whole draft vocabulary and stays below it otherwise (its uniform tail: the
full KL against an even tail, and a top token kept on the target's), a top-k run and a 4-bit run learn."""

import json

import pytest
import torch

from eaglet.services.trainer.topk import draft_index, topk_terms
from eaglet.services.trainer.train import Dist, train
from eaglet.shared.layout import Layout
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.store import checkpoints_dir
from tests.trainer.fixtures import make_run
from tests.trainer.test_dflash import LAYERS as DFLASH_LAYERS
from tests.trainer.test_dflash import small as dflash_small
from tests.trainer.test_train import small


def full_kl(tlogp: torch.Tensor, logq: torch.Tensor) -> float:
    return float((tlogp.exp() * (tlogp - logq)).sum())


def test_topk_loss_is_the_full_kl_when_nothing_is_left_out_and_a_lower_bound_otherwise():
    g = torch.Generator().manual_seed(0)
    V, Vd, N = 40, 16, 7
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:Vd]] = True
    index = draft_index(t2d)
    assert torch.equal(torch.nonzero(index >= 0).flatten(), torch.nonzero(t2d).flatten())
    logits = torch.randn(N, V, generator=g) * 2
    logits[:, ~t2d] = -1e4  # the whole mass inside the draft vocabulary
    logp_full = torch.log_softmax(logits, -1)
    logq = torch.log_softmax(torch.randn(N, Vd, generator=g), -1)
    tlogp = torch.log_softmax(logits[:, t2d], -1)  # what the trainer forms from the final states
    values, ids = logp_full.topk(Vd, -1)
    kl, hits, accept, _ = topk_terms(values, index[ids], logq).sum(-1)  # per position: summed
    assert float(kl) == pytest.approx(full_kl(tlogp, logq), rel=1e-4)
    assert float(hits) == float((logq.argmax(-1) == tlogp.argmax(-1)).sum())
    assert float(accept) == pytest.approx(float(torch.minimum(tlogp.exp(), logq.exp()).sum()), rel=1e-4)
    for k in (1, 4, 8):
        values, ids = logp_full.topk(k, -1)
        assert float(topk_terms(values, index[ids], logq)[0].sum()) <= full_kl(tlogp, logq) + 1e-5


def test_topk_loss_moves_the_drafter_toward_the_target_and_puts_the_tail_in_its_bucket():
    logp = torch.log(torch.tensor([[0.6, 0.3]]))  # a tail of 0.1
    idx = torch.tensor([[0, 1]])
    logits = torch.zeros(1, 5, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)
    for _ in range(500):
        kl = topk_terms(logp, idx, torch.log_softmax(logits, -1))[0].sum()
        opt.zero_grad()
        kl.backward()
        opt.step()
    q = torch.softmax(logits, -1)[0]
    assert q[0].item() == pytest.approx(0.6, abs=0.02) and q[1].item() == pytest.approx(0.3, abs=0.02)
    assert q[2:].sum().item() == pytest.approx(0.1, abs=0.02)  # not piled onto the top tokens
    assert kl.item() < 1e-3


def test_the_uniform_tail_is_the_full_kl_against_a_target_whose_tail_is_even():
    g = torch.Generator().manual_seed(1)
    Vd, k = 12, 3
    p = torch.full((2, Vd), 0.4 / (Vd - k))
    p[:, :k] = torch.tensor([0.3, 0.2, 0.1])  # the top 3 hold 0.6, the rest 0.4 evenly
    logq = torch.log_softmax(torch.randn(2, Vd, generator=g), -1)
    values, ids = p.log().topk(k, -1)
    kl = topk_terms(values, ids, logq, "uniform")[0].sum()
    assert float(kl) == pytest.approx(full_kl(p.log(), logq), rel=1e-4)
    assert float(topk_terms(values, ids, logq, "bucket")[0].sum()) < float(kl)  # the bucket: a lower bound


def test_a_flat_target_lets_the_bucket_heap_the_tail_on_one_token_and_the_uniform_tail_does_not():
    # the top 4 of 200 hold 0.2 of the mass (a high-entropy position); the drafter starts favouring token 100
    logp = torch.log(torch.tensor([[0.08, 0.05, 0.04, 0.03]]))
    idx = torch.tensor([[0, 1, 2, 3]])
    start = torch.zeros(1, 200)
    start[0, 100] = 6.0
    for tail, top in (("bucket", 100), ("uniform", 0)):
        logits = start.clone().requires_grad_(True)
        opt = torch.optim.SGD([logits], lr=1.0)
        for _ in range(300):
            kl = topk_terms(logp, idx, torch.log_softmax(logits, -1), tail)[0].sum()
            opt.zero_grad()
            kl.backward()
            opt.step()
        assert int(logits.argmax()) == top, tail
        assert topk_terms(logp, idx, torch.log_softmax(logits, -1), tail)[1].item() == float(top == 0)


def losses_of(data_dir, run_id) -> list[float]:
    rows = (checkpoints_dir(data_dir, run_id) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in rows]


TOPK16 = Layout(final="topk", topk=16)


@pytest.mark.parametrize(
    ("full", "narrow", "method"),
    [
        (Layout(), Layout(final="loss"), "eagle3"),
        (TOPK16, Layout(final="topk", topk=16, topk_rows="loss"), "eagle3"),
        (TOPK16, Layout(final="topk", topk=16, topk_rows="loss"), "dflash"),
    ],
    ids=["final-at-loss-positions", "topk-at-loss-positions", "dflash-topk-at-loss-positions"],
)
def test_a_layout_at_loss_positions_trains_exactly_as_the_full_one(redis, tmp_path, tiny_model_dir, full, narrow,
                                                                   method):  # fmt: skip
    """Training reads the final state (or its top-k) at loss positions only: keeping those rows alone changes
    nothing, for either drafter."""
    dflash = method == "dflash"
    kw = (
        dict(layer_ids=DFLASH_LAYERS, options=RunOptions(method="dflash", aux_layer_ids=DFLASH_LAYERS))
        if dflash
        else {}
    )
    make_run(redis, tmp_path / "a", tiny_model_dir, "all", n=8, layout=full, **kw)
    make_run(redis, tmp_path / "b", tiny_model_dir, "loss", n=8, layout=narrow, **kw)
    cfg = (dflash_small if dflash else small)(epochs=1, heldout_fraction=0.3)
    figures = [
        train(redis=redis, run_id=run, data_dir=tmp_path / d, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
        for run, d in (("all", "a"), ("loss", "b"))
    ]
    assert losses_of(tmp_path / "a", "all") == losses_of(tmp_path / "b", "loss")
    assert figures[0]["heldout_loss"] == figures[1]["heldout_loss"]


@pytest.mark.parametrize(
    ("layout", "tail"),
    [(Layout(final="topk", topk=16), "bucket"), (Layout(final="topk", topk=16), "uniform"), (Layout(aux="fp4"), "")],
    ids=["topk16", "topk16-uniform-tail", "fp4"],
)
def test_a_run_of_each_narrow_layout_learns(redis, tmp_path, tiny_model_dir, layout, tail):
    make_run(redis, tmp_path, tiny_model_dir, "narrow", layout=layout)
    cfg = small(epochs=6, heldout_fraction=0.3, **({"topk_tail": tail} if tail else {}))
    final = train(redis=redis, run_id="narrow", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    losses = losses_of(tmp_path, "narrow")
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    assert final["heldout_loss"] is not None
