"""Speculative decoding, batch 1, chain of k draft tokens, greedy verification: target (transformers) + drafter.

Every emitted token is the target's own argmax, so the output equals greedy decoding with the target alone.

Bookkeeping: ``P`` tokens have target features (they sit in the target's KV cache); the drafter's cache holds
the same ``P`` positions, position t pairing the target's aux states at t with token t + 1. The last emitted token
is not yet in either cache: the verify pass feeds it first, followed by the k drafts.
"""

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from eaglet.services.trainer.dflash import DFlashDrafter
from eaglet.services.trainer.model import Drafter, KVCache


@dataclass
class SpecStats:
    k: int
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)  # per round: draft tokens accepted (0..k)

    def accept_length(self) -> float:
        """Tokens emitted per target forward (accepted drafts + the target's own token)."""
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)

    def position_rates(self) -> list[float]:
        """Share of rounds whose draft at position j (0-based) was accepted."""
        n = max(len(self.accepted), 1)
        return [sum(a > j for a in self.accepted) / n for j in range(self.k)]


def aux_states(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Transformers' hidden_states[i] is the input of layer i: concat of the captured ones [1, n, 3H]."""
    return torch.cat([hidden_states[i] for i in layer_ids], -1)


def _stop(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def _done(tokens: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in eos for t in tokens)


@torch.no_grad()
def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding, one token per forward: the reference output and the reference speed."""
    cache = DynamicCache()
    logits = target(input_ids, cache=cache, use_cache=True).logits
    out = [int(logits[0, -1].argmax())]
    while not _done(out, max_new_tokens, eos):
        logits = target(torch.tensor([[out[-1]]], device=input_ids.device), cache=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
    return _stop(out, max_new_tokens, eos)


@torch.no_grad()
def speculative_generate(
    target, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int, k: int, layer_ids: list[int], eos: set[int]
) -> tuple[list[int], SpecStats]:
    """input_ids [1, n] -> (new tokens, stats). ``layer_ids``: captured layer inputs (as stored, e.g. [2, 15, 27])."""
    device = input_ids.device
    dtype = next(drafter.parameters()).dtype
    stats = SpecStats(k)
    cache = DynamicCache()
    out = target(input_ids, cache=cache, use_cache=True, output_hidden_states=True)
    emitted = [int(out.logits[0, -1].argmax())]
    P = input_ids.shape[1]
    dcache = KVCache()
    # drafter catches up on the prompt: pairs (features at t, token t + 1), the last one the target's new token
    follow = torch.cat([input_ids[:, 1:], torch.tensor([emitted], device=device)], 1)
    h = drafter.decode(follow, drafter.fuse(aux_states(out.hidden_states, layer_ids).to(dtype)), 0, dcache)[:, -1:]
    while not _done(emitted, max_new_tokens, eos):
        drafts: list[int] = []
        for j in range(k):
            d = drafter.draft_to_target(drafter.logits(h)[0, -1].argmax())
            drafts.append(int(d))
            if j < k - 1:
                h = drafter.decode(d.view(1, 1), h, len(dcache), dcache)
        verify = torch.tensor([[emitted[-1], *drafts]], device=device)
        out = target(verify, cache=cache, use_cache=True, output_hidden_states=True)
        preds = out.logits[0].argmax(-1).tolist()  # [k + 1]
        a = 0
        while a < k and drafts[a] == preds[a]:
            a += 1
        stats.accepted.append(a)
        stats.rounds += 1
        new = drafts[:a] + [preds[a]]
        emitted.extend(new)
        # keep what was accepted: the last emitted token + a drafts now have target features
        cache.crop(P + 1 + a - cache.get_seq_length())  # negative: the number of tokens to drop
        dcache.crop(P)
        feats = drafter.fuse(aux_states(out.hidden_states, layer_ids)[:, : a + 1].to(dtype))
        h = drafter.decode(torch.tensor([new], device=device), feats, P, dcache)[:, -1:]
        P += 1 + a
    return _stop(emitted, max_new_tokens, eos), stats


@torch.no_grad()
def dflash_generate(
    target, drafter: DFlashDrafter, input_ids: torch.Tensor, max_new_tokens: int, eos: set[int]
) -> tuple[list[int], SpecStats]:
    """input_ids [1, n] -> (new tokens, stats), drafting a DFlash block a round as SGLang's DFlash worker does: the
    last emitted token and block_size - 1 mask tokens in one drafter pass over the context of every token before
    it, then one target pass verifying the whole block. The drafter's context cache holds the ``P`` tokens that
    have target states; the last emitted token is the block's first."""
    device = input_ids.device
    dtype = drafter.fc.weight.dtype
    layers = [i + 1 for i in drafter.cfg.target_layer_ids]  # outputs of layer i = transformers' hidden_states[i + 1]
    head = target.get_output_embeddings().weight.to(dtype)  # [V, H]
    bs = drafter.cfg.block_size
    stats = SpecStats(bs - 1)
    cache = DynamicCache()
    out = target(input_ids, cache=cache, use_cache=True, output_hidden_states=True)
    emitted = [int(out.logits[0, -1].argmax())]
    P = input_ids.shape[1]
    context = drafter.context_kv(aux_states(out.hidden_states, layers).to(dtype), torch.arange(P, device=device)[None])
    while not _done(emitted, max_new_tokens, eos):
        block = drafter.block_ids(torch.tensor([emitted[-1]], device=device))
        h = drafter(block, torch.arange(P, P + bs, device=device)[None], context)
        drafts = (h[0, 1:] @ head.T).argmax(-1).tolist()  # [bs - 1]: block index j guesses the token at P + j
        out = target(torch.tensor([[emitted[-1], *drafts]], device=device), cache=cache, use_cache=True,
                     output_hidden_states=True)  # fmt: skip
        preds = out.logits[0].argmax(-1).tolist()  # [bs]
        a = 0
        while a < bs - 1 and drafts[a] == preds[a]:
            a += 1
        stats.accepted.append(a)
        stats.rounds += 1
        emitted.extend(drafts[:a] + [preds[a]])
        cache.crop(P + 1 + a - cache.get_seq_length())  # keep the verified tokens: the block's first and a drafts
        fresh = drafter.context_kv(aux_states(out.hidden_states, layers)[:, : a + 1].to(dtype),
                                   torch.arange(P, P + 1 + a, device=device)[None])  # fmt: skip
        context = [
            (torch.cat([k, k2], 2), torch.cat([v, v2], 2)) for (k, v), (k2, v2) in zip(context, fresh, strict=True)
        ]
        P += 1 + a
    return _stop(emitted, max_new_tokens, eos), stats
