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

Only at loss positions, when the request names them (``TOPK_ROWS_PARAM``: the spans of positions whose next token
is under the loss mask, ``loss_spans``): the LM-head product and the selection cost a share of the forward in
proportion to the rows scored, and a chat prompt's system and user turns are rows no loss reads. The dump's top-k
then holds those rows only, in position order, and so does the stored sample (shared/layout.py ``topk_rows``).
"""

from collections.abc import Iterator

import torch

from .layout import TopkError, check_k
from .tensorfile import row_blocks

TOPK_TENSORS = ("topk_ids", "topk_logp")
TOPK_PARAM = "eaglet_topk"
"""The request's ``sampling_params.custom_params`` key asking for the top-k distribution in the dump; its value: k."""
TOPK_ROWS_PARAM = "eaglet_topk_rows"
"""...and the positions to score: ``[[start, end], ...]`` spans of the prompt, rising and apart; absent: every one."""

Spans = tuple[tuple[int, int], ...]
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


def loss_spans(loss_mask: torch.Tensor) -> Spans:
    """The spans [start, end) of the positions whose next token is under ``loss_mask`` [T]: the rows a loss reads
    (position p predicts token p + 1), as few numbers as the prompt has answer turns."""
    m = torch.zeros(len(loss_mask) + 1, dtype=torch.int8)
    m[1:-1] = loss_mask[1:].bool().to(torch.int8)
    edges = torch.nonzero(m[1:] != m[:-1]).flatten().tolist()  # where a span starts or ends, in turn
    return tuple((edges[i], edges[i + 1]) for i in range(0, len(edges), 2))


def parse_spans(value: object, where: str) -> Spans:
    """``value`` (a request's ``TOPK_ROWS_PARAM``) as spans; ``ValueError`` naming ``where`` unless they are pairs
    of integers, each span not empty, rising and apart."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}={value!r}: give a list of [start, end] spans")
    spans, end = [], 0
    for span in value:
        if not (isinstance(span, list | tuple) and len(span) == 2 and all(type(x) is int for x in span)):
            raise ValueError(f"{where}: span {span!r} is not a pair of integers [start, end]")
        start, stop = span
        if not end <= start < stop:
            raise ValueError(f"{where}: span {list(span)} is empty, or overlaps or precedes the one before it")
        spans.append((start, stop))
        end = stop
    return tuple(spans)


def span_rows(spans: Spans | None, first: int, count: int) -> torch.Tensor | None:
    """The rows (int64 indices into ``[0, count)``) of the positions ``[first, first + count)`` (a prefill chunk)
    that ``spans`` covers; None: ``spans`` is None, every row."""
    if spans is None:
        return None
    last = first + count
    parts = [torch.arange(max(a, first), min(b, last)) - first for a, b in spans if a < last and b > first]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def spans_length(spans: Spans | None, num_tokens: int) -> int:
    """Rows a top-k over ``spans`` of a ``num_tokens`` prompt holds."""
    return num_tokens if spans is None else sum(min(b, num_tokens) - min(a, num_tokens) for a, b in spans)
