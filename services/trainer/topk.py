"""The loss on a stored top-k distribution (shared/topk.py) instead of the target's final state.

The stored entries are the target's k most likely tokens over its whole vocabulary, with their log-probabilities.
Mapped onto the draft vocabulary, some fall outside it; what the k entries leave of the mass (the tail) is not
known token by token. The tail is kept as **one bucket**: the target's distribution over the draft vocabulary
becomes the k' entries in it plus a bucket holding ``1 - sum of the k stored probabilities``, renormalized
together; the drafter's distribution is bucketed the same way (its probabilities of those k' tokens, and the rest
of its mass as the bucket). The KL is taken over these k' + 1 outcomes.

Why a bucket and not renormalizing the k' entries alone: renormalizing tells the drafter the tail is empty, so it
learns to pile the tail's mass onto the top tokens, overconfident exactly where the target is unsure (and the
acceptance of a draft, sum of min(p, q), pays for every misplaced bit of q). With the bucket, the drafter is only
told how much mass lies outside the top tokens, not where. The bucketed KL is a lower bound of the full one
(merging outcomes never raises a KL) and equals it when the tail is empty. The bucket's target mass counts tail
mass outside the draft vocabulary too (unknown at extraction, where the draft vocabulary is not yet chosen): an
upper bound of the draft vocabulary's own tail, small at the k where the top-k holds nearly all the mass.

What the bucket does not say is where the tail lies, and the drafter may put it anywhere: heaped on one token of
its own, whose probability then tops the k' entries. Where the k entries hold little of the mass (a flat target,
high-entropy text) the bucketed KL reaches 0 with a drafter whose top token is never the target's (a tiny random
target's top-32 run: held-out accuracy 0.01 where the final state's gave 0.54). ``--topk-tail uniform`` says
instead that the tail lies evenly on the draft tokens outside the k' entries: the KL over the whole draft
vocabulary against that spread, which holds the drafter's tail flat and its top token on the target's. On SmolLM2
the bucket accepted more (CPU, two seeds, within noise; SGLang on one H200: +2.0 % / +1.6 % over bf16 against the
uniform tail's +0.2 % / +1.1 %: BENCHMARKS.md section 4b), so it is the default.

The acceptance of the LK losses, sum over the draft vocabulary of min(p, q) with p over the whole vocabulary, is
exact over the k' entries and takes the bucket's min(p_tail, q_tail) for the rest (an upper bound of the tail's
share). The top-token check compares the drafter's top token with the target's most likely entry in the draft
vocabulary; a token whose k entries are all outside it counts as a miss.
"""

import torch

_TINY = 1e-30


def draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """[V] int64: each target id's index in the draft vocabulary, -1 for those outside (t2d: bool [V])."""
    return torch.where(t2d, torch.cumsum(t2d, 0) - 1, -1)


def topk_terms(logp: torch.Tensor, idx: torch.Tensor, logq: torch.Tensor, tail: str = "bucket") -> torch.Tensor:
    """logp [N, k] (target log-probs over its whole vocabulary, most likely first), idx [N, k] (their draft ids,
    -1 outside the draft vocabulary), logq [N, Vd] (the drafter's log-probs) -> [KL, right top token, expected
    acceptance, its log] of each of the N positions [4, N], with the tail as one bucket, or for the KL spread evenly
    on the draft tokens outside the k entries (``tail`` uniform)."""
    inside = idx >= 0
    p_all = logp.float().exp()  # [N, k]
    p = p_all * inside
    p_tail = (1 - p_all.sum(-1)).clamp_min(0)  # [N]
    q = logq.exp().gather(-1, idx.clamp_min(0)) * inside  # [N, k]
    q_tail = (1 - q.sum(-1)).clamp_min(0)
    z = (p.sum(-1) + p_tail).clamp_min(_TINY)
    pn, tn = p / z[:, None], p_tail / z
    log_qk = logq.gather(-1, idx.clamp_min(0))
    kl_k = torch.where(inside & (pn > 0), pn * (pn.clamp_min(_TINY).log() - log_qk), 0.0).sum(-1)
    if tail == "uniform":  # tn / n on each of the n draft tokens outside the k': sum of u (log u - log q_v)
        n = (logq.shape[-1] - inside.sum(-1)).clamp_min(1)
        u = tn / n
        logq_tail = logq.sum(-1) - (log_qk * inside).sum(-1)
        kl_tail = torch.where(tn > 0, tn * u.clamp_min(_TINY).log() - u * logq_tail, 0.0)
    else:
        kl_tail = torch.where(tn > 0, tn * (tn.clamp_min(_TINY).log() - q_tail.clamp_min(_TINY).log()), 0.0)
    kl = kl_k + kl_tail
    # the stored entries fall in probability: the first one inside the draft vocabulary is the target's top there
    first = inside.float().argmax(-1, keepdim=True)
    target_top = idx.gather(-1, first).squeeze(-1)
    hits = ((logq.argmax(-1) == target_top) & inside.any(-1)).float()
    accept = torch.minimum(p, q).sum(-1) + torch.minimum(p_tail, q_tail)  # [N]
    log_accept = torch.where(accept > 0, accept.clamp_min(_TINY).log(), torch.zeros_like(accept))
    return torch.stack([kl, hits, accept, log_accept])
