"""Long samples' memory options change nothing but memory: the loss in chunks of positions (its logits recomputed
in the backward pass) and checkpointed unrolled steps give the same loss, accuracies and gradients; the LK losses
are what SpecForge defines."""

import pytest
import torch

from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.model import Drafter, DrafterConfig
from eaglet.services.trainer.objective import TTTObjective

V, H, T, B = 64, 32, 23, 2


def objective(**options) -> TTTObjective:
    cfg = DrafterConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=V, draft_vocab_size=40)  # fmt: skip
    torch.manual_seed(0)
    drafter = Drafter(cfg, torch.randn(V, H))
    o = TTTObjective(drafter, torch.randn(V, H), TrainConfig(**{"ttt_steps": 4, **options}), "math", oov=True)
    o.set_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40].sort().values)
    return o


def batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    return ids, mask, torch.randn(B, T, H, generator=g), torch.randn(B, T, 3 * H, generator=g)


def run(o: TTTObjective):
    loss, losses, accs = o(*batch())
    loss.backward()
    return loss.detach(), losses, accs, {n: p.grad.clone() for n, p in o.named_parameters()}


@pytest.mark.parametrize("options", [{"loss_chunk": 5}, {"loss_chunk": 1}, {"checkpoint_steps": True},
                                     {"loss_chunk": 7, "checkpoint_steps": True}])  # fmt: skip
def test_chunked_loss_and_checkpointed_steps_equal_the_plain_computation(options):
    plain = run(objective(loss_chunk=0))
    other = run(objective(**options))
    for a, b in zip(plain[:3], other[:3], strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a, b)
    assert plain[2].max() > 0  # some positions right: the accuracies are compared on something
    for name, grad in plain[3].items():
        assert torch.allclose(grad, other[3][name], atol=1e-5), name


def test_loss_chunk_is_checked():
    with pytest.raises(ValueError, match="loss_chunk"):
        TrainConfig(loss_chunk=-1)


@pytest.mark.parametrize("loss", ["lk-alpha", "lk-lambda"])
def test_lk_losses_chunked_equal_plain(loss):
    plain = run(objective(loss_chunk=0, loss=loss))
    other = run(objective(loss_chunk=4, loss=loss, checkpoint_steps=True))
    for a, b in zip(plain[:3], other[:3], strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a, b)
    for name, grad in plain[3].items():
        assert torch.allclose(grad, other[3][name], atol=1e-5), name


def test_lk_alpha_is_minus_the_log_of_the_expected_acceptance():
    o = objective(loss="lk-alpha", ttt_steps=1).eval()
    ids, mask, hidden, aux = batch()
    _, losses, _ = o(ids, mask, hidden, aux)
    with torch.no_grad():
        full = torch.softmax(hidden @ o.target_head.T, -1)  # the target's probabilities over its whole vocabulary
        usable = o.drafter.t2d[full.argmax(-1)]
        out = o.drafter.forward_ttt(ids, aux, 1)[0]
        q = torch.softmax(o.drafter.logits(out), -1)  # [B, T, Vd]
        logs = []
        for b in range(B):
            for t in range(T - 2):
                if mask[b, t + 2] and usable[b, t + 1]:
                    accept = torch.minimum(full[b, t + 1, o.draft_ids], q[b, t]).sum()
                    logs.append(torch.log(accept))
    assert torch.allclose(losses[0], -torch.stack(logs).mean(), atol=1e-5)
    kl = objective(loss="kl", ttt_steps=1).eval()(ids, mask, hidden, aux)[1]
    assert not torch.allclose(kl, losses)


def test_the_loss_is_checked():
    with pytest.raises(ValueError, match="loss"):
        TrainConfig(loss="mse")
