import math

import pytest
import torch

from eaglet.services.trainer.model import (
    CausalAttention,
    Drafter,
    DrafterConfig,
    KVCache,
    causal_block_mask,
    ttt_attention,
)


def tiny_drafter(seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=50, draft_vocab_size=50)  # fmt: skip
    model = Drafter(cfg, torch.randn(50, 32))
    model.set_vocab(torch.arange(50))
    for p in model.parameters():  # ones-initialised norms hide mistakes; perturb everything
        p.data += 0.1 * torch.randn_like(p)
    return model.eval()


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=50, draft_vocab_size=51)  # fmt: skip


def dense_ttt_attention(q, ks, vs, documents=None):
    """The TTT attention with every score materialized and the keys expanded to the query heads: the reference."""
    B, h, T, d = q.shape
    ks, vs = ([t.repeat_interleave(h // t.shape[1], 1) for t in x] for x in (ks, vs))
    s0 = q @ ks[0].transpose(-1, -2) / math.sqrt(d)
    seen = torch.ones(T, T, dtype=torch.bool).tril()
    if documents is not None:
        seen = seen & (documents[:, :, None] == documents[:, None, :])[:, None]
    diag = [(q * k).sum(-1, keepdim=True) / math.sqrt(d) for k in ks[1:]]
    p = torch.softmax(torch.cat([s0.masked_fill(~seen, float("-inf")), *diag], -1), -1)
    out = p[..., :T] @ vs[0]
    for j, v in enumerate(vs[1:], start=1):
        out = out + p[..., T + j - 1 : T + j] * v
    return out


CASES = [(16, 3, None), (300, 3, None), (129, 7, None), (300, 4, [100, 150, 50]), (257, 2, [3, 254]), (40, 3, [1] * 40)]


@pytest.mark.parametrize("T, steps, docs", CASES)
def test_ttt_attention_is_the_dense_one_on_both_paths(T, steps, docs, monkeypatch):
    """Grouped-query keys never expanded, documents kept apart, the math path in several blocks (each recomputed in
    the backward pass) with the reference's gradients in float64; FlexAttention has no backward on the CPU."""
    g = torch.Generator().manual_seed(T)
    documents = None if docs is None else torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None]
    B = 2 if docs is None else 1

    def randn(heads):
        return torch.randn(B, heads, T, 8, generator=g, dtype=torch.float64, requires_grad=True)

    q, ks, vs = randn(4), [randn(2) for _ in range(steps)], [randn(2) for _ in range(steps)]
    reference = dense_ttt_attention(q, ks, vs, documents)
    grad = torch.randn(reference.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(reference, [q, *ks, *vs], grad)
    monkeypatch.setattr(CausalAttention, "MATH_CELLS", 4 * 7 * T)  # blocks of 7 queries
    out = ttt_attention(q, ks, vs, CausalAttention("math", T, q.device, documents))
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, [q, *ks, *vs], grad), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    q, ks, vs = q.detach(), [k.detach() for k in ks], [v.detach() for v in vs]
    flex = ttt_attention(q, ks, vs, CausalAttention("flex", T, q.device, documents))
    torch.testing.assert_close(flex, reference.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T, docs", [(16, None), (300, None), (384, None), (300, [100, 150, 50]), (384, [128, 256]),
                                     (1000, "random")])  # fmt: skip
def test_the_block_mask_built_from_blocks_is_torchs_own(T, docs):
    from torch.nn.attention.flex_attention import create_block_mask

    if docs == "random":
        documents = torch.randint(0, 9, (1, T), generator=torch.Generator().manual_seed(0)).sort().values
    else:
        documents = None if docs is None else torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None]
    mine = causal_block_mask(T, torch.device("cpu"), documents)

    def mask_mod(b, h, q_idx, kv_idx):  # the mask, evaluated densely by torch
        seen = kv_idx <= q_idx
        return seen if documents is None else seen & (documents[b, q_idx] == documents[b, kv_idx])

    theirs = create_block_mask(mask_mod, None if documents is None else 1, None, T, T, device="cpu")
    assert torch.equal(mine.to_dense(), theirs.to_dense())  # the blocks attended at all
    assert int(mine.full_kv_num_blocks.sum()) == int(theirs.full_kv_num_blocks.sum())  # and those fully


@torch.no_grad()
def test_training_unroll_is_what_decoding_does():
    """Step 1 of the unroll at position t equals drafting one token after position t at inference time."""
    model = tiny_drafter()
    T = 10
    ids = torch.randint(0, 50, (1, T))
    aux = torch.randn(1, T, 96)
    outs = list(model.unroll(ids, aux, steps=3))
    # step 0 over the whole sequence == causal incremental decoding of (features t, token t + 1)
    follow = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    step0 = model.decode(follow, model.fc(aux), 0, KVCache())
    torch.testing.assert_close(outs[0], step0, rtol=1e-4, atol=1e-5)
    for t in (0, 3, 6):
        cache = KVCache()
        g = model.decode(follow[:, : t + 1], model.fc(aux[:, : t + 1]), 0, cache)[:, -1:]
        g1 = model.decode(ids[:, t + 2 : t + 3], g, t + 1, cache)
        torch.testing.assert_close(outs[1][:, t : t + 1], g1, rtol=1e-4, atol=1e-5)
        g2 = model.decode(ids[:, t + 3 : t + 4], g1, t + 2, cache)
        torch.testing.assert_close(outs[2][:, t : t + 1], g2, rtol=1e-4, atol=1e-5)
