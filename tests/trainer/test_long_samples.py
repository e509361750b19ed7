"""Long samples' memory options change nothing but memory: the loss in chunks of rows (each recomputed in the
backward pass), checkpointed unrolled steps and the math attention a block of queries at a time give the plain
computation's loss, accuracies and gradients, in float64 to rounding; samples packed into one row train as they
would alone; the objective's step never reads a figure back to the host; the LK losses are what SpecForge defines."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.model import CausalAttention, Drafter, DrafterConfig
from eaglet.services.trainer.objective import TTTObjective

V, H, T, B = 64, 32, 23, 2


def objective(oov: bool = True, **options) -> TTTObjective:
    cfg = DrafterConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=V, draft_vocab_size=40)  # fmt: skip
    torch.manual_seed(0)
    drafter = Drafter(cfg, torch.randn(V, H))
    # no noise on the auxiliary states: a packed and a padded batch would draw it at other positions
    o = TTTObjective(drafter, torch.randn(V, H), TrainConfig(**{"ttt_steps": 4, "aux_noise": 0.0, **options}), "math",
                     oov=oov)  # fmt: skip
    o.set_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40].sort().values)
    return o.double()


def batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    states = [torch.randn(B, T, n, generator=g, dtype=torch.float64) for n in (H, 3 * H)]
    return ids, mask, *states


def run(o: TTTObjective, *inputs):
    loss, losses, accs = o(*(inputs or batch()))
    loss.backward()
    return loss.detach(), losses, accs, {n: p.grad.clone() for n, p in o.named_parameters()}


def assert_same(a, b):
    for x, y in zip(a[:3], b[:3], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    for name, grad in a[3].items():
        torch.testing.assert_close(grad, b[3][name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("options", [{"loss_chunk": 5}, {"loss_chunk": 1}, {"checkpoint_steps": 99},
                                     {"checkpoint_steps": 1}, {"loss_chunk": 7, "checkpoint_steps": 2}])  # fmt: skip
@pytest.mark.parametrize("blocks", [False, True])
def test_chunked_loss_checkpointed_steps_and_attention_blocks_equal_the_plain_computation(options, blocks,
                                                                                          monkeypatch):  # fmt: skip
    plain = run(objective(loss_chunk=0))
    assert plain[2].max() > 0  # some positions right: the accuracies are compared on something
    if blocks:
        monkeypatch.setattr(CausalAttention, "MATH_CELLS", 4 * 5 * T)  # blocks of 5 queries
    assert_same(plain, run(objective(**options)))


def test_a_row_longer_than_one_chunk_keeps_no_steps_log_probs_even_where_each_steps_rows_fit_one():
    """The memory rule counts no kept log-probabilities in a row longer than a loss chunk: a row whose loss
    positions are few (each step's rows fit one chunk) recomputes them too, with the same figures."""
    ids, mask, hidden, aux = batch()
    mask = torch.zeros_like(mask)
    mask[:, 3:9] = True  # 12 loss positions at most a step, in rows of B x T = 46 positions
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-1] == 40:  # the draft vocabulary: a step's logits or log-probabilities
            kept.append(tuple(t.shape))
        return t

    def run_kept(o: TTTObjective) -> tuple:
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            figures = run(o, ids, mask, hidden, aux)
        return figures, list(kept)

    plain, plain_kept = run_kept(objective(loss_chunk=0))
    chunked, chunked_kept = run_kept(objective(loss_chunk=16))
    assert plain_kept, "the plain computation keeps each step's log-probabilities for its backward pass"
    assert chunked_kept == []
    assert_same(plain, chunked)


def samples(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)

    def sample(n: int) -> dict[str, torch.Tensor]:
        states = [torch.randn(n, width, generator=g, dtype=torch.float64) for width in (H, 3 * H)]
        return {"input_ids": torch.randint(0, V, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.2,
                "hidden_states": states[0], "aux_hidden_states": states[1]}  # fmt: skip

    return [sample(n) for n in lengths]


KEYS = ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states")


def packed_inputs(batch: data.Batch) -> tuple:
    return (*(batch[k] for k in KEYS), None, None,
            *(batch[k] for k in ("position_ids", "document_ids", "loss_rows", "loss_row_counts")))  # fmt: skip


@pytest.mark.parametrize("options", [{}, {"loss_chunk": 4, "checkpoint_steps": 99}, {"loss": "lk-lambda"}])
def test_packed_samples_train_as_each_does_alone(options):
    """One row of three samples end to end: the same loss, accuracies and gradients as the three right-padded in
    rows of their own (the loss a mean over all their positions either way); and, without the OOV mask (so the
    positions are the loss rows), each step's loss the position-weighted mean of the samples' own losses."""
    lengths = [9, 23, 14]
    parts = samples(lengths)
    packed = data.collate(parts, max_len=100, steps=4)
    assert packed["input_ids"].shape == (1, sum(lengths))
    assert packed["position_ids"][0, 9:12].tolist() == [0, 1, 2] and packed["document_ids"][0, -1] == 2
    padded = [torch.stack([torch.nn.functional.pad(s[k], [0, 0] * (s[k].dim() - 1) + [0, max(lengths) - len(s[k])])
                           for s in parts]) for k in KEYS]  # fmt: skip
    assert_same(run(objective(**options), *padded), run(objective(**options), *packed_inputs(packed)))

    o = objective(oov=False, **options).eval()
    with torch.no_grad():
        _, together, _ = o(*packed_inputs(packed))
        alone = [o(*(s[k][None] for k in KEYS))[1] for s in parts]
    counts = torch.tensor([data.ttt_rows(s["loss_mask"][None], None, 4)[1] for s in parts], dtype=torch.float64)
    if options.get("loss") != "lk-lambda":  # its per-step weight depends on the batch's acceptance: not a mean
        torch.testing.assert_close(together, (torch.stack(alone) * counts).sum(0) / counts.sum(0), rtol=1e-10,
                                   atol=1e-12)  # fmt: skip


class HostReads(TorchDispatchMode):
    """The ops run inside, by name: a read of a device value back to the host shows as one of SYNCS."""

    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", [{}, {"loss_chunk": 4, "checkpoint_steps": 99}, {"loss": "lk-alpha"}])
def test_a_training_step_reads_nothing_back_from_the_device(options):
    """The loss rows come with the packed batch and every count stays a tensor: neither the forward nor the
    backward pass runs an op that needs a device value on the host (on a GPU, each would wait for the queue)."""
    o = objective(**options)
    inputs = packed_inputs(data.collate(samples([9, 23, 14]), max_len=100, steps=4))
    with HostReads() as seen:
        loss, losses, accs = o(*inputs)
        loss.backward()
    assert "mm" in seen.ops and not seen.ops & HostReads.SYNCS, seen.ops & HostReads.SYNCS


def test_loss_chunk_is_checked():
    with pytest.raises(ValueError, match="loss_chunk"):
        TrainConfig(loss_chunk=-1)


@pytest.mark.parametrize("loss", ["lk-alpha", "lk-lambda"])
def test_lk_losses_chunked_equal_plain(loss):
    assert_same(run(objective(loss_chunk=0, loss=loss)), run(objective(loss_chunk=4, loss=loss, checkpoint_steps=99)))


def test_lk_alpha_is_minus_the_log_of_the_expected_acceptance():
    o = objective(loss="lk-alpha", ttt_steps=1).eval()
    ids, mask, hidden, aux = batch()
    _, losses, _ = o(ids, mask, hidden, aux)
    with torch.no_grad():
        full = torch.softmax(hidden @ o.target_head.T, -1)  # the target's probabilities over its whole vocabulary
        usable = o.drafter.t2d[full.argmax(-1)]
        out = next(o.drafter.unroll(ids, aux, 1))
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
