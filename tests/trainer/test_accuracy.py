"""Accuracy counts every loss position: one whose target token is outside the draft vocabulary is a miss, as
SpecForge counts it, so figures compare across draft vocabularies and with SpecForge's."""

import torch
import torch.nn.functional as F

from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.model import Drafter, DrafterConfig
from eaglet.services.trainer.objective import TTTObjective

V, H, VD, T = 40, 40, 8, 12


def test_a_drafter_right_wherever_it_can_be_scores_the_in_vocabulary_share():
    # target head = identity: the target's top token at t is the one-hot in hidden_states[t]
    tokens = torch.tensor([[3, 30, 1, 2, 25, 5, 6, 33, 7, 0, 39, 4]])  # ids < VD are in the draft vocabulary
    hidden = 5 * F.one_hot(tokens, V).float() + 0.01 * torch.randn(1, T, V, generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(1, T, dtype=torch.bool)
    loss_mask[0, :3] = False
    cfg = DrafterConfig(hidden_size=H, intermediate_size=16, num_attention_heads=5, num_key_value_heads=5,
                        vocab_size=V, draft_vocab_size=VD)  # fmt: skip
    drafter = Drafter(cfg, torch.randn(V, H))
    with torch.no_grad():
        drafter.lm_head.weight.copy_(torch.eye(V)[:VD])
    # each step's output is the target's own state for the token it predicts: right wherever the draft vocab allows
    drafter.unroll = lambda ids, aux, steps, attention, **options: [
        F.pad(hidden[:, 1 + i :], (0, 0, 0, 1 + i)) for i in range(steps)
    ]
    objective = TTTObjective(drafter, torch.eye(V), TrainConfig(ttt_steps=3), "math", oov=True).eval()
    objective.set_vocab(torch.arange(VD))
    _, _, acc = objective(torch.zeros(1, T, dtype=torch.long), loss_mask, hidden, torch.zeros(1, T, 3 * H))
    for i in range(3):
        predicted = tokens[0, 1 + i : T - 1]  # step i at t predicts the target's top token at t + 1 + i
        positions = loss_mask[0, 2 + i :]
        expected = (positions & (predicted < VD)).sum() / positions.sum()
        assert 0 < expected < 1
        assert float(acc[i]) == float(expected), (i, acc)
