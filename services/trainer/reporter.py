"""Where a training's progress goes: rank 0 reports to the run's Redis record and series, the console bar,
``metrics.jsonl`` and the TensorBoard curves."""

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from eaglet.services.trainer.curves import Curves
from eaglet.shared.records import TrainProgress
from eaglet.shared.runstate import RunState
from eaglet.shared.series import TrainPoint, train_series


class Reporter:
    """Progress of rank 0 to Redis, the console bar, metrics.jsonl and the TensorBoard curves; other ranks report
    nothing."""

    def __init__(self, state: RunState | None, folder: Path, curves_folder: Path, enabled: bool):
        self.state, self.enabled = state, enabled
        self.series = train_series(state.redis, state.run_id) if state is not None else None
        self.metrics = folder / "metrics.jsonl"
        self.curves = Curves(curves_folder) if enabled else None
        self.bar: Progress | None = None
        self.task: TaskID | None = None

    def set(self, progress: TrainProgress) -> None:
        if self.enabled and self.state is not None:
            self.state.update_train(replace(progress, updated_at=time.time()))

    def point(self, point: TrainPoint, *, last: bool) -> None:
        """The report's figures into the run's capped training series (the page's charts); ``last``: the final step."""
        if self.enabled and self.series is not None:
            self.series.append(point.step, point, close=last)

    def start_bar(self, total: int, done: int) -> None:
        if self.enabled and sys.stderr.isatty():
            columns = [TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
            columns += [TextColumn("{task.fields[info]}"), TimeRemainingColumn()]
            self.bar = Progress(*columns)
            self.task = self.bar.add_task("train", total=total, completed=done, info="")
            self.bar.start()

    def step(self, step: int, info: str) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=step, info=info)

    def record(self, row: dict) -> None:
        if self.curves is not None:  # made when enabled
            with open(self.metrics, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.curves.step(row["step"], row["loss"], row["acc"], row["lr"], row["grad_norm"])

    def throughput(self, step: int, tokens_per_s: float) -> None:
        if self.curves is not None:
            self.curves.throughput(step, tokens_per_s)

    def heldout(self, step: int, figures: dict) -> None:
        self.set(TrainProgress(**figures))
        if self.curves is not None and figures and figures["heldout_loss"] is not None:
            self.curves.heldout(step, figures["heldout_loss"], figures["heldout_acc"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.curves is not None:
            self.curves.close()
