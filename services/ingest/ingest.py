"""Streams a JSONL dataset into a run's sample arrays, one line at a time.

A bad line is reported (file, line number, reason) and skipped; the rest goes on. Samples are handed
to ``on_sample`` as they are stored, so extraction can start before the file has been read to the end.
The result doubles as the cursor: where in the file reading stopped and what it counted, so an ingest
whose process died is taken up from its last flush.
"""

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from eaglet.services.ingest.chat import tokenize_conversation
from eaglet.shared import chatlines
from eaglet.shared.chatlines import BadLine, Conversation, parse_line
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.samples import SampleWriter

log = logging.getLogger(__name__)


@dataclass
class IngestResult:
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    bad_lines: int = 0
    lines: int = 0
    """Lines read so far, blank ones included: the line number of the last one."""
    offset: int = 0
    """Byte offset of the next unread line."""
    errors: list[str] = field(default_factory=list)  # the first few, for the console

    def cursor(self) -> dict:
        """What a resumed ingest starts from (``IngestResult(**cursor)``): everything but the console's errors."""
        return {k: v for k, v in asdict(self).items() if k != "errors"}


def ingest_dataset(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    writer: SampleWriter,
    options: RunOptions,
    *,
    vocab_size: int,
    on_error: Callable[[str, str], None],
    on_sample: Callable[[int], None],
    result: IngestResult | None = None,
    earlier_ids: Iterable[str] = (),
) -> IngestResult:
    """Reads ``path`` line by line; ``on_error(sample_id, message)``, ``on_sample(index)`` as they happen.

    ``result``: the cursor of an ingest taken up again (it is updated in place); ``earlier_ids``: the ids
    that ingest already stored, so duplicates of them are still caught."""
    result = result or IngestResult()
    first_line_of: dict[str, int | None] = dict.fromkeys(earlier_ids)
    with open(path, "rb") as f:
        f.seek(result.offset)
        for line_no, raw, size in chatlines.read_lines(f, result.lines + 1):
            result.lines, result.offset = line_no, f.tell()
            if raw is not None and not raw.strip():
                continue
            if options.limit is not None and result.samples >= options.limit:
                break
            sample_id = ""
            try:
                if raw is None:
                    raise chatlines.oversize(size)
                record = parse_line(raw)
                sample_id = record.sample_id
                if sample_id in first_line_of:
                    first = first_line_of[sample_id]
                    raise BadLine(f"duplicate id {sample_id!r} (first at line {first or 'before the resume'})")
                ids, mask = _tokens(record, tokenizer)
                if max(ids) >= vocab_size:
                    raise BadLine(f"token id {max(ids)} outside the model's vocabulary of {vocab_size}")
                ids, mask, truncated = _fit(ids, mask, options)
                if not any(mask[1:]):  # a loss reads the target at the token before each one it predicts
                    raise BadLine("no assistant token after the first token: nothing to train on")
            except BadLine as e:
                message = f"{path.name}:{line_no}: {e}"
                result.bad_lines += 1
                if len(result.errors) < 20:
                    result.errors.append(message)
                log.warning("ingest %s", message)
                on_error(sample_id, message)
                continue
            first_line_of[sample_id] = line_no
            index = writer.append(sample_id, ids, mask)
            result.samples += 1
            result.tokens += len(ids)
            result.loss_tokens += sum(mask)
            result.truncated += truncated
            on_sample(index)
    return result


def _tokens(record, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    if isinstance(record, Conversation):
        return tokenize_conversation(tokenizer, record.messages)
    return record.input_ids, record.loss_mask


def _fit(ids: list[int], mask: list[int], options: RunOptions) -> tuple[list[int], list[int], bool]:
    if len(ids) <= options.max_tokens:
        return ids, mask, False
    if options.overlong == "reject":
        raise BadLine(f"{len(ids)} tokens exceeds max_tokens={options.max_tokens} (overlong=reject)")
    ids, mask = ids[: options.max_tokens], mask[: options.max_tokens]
    if not any(mask[1:]):
        raise BadLine(f"no assistant token left after truncation to {options.max_tokens} tokens")
    return ids, mask, True
