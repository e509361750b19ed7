import pytest
import torch

from eaglet.services.trainer.model import (
    Drafter,
    DrafterConfig,
    KVCache,
    ttt_attention_flex,
    ttt_attention_math,
    ttt_block_mask,
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


@pytest.mark.parametrize("T, steps", [(16, 3), (300, 3), (256, 2), (129, 7)])
def test_flex_attention_matches_math(T, steps):
    torch.manual_seed(0)
    B, h, d = 2, 2, 8
    ks = [torch.randn(B, h, T, d) for _ in range(steps)]
    vs = [torch.randn(B, h, T, d) for _ in range(steps)]
    q = torch.randn(B, h, T, d)
    torch.testing.assert_close(ttt_attention_flex(q, ks, vs), ttt_attention_math(q, ks, vs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T, steps", [(16, 3), (300, 3), (129, 7)])
def test_the_block_mask_built_row_by_row_is_torchs_own(T, steps):
    from torch.nn.attention.flex_attention import create_block_mask

    mine = ttt_block_mask(T, steps, torch.device("cpu"))
    length = torch.tensor(T)

    def mask_mod(b, h, q_idx, kv_idx):  # the mask, evaluated densely by torch
        j, s = kv_idx // length, kv_idx % length
        return ((j == 0) & (s <= q_idx)) | ((j > 0) & (s == q_idx))

    theirs = create_block_mask(mask_mod, None, None, T, T * steps, device="cpu")
    assert torch.equal(mine.to_dense(), theirs.to_dense())  # the blocks attended at all
    assert int(mine.full_kv_num_blocks.sum()) <= int(theirs.full_kv_num_blocks.sum())  # full only where all set


@torch.no_grad()
def test_training_unroll_is_what_decoding_does():
    """Step 1 of the unroll at position t equals drafting one token after position t at inference time."""
    model = tiny_drafter()
    T = 10
    ids = torch.randint(0, 50, (1, T))
    aux = torch.randn(1, T, 96)
    outs = model.forward_ttt(ids, aux, steps=3)
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
