"""The EAGLE-3 training-time-test objective: the drafter unrolled over stored hidden states and its loss against the
target's distribution (forward KL or the acceptance-aware LK losses), and its figures on a held-out split."""

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.dflash_objective import DFlashObjective
from eaglet.services.trainer.model import Drafter, wide
from eaglet.services.trainer.onpolicy import ChainReplay
from eaglet.services.trainer.topk import draft_index, topk_terms
from eaglet.services.trainer.unreadable import UnreadableSamples
from eaglet.shared.store import StoreError

log = logging.getLogger(__name__)


class TTTObjective(nn.Module):
    """Drafter + loss in one forward, so DDP sees every parameter use inside ``forward``.

    Nothing in the forward reads a figure back to the host: the rows of each step's loss come from the batch
    (computed by the loader on the host, ``data.ttt_rows``), and every count stays a device tensor, so a step
    queues its kernels without waiting for the GPU until the caller reads its figures."""

    target_head: torch.Tensor  # buffers, set in __init__
    draft_ids: torch.Tensor

    def __init__(self, drafter: Drafter, target_head: torch.Tensor, cfg: TrainConfig, attention: str, oov: bool,
                 replay: ChainReplay | None = None):  # fmt: skip
        super().__init__()
        self.drafter, self.cfg, self.attention, self.oov = drafter, cfg, attention, oov
        self.replay = replay  # an on-policy round's previous drafter: its rejections weight the training loss
        # the seed of the next training forward's noise on the auxiliary states (cfg.aux_noise): the trainer sets it
        # for each step and process, so a resumed training draws the noise one never stopped would have
        self.noise_seed = cfg.seed
        self.register_buffer("target_head", target_head, persistent=False)  # [V, H], frozen
        self.register_buffer("draft_ids", torch.zeros(drafter.cfg.draft_vocab_size, dtype=torch.long), persistent=False)

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        self.draft_ids.copy_(draft_ids)
        self.drafter.set_vocab(draft_ids)

    @property
    def positions(self) -> int:
        """Figures per draft position: the unrolled steps."""
        return self.cfg.ttt_steps

    def batch_set(self, batches: list[list[data.Item]], data_dir: Path, run_id: str, dtype: torch.dtype,
                  max_len: int) -> data.BatchSet:  # fmt: skip
        return data.BatchSet(batches, data_dir, run_id, dtype, max_len, self.cfg.ttt_steps, self.cfg.loss_mask_align)

    @staticmethod
    def inputs(b: data.Batch) -> tuple:
        return objective_inputs(b)

    def spans(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) chunks of ``n`` rows, ``cfg.loss_chunk`` at most each (one chunk when 0)."""
        size = self.cfg.loss_chunk or n
        return [(lo, min(lo + size, n)) for lo in range(0, n, size)] or [(0, 0)]

    @torch.no_grad()
    def target_view(self, rows: torch.Tensor, hidden: torch.Tensor | None, topk: tuple | None) -> tuple:
        """The target's side of the loss at the flat positions ``rows`` [N] (every position some step predicts
        from), computed there only, by chunks of rows: the logits of a long sample over the whole vocabulary
        would be N x V. Returns (usable [N] float: 1 where the target's top token over its whole vocabulary is in
        the draft vocabulary, all 1 with the OOV mask off; and the target: from ``hidden`` [B, T, H] its logits
        over the draft vocabulary [N, Vd] in hidden's dtype, their log-normalizer [N], their top draft token [N]
        and the log of its normalizer over the whole vocabulary [N] for the LK losses (else None); from a stored
        top-k (``topk``: ids, log-probs [B, T, k]) its log-probs and their draft ids [N, k])."""
        if hidden is None:
            assert topk is not None  # a run stores one of the two
            ids = topk[0].flatten(0, 1)[rows]
            usable = self.drafter.t2d[ids[:, 0]] if self.oov else torch.ones_like(rows, dtype=torch.bool)
            return usable.float(), (topk[1].flatten(0, 1)[rows], draft_index(self.drafter.t2d)[ids])
        lk = self.cfg.loss != "kl"
        states = hidden.flatten(0, 1)
        head_d = self.target_head[self.draft_ids].T.to(hidden.dtype)  # [H, Vd]
        head = self.target_head.T.to(hidden.dtype) if self.oov or lk else None  # [H, V]
        logits, lse_d, top_d, usable, lse = [], [], [], [], []
        for lo, hi in self.spans(len(rows)):
            h = states[rows[lo:hi]]  # [n, H]
            logits.append(h @ head_d)  # [n, Vd]
            lse_d.append(torch.logsumexp(wide(logits[-1]), -1))
            top_d.append(logits[-1].argmax(-1))
            if head is not None:
                full = h @ head  # [n, V]
                usable.append(self.drafter.t2d[full.argmax(-1)] if self.oov else torch.ones_like(top_d[-1]).bool())
                if lk:
                    lse.append(torch.logsumexp(wide(full), -1))
        if not usable:
            usable = [torch.ones_like(rows, dtype=torch.bool)]
        target = (torch.cat(logits), torch.cat(lse_d), torch.cat(top_d), torch.cat(lse) if lk else None)
        return torch.cat(usable).float(), target

    def step_terms(self, out: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                   usable: torch.Tensor, target: tuple) -> torch.Tensor:  # fmt: skip
        """[KL summed, right top tokens, expected acceptance summed, its log summed] (the last two 0 for the KL
        loss) of one step at the flat drafter positions ``rows`` [n], predicting from the target rows ``targets``
        [n] (indexes into ``target_view``'s rows): the loss terms weighted by ``weight`` [n], the right top tokens
        by ``usable`` [n] (both 0 where the OOV mask drops a position). A function of its inputs alone: a chunk of
        rows recomputes exactly this in the backward pass."""
        logq = torch.log_softmax(wide(self.drafter.logits(out.flatten(0, 1)[rows])), -1)  # [n, Vd]
        if len(target) == 2:  # the stored top-k
            terms = topk_terms(target[0][targets], target[1][targets], logq, self.cfg.topk_tail)
        else:
            logits, lse_d, top_d, lse = target
            t = wide(logits[targets])
            lp = t - lse_d[targets, None]  # the target's log-probs over the draft vocabulary
            kl = (lp.exp() * (lp - logq)).sum(-1)
            hits = (logq.argmax(-1) == top_d[targets]).float()
            if lse is None:
                zero = torch.zeros_like(kl)
                terms = torch.stack([kl, hits, zero, zero])
            else:
                full = t - lse[targets, None]  # log p over the whole vocabulary, on the draft vocabulary's tokens
                accept = torch.minimum(full.exp(), logq.exp()).sum(-1)
                log_accept = torch.where(accept > 0, accept.clamp_min(1e-30).log(), torch.zeros_like(accept))
                terms = torch.stack([kl, hits, accept, log_accept])
        return (terms * torch.stack([weight, usable, weight, weight])).sum(-1)

    def forward(self, input_ids, loss_mask, hidden_states, aux_hidden_states, topk_ids=None, topk_logp=None,
                position_ids=None, document_ids=None, loss_rows=None, loss_row_counts=None):  # fmt: skip
        """(weighted loss, per-step losses [ttt_steps], per-step accuracies [ttt_steps]) as this process's share of
        the global batch while training across processes: summed over the processes they are what one process
        would compute on the whole batch. Otherwise (one process, evaluation) the figures of this batch alone.
        The target's distribution comes from ``hidden_states`` [B, T, H], or, for a run that stored its top-k
        instead (``hidden_states`` None), from ``topk_ids`` and ``topk_logp`` [B, T, k]. A packed batch
        (``data.collate``) gives its ``position_ids``, ``document_ids`` and the rows of each step's loss
        (``loss_rows``, ``loss_row_counts``); without them they are worked out here from ``loss_mask``."""
        steps = self.cfg.ttt_steps
        if loss_rows is None:
            documents = None if document_ids is None else document_ids.cpu()
            loss_rows, loss_row_counts = data.ttt_rows(loss_mask.cpu(), documents, steps, self.cfg.loss_mask_align)
            loss_rows = loss_rows.to(input_ids.device)
        rows = loss_rows.split(list(loss_row_counts))  # step i: the flat positions t it is trained at
        # every target position a step predicts from is one step 0 does (t + 1 + i is step 0's row t + i + 1)
        first = rows[0] + 1
        targets = [torch.searchsorted(first, r + 1 + i) for i, r in enumerate(rows)]
        usable, target = self.target_view(first, hidden_states, None if hidden_states is not None else
                                          (topk_ids, topk_logp))  # fmt: skip
        # the previous drafter's chains on the stored states as they are: the engine's, never the training's noise
        first_misses = (self.replay.first_misses(input_ids, aux_hidden_states, steps, position_ids, document_ids)
                        if self.replay is not None and self.training else None)  # fmt: skip
        if self.training and self.cfg.aux_noise > 0:
            noise = torch.Generator(aux_hidden_states.device)
            noise.manual_seed(self.noise_seed)
            aux_hidden_states = aux_hidden_states + torch.empty_like(aux_hidden_states).uniform_(
                -self.cfg.aux_noise, self.cfg.aux_noise, generator=noise
            )
        outs = self.drafter.unroll(input_ids, aux_hidden_states, steps, self.attention,
                                   checkpoint=self.cfg.checkpoint_steps if self.training else 0,
                                   position_ids=position_ids, document_ids=document_ids)  # fmt: skip
        usables = [usable[t] for t in targets]
        weights = usables
        if first_misses is not None:
            weights = [u * e for u, e in zip(usables, self.replay.weights(first_misses, rows), strict=True)]
        # accuracy is over every loss position, the unusable ones counting as misses: comparable across vocabularies
        positions = torch.tensor(loss_row_counts, dtype=torch.float32).to(input_ids.device, non_blocking=True)
        counts, positions = self.global_counts(torch.cat([torch.stack([w.sum() for w in weights]), positions]))
        # A chunk keeps its inputs only, its logits recomputed in the backward pass, in any row longer than one
        # chunk (the memory rule's case), even where each step's loss rows fit one: every step's kept log-probs
        # would then be S x chunk x Vd, which the rule does not count
        recompute = torch.is_grad_enabled() and 0 < self.cfg.loss_chunk < input_ids.numel() - 2
        sums = []
        for out, r, t, w, u in zip(outs, rows, targets, weights, usables, strict=True):
            total = torch.zeros(4, device=input_ids.device)
            for lo, hi in self.spans(len(r)):
                args = (out, r[lo:hi], t[lo:hi], w[lo:hi], u[lo:hi], target)
                if recompute:
                    total = total + torch.utils.checkpoint.checkpoint(self.step_terms, *args, use_reentrant=False)
                else:
                    total = total + self.step_terms(*args)
            sums.append(total)
        kl, hits, accept, log_accept = torch.stack(sums, 1) / torch.stack([counts, positions, counts, counts])
        if self.cfg.loss == "lk-alpha":
            losses = -log_accept
        elif self.cfg.loss == "lk-lambda":
            w = self.cfg.lk_kl_scale * torch.exp(-self.cfg.lk_kl_decay * accept.detach())
            losses = w * kl + (1 - w) * (1 - accept)
        else:
            losses = kl
        step_weights = self.cfg.step_weight ** torch.arange(steps, device=input_ids.device, dtype=losses.dtype)
        return (step_weights * losses).sum(), losses.detach(), hits.detach()

    def global_counts(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(usable positions, weighted: the loss's denominators; loss positions) per step: over every process's
        batch while training across processes, so the loss is the mean over the global batch's positions whatever
        their split, as on one process."""
        counts = local.float()
        if self.training and dist.is_initialized():
            dist.all_reduce(counts)
        return counts.clamp(min=1).split(len(counts) // 2)


def place(objective: TTTObjective, device: torch.device) -> TTTObjective:
    """The objective on ``device``, the frozen target tensors (embedding, LM head) in the states' dtype first
    (one embedding for both drafters of an on-policy round):
    every use casts them to it anyway, and on a GPU float32 copies would hold twice the memory (4.4 GiB each at
    Kimi-K2.5's vocabulary)."""
    dtype = states_dtype(device)
    objective.target_head = objective.target_head.to(dtype)
    objective.drafter.embed_tokens = objective.drafter.embed_tokens.to(dtype)
    replay = objective.replay
    if replay is not None:  # an on-policy round's previous drafter embeds with the same one, moved once, not twice
        replay.drafter.embed_tokens = objective.drafter.embed_tokens[:0]
    objective = objective.to(device)
    if replay is not None:
        replay.drafter.embed_tokens = objective.drafter.embed_tokens
    return objective


def objective_options(cfg: TrainConfig, device: torch.device) -> tuple[str, bool]:
    """(attention implementation, OOV mask on) of the objective on ``device``: ``auto`` resolved."""
    gpu = device.type == "cuda"
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if gpu else "math")
    return attention, cfg.oov_mask == "on" or (cfg.oov_mask == "auto" and gpu)


def states_dtype(device: torch.device) -> torch.dtype:
    """The dtype the stored states are read in on ``device`` (the objective runs under bf16 autocast on CUDA)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def objective_inputs(b: data.Batch) -> tuple:
    """A batch as the objective's arguments: the final states, or the stored top-k where a run kept that instead,
    and the packing's positions, documents and loss rows."""
    keys = ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states", "topk_ids", "topk_logp", "position_ids",
            "document_ids", "loss_rows", "loss_row_counts")  # fmt: skip
    return tuple(b.get(k) for k in keys)


@torch.no_grad()
def heldout_figures(
    objective: "TTTObjective | DFlashObjective", items: list[data.Item], *, data_dir: Path, run_id: str,
    tokens_per_batch: int, max_len: int, device: torch.device, rank: int = 0, world: int = 1,
    unreadable: UnreadableSamples | None = None,
) -> dict:  # fmt: skip
    """The held-out figures of ``objective`` on ``items`` (a run's held-out split), the training's and any saved
    drafter's alike (``score``): the mean over the batches (fixed: seed 0, epoch 0) of the weighted TTT loss and of
    each step's accuracy, with ``samples`` and ``tokens`` (after the ``max_len`` cut) of the split. Across
    processes each evaluates every world-th batch and every process gets the whole split's figures. Without
    autograd: a graph kept alive by the running sums would hold every batch's activations until the end (on the
    GPU, tens of GiB at the checkpoint of a small drafter). A sample whose stored file cannot be read is left out,
    noted by ``unreadable`` (the training's); without one it is an error (StoreError), as for a saved drafter's
    score."""
    batches = data.make_batches(items, tokens_per_batch, 0, 0)[rank::world]
    was_training = objective.training
    objective.eval()
    sums = torch.zeros(objective.positions + 2, device=device)  # loss, accuracy per position, batches
    batch_set = objective.batch_set(batches, data_dir, run_id, states_dtype(device), max_len)
    for b in data.on_device(batch_set, device):
        if unreadable is not None:
            unreadable.note(b)
        elif b["unreadable"]:
            bad = b["unreadable"][0]
            raise StoreError(f"held-out sample {bad.sample_id}: {bad.reason}")
        if data.is_empty(b):
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _, acc = objective(*objective.inputs(b))
        sums += torch.cat([loss.float()[None], acc.float(), torch.ones(1, device=device)])
    objective.train(was_training)
    if world > 1:
        dist.all_reduce(sums)
    if sums[-1] == 0:  # no held-out sample, or every one unreadable (each already noted): no figure, not 0 / 0
        if items:
            log.warning("run %s: none of the %d held-out samples could be read: no held-out figures", run_id,
                        len(items))  # fmt: skip
        loss, acc = None, None
    else:
        mean_loss, *mean_acc = (sums[:-1] / sums[-1]).tolist()
        loss, acc = round(mean_loss, 5), [round(a, 4) for a in mean_acc]
    return {
        "heldout_loss": loss,
        "heldout_acc": acc,
        "samples": len(items),
        "tokens": sum(min(it.length, max_len) for it in items),  # what collate keeps of each
    }
