"""Stored samples the trainer cannot read (a truncated file, a bad header): skipped, not the end of the run.

The loader (``data.BatchSet``, in its worker processes too) leaves such a sample out of its batch and names it in
the batch's ``unreadable``; the training loop hands every batch to ``UnreadableSamples.note``, which logs each one
once, naming its file and sample id, and records it in the run's state: its error among the run's errors (what
``/status`` lists in ``last_errors``) and the count of unreadable samples in the training's record. The run fails,
saying so, once more than ``max_unreadable`` of its samples are unreadable: a store that lost that much is a
problem to fix, not to train around."""

import logging

from eaglet.services.trainer import data
from eaglet.shared.runstate import RunState

log = logging.getLogger(__name__)


class TooManyUnreadable(RuntimeError):
    """More of the run's stored samples are unreadable than the training allows."""


class UnreadableSamples:
    """The unreadable samples a training met, against its allowance: ``share`` of its ``samples``. With the run's
    state (``state``) the count is the run's, over every process and resumption; without it, this process's."""

    def __init__(self, run_id: str, state: RunState | None, samples: int, share: float):
        self.run_id, self.state = run_id, state
        self.allowed = share * samples
        self.samples = samples
        self.seen: set[str] = set()

    def note(self, batch: data.Batch) -> None:
        """Logs and records the batch's unreadable samples not met before; TooManyUnreadable past the allowance."""
        for bad in batch.get("unreadable", ()):
            if bad.sample_id in self.seen:
                continue
            self.seen.add(bad.sample_id)
            log.error("run %s: sample %s (index %d) skipped: its stored file %s cannot be read: %s",
                      self.run_id, bad.sample_id, bad.index, bad.path, bad.reason)  # fmt: skip
            reason = f"trainer: stored file {bad.path} unreadable, sample skipped: {bad.reason}"
            count = self.state.record_unreadable(bad.index, bad.sample_id, reason) if self.state else len(self.seen)
            if count > self.allowed:
                raise TooManyUnreadable(
                    f"run {self.run_id}: {count} of its {self.samples} samples have unreadable stored files "
                    f"(the newest: {bad.sample_id}, {bad.path}: {bad.reason}), more than --max-unreadable allows "
                    f"({self.allowed:.1f}): the run's errors list each one"
                )
