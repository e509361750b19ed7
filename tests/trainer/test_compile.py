"""``--compile on``: the trainer's steps run through torch.compile's graphs and train as eager does, step for step.

On the CPU with the trainer's own backend, inductor (its C++ kernels built by the C compiler: about two minutes
here for the graphs of a training). The speed bench's CPU test uses aot_eager, which runs the same tracing,
autograd graphs and guards with eager kernels, in a fraction of the time."""

import json
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from eaglet.services.trainer import compiled
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from tests.trainer.fixtures import make_run
from tests.trainer.test_train import small

# float32 on the CPU: inductor's fused kernels sum in other orders than eager's, a few ulps a step
RTOL, ATOL = 1e-5, 1e-6


def losses(folder: Path) -> list[float]:
    rows = (folder / "checkpoints" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in rows]


@pytest.mark.timeout(900)
def test_compiled_steps_train_as_eager_with_checkpointed_steps_and_a_chunked_loss(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "cmp", n=12)
    # rows of different lengths (packed samples of 38-40 tokens), the first step recomputed in the backward pass and
    # the others kept, the loss in chunks of 24 rows (each recomputed too): the paths a compiled step must serve
    base = dict(max_steps=4, heldout_fraction=0.0, tokens_per_batch=100, checkpoint_steps=1, loss_chunk=24,
                log_every=1)  # fmt: skip
    runs = {}
    for mode in ("off", "on"):
        counters.clear()
        train(redis=None, run_id="cmp", data_dir=tmp_path, target_dir=tiny_model_dir,
              cfg=small(**base, compile=mode), env=Dist(), out_dir=tmp_path / mode)  # fmt: skip
        runs[mode] = losses(tmp_path / mode), dict(counters["stats"]), dict(counters["graph_break"])
    (eager, eager_stats, _), (fast, fast_stats, breaks) = runs["off"], runs["on"]
    assert not eager_stats.get("unique_graphs")  # off compiles nothing
    # on: a graph of the TTT step for each of its 3 step indexes at least, the loss chunk's besides, none broken
    assert fast_stats["unique_graphs"] >= 3 + 1 and not breaks, (fast_stats, breaks)
    assert len(eager) == len(fast) == 4
    assert fast == pytest.approx(eager, rel=RTOL, abs=ATOL)
    assert eager[0] != eager[-1]  # the steps trained: the comparison is of a moving loss


def test_a_compile_failure_is_an_error_not_a_silent_fall_back_to_eager(redis, tmp_path, tiny_model_dir, monkeypatch):
    def broken(graph, example_inputs):
        raise RuntimeError("no kernels for this graph")

    monkeypatch.setattr(compiled, "BACKEND", broken)
    make_run(redis, tmp_path, tiny_model_dir, "bad", n=6)
    said = r"(?s)torch.compile \(broken\) of the drafter's TTT step failed.*no kernels for this graph.*--compile off"
    with pytest.raises(compiled.CompileError, match=said):
        train(redis=None, run_id="bad", data_dir=tmp_path, target_dir=tiny_model_dir,
              cfg=small(max_steps=1, heldout_fraction=0.0, compile="on"), env=Dist())  # fmt: skip
