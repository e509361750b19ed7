"""The EAGLE-3 training-time-test objective: the drafter unrolled over stored hidden states and its loss against the
target's distribution (forward KL or the acceptance-aware LK losses), and its figures on a held-out split."""

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.model import Drafter
from eaglet.services.trainer.topk import draft_index, topk_terms


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
        [B, T, k], draft ids [B, T, k]: services/trainer/topk.py)."""
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


def objective_options(cfg: TrainConfig, device: torch.device) -> tuple[str, bool]:
    """(attention implementation, OOV mask on) of the objective on ``device``: ``auto`` resolved."""
    gpu = device.type == "cuda"
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if gpu else "math")
    return attention, cfg.oov_mask == "on" or (cfg.oov_mask == "auto" and gpu)


def states_dtype(device: torch.device) -> torch.dtype:
    """The dtype the stored states are read in on ``device`` (the objective runs under bf16 autocast on CUDA)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@torch.no_grad()
def objective_inputs(b: dict[str, torch.Tensor]) -> tuple:
    """A batch as the objective's arguments: the final states, or the stored top-k where a run kept that instead."""
    keys = ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states", "topk_ids", "topk_logp")
    return tuple(b.get(k) for k in keys)


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
