"""Training curves as TensorBoard event files under ``<run>/tensorboard/`` (rank 0 only), where ML engineers look:
``tensorboard --logdir <data>/runs`` shows every run side by side.

Scalars, by optimizer step:

    train/loss, train/acc/<i> (TTT step i), train/lr, train/grad_norm   every step, as in metrics.jsonl
    train/tokens_per_s                                                   at each progress report
    heldout/loss, heldout/acc/<i>                                        at each checkpoint and at the end
"""

from pathlib import Path

from tensorboardX import SummaryWriter

from eaglet.shared.store import run_dir


def curves_dir(data_dir: Path, run_id: str) -> Path:
    return run_dir(data_dir, run_id) / "tensorboard"


class Curves:
    """One writer per training process lifetime; a resumed run appends a new event file beside the old ones (the
    viewer merges them by step)."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(folder), flush_secs=30)

    def step(self, step: int, loss: float, acc: list[float], lr: float, grad_norm: float) -> None:
        self.writer.add_scalar("train/loss", loss, step)
        for i, a in enumerate(acc):
            self.writer.add_scalar(f"train/acc/{i}", a, step)
        self.writer.add_scalar("train/lr", lr, step)
        self.writer.add_scalar("train/grad_norm", grad_norm, step)

    def throughput(self, step: int, tokens_per_s: float) -> None:
        self.writer.add_scalar("train/tokens_per_s", tokens_per_s, step)

    def heldout(self, step: int, loss: float, acc: list[float]) -> None:
        self.writer.add_scalar("heldout/loss", loss, step)
        for i, a in enumerate(acc):
            self.writer.add_scalar(f"heldout/acc/{i}", a, step)

    def close(self) -> None:
        self.writer.close()
