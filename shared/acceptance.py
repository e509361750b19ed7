"""What a drafter's training predicts for its served acceptance, and when a served figure falls short of it.

A chain of ``k`` drafted tokens accepts the first ``j`` when the first ``j`` positions are right; with position i
right at its held-out accuracy a_i, the expected accept length (the verified token included) is
1 + sum over j <= k of a_1 * ... * a_j. The positions' accuracies are not independent (a drafter right at position 2
is more often right at 3), so this is an estimate, not a bound; on a drafter served as it was trained the served
figure lands near it (2026-12-04's head-to-head drafter: 1.98 predicted, 1.85 served on its held-out prompts).
Far below it, the engine is not running the drafter that was trained.
"""

SERVED_FLOOR = 0.8
"""A served accept length below this share of the predicted one raises the run's ``served_acceptance`` alert."""

LIKELY_CAUSES = (
    "a drafter config key the engine ignored or reads otherwise (architectures, eagle_config / dflash_config, "
    "target layer ids), a vocabulary map (d2t / t2d) that does not match the target's vocabulary, a RoPE base or "
    "scaling other than the target's, or states of another dtype or quantization than those the drafter trained on"
)


def predicted_accept_length(heldout_acc: list[float] | None, positions: int) -> float | None:
    """1 + the sum over the first ``positions`` draft positions of the product of their held-out accuracies; None
    without accuracies. Positions past those measured count as misses (the prediction cannot see them)."""
    if not heldout_acc or positions < 1:
        return None
    total, chain = 1.0, 1.0
    for acc in heldout_acc[:positions]:
        chain *= min(max(float(acc), 0.0), 1.0)
        total += chain
    return total


def served_shortfall(served: float | None, predicted: float | None) -> bool:
    """Whether ``served`` is below SERVED_FLOOR of ``predicted`` (both known)."""
    return served is not None and predicted is not None and served < SERVED_FLOOR * predicted


def position_acceptance(histograms: list[list[int]]) -> dict:
    """Summed per-request histograms (entry n: verify steps that accepted exactly n drafts, SGLang's
    ``spec_accept_histogram``) -> ``accepted_drafts_histogram`` (the sum) and ``accept_rate_per_position``: the share
    of verify steps whose draft at position k (1-based) was accepted, i.e. that accepted at least k drafts. Empty
    without a verify step."""
    total: list[int] = []
    for h in histograms:
        total += [0] * (len(h) - len(total))
        total = [a + int(b) for a, b in zip(total, h + [0] * (len(total) - len(h)), strict=True)]
    steps = sum(total)
    if not steps:
        return {}
    return {"accepted_drafts_histogram": total,
            "accept_rate_per_position": [round(sum(total[k:]) / steps, 4) for k in range(1, len(total))]}  # fmt: skip
