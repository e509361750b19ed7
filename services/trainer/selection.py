"""Checkpoint choice: the drafter a run exports, chosen among its epochs' drafters.

Served acceptance often peaks epochs before the loss stops falling, so the last epoch's drafter is not always the
best one. With ``TrainConfig.keep_epochs`` the trainer keeps each epoch's drafter, as SGLang loads it and with the
held-out figures every export carries, in ``<run>/epochs/<epoch>/drafter/`` (``keep``). After training,
``select`` picks one by ``--select-by``:

- ``last``: the drafter training ended with (nothing kept, nothing copied);
- ``predicted``: the highest accept length its held-out accuracy per position predicts (``shared/acceptance.py``);
- ``served``: the ``top`` best predicted, each decoded by the evaluation engine (``serve``), the highest served
  accept length; the prediction breaks ties, then the later epoch.

The winner is copied to ``<run>/drafter/`` (unless it is the drafter already there), the train record's held-out
figures become the winner's (so the prediction shown beside the served figure is the exported drafter's), and
``<run>/selection.json`` and the record's ``selection`` line say which epoch won and on what figure. The folder
holds one entry per epoch: reading it is bounded by the epochs, not the samples.
"""

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from eaglet.services.trainer.checkpoint import carried_heldout, replace_folder
from eaglet.shared.acceptance import predicted_accept_length
from eaglet.shared.records import TrainProgress
from eaglet.shared.runoptions import SelectBy
from eaglet.shared.runstate import RunState

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    epoch: int  # 1-based: the epochs done when it was kept
    step: int | None
    drafter: Path
    heldout_loss: float | None
    heldout_acc: list[float] | None
    predicted: float | None = None
    served: float | None = None


def epochs_dir(run_folder: Path) -> Path:
    """Where a run's (or a recipe's ``out_dir``'s) epochs are kept: beside its ``drafter/``."""
    return Path(run_folder) / "epochs"


def keep(root: Path, epoch: int, drafter: Path) -> Path:
    """Copies the exported ``drafter`` folder, with the held-out figures it carries (``checkpoint.HELDOUT``), to
    ``root/<epoch>/drafter``; written aside and renamed, so a crash leaves no half-copied candidate."""
    final = root / f"{epoch:04d}"
    partial = root / f".{epoch:04d}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(drafter, partial / "drafter")
    shutil.rmtree(final, ignore_errors=True)  # a resumed run's epoch, kept again
    partial.rename(final)
    return final


def candidates(root: Path, positions: int) -> list[Candidate]:
    """The kept epochs, oldest first, each with its predicted accept length at ``positions`` draft positions (None
    without held-out figures). One whose figures cannot be read is left out, its file named in the log."""
    found = []
    for folder in sorted(p for p in root.glob("[0-9]*") if p.is_dir()):
        try:
            figures = carried_heldout(folder / "drafter") or {}
        except ValueError as e:
            log.error("%s; left out of the choice", e)
            continue
        c = Candidate(int(folder.name), figures.get("step"), folder / "drafter", figures.get("heldout_loss"),
                      figures.get("heldout_acc"))  # fmt: skip
        c.predicted = predicted_accept_length(c.heldout_acc, positions)
        found.append(c)
    return found


def choose(found: list[Candidate], select_by: SelectBy, top: int, serve: Callable[[Path], float | None]) -> Candidate:
    """The winner of ``found`` (not empty) by ``select_by``; ``serve`` gives a drafter folder's served accept length
    (called for the ``top`` best predicted only, with ``served``)."""
    if select_by == "last":
        return max(found, key=lambda c: c.epoch)

    def predicted(c: Candidate) -> tuple[float, int]:
        return (c.predicted if c.predicted is not None else float("-inf"), c.epoch)

    ranked = sorted(found, key=predicted, reverse=True)
    if select_by == "predicted":
        return ranked[0]
    for c in ranked[:top]:
        c.served = serve(c.drafter)
        log.info("epoch %d (step %s): served accept length %s, predicted %s", c.epoch, c.step, c.served, c.predicted)
    tried = [c for c in ranked[:top] if c.served is not None]
    if not tried:
        raise RuntimeError(f"--select-by served: none of epochs {[c.epoch for c in ranked[:top]]} was served")
    return max(tried, key=lambda c: (c.served, *predicted(c)))


def export(winner: Candidate, drafter_dir: Path) -> None:
    """``drafter_dir`` becomes a copy of the winner's drafter, swapped in whole as every export is."""
    replace_folder(drafter_dir, lambda tmp: shutil.copytree(winner.drafter, tmp, dirs_exist_ok=True))


def select(
    state: RunState | None, run_folder: Path, drafter_dir: Path, select_by: SelectBy, top: int, positions: int,
    serve: Callable[[Path], float | None],
) -> dict:  # fmt: skip
    """Chooses the run's drafter among its kept epochs and exports it; returns what ``selection.json`` holds."""
    found = candidates(epochs_dir(run_folder), positions)
    if not found:
        raise RuntimeError(f"--select-by {select_by}: no kept epoch in {epochs_dir(run_folder)} (train with "
                           "--keep-epochs)")  # fmt: skip
    winner = choose(found, select_by, top, serve)
    last = max(c.epoch for c in found)
    if winner.epoch != last:
        export(winner, drafter_dir)
    figure = {"served": winner.served, "predicted": winner.predicted, "last": None}[select_by]
    line = f"epoch {winner.epoch} of {last} by {select_by}" + (f" ({figure:.3f})" if figure else "")
    report = {"select_by": select_by, "top": top, "positions": positions, "chosen_epoch": winner.epoch,
              "summary": line, "candidates": [{**asdict(c), "drafter": str(c.drafter)} for c in found]}  # fmt: skip
    (Path(run_folder) / "selection.json").write_text(json.dumps(report, indent=1))
    log.info("drafter chosen: %s; exported to %s", line, drafter_dir)
    if state is not None:
        state.update_train(TrainProgress(selection=line, heldout_loss=winner.heldout_loss,
                                         heldout_acc=winner.heldout_acc))  # fmt: skip
    return report
