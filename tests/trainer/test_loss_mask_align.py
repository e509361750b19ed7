"""Which positions each loss-mask rule trains at each TTT step (``TrainConfig.loss_mask_align``): eaglet's rule (the
predicted token's mask) and SpecForge's (the mask moved on with the step), on hand-built masks, against SpecForge's
own shifting, and in the trainer."""

import json

import pytest
import torch

from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import make_objective, train
from eaglet.shared.store import checkpoints_dir
from tests.trainer.fixtures import make_run
from tests.trainer.test_train import small

# a prompt (0-2), an answer (3-6), the next turn's first tokens (7-11)
TURN = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])


def rows_by_step(mask: torch.Tensor, align: str, steps: int = 3, documents: torch.Tensor | None = None) -> list:
    rows, counts = data.ttt_rows(mask, documents, steps, align)
    return [r.tolist() for r in rows.split(list(counts))]


def test_predicted_trains_every_step_on_the_answer_tokens_alone():
    # step i at t predicts token t + 2 + i: the rows are the answer (3-6) moved back by 2 + i
    assert rows_by_step(TURN, "predicted") == [[1, 2, 3, 4], [0, 1, 2, 3], [0, 1, 2]]
    predicted = [[t + 2 + i for t in r] for i, r in enumerate(rows_by_step(TURN, "predicted"))]
    assert predicted == [[3, 4, 5, 6], [3, 4, 5, 6], [4, 5, 6]]  # step 2's chain from t = -1 does not exist


def test_position_trains_on_the_two_tokens_after_each_answer_token():
    # step i at t counts where mask[t + i]: the answer moved back by i, the tokens predicted two later
    assert rows_by_step(TURN, "position") == [[3, 4, 5, 6], [2, 3, 4, 5], [1, 2, 3, 4]]
    predicted = [[t + 2 + i for t in r] for i, r in enumerate(rows_by_step(TURN, "position"))]
    assert predicted == [[5, 6, 7, 8]] * 3  # never the answer's first two tokens, always the two after it


def test_position_at_a_samples_end_learns_the_targets_distribution_after_its_last_token():
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    assert rows_by_step(mask, "predicted", 2) == [[0, 1, 2], [0, 1]]
    # t = 3 at step 0 learns the distribution at 4, the last token's: there is no token 5 to predict
    assert rows_by_step(mask, "position", 2) == [[2, 3], [1, 2]]


def test_neither_rule_reaches_into_the_next_packed_document():
    mask = torch.ones(1, 12, dtype=torch.bool)
    docs = torch.tensor([[0] * 6 + [1] * 6])
    assert rows_by_step(mask, "predicted", 2, docs) == [[0, 1, 2, 3, 6, 7, 8, 9], [0, 1, 2, 6, 7, 8]]
    assert rows_by_step(mask, "position", 2, docs) == [[0, 1, 2, 3, 4, 6, 7, 8, 9, 10], [0, 1, 2, 3, 6, 7, 8, 9]]


def specforge_positions(mask: torch.Tensor, steps: int) -> list[list[int]]:
    """SpecForge 0.2.0's rule, as its offline trainer computes it: the sample's last mask entry zeroed
    (``normalize_offline_sample``), then at each step the positions whose entry is set, the mask shifted one to the
    left with a zero after every step (``padding(loss_mask, left=False)``); OOV positions aside."""
    m = mask.clone()
    m[-1] = 0
    out = []
    for _ in range(steps):
        out.append(torch.nonzero(m).flatten().tolist())
        m = torch.cat([m[1:], torch.zeros(1, dtype=m.dtype)])
    return out


@pytest.mark.parametrize("seed", range(5))
def test_position_is_specforges_rule_on_any_mask(seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(30, generator=g) < 0.6
    assert rows_by_step(mask[None], "position", 7) == specforge_positions(mask, 7)
    assert rows_by_step(mask[None], "predicted", 7) != specforge_positions(mask, 7)


def test_the_objective_trains_where_its_rule_says(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "ma", n=2)
    figures = {}
    for align in ("predicted", "position"):
        objective = make_objective(tiny_model_dir, torch.arange(512), small(loss_mask_align=align), Dist(),
                                   [1, 2, 3], None)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 500, (1, 12), generator=g)
        hidden = torch.randn(1, 12, objective.drafter.cfg.hidden_size, generator=g)
        aux = torch.randn(1, 12, 3 * objective.drafter.cfg.target_hidden_size, generator=g)
        # the rows worked out inside the forward (no packed batch given) are the rule's
        batch = data.collate([{"input_ids": ids[0], "loss_mask": TURN[0].bool(), "hidden_states": hidden[0],
                               "aux_hidden_states": aux[0]}], 100, 3, align)  # fmt: skip
        inner = objective(ids, TURN.bool(), hidden, aux)[0]
        packed = objective(ids, TURN.bool(), hidden, aux, loss_rows=batch["loss_rows"],
                           loss_row_counts=batch["loss_row_counts"])[0]  # fmt: skip
        assert torch.allclose(inner, packed)
        figures[align] = inner
    assert not torch.allclose(figures["predicted"], figures["position"])


def test_the_trainer_reads_its_batches_by_the_rule(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "mt", n=8)
    first = {}
    for align in ("predicted", "position"):
        out = tmp_path / align
        train(redis=None, run_id="mt", data_dir=tmp_path, target_dir=tiny_model_dir,
              cfg=small(max_steps=1, log_every=1, loss_mask_align=align), env=Dist(), out_dir=out)  # fmt: skip
        first[align] = json.loads((out / "checkpoints" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    # the same drafter, batch and seed: only the loss positions differ
    assert first["predicted"] != pytest.approx(first["position"], rel=1e-4)
    assert not (checkpoints_dir(tmp_path, "mt") / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="loss_mask_align"):
        TrainConfig(loss_mask_align="shifted")  # type: ignore[arg-type]
