"""The DFlash objective: blocks drafted in parallel from the target's context, their loss against the target's
distribution at every block position.

A packed row of T tokens trains up to ``dflash_anchors`` blocks at once (``data.BlockRule`` picks their anchors on
the host). Block a starts at anchor p: its tokens are [token p, mask x (block_size - 1)] at positions p .. p +
block_size - 1 of its document, its queries see the context keys of its document's tokens before p (the target's
states, as the engine has them when it drafts after verifying token p - 1) and every key of its own block. Block
index j learns the target's distribution at position p + j - 1, the one the target's verify pass would sample token
p + j from: forward KL over the whole vocabulary (from the stored final state through the target's LM head, or
from the stored top-k, ``topk.py``). Position j's loss is weighted exp(-(j - 1) / dflash_decay), the DFlash paper's
decay: a block is accepted up to its first miss, so the early positions count most.
"""

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.dflash import DFlashDrafter
from eaglet.services.trainer.model import wide
from eaglet.services.trainer.topk import topk_terms


class DFlashObjective(nn.Module):
    """Drafter + loss in one forward, so DDP sees every parameter use inside ``forward``; nothing in it reads a
    figure back to the host (invalid block positions are weighted 0, not dropped)."""

    target_head: torch.Tensor  # a buffer, set in __init__

    def __init__(self, drafter: DFlashDrafter, target_head: torch.Tensor, cfg: TrainConfig):
        super().__init__()
        self.drafter, self.cfg = drafter, cfg
        self.attention = "sdpa"
        self.noise_seed = cfg.seed  # set by the trainer for each step and process, as the EAGLE-3 objective's
        self.register_buffer("target_head", target_head, persistent=False)  # [V, H], frozen

    @property
    def positions(self) -> int:
        """Figures per block position: the drafted tokens of a block."""
        return self.drafter.cfg.block_size - 1

    def batch_set(self, batches: list[list[data.Item]], data_dir: Path, run_id: str, dtype: torch.dtype,
                  max_len: int) -> data.BatchSet:  # fmt: skip
        rule = data.BlockRule(self.drafter.cfg.block_size, self.cfg.dflash_anchors)
        return data.BatchSet(batches, data_dir, run_id, dtype, max_len, 0, blocks=rule)

    @staticmethod
    def inputs(b: data.Batch) -> tuple:
        keys = ("input_ids", "hidden_states", "aux_hidden_states", "topk_ids", "topk_logp", "position_ids",
                "document_ids", "anchors", "labels")  # fmt: skip
        return tuple(b.get(k) for k in keys)

    def position_terms(self, out: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, hidden, topk) -> torch.Tensor:
        """[KL summed, right top tokens] of one block position over the blocks: ``out`` [A, H] the drafter's final
        states, ``rows`` [A] the target rows it learns (flat), ``weight`` [A] 1 where it is a loss position. A
        function of its inputs alone: recomputed in the backward pass, its A x V logits are never kept."""
        logq = torch.log_softmax(wide(out @ self.target_head.T.to(out.dtype)), -1)  # [A, V]
        if hidden is None:
            ids, logp = topk[0][rows], topk[1][rows]
            kl, hits = topk_terms(logp, ids, logq)[:2]
        else:
            with torch.no_grad():
                lp = torch.log_softmax(wide(hidden[rows] @ self.target_head.T.to(hidden.dtype)), -1)
            kl = (lp.exp() * (lp - logq)).sum(-1)
            hits = (logq.argmax(-1) == lp.argmax(-1)).float()
        return torch.stack([(kl * weight).sum(), (hits * weight).sum()])

    def forward(self, input_ids, hidden_states, aux_hidden_states, topk_ids, topk_logp, position_ids, document_ids,
                anchors, labels):  # fmt: skip
        """(weighted loss, per-position losses [block_size - 1], per-position accuracies [block_size - 1]): this
        process's share of the global batch while training across processes, as the EAGLE-3 objective's."""
        bs, T = self.drafter.cfg.block_size, input_ids.shape[1]
        ids, pos, docs = input_ids[0], position_ids[0], document_ids[0]
        aux = aux_hidden_states
        if self.training and self.cfg.aux_noise > 0:
            noise = torch.Generator(aux.device)
            noise.manual_seed(self.noise_seed)
            aux = aux + torch.empty_like(aux).uniform_(-self.cfg.aux_noise, self.cfg.aux_noise, generator=noise)
        context = self.drafter.context_kv(aux, position_ids)
        A = len(anchors)
        offsets = torch.arange(bs, device=ids.device)
        tokens = self.drafter.block_ids(ids[anchors]).reshape(1, -1)  # [1, A * bs]
        block_pos = (pos[anchors][:, None] + offsets).reshape(1, -1)
        # a block's queries see its document's tokens before its anchor, and the whole of its own block
        sees_ctx = (docs[None, :] == docs[anchors][:, None]) & (torch.arange(T, device=ids.device) < anchors[:, None])
        block_of = torch.arange(A * bs, device=ids.device) // bs
        mask = torch.cat([sees_ctx.repeat_interleave(bs, 0), block_of[:, None] == block_of[None, :]], 1)
        out = self.drafter(tokens, block_pos, context, mask[None, None]).view(A, bs, -1)
        hidden = None if hidden_states is None else hidden_states[0]
        topk = None if topk_ids is None else (topk_ids[0], topk_logp[0])
        weights = labels.float()
        recompute = torch.is_grad_enabled()
        sums = []
        for j in range(1, bs):
            args = (out[:, j], (anchors + j - 1).clamp(max=T - 1), weights[:, j - 1], hidden, topk)
            if recompute:
                sums.append(torch.utils.checkpoint.checkpoint(self.position_terms, *args, use_reentrant=False))
            else:
                sums.append(self.position_terms(*args))
        kl, hits = torch.stack(sums, 1)  # [bs - 1] each
        counts = weights.sum(0)
        if self.training and dist.is_initialized():
            dist.all_reduce(counts)
        counts = counts.clamp(min=1)
        losses, accs = kl / counts, hits / counts
        decay = self.cfg.dflash_decay
        w = torch.exp(-torch.arange(bs - 1, device=ids.device, dtype=losses.dtype) / decay) if decay > 0 else 1.0
        return (w * losses).sum(), losses.detach(), accs.detach()
