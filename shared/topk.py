"""The target's top-k distribution, stored in place of its final state.

What the trainer reads of the final state is the target's next-token distribution at loss positions. Its k most
likely tokens carry almost all of it: ``topk_ids`` int32 [T, k] (target token ids, most likely first) and
``topk_logp`` float16 [T, k] (their log-probabilities over the target's whole vocabulary), 6 bytes an entry where
the final state costs 2 x hidden (Kimi-K2.5: 192 bytes at k = 32 against 14,336).

Over the whole vocabulary, not the draft one: the draft vocabulary is chosen by the trainer from the run's own
loss tokens after extraction (and a recipe may choose another size), so the stored distribution must not depend on
it. The trainer maps the ids onto its draft vocabulary and treats the rest of the mass as one bucket
(services/trainer/topk.py).

The server computes it (it alone holds the LM head), with ``encode_topk``: plain torch, on its GPU or on the CPU.
"""

from collections.abc import Iterator

import torch

from .layout import TopkError, check_k
from .tensorfile import row_blocks

TOPK_TENSORS = ("topk_ids", "topk_logp")
TOPK_PARAM = "eaglet_topk"
"""The request's ``sampling_params.custom_params`` key asking for the top-k distribution in the dump; its value: k."""
_LOGITS_BYTES = 256 << 20
_LOGP_SLACK = 1e-2  # float16 rounding of a log-probability near 0
_CHUNK = 64  # columns a chunk in ``top_logits``: about sqrt(V / k), so the maxima (V / 64 a row) and the candidates
# (64 k a row) stay small at every vocabulary of interest (49,152 to 163,840 at k 16 to 32)


def encode_topk(final: torch.Tensor, lm_head: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """final [T, H] (after the final norm), lm_head [V, H] -> (int32 ids [T, k], float16 log-probs [T, k]) on
    final's device. Rows in blocks: the logits of a long prompt (T x V floats) never exist whole."""
    check_k(k, lm_head.shape[0])
    ids = torch.empty(final.shape[0], k, dtype=torch.int32, device=final.device)
    logp = torch.empty(final.shape[0], k, dtype=torch.float16, device=final.device)
    for rows in logit_blocks(final, lm_head.shape[0]):
        logits = final[rows] @ lm_head.T  # [t, V] in the states' dtype
        values, top = top_logits(logits, k)
        lse = torch.logsumexp(logits.float(), -1, keepdim=True)
        ids[rows], logp[rows] = top.to(torch.int32), (values.float() - lse).to(torch.float16)
    return ids, logp


def logit_blocks(final: torch.Tensor, vocab_size: int) -> Iterator[slice]:
    """Row blocks of ``final`` [T, H] whose logits over ``vocab_size`` tokens take about 256 MiB in float32."""
    return row_blocks(final, _LOGITS_BYTES // (4 * vocab_size) * 4 * final.shape[1])


def top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``logits`` [t, V] and their columns (int64), largest first: the values of
    ``logits.topk(k)`` (columns may differ only among equal values), without a selection over all V columns.

    Why it is exact: a chunk of _CHUNK columns that holds one of a row's k largest has its maximum at least the
    k-th largest, and at most k chunks do, so the k chunks of largest maxima hold all of them; the selection then
    runs over k x _CHUNK columns (the last, partial chunk always kept). bench/gpu/devicecost.py times it against
    the selection over every column."""
    t, V = logits.shape
    n = V // _CHUNK
    if n <= 4 * k:  # a small vocabulary: the chunks would not spare much
        return logits.topk(k, dim=-1)
    body = logits[:, : n * _CHUNK].unflatten(1, (n, _CHUNK))
    chunks = body.amax(-1).topk(k, dim=-1).indices  # [t, k]
    columns = chunks.unsqueeze(-1) * _CHUNK + torch.arange(_CHUNK, device=logits.device)  # [t, k, _CHUNK]
    values = body.gather(1, chunks.unsqueeze(-1).expand(t, k, _CHUNK)).flatten(1)
    columns = columns.flatten(1)
    if V > n * _CHUNK:
        values = torch.cat([values, logits[:, n * _CHUNK :]], 1)
        columns = torch.cat([columns, torch.arange(n * _CHUNK, V, device=logits.device).expand(t, -1)], 1)
    values, pick = values.topk(k, dim=-1)
    return values, columns.gather(1, pick)


def check_topk(ids: torch.Tensor, logp: torch.Tensor, *, rows: int, k: int, vocab_size: int, where: str) -> None:
    """Raises ``TopkError`` naming ``where`` and the first bad token unless (ids, logp) is ``rows`` tokens' top-k
    distribution over a vocabulary of ``vocab_size``: ids in range and distinct enough to be sorted by
    probability, log-probabilities finite, at most 0, falling, and summing to at most 1 in probability."""
    for name, t, dtype in (("topk_ids", ids, torch.int32), ("topk_logp", logp, torch.float16)):
        if t.dtype != dtype or tuple(t.shape) != (rows, k):
            raise TopkError(f"{where}: {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} ({rows}, {k})")
    for block in row_blocks(logp, 8 << 20):
        i, p = ids[block], logp[block].float()
        checks = (
            ("an id outside the vocabulary", ((i < 0) | (i >= vocab_size)).any(-1)),
            ("a log-probability that is not finite or above 0", ~(torch.isfinite(p) & (p <= _LOGP_SLACK)).all(-1)),
            ("log-probabilities not in falling order", (p[:, 1:] > p[:, :-1]).any(-1)),
            ("probabilities summing past 1", p.exp().sum(-1) > 1 + k * _LOGP_SLACK),
        )
        for what, bad in checks:
            if bool(bad.any()):
                token = block.start + int(bad.nonzero()[0, 0])
                raise TopkError(f"{where}: top-k distribution has {what} (first at token {token})")
