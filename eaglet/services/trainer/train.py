"""The training loop: EAGLE-3 training-time test on stored hidden states, any number of processes (torchrun/DDP).

Progress goes to the Redis hash ``RunKeys(run).train`` (written by rank 0 only)::

    state           waiting | training | evaluating | done | failed
    step, total_steps, epoch, epochs
    loss            weighted TTT loss of the last step (forward KL, steps weighted 0.8^i)
    acc             JSON list: per unroll step, the share of loss positions where the drafter's top token is the
                    target's top token (over the draft vocabulary)
    lr, tokens_per_s (all ranks, padding excluded), eta_s
    last_checkpoint path of the newest trainer checkpoint; drafter_dir once written
    heldout_loss, heldout_acc   on the held-out split, at each checkpoint and at the end
    train_samples, heldout_samples, draft_vocab_size, ttt_steps, world_size, device
    started_at, updated_at, finished_at (unix s); error (on failure)

Every step's loss and accuracy are also appended to ``<run>/checkpoints/metrics.jsonl`` (the loss curve).
"""

import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from redis import Redis
from redis.client import NEVER_DECODE
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from eaglet.services.trainer import checkpoint as ckpt
from eaglet.services.trainer import data
from eaglet.services.trainer.model import Drafter, DrafterConfig, rope_inv_freq
from eaglet.services.trainer.vocab import build_vocab, count_tokens
from eaglet.shared.keys import RunKeys
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import checkpoints_dir, drafter_dir, samples_dir
from eaglet.shared.target import model_config

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    ttt_steps: int = 7
    """Unrolled training-time-test steps; the drafter is trained to draft this many tokens in a chain."""
    step_weight: float = 0.8
    """Loss weight of step i is step_weight ** i."""
    draft_vocab_size: int = 32768
    """Clipped to the target vocabulary. 32K suits 128K+ vocabularies; 8K-16K for small models."""
    epochs: int = 1
    max_steps: int = 0
    """Stop after this many optimizer steps (0: ``epochs`` full passes). The schedule spans the total either way."""
    max_tokens: int = 16384
    """Padded tokens per batch per process; samples are grouped by length under this budget."""
    max_len: int = 8192
    """Longer samples are cut to this many tokens."""
    lr: float = 1e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    heldout_fraction: float = 0.05
    seed: int = 0
    workers: int = 2
    """DataLoader processes reading samples ahead of the step (0: read in the loop)."""
    attention: str = "auto"
    """math (scores materialized: short samples, CPU) | flex (block-sparse, O(T * steps) memory) | auto: flex on GPU."""
    init_from_target: bool = True
    """Start lm_head from the target's LM head rows of the draft vocabulary and norm from its final norm."""
    oov_mask: str = "auto"
    """on | off | auto (on on GPU): drop positions whose target top token (over the full vocabulary) is not in the
    draft vocabulary. Costs a full-vocabulary projection per token; off on CPU for speed."""
    log_every: int = 10

    def __post_init__(self):
        for name in ("ttt_steps", "draft_vocab_size", "max_tokens", "max_len", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.epochs < 1 and self.max_steps < 1:
            raise ValueError("TrainConfig.epochs or max_steps must be at least 1")
        if not 0 < self.lr < 1:
            raise ValueError(f"TrainConfig.lr must be in (0, 1), got {self.lr}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"TrainConfig.heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.attention not in ("auto", "math", "flex"):
            raise ValueError(f"TrainConfig.attention must be auto, math or flex, got {self.attention!r}")
        if self.oov_mask not in ("auto", "on", "off"):
            raise ValueError(f"TrainConfig.oov_mask must be auto, on or off, got {self.oov_mask!r}")


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

    @torch.no_grad()
    def targets(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, H] (target's final normed states) -> (log-probs over the draft vocab [B, T, Vd] float32,
        positions usable [B, T]: the target's top token is in the draft vocabulary)."""
        logits = (hidden @ self.target_head[self.draft_ids].T.to(hidden.dtype)).float()
        usable = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        if self.oov:
            top = torch.cat([(h @ self.target_head.T.to(h.dtype)).argmax(-1) for h in hidden.split(1)])  # [B, T]
            usable = self.drafter.t2d[top]
        return torch.log_softmax(logits, -1), usable

    def forward(self, input_ids, loss_mask, hidden_states, aux_hidden_states):
        T = input_ids.shape[1]
        tlogp, usable = self.targets(hidden_states)
        outs = self.drafter.forward_ttt(input_ids, aux_hidden_states, self.cfg.ttt_steps, self.attention)
        total = torch.zeros((), device=input_ids.device)
        losses, accs, counts = [], [], []
        for i, out in enumerate(outs):
            n = T - 2 - i  # step i at position t predicts token t + 2 + i from the target's logits at t + 1 + i
            if n <= 0:
                break
            m = loss_mask[:, 2 + i :] & usable[:, 1 + i : 1 + i + n]  # [B, n]
            lp = tlogp[:, 1 + i : 1 + i + n][m]  # [N, Vd]
            logq = torch.log_softmax(self.drafter.logits(out[:, :n][m]).float(), -1)  # logits only where needed
            kl = (lp.exp() * (lp - logq)).sum(-1)  # forward KL(target || drafter) [N]
            count = max(int(m.sum()), 1)
            loss_i = kl.sum() / count
            total = total + self.cfg.step_weight**i * loss_i
            losses.append(loss_i.detach())
            accs.append((logq.argmax(-1) == lp.argmax(-1)).float().sum().detach() / count)
            counts.append(count)
        return total, torch.stack(losses), torch.stack(accs)


def build_drafter(target_dir: Path, draft_ids: torch.Tensor, init_from_target: bool) -> tuple[Drafter, torch.Tensor]:
    """A fresh drafter shaped after the target, and the target's LM head [V, H] for the loss."""
    tcfg = model_config(target_dir)
    text = tcfg.get("text_config", tcfg)
    tensors = ckpt.load_target_tensors(target_dir)
    cfg = DrafterConfig(
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text.get("num_key_value_heads", text["num_attention_heads"]),
        head_dim=text.get("head_dim") or 0,
        vocab_size=tensors["embed"].shape[0],
        draft_vocab_size=len(draft_ids),
        rms_norm_eps=text.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta(text),
        max_position_embeddings=text.get("max_position_embeddings", 4096),
    )
    model = Drafter(cfg, tensors["embed"].float(), target_inv_freq(text, cfg.head_dim))
    model.set_vocab(draft_ids)
    if init_from_target:
        with torch.no_grad():
            model.lm_head.weight.copy_(tensors["lm_head"][draft_ids].float())
            model.norm.weight.copy_(tensors["norm"].float())
    return model, tensors["lm_head"].float()


def rope_theta(text_config: dict) -> float:
    params = text_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", text_config.get("rope_theta", 10000.0)))


def target_inv_freq(text_config: dict, head_dim: int) -> torch.Tensor:
    """RoPE frequencies as the target computes them (scaled variants included), through transformers' table."""
    params = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return rope_inv_freq(head_dim, rope_theta(text_config))
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model(**{k: v for k, v in text_config.items() if k not in ("architectures",)})
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float()


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
    """Progress of rank 0 to Redis, the console bar and metrics.jsonl; other ranks report nothing."""

    def __init__(self, redis: Redis | None, run_id: str, folder: Path, enabled: bool):
        self.redis, self.key, self.enabled = redis, RunKeys(run_id).train, enabled
        self.metrics = folder / "metrics.jsonl"
        self.bar: Progress | None = None
        self.task = None

    def set(self, **fields) -> None:
        if self.enabled and self.redis is not None:
            fields = {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in fields.items()}
            self.redis.hset(self.key, mapping={**fields, "updated_at": time.time()})

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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def train(*, redis: Redis | None, run_id: str, data_dir: Path, target_dir: Path, cfg: TrainConfig, env: Dist) -> dict:
    """Trains the run's drafter and writes ``<run>/drafter/``; resumes from the newest checkpoint if any.
    Returns the final figures (also in the Redis hash)."""
    data_dir = Path(data_dir)
    meta = redis.hgetall(RunKeys(run_id).meta) if redis is not None else {}
    aux_layer_ids = json.loads(meta.get("aux_layer_ids", "null") or "null")
    samples = SampleSet(samples_dir(data_dir, run_id))
    indexes = read_done(redis, run_id, len(samples)) if redis is not None else list(range(len(samples)))
    train_items, held_items = data.split_items(samples, indexes, cfg.heldout_fraction)
    if not train_items:
        raise RuntimeError(f"run {run_id}: no extracted samples to train on ({len(indexes)} done)")
    folder = checkpoints_dir(data_dir, run_id)
    folder.mkdir(parents=True, exist_ok=True)
    gpu = env.device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if gpu else "math")
    oov = cfg.oov_mask == "on" or (cfg.oov_mask == "auto" and gpu)

    state = ckpt.load_latest_state(folder)
    if state is not None:
        draft_ids = state["draft_ids"]
    else:
        tcfg = model_config(target_dir)
        vocab_size = int(tcfg.get("text_config", tcfg)["vocab_size"])
        counts = count_tokens(
            ((samples[it.index].input_ids, samples[it.index].loss_mask) for it in train_items), vocab_size
        )
        draft_ids = build_vocab(counts, min(cfg.draft_vocab_size, vocab_size), always=eos_ids(target_dir))
    torch.manual_seed(cfg.seed)  # the fresh drafter's weights are the same in every process and rerun
    drafter, target_head = build_drafter(target_dir, draft_ids, cfg.init_from_target)
    objective = TTTObjective(drafter, target_head, cfg, attention, oov).to(env.device)
    objective.set_vocab(draft_ids.to(env.device))
    model = objective
    if env.world > 1:
        model = nn.parallel.DistributedDataParallel(objective, device_ids=[env.local_rank] if gpu else None)

    per_epoch = len(data.shard(data.make_batches(train_items, cfg.max_tokens, cfg.seed, 0), env.rank, env.world))
    if per_epoch == 0:
        raise RuntimeError(f"run {run_id}: {len(train_items)} samples make no batch for {env.world} processes")
    total = cfg.max_steps if cfg.max_steps > 0 else per_epoch * cfg.epochs
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(total, max(1, int(cfg.warmup_ratio * total)), cfg.min_lr_ratio)
    )
    step, epoch, pos = 0, 0, 0
    if state is not None:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, epoch, pos = state["step"], state["epoch"], state["batch"]
        ckpt.set_rng_state(state["rng"])

    rep = Reporter(redis, run_id, folder, env.main)
    started = time.time()
    rep.set(
        state="training", step=step, total_steps=total, epoch=epoch, epochs=cfg.epochs, started_at=started,
        train_samples=len(train_items), heldout_samples=len(held_items), draft_vocab_size=len(draft_ids),
        ttt_steps=cfg.ttt_steps, world_size=env.world, device=str(env.device),
    )  # fmt: skip
    log.info(
        "run %s: training %d steps (%d a epoch), %d train / %d held-out samples, draft vocab %d, %d TTT steps, "
        "%d process(es) on %s, attention %s",
        run_id, total, per_epoch, len(train_items), len(held_items), len(draft_ids), cfg.ttt_steps,
        env.world, env.device, attention,
    )  # fmt: skip
    rep.start_bar(total, step)

    def save(final: bool = False) -> Path:
        blob = {
            "model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": step, "epoch": epoch, "batch": pos, "rng": ckpt.rng_state(), "draft_ids": draft_ids.cpu(),
            "train_config": asdict(cfg), "drafter_config": drafter.cfg.to_dict(),
        }  # fmt: skip
        path = ckpt.save_state(folder, step, blob, cfg.keep_checkpoints)
        out = ckpt.save_drafter(
            drafter_dir(data_dir, run_id), drafter, model_config(target_dir), aux_layer_ids or [], dtype
        )
        rep.set(last_checkpoint=str(path), drafter_dir=str(out))
        return path

    window_tokens, window_start, last = 0, time.time(), {}
    try:
        while step < total:
            batches = data.shard(data.make_batches(train_items, cfg.max_tokens, cfg.seed, epoch), env.rank, env.world)
            batch_set = data.BatchSet(batches, data_dir, run_id, dtype, cfg.max_len)
            for batch in data.loader(batch_set, pos, cfg.workers):
                if step >= total:
                    break
                b = {k: v.to(env.device, non_blocking=True) for k, v in batch.items()}
                with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=gpu):
                    loss, losses, accs = model(
                        b["input_ids"], b["loss_mask"], b["hidden_states"], b["aux_hidden_states"]
                    )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
                opt.step()
                sched.step()
                step, pos = step + 1, pos + 1
                window_tokens += int(b["tokens"]) * env.world
                last = {"loss": loss.item(), "acc": [round(a, 4) for a in accs.tolist()]}
                rep.record({"step": step, **last, "step_losses": losses.tolist(), "grad_norm": float(gnorm)})
                if step % cfg.log_every == 0 or step == total:
                    now = time.time()
                    tps = window_tokens / max(now - window_start, 1e-9)
                    steps_s = cfg.log_every / max(now - window_start, 1e-9)
                    eta = (total - step) / max(steps_s, 1e-9)
                    rep.set(
                        step=step,
                        epoch=epoch,
                        lr=sched.get_last_lr()[0],
                        tokens_per_s=round(tps, 1),
                        eta_s=round(eta),
                        **last,
                    )
                    log.info(
                        "run %s: step %d/%d loss %.4f acc %s %.0f tok/s",
                        run_id,
                        step,
                        total,
                        last["loss"],
                        last["acc"],
                        tps,
                    )
                    window_tokens, window_start = 0, now
                rep.step(step, f"loss {last['loss']:.3f} acc0 {last['acc'][0]:.2f}")
                if step % cfg.checkpoint_every == 0 and step < total and env.main:
                    save()
                    rep.set(**heldout(objective, held_items, data_dir, run_id, dtype, cfg, env))
            else:
                epoch, pos = epoch + 1, 0
    finally:
        rep.close()
    final = {}
    if env.main:
        path = save(final=True)
        final = {
            "step": step,
            "last_checkpoint": str(path),
            **last,
            **heldout(objective, held_items, data_dir, run_id, dtype, cfg, env),
        }
        rep.set(**{k: v for k, v in final.items() if k != "acc"}, acc=last.get("acc", []), finished_at=time.time())
        log.info(
            "run %s: training done at step %d, held-out %s",
            run_id,
            step,
            {k: final.get(k) for k in ("heldout_loss", "heldout_acc")},
        )
    if env.world > 1:
        dist.barrier()
    return final


@torch.no_grad()
def heldout(objective: TTTObjective, items, data_dir: Path, run_id: str, dtype, cfg: TrainConfig, env: Dist) -> dict:
    """Mean TTT loss and per-step accuracy on the held-out samples (rank 0 alone: the split is small)."""
    if not items:
        return {}
    objective.eval()
    losses, accs = [], []
    for batch in data.BatchSet(data.make_batches(items, cfg.max_tokens, 0, 0), data_dir, run_id, dtype, cfg.max_len):
        b = {k: v.to(env.device) for k, v in batch.items()}
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=env.device.type == "cuda"):
            loss, _, acc = objective(b["input_ids"], b["loss_mask"], b["hidden_states"], b["aux_hidden_states"])
        losses.append(loss.item())
        accs.append(acc.cpu().numpy())
    objective.train()
    steps = min(len(a) for a in accs)
    return {
        "heldout_loss": round(float(np.mean(losses)), 5),
        "heldout_acc": [round(float(x), 4) for x in np.mean([a[:steps] for a in accs], 0)],
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
