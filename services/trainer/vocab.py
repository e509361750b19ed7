"""The draft vocabulary: the most frequent target tokens of the loss-masked (assistant) text.

The drafter predicts only these ``draft_vocab_size`` tokens. Checkpoint tensors, as SGLang and vLLM read them:
``d2t`` int64 [Vd] = target_id - draft_id (SGLang: ``hot_token_id = d2t + arange(Vd)``), and ``t2d`` bool [V],
true where a target token is in the draft vocabulary (ignored by both engines, kept for training tools).
"""

import logging
from collections.abc import Iterable

import numpy as np
import torch

log = logging.getLogger(__name__)


def count_tokens(samples: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """Counts [V] of the tokens under the loss mask; ``samples`` yields (input_ids int [T], loss_mask [T])."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in samples:
        counts += np.bincount(ids[mask.astype(bool)], minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab(counts: np.ndarray, draft_vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """Target ids of the draft vocabulary [Vd], sorted ascending (so ``d2t`` is non-negative and monotone).

    ``always`` (e.g. the end-of-turn token) is kept whatever its count. Ties and unseen tokens fill the rest in
    target-id order, so the vocabulary is the same on every rank and every rerun.
    """
    V = len(counts)
    if draft_vocab_size > V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({V})")
    score = counts.astype(np.float64)
    for t in always:
        score[t] = np.inf
    # stable sort on -score: equal counts keep ascending id order
    chosen = np.sort(np.argsort(-score, kind="stable")[:draft_vocab_size])
    covered = counts[chosen].sum() / max(counts.sum(), 1)
    log.info(
        "draft vocabulary: %d of %d tokens cover %.2f%% of the loss-masked tokens", draft_vocab_size, V, 100 * covered
    )
    return torch.from_numpy(chosen.astype(np.int64))


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) of a draft vocabulary."""
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d
