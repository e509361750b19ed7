"""A stop asked of a training in progress (SIGTERM: a scheduler's preemption, a supervisor's stop, a job's time
limit) ends it at the next step with a checkpoint, so a rerun resumes where it stopped, not at the checkpoint before.

The signal only sets a flag; the loop reads it between steps (and, with several processes, votes on it with its
other per-step decision, so every process stops at the same step). More SIGTERMs change nothing: a caller that must
end the process at once sends SIGKILL. The loader's workers ignore SIGTERM (``data.ignore_sigterm``), so one sent to
the whole process group leaves them reading until the loop ends them itself.
"""

import logging
import signal
import threading
from types import FrameType, TracebackType

log = logging.getLogger(__name__)


class Preempted(Exception):
    """The training stopped on request after writing a checkpoint; the message says at which step and where."""


class StopOnSignal:
    """While entered, SIGTERM sets ``requested`` instead of ending the process (main thread only: elsewhere Python
    cannot install a handler, and the flag is never set)."""

    def __init__(self) -> None:
        self.requested = False
        self._installed = False
        self._previous: object = None

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            log.warning("SIGTERM: stopping after this step, with a checkpoint")
        self.requested = True
