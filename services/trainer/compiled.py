"""The training step's drafter work compiled with torch.compile (``--compile on``, or ``auto``: on a GPU; off by default
until the GPU speed bench has measured what it pays).

Why: a small drafter (SmolLM2-135M's, hidden 576) runs each TTT step as a few dozen small kernels, and the
per-kernel overhead (the launches, the Python of every op and of autograd) is most of a step's time. Compiled,
each step and each loss chunk is a few fused kernels, forward and backward.

What is compiled, in the objective itself (never the DDP wrapper, so DDP's gradient hooks see the same parameters
and buckets as in eager):

* ``Drafter.ttt_step``: one unrolled step, the decoder layer whole (its norms, q/k/v, RoPE, the attention with
  the later steps' diagonal merged in, o_proj, the MLP). FlexAttention's call inside it is traced into the step's
  graph; the math path's query blocks too.
* ``TTTObjective.step_terms``: one loss chunk (the final norm, the LM head, the log-softmax, the loss terms).

Both are functions of their inputs alone, which is what ``--checkpoint-steps`` and the chunked loss recompute in
the backward pass: a recomputation calls the same compiled function. Left eager: the target's side of the loss
(no gradient; its projections are single large matmuls), ``fc`` and the token embedding (once a row, one matmul or a
gather each: nothing to fuse), the optimizer.

Shapes are dynamic (``dynamic=True``), not bucketed: a packed row's length changes every step (any total up to
``--tokens-per-batch``), and bucketing it would mean padding, which packing exists to avoid; with the lengths as
symbols one graph serves them all. What still specializes is static by nature: the step's index (how many earlier
steps' keys it merges), training against held-out evaluation (grad mode), a loss chunk against the last, shorter
one. A training compiles about twice ``ttt_steps`` graphs of the step and a few of the loss chunk; the recompile
limit is raised to that, and a hit is an error (``fail_on_recompile_limit_hit``), never a silent fall-back to eager.
A compile failure in the forward pass is a ``CompileError`` naming what failed and the way out (``--compile off``);
one in a backward graph (compiled at the first backward pass) stops the step with torch's own error. Neither falls
back to eager."""

import functools
from collections.abc import Callable
from typing import Any

import torch

from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.objective import TTTObjective

BACKEND: str | Callable = "inductor"  # what torch.compile hands the graphs to
# graphs a compiled function may keep per TTT step: its index's in training and in held-out evaluation, with room
# for the few shapes dynamic sizes still specialize on (a loss chunk of a single row) and for drafters of other
# shapes trained in the same process (the benches)
GRAPHS_PER_STEP = 8


class CompileError(RuntimeError):
    """torch.compile could not compile a part of the training step."""


def compile_on(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the step is compiled on ``device``: ``auto`` means on a GPU, where the overhead it removes lies."""
    return cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda")


def compile_objective(objective: TTTObjective) -> TTTObjective:
    """``objective`` with its drafter's step and its loss chunk compiled (the module docstring), in place: the
    compiled functions shadow the methods on the instances, so every caller, recomputations included, gets them."""
    backend = BACKEND
    limit = GRAPHS_PER_STEP * objective.cfg.ttt_steps
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    drafter = objective.drafter
    drafter.ttt_step = _compiled(drafter.ttt_step, "the drafter's TTT step", backend)  # type: ignore[method-assign]
    objective.step_terms = _compiled(objective.step_terms, "the loss chunk", backend)  # type: ignore[method-assign]
    return objective


def _compiled(fn: Callable, what: str, backend: str | Callable) -> Callable:
    compiled = torch.compile(fn, dynamic=True, backend=backend)
    name = getattr(backend, "__name__", backend)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            raise CompileError(
                f"torch.compile ({name}) of {what} failed: {type(e).__name__}: {e}. --compile off trains eager"
            ) from e

    return call
