"""The training loop: EAGLE-3 training-time test on stored hidden states, any number of processes (torchrun/DDP).

Progress goes to the run's ``TrainProgress`` record (the Redis hash ``RunKeys(run).train``, rank 0 only)::

    step, total_steps, epoch, epochs
    loss            weighted TTT loss of the last step (forward KL, steps weighted 0.8^i)
    acc             per unroll step, the share of loss positions where the drafter's top token is the target's
                    top token; a position whose target top token is outside the draft vocabulary counts as a miss
                    (as SpecForge counts; seen only with the OOV mask on, else the top over the draft vocabulary)
    lr, tokens_per_s (all ranks, padding excluded), eta_s
    last_checkpoint path of the newest trainer checkpoint; drafter_dir once written
    heldout_loss, heldout_acc   on the held-out split, at each checkpoint and at the end
    train_samples, heldout_samples, draft_vocab_size, ttt_steps, world_size, device
    started_at, updated_at, finished_at (unix s)

The same loss, accuracy and tokens/s of each report also go to the run's capped training series (by step, for the
live page's charts: eaglet/shared/series.py).
Whether the trainer waits, trains, evaluates, is done or failed (and why) is the run's stage, set by the entry point.
Every step's loss, accuracy, learning rate and gradient norm are also appended to
``<run>/checkpoints/metrics.jsonl`` (the loss curve) and, with throughput and held-out figures, written as
TensorBoard curves under ``<run>/tensorboard/`` (``curves``). With several processes every figure is the global
batch's, the same as one process would report on it."""

import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.distributed as dist
from redis import Redis
from redis.client import NEVER_DECODE
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from eaglet.services.trainer import checkpoint as ckpt
from eaglet.services.trainer import data
from eaglet.services.trainer.curves import Curves, curves_dir
from eaglet.services.trainer.model import Drafter, DrafterConfig, drafter_config
from eaglet.services.trainer.topk import draft_index, topk_terms
from eaglet.services.trainer.vocab import build_vocab, count_tokens
from eaglet.shared.keys import RunKeys
from eaglet.shared.records import RunMeta, TrainProgress
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.series import TrainPoint, train_series
from eaglet.shared.store import checkpoints_dir, drafter_dir, read_metadata, sample_path, samples_dir
from eaglet.shared.target import model_config

log = logging.getLogger(__name__)


Attention = Literal["auto", "math", "flex"]
OovMask = Literal["auto", "on", "off"]
Loss = Literal["kl", "lk-alpha", "lk-lambda"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The trainer's options. Each field is a flag of ``eaglet.services.trainer.main`` (``ttt_steps``:
    ``--ttt-steps``), its docstring the flag's help."""

    ttt_steps: int = 7
    """Unrolled training-time-test steps; the drafter is trained to draft this many tokens in a chain."""
    step_weight: float = 0.8
    """Loss weight of step i is step_weight ** i."""
    loss: Loss = "kl"
    """kl: forward KL(target || drafter) over the draft vocabulary | lk-alpha: minus the log of the expected
    acceptance sum_v min(p_v, q_v) (p: the target's probabilities over its whole vocabulary, on the draft
    vocabulary's tokens; q: the drafter's) | lk-lambda: w KL + (1 - w) (1 - acceptance), w = lk_kl_scale *
    exp(-lk_kl_decay * acceptance): SpecForge's acceptance-aware LK losses, per step, then weighted as above."""
    lk_kl_scale: float = 1.0
    """lk-lambda's weight of the KL term at zero acceptance."""
    lk_kl_decay: float = 1.0
    """lk-lambda: how fast the KL term's weight falls as the acceptance grows."""
    draft_vocab_size: int = 32768
    """Clipped to the target vocabulary. 32K suits 128K+ vocabularies; 8K-16K for small models."""
    draft_head_dim: int = 0
    """The drafter's head size (0: the target's, or 128 for latent-attention targets such as DeepSeek-V3); with
    another value the drafter has hidden_size / draft_head_dim heads."""
    draft_kv_heads: int = 0
    """The drafter's KV heads (0: the target's, or 8 for latent-attention targets)."""
    epochs: int = 10
    """Full passes over the training split (when max_steps is 0). With ``tokens_per_batch`` 2048 a typical sample
    (1-4K tokens) is about one step per epoch: as many updates per sample as SpecForge's published recipe
    (batch 1 per GPU, 10 epochs, lr 1e-4). bench/recipe.py: more updates per sample, better held-out accuracy."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: ``epochs`` full passes). The schedule spans the total either way."""
    tokens_per_batch: int = 2048
    """Padded tokens per batch per process; samples are grouped by length under this budget (a longer one trains
    alone)."""
    max_len: int = 8192
    """Longer samples are cut to this many tokens."""
    lr: float = 1e-4
    """Peak learning rate (AdamW), reached after the warmup, then cosine decay."""
    min_lr_ratio: float = 0.0
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_ratio: float = 0.015
    """Share of the steps over which the learning rate rises linearly to lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Gradients are clipped to this global norm."""
    checkpoint_every: int = 500
    """Optimizer steps between checkpoints (each followed by a held-out evaluation)."""
    keep_checkpoints: int = 2
    """Newest trainer checkpoints kept; older ones are deleted."""
    heldout_fraction: float = 0.05
    """Share of the samples held out of training (chosen by a hash of the sample id) to measure loss on."""
    seed: int = 0
    """Seeds the fresh drafter's weights and the batch order."""
    loader_workers: int = 2
    """DataLoader processes reading samples ahead of the step (0: read in the loop)."""
    attention: Attention = "auto"
    """math (scores materialized: short samples, CPU) | flex (block-sparse, O(T * steps) memory) | auto: flex on GPU."""
    init_from_target: bool = True
    """Start lm_head from the target's LM head rows of the draft vocabulary and norm from its final norm."""
    norm_before_fc: bool = False
    """An RMSNorm over the concatenated auxiliary states before fc (written to config.json as ``norm_before_fc``,
    which SGLang and vLLM load)."""
    loss_chunk: int = 8192
    """Positions per chunk of the loss. A batch with more computes the target's distribution, the top-token check
    and the loss chunk by chunk, recomputing each chunk's logits in the backward pass instead of keeping
    positions x vocabulary tensors (one more LM-head forward); 0: never chunked."""
    checkpoint_steps: bool = False
    """Recompute each unrolled step's activations in the backward pass instead of keeping them (about a third more
    compute): for samples too long for memory otherwise."""
    aux_noise: float = 0.0
    """Uniform noise in [-a, a] added to the auxiliary states while training (never to held-out figures): the
    drafter meets the engine's states, computed in other batches, not the stored ones. speculators uses 0.05."""
    oov_mask: OovMask = "auto"
    """on | off | auto (on on GPU): drop positions whose target top token (over the full vocabulary) is not in the
    draft vocabulary. Costs a full-vocabulary projection per token; off on CPU for speed."""
    log_every: int = 10
    """Optimizer steps between progress reports (Redis hash and log)."""

    def __post_init__(self):
        for name in (
            "ttt_steps", "draft_vocab_size", "tokens_per_batch", "max_len", "checkpoint_every", "keep_checkpoints",
            "log_every",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.epochs < 1 and self.max_steps < 1:
            raise ValueError("TrainConfig.epochs or max_steps must be at least 1")
        if not 0 < self.lr < 1:
            raise ValueError(f"TrainConfig.lr must be in (0, 1), got {self.lr}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"TrainConfig.heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        for name in ("draft_head_dim", "draft_kv_heads"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be 0 (the rule) or more, got {getattr(self, name)}")
        if self.loss_chunk < 0:
            raise ValueError(f"TrainConfig.loss_chunk must be 0 (never chunked) or more, got {self.loss_chunk}")
        if self.aux_noise < 0:
            raise ValueError(f"TrainConfig.aux_noise must be 0 (off) or more, got {self.aux_noise}")
        if self.loader_workers < 0:
            raise ValueError(
                f"TrainConfig.loader_workers must be 0 (read in the loop) or more, got {self.loader_workers}"
            )
        for name, choices in (("attention", Attention), ("oov_mask", OovMask), ("loss", Loss)):
            if getattr(self, name) not in get_args(choices):
                raise ValueError(
                    f"TrainConfig.{name} must be one of {', '.join(get_args(choices))}, got {getattr(self, name)!r}"
                )


@dataclass(slots=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; a plain ``python -m`` run is one process."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank, world, local, device)


class TTTObjective(nn.Module):
    """Drafter + loss in one forward, so DDP sees every parameter use inside ``forward``."""

    def __init__(self, drafter: Drafter, target_head: torch.Tensor, cfg: TrainConfig, attention: str, oov: bool):
        super().__init__()
        self.drafter, self.cfg, self.attention, self.oov = drafter, cfg, attention, oov
        self.register_buffer("target_head", target_head, persistent=False)  # [V, H], frozen
        self.register_buffer("draft_ids", torch.zeros(drafter.cfg.draft_vocab_size, dtype=torch.long), persistent=False)

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        self.draft_ids.copy_(draft_ids)
        self.drafter.set_vocab(draft_ids)

    def spans(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) chunks of ``n`` positions, ``cfg.loss_chunk`` at most each (one chunk when 0)."""
        size = self.cfg.loss_chunk or n
        return [(lo, min(lo + size, n)) for lo in range(0, n, size)] or [(0, 0)]

    @torch.no_grad()
    def target_view(self, hidden: torch.Tensor | None, topk_ids: torch.Tensor | None = None):
        """hidden [B, T, H] (target's final normed states) -> (positions whose target top token over the whole
        vocabulary is in the draft vocabulary [B, T], all when the OOV mask is off; the log of the target's
        normalizer over the whole vocabulary [B, T], for the LK losses, else None). By chunks of positions: the
        full-vocabulary logits of a long sample would be T x V. From a stored top-k (``topk_ids`` [B, T, k], no
        ``hidden``) the top token is its first entry, and the LK losses need no normalizer."""
        lk = self.cfg.loss != "kl"
        if hidden is None:
            usable = (
                self.drafter.t2d[topk_ids[..., 0]] if self.oov else torch.ones_like(topk_ids[..., 0], dtype=torch.bool)
            )
            return usable, None
        if not (self.oov or lk):
            return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device), None
        head = self.target_head.T.to(hidden.dtype)
        tops, lses = [], []
        for lo, hi in self.spans(hidden.shape[1]):
            logits = hidden[:, lo:hi] @ head  # [B, hi - lo, V]
            tops.append(logits.argmax(-1))
            if lk:
                lses.append(torch.logsumexp(logits.float(), -1))
        top = torch.cat(tops, 1)
        usable = self.drafter.t2d[top] if self.oov else torch.ones_like(top, dtype=torch.bool)
        return usable, torch.cat(lses, 1) if lk else None

    def chunk_terms(self, lo, hi, outs: tuple, masks: tuple, *target) -> torch.Tensor:
        """Per step, over the target positions [lo, hi): [KL summed, right top tokens, expected acceptance summed,
        its log summed] (the last two 0 for the KL loss). ``target``: (head [H, Vd], hidden [B, T, H], lse or None),
        whose log-probs over the draft vocabulary are formed here once for every step that predicts from them
        (step i at drafter position t predicts from target position t + 1 + i); or a stored top-k (log-probs
        [B, T, k], draft ids [B, T, k]: eaglet/services/trainer/topk.py)."""
        topk = len(target) == 2
        if not topk:
            head, hidden, lse = target
            with torch.no_grad():
                logits = (hidden[:, lo:hi] @ head).float()  # [B, hi - lo, Vd]
                tlogp = torch.log_softmax(logits, -1)
                full = logits - lse[:, lo:hi, None] if lse is not None else None  # log p over the whole vocabulary
        sums = []
        for i, (out, m) in enumerate(zip(outs, masks, strict=True)):
            t0, t1 = max(lo - 1 - i, 0), min(hi - 1 - i, m.shape[1])
            mm = m[:, t0 : max(t0, t1)]
            rows = slice(t0 + 1 + i, t0 + 1 + i + mm.shape[1])  # of the target positions
            logq = torch.log_softmax(self.drafter.logits(out[:, t0 : t0 + mm.shape[1]][mm]).float(), -1)
            if topk:
                sums.append(topk_terms(target[0][:, rows][mm], target[1][:, rows][mm], logq))
                continue
            lp = tlogp[:, rows.start - lo : rows.stop - lo][mm]  # [N, Vd]
            kl = (lp.exp() * (lp - logq)).sum()
            hits = (logq.argmax(-1) == lp.argmax(-1)).sum().float().detach()
            if full is None:
                sums.append(torch.stack([kl, hits, torch.zeros_like(kl), torch.zeros_like(kl)]))
                continue
            accept = torch.minimum(full[:, rows.start - lo : rows.stop - lo][mm].exp(), logq.exp()).sum(-1)  # [N]
            log_accept = torch.where(accept > 0, accept.clamp_min(1e-30).log(), torch.zeros_like(accept))
            sums.append(torch.stack([kl, hits, accept.sum(), log_accept.sum()]))
        return torch.stack(sums, 1)  # [4, steps]

    def forward(self, input_ids, loss_mask, hidden_states, aux_hidden_states, topk_ids=None, topk_logp=None):
        """(weighted loss, per-step losses [ttt_steps], per-step accuracies [ttt_steps]) as this process's share of
        the global batch while training across processes: summed over the processes they are what one process
        would compute on the whole batch. Otherwise (one process, evaluation) the figures of this batch alone.
        The target's distribution comes from ``hidden_states`` [B, T, H], or, for a run that stored its top-k
        instead (``hidden_states`` None), from ``topk_ids`` and ``topk_logp`` [B, T, k]."""
        T = input_ids.shape[1]
        usable, lse = self.target_view(hidden_states, topk_ids)
        if self.training and self.cfg.aux_noise > 0:
            aux_hidden_states = aux_hidden_states + torch.empty_like(aux_hidden_states).uniform_(
                -self.cfg.aux_noise, self.cfg.aux_noise
            )
        outs = self.drafter.forward_ttt(input_ids, aux_hidden_states, self.cfg.ttt_steps, self.attention,
                                        checkpoint=self.cfg.checkpoint_steps and self.training)  # fmt: skip
        # step i at position t predicts token t + 2 + i from the target's logits at t + 1 + i; a step past the
        # batch's length has no position here (but may elsewhere: every process counts every step)
        masks = tuple(loss_mask[:, 2 + i :] & usable[:, 1 + i : T - 1] for i in range(len(outs)))  # [B, T-2-i]
        # accuracy is over every loss position, the unusable ones counting as misses: comparable across vocabularies
        positions = [loss_mask[:, 2 + i :].sum() for i in range(len(outs))]
        counts, positions = self.global_counts(torch.stack([m.sum() for m in masks] + positions)).split(len(outs))
        if hidden_states is None:
            target = (topk_logp, draft_index(self.drafter.t2d)[topk_ids])
        else:
            target = (self.target_head[self.draft_ids].T.to(hidden_states.dtype), hidden_states, lse)  # head [H, Vd]
        spans = self.spans(T)
        sums = torch.zeros(4, len(outs), device=input_ids.device)
        for lo, hi in spans:
            args = (lo, hi, tuple(outs), masks, *target)
            if len(spans) > 1 and torch.is_grad_enabled():  # keep a chunk's inputs only; its logits are recomputed
                sums = sums + torch.utils.checkpoint.checkpoint(self.chunk_terms, *args, use_reentrant=False)
            else:
                sums = sums + self.chunk_terms(*args)
        kl, hits, accept, log_accept = sums / torch.stack([counts, positions, counts, counts])
        if self.cfg.loss == "lk-alpha":
            losses = -log_accept
        elif self.cfg.loss == "lk-lambda":
            w = self.cfg.lk_kl_scale * torch.exp(-self.cfg.lk_kl_decay * accept.detach())
            losses = w * kl + (1 - w) * (1 - accept)
        else:
            losses = kl
        weights = self.cfg.step_weight ** torch.arange(len(outs), device=input_ids.device, dtype=losses.dtype)
        return (weights * losses).sum(), losses.detach(), hits

    def global_counts(self, local: torch.Tensor) -> torch.Tensor:
        """Position counts (per step): over every process's batch while training across processes, so the loss is
        the mean over the global batch's positions whatever their split, as on one process."""
        counts = local.float()
        if self.training and dist.is_initialized():
            dist.all_reduce(counts)
        return counts.clamp(min=1)


def build_drafter(
    target_dir: Path, draft_ids: torch.Tensor, cfg: TrainConfig, layers: list[int], shape: DrafterConfig | None = None
) -> tuple[Drafter, torch.Tensor]:
    """A fresh drafter shaped after the target (``model.drafter_config``) reading the states of ``layers``, or as
    ``shape`` says (a resumed run keeps its checkpoint's shape), and the target's LM head [V, H] for the loss."""
    tcfg = model_config(target_dir)
    tensors = ckpt.load_target_tensors(target_dir)
    if shape is None:
        shape = drafter_config(
            tcfg.get("text_config", tcfg), vocab_size=tensors["embed"].shape[0], draft_vocab_size=len(draft_ids),
            num_aux_hidden_states=len(layers), head_dim=cfg.draft_head_dim, kv_heads=cfg.draft_kv_heads,
            norm_before_fc=cfg.norm_before_fc,
        )  # fmt: skip
    model = Drafter(shape, tensors["embed"].float())
    model.set_vocab(draft_ids)
    if cfg.init_from_target:
        with torch.no_grad():
            model.lm_head.weight.copy_(tensors["lm_head"][draft_ids].float())
            model.norm.weight.copy_(tensors["norm"].float())
    return model, tensors["lm_head"].float()


def captured_layers(meta: RunMeta, data_dir: Path, run_id: str, items: list[data.Item]) -> list[int]:
    """The layers the run's stored states were captured at: the run's record, set by its first dump; for a run
    stored before that record existed, a stored sample's own metadata. RuntimeError when neither says."""
    if meta.captured_layers:
        return meta.captured_layers
    for item in items[:1]:
        raw = read_metadata(sample_path(data_dir, run_id, item.sample_id)).get("aux_layer_ids")
        if raw:
            return [int(i) for i in json.loads(raw)]
    raise RuntimeError(
        f"run {run_id}: the layers its hidden states were captured at are not known (neither the run nor its "
        "stored samples record them): the drafter's config would tell the engines to feed it other layers"
    )


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def read_done(redis: Redis, run_id: str, total: int) -> list[int]:
    bitmap = redis.execute_command("GET", RunKeys(run_id).done, **{NEVER_DECODE: []})
    return data.done_indexes(bitmap, total)


class Reporter:
    """Progress of rank 0 to Redis, the console bar, metrics.jsonl and the TensorBoard curves; other ranks report
    nothing."""

    def __init__(self, state: RunState | None, folder: Path, curves_folder: Path, enabled: bool):
        self.state, self.enabled = state, enabled
        self.series = train_series(state.redis, state.run_id) if state is not None else None
        self.metrics = folder / "metrics.jsonl"
        self.curves = Curves(curves_folder) if enabled else None
        self.bar: Progress | None = None
        self.task = None

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
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)

    def record(self, row: dict) -> None:
        if self.enabled:
            with open(self.metrics, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.curves.step(row["step"], row["loss"], row["acc"], row["lr"], row["grad_norm"])

    def throughput(self, step: int, tokens_per_s: float) -> None:
        if self.enabled:
            self.curves.throughput(step, tokens_per_s)

    def heldout(self, step: int, figures: dict) -> None:
        self.set(TrainProgress(**figures))
        if self.enabled and figures:
            self.curves.heldout(step, figures["heldout_loss"], figures["heldout_acc"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.curves is not None:
            self.curves.close()


@dataclass(slots=True)
class Session:
    """One training in progress: its run, its model and optimizer, and where it stands."""

    cfg: TrainConfig
    env: Dist
    run_id: str
    data_dir: Path
    target_dir: Path
    folder: Path  # the run's checkpoints
    drafter_out: Path  # where the drafter is written
    train_items: list[data.Item]
    held_items: list[data.Item]
    aux_layer_ids: list[int]  # the layers the stored states were captured at
    draft_ids: torch.Tensor  # [Vd] target ids of the draft vocabulary
    objective: TTTObjective
    model: nn.Module  # the objective, wrapped in DDP across processes
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    rep: Reporter
    total: int  # optimizer steps of the whole training
    step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of the epoch done: where a resumed epoch starts
    last: dict = field(default_factory=dict)  # loss and per-step accuracy of the newest step
    window_tokens: int = 0  # tokens (all ranks) since the last report
    window_start: float = field(default_factory=time.time)

    @property
    def dtype(self) -> torch.dtype:
        return states_dtype(self.env.device)


def states_dtype(device: torch.device) -> torch.dtype:
    """The dtype the stored states are read in on ``device`` (the objective runs under bf16 autocast on CUDA)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def train(
    *, redis: Redis | None, run_id: str, data_dir: Path, target_dir: Path, cfg: TrainConfig, env: Dist,
    out_dir: Path | None = None,
) -> dict:  # fmt: skip
    """Trains the run's drafter and writes ``<run>/drafter/``; resumes from the newest checkpoint if any.
    Returns the final figures (also in the Redis hash, when given one).

    ``out_dir``: another drafter from the same extraction (a recipe compared with the run's own): its checkpoints,
    curves and drafter go to ``out_dir/{checkpoints,curves,drafter}`` and the run's own stay as they are."""
    s = start(redis, run_id, Path(data_dir), Path(target_dir), cfg, env, out_dir)
    try:
        while s.step < s.total:
            train_epoch(s)
        final = finish(s)
    finally:
        s.rep.close()
    if env.world > 1:
        dist.barrier()
    return final


def start(
    redis: Redis | None, run_id: str, data_dir: Path, target_dir: Path, cfg: TrainConfig, env: Dist,
    out_dir: Path | None = None,
) -> Session:  # fmt: skip
    """The run's split, the drafter (fresh, or as the newest checkpoint left it) and its optimizer."""
    state = RunState(redis, run_id) if redis is not None else None
    meta = state.meta() if state is not None else RunMeta()
    samples = SampleSet(samples_dir(data_dir, run_id))
    indexes = read_done(redis, run_id, len(samples)) if redis is not None else list(range(len(samples)))
    train_items, held_items = data.split_items(samples, indexes, cfg.heldout_fraction)
    if not train_items:
        raise RuntimeError(f"run {run_id}: no extracted samples to train on ({len(indexes)} done)")
    layers = captured_layers(meta, data_dir, run_id, train_items)
    if out_dir is not None:
        folder, curves, drafter_out = (Path(out_dir) / name for name in ("checkpoints", "curves", "drafter"))
    else:
        folder, curves, drafter_out = (f(data_dir, run_id) for f in (checkpoints_dir, curves_dir, drafter_dir))
    folder.mkdir(parents=True, exist_ok=True)
    saved = ckpt.load_latest_state(folder)
    draft_ids = saved["draft_ids"] if saved is not None else draft_vocab(samples, train_items, target_dir, cfg, env)
    shape = DrafterConfig(**saved["drafter_config"]) if saved is not None else None
    objective = make_objective(target_dir, draft_ids, cfg, env, layers, shape)
    per_epoch = len(epoch_batches(train_items, cfg, env, 0))
    if per_epoch == 0:
        raise RuntimeError(f"run {run_id}: {len(train_items)} samples make no batch for {env.world} processes")
    total = cfg.max_steps if cfg.max_steps > 0 else per_epoch * cfg.epochs
    opt = torch.optim.AdamW(objective.drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warmup = max(1, int(cfg.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup, cfg.min_lr_ratio))
    s = Session(
        cfg=cfg, env=env, run_id=run_id, data_dir=data_dir, target_dir=target_dir, folder=folder,
        drafter_out=drafter_out,
        train_items=train_items, held_items=held_items, aux_layer_ids=layers,
        draft_ids=draft_ids, objective=objective, model=distribute(objective, env), opt=opt, sched=sched,
        rep=Reporter(state, folder, curves, env.main), total=total,
    )  # fmt: skip
    if saved is not None:
        resume(s, saved)
    announce(s, per_epoch)
    return s


def draft_vocab(
    samples: SampleSet, items: list[data.Item], target_dir: Path, cfg: TrainConfig, env: Dist
) -> torch.Tensor:
    """The draft vocabulary [Vd]: the target ids most frequent in the training split's loss positions. Rank 0
    counts them and sends the result: every sample is read once, not once per process."""
    vocab: list[torch.Tensor | None] = [None]
    if env.main:
        tcfg = model_config(target_dir)
        vocab_size = int(tcfg.get("text_config", tcfg)["vocab_size"])
        counts = count_tokens(((samples[it.index].input_ids, samples[it.index].loss_mask) for it in items), vocab_size)
        vocab[0] = build_vocab(counts, min(cfg.draft_vocab_size, vocab_size), always=eos_ids(target_dir))
    if env.world > 1:
        dist.broadcast_object_list(vocab, src=0)
    return vocab[0]


def make_objective(
    target_dir: Path,
    draft_ids: torch.Tensor,
    cfg: TrainConfig,
    env: Dist,
    layers: list[int],
    shape: DrafterConfig | None,
) -> TTTObjective:
    attention, oov = objective_options(cfg, env.device)
    torch.manual_seed(cfg.seed)  # the fresh drafter's weights are the same in every process and rerun
    drafter, target_head = build_drafter(target_dir, draft_ids, cfg, layers, shape)
    objective = TTTObjective(drafter, target_head, cfg, attention, oov).to(env.device)
    objective.set_vocab(draft_ids.to(env.device))
    return objective


def objective_options(cfg: TrainConfig, device: torch.device) -> tuple[str, bool]:
    """(attention implementation, OOV mask on) of the objective on ``device``: ``auto`` resolved."""
    gpu = device.type == "cuda"
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if gpu else "math")
    return attention, cfg.oov_mask == "on" or (cfg.oov_mask == "auto" and gpu)


def distribute(objective: TTTObjective, env: Dist) -> nn.Module:
    if env.world == 1:
        return objective
    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    # the buffers (the target's LM head and embedding, the vocabulary maps) are the same everywhere and never change:
    # re-sending them before every forward would move the whole LM head each step
    return nn.parallel.DistributedDataParallel(objective, device_ids=device_ids, broadcast_buffers=False)


def epoch_batches(items: list[data.Item], cfg: TrainConfig, env: Dist, epoch: int) -> list[list[data.Item]]:
    """This rank's batches of ``epoch``: the same on every rerun, so a resumed epoch skips to its place."""
    return data.shard(data.make_batches(items, cfg.tokens_per_batch, cfg.seed, epoch), env.rank, env.world)


def resume(s: Session, saved: dict) -> None:
    s.objective.drafter.load_state_dict(saved["model"])
    s.opt.load_state_dict(saved["optimizer"])
    s.sched.load_state_dict(saved["scheduler"])
    s.step, s.epoch, s.batch = saved["step"], saved["epoch"], saved["batch"]
    ckpt.set_rng_state(saved["rng"])


def announce(s: Session, per_epoch: int) -> None:
    cfg, env = s.cfg, s.env
    s.rep.set(TrainProgress(
        step=s.step, total_steps=s.total, epoch=s.epoch, epochs=cfg.epochs, started_at=time.time(),
        train_samples=len(s.train_items), heldout_samples=len(s.held_items), draft_vocab_size=len(s.draft_ids),
        ttt_steps=cfg.ttt_steps, world_size=env.world, device=str(env.device),
    ))  # fmt: skip
    log.info(
        "run %s: training %d steps (%d a epoch), %d train / %d held-out samples, draft vocab %d, %d TTT steps, "
        "%d process(es) on %s, attention %s",
        s.run_id, s.total, per_epoch, len(s.train_items), len(s.held_items), len(s.draft_ids),
        cfg.ttt_steps, env.world, env.device, s.objective.attention,
    )  # fmt: skip
    s.rep.start_bar(s.total, s.step)


def train_epoch(s: Session) -> None:
    """The rest of the current epoch, or of the training if it ends first; a checkpoint every ``checkpoint_every``."""
    batches = epoch_batches(s.train_items, s.cfg, s.env, s.epoch)
    batch_set = data.BatchSet(batches, s.data_dir, s.run_id, s.dtype, s.cfg.max_len)
    for batch in data.loader(batch_set, s.batch, s.cfg.loader_workers):
        if s.step >= s.total:
            return
        train_step(s, batch)
        if s.step % s.cfg.checkpoint_every == 0 and s.step < s.total:
            checkpoint(s)
    s.epoch, s.batch = s.epoch + 1, 0


def objective_inputs(b: dict[str, torch.Tensor]) -> tuple:
    """A batch as the objective's arguments: the final states, or the stored top-k where a run kept that instead."""
    keys = ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states", "topk_ids", "topk_logp")
    return tuple(b.get(k) for k in keys)


def train_step(s: Session, batch: dict[str, torch.Tensor]) -> None:
    """One optimizer step on one batch, recorded in metrics.jsonl and reported every ``log_every`` steps."""
    env = s.env
    b = {k: v.to(env.device, non_blocking=True) for k, v in batch.items()}
    with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=env.device.type == "cuda"):
        loss, losses, accs = s.model(*objective_inputs(b))
    s.opt.zero_grad(set_to_none=True)
    # DDP averages the processes' gradients, and the global loss is the sum of their shares
    (loss * env.world).backward()
    gnorm = torch.nn.utils.clip_grad_norm_(s.objective.drafter.parameters(), s.cfg.grad_clip)
    s.opt.step()
    lr = s.sched.get_last_lr()[0]  # the rate this step used
    s.sched.step()
    s.step, s.batch = s.step + 1, s.batch + 1
    figures = torch.cat([loss.detach()[None], losses, accs, b["tokens"].float()[None]])
    if env.world > 1:
        dist.all_reduce(figures)  # shares summed: the global batch's figures
    total_loss, *per_step, tokens = figures.tolist()
    k = len(losses)
    s.window_tokens += int(tokens)
    s.last = {"loss": total_loss, "acc": [round(a, 4) for a in per_step[k:]]}
    s.rep.record({"step": s.step, **s.last, "step_losses": per_step[:k], "grad_norm": float(gnorm), "lr": lr})
    if s.step % s.cfg.log_every == 0 or s.step == s.total:
        report(s)
    s.rep.step(s.step, f"loss {s.last['loss']:.3f} acc0 {s.last['acc'][0]:.2f}")


def report(s: Session) -> None:
    """Progress, with throughput and time left measured since the previous report."""
    now = time.time()
    elapsed = max(now - s.window_start, 1e-9)
    tokens_per_s = s.window_tokens / elapsed
    eta = (s.total - s.step) / max(s.cfg.log_every / elapsed, 1e-9)
    lr = s.sched.get_last_lr()[0]
    figures = TrainProgress(
        step=s.step, epoch=s.epoch, lr=lr, tokens_per_s=round(tokens_per_s, 1), eta_s=round(eta), **s.last
    )
    s.rep.set(figures)
    point = TrainPoint(step=s.step, t=now, loss=s.last["loss"], acc=s.last["acc"], tokens_per_s=figures.tokens_per_s)
    s.rep.point(point, last=s.step == s.total)
    s.rep.throughput(s.step, figures.tokens_per_s)
    log.info(
        "run %s: step %d/%d loss %.4f acc %s %.0f tok/s",
        s.run_id, s.step, s.total, s.last["loss"], s.last["acc"], tokens_per_s,
    )  # fmt: skip
    s.window_tokens, s.window_start = 0, now


def checkpoint(s: Session) -> dict:
    """Rank 0 saves a checkpoint, then every process evaluates its share of the held-out split. Returns the
    checkpoint's path (rank 0) and the held-out figures."""
    path = save(s) if s.env.main else None
    figures = heldout(s)
    s.rep.heldout(s.step, figures)
    return {"last_checkpoint": str(path), **figures} if path is not None else figures


def save(s: Session) -> Path:
    """A resumable checkpoint, and the drafter as SGLang and vLLM load it; returns the checkpoint's path."""
    drafter = s.objective.drafter
    blob = {
        "model": drafter.state_dict(), "optimizer": s.opt.state_dict(), "scheduler": s.sched.state_dict(),
        "step": s.step, "epoch": s.epoch, "batch": s.batch, "rng": ckpt.rng_state(), "draft_ids": s.draft_ids.cpu(),
        "train_config": asdict(s.cfg), "drafter_config": drafter.cfg.to_dict(),
    }  # fmt: skip
    path = ckpt.save_state(s.folder, s.step, blob, s.cfg.keep_checkpoints)
    target_config = model_config(s.target_dir)
    out = ckpt.save_drafter(s.drafter_out, drafter, target_config, s.aux_layer_ids, s.dtype)
    s.rep.set(TrainProgress(last_checkpoint=str(path), drafter_dir=str(out)))
    return path


def finish(s: Session) -> dict:
    """The last checkpoint and held-out figures; returns the final figures (rank 0; the others: {})."""
    final = {"step": s.step, **s.last, **checkpoint(s)}
    s.rep.set(TrainProgress(**final, finished_at=time.time()))
    figures = {k: final.get(k) for k in ("heldout_loss", "heldout_acc")}
    log.info("run %s: training done at step %d, held-out %s", s.run_id, s.step, figures)
    return final if s.env.main else {}


def heldout(s: Session) -> dict:
    """Mean TTT loss and per-step accuracy over the held-out batches, each process evaluating every world-th one
    (the objective alone, outside DDP: no lock-step needed)."""
    if not s.held_items:
        return {}
    figures = heldout_figures(
        s.objective, s.held_items, data_dir=s.data_dir, run_id=s.run_id, tokens_per_batch=s.cfg.tokens_per_batch,
        max_len=s.cfg.max_len, device=s.env.device, rank=s.env.rank, world=s.env.world,
    )  # fmt: skip
    return {k: figures[k] for k in ("heldout_loss", "heldout_acc")}


@torch.no_grad()
def heldout_figures(
    objective: TTTObjective, items: list[data.Item], *, data_dir: Path, run_id: str, tokens_per_batch: int,
    max_len: int, device: torch.device, rank: int = 0, world: int = 1,
) -> dict:  # fmt: skip
    """The held-out figures of ``objective`` on ``items`` (a run's held-out split), the training's and any saved
    drafter's alike (``score``): the mean over the batches (fixed: seed 0, epoch 0) of the weighted TTT loss and of
    each step's accuracy, with ``samples`` and ``tokens`` (after the ``max_len`` cut) of the split. Across
    processes each evaluates every world-th batch and every process gets the whole split's figures."""
    batches = data.make_batches(items, tokens_per_batch, 0, 0)[rank::world]
    was_training = objective.training
    objective.eval()
    sums = torch.zeros(objective.cfg.ttt_steps + 2, device=device)  # loss, accuracy per step, batches
    for batch in data.BatchSet(batches, data_dir, run_id, states_dtype(device), max_len):
        b = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _, acc = objective(*objective_inputs(b))
        sums += torch.cat([loss.float()[None], acc.float(), torch.ones(1, device=device)])
    objective.train(was_training)
    if world > 1:
        dist.all_reduce(sums)
    loss, *acc = (sums[:-1] / sums[-1]).tolist()
    return {
        "heldout_loss": round(loss, 5),
        "heldout_acc": [round(a, 4) for a in acc],
        "samples": len(items),
        "tokens": sum(min(it.length, max_len) for it in items),  # what collate keeps of each
    }


def eos_ids(target_dir: Path) -> list[int]:
    """End-of-turn ids: the drafter must be able to propose the end of an answer."""
    cfg = model_config(target_dir)
    eos = cfg.get("eos_token_id")
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return [int(i) for i in ids]
