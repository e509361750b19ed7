"""What one training step holds in memory: a tracker of every tensor storage torch allocates (any device, the meta
device included, so a full-size step is accounted for without the memory), and the memory rule the trainer checks
a ``max_len`` against before its first step."""

import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from eaglet.services.trainer.config import TrainConfig
    from eaglet.services.trainer.model import DrafterConfig


@dataclass(slots=True)
class Allocation:
    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    phase: str
    born: int  # the tracker's count of allocations when it was made, and when it was freed
    freed: int | None = None


@dataclass
class MemoryTracker(TorchDispatchMode):
    """Inside ``with``, every new storage an op returns, until it is freed: the live bytes, their peak, what was
    live at the peak and the largest single allocations. ``phase`` labels the allocations made from then on
    (forward, backward, ...). Storages made before entering (parameters, inputs) are counted with ``hold``."""

    phase: str = "setup"
    current: int = 0
    peak: int = 0
    history: list[Allocation] = field(default_factory=list)
    live: dict[int, Allocation] = field(default_factory=dict)
    peak_at: int = 0  # the allocation count at the peak
    since: int = 0  # the allocation count at ``reset_peak``

    def __post_init__(self) -> None:
        super().__init__()

    def hold(self, tensors: object) -> None:
        """Counts tensors made outside the tracker (parameters, buffers, the batch) as live from now on."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._add(t, "held")

    def reset_peak(self) -> None:
        """The peak from now on (what is live now counts)."""
        self.peak, self.peak_at, self.since = self.current, len(self.history), len(self.history)

    @property
    def at_peak(self) -> list[Allocation]:
        return [a for a in self.history[: self.peak_at] if a.freed is None or a.freed > self.peak_at]

    def largest(self, n: int = 12) -> list[Allocation]:
        """The ``n`` largest allocations since ``reset_peak``."""
        return sorted(self.history[self.since :], key=lambda a: -a.nbytes)[:n]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, str(func.overloadpacket.__name__))
        return out

    def _add(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or storage.nbytes() == 0:
            return
        a = Allocation(storage.nbytes(), op, tuple(t.shape), t.dtype, self.phase, born=len(self.history))
        self.history.append(a)
        self.live[key] = a
        weakref.finalize(storage, self._free, key)
        self.current += a.nbytes
        if self.current > self.peak:
            self.peak, self.peak_at = self.current, len(self.history)

    def _free(self, key: int) -> None:
        a = self.live.pop(key, None)
        if a is not None:
            a.freed = len(self.history)
            self.current -= a.nbytes


@dataclass(frozen=True, slots=True)
class Estimate:
    """The memory rule at one shape and length (``estimate``): the bytes live at the two moments a step peaks,
    term by term, and the peak with the allocator's margin."""

    forward_end: dict[str, float]
    backward: dict[str, float]

    @property
    def peak(self) -> dict[str, float]:
        """The terms of the larger moment."""
        return max(self.forward_end, self.backward, key=lambda t: sum(t.values()))

    @property
    def total_gib(self) -> float:
        return (sum(self.peak.values()) * MARGIN + FIXED_BYTES) / 2**30

    def terms_gib(self) -> dict[str, float]:
        return {k: round(v / 2**30, 2) for k, v in self.peak.items()}


MARGIN = 1.08
"""The CUDA caching allocator's rounding and fragmentation over the bytes the tensors hold."""
FIXED_BYTES = 1.0 * 2**30
"""What torch's allocator does not count but the device holds: the CUDA context, cuBLAS and compiled kernels'
workspaces."""


def estimate(shape: "DrafterConfig", T: int, cfg: "TrainConfig", world: int = 1) -> Estimate:
    """The memory rule: the GPU bytes of a training step of the drafter ``shape`` on a row of T tokens under ``cfg``
    (bf16 autocast, every position a loss position: the worst case), at the end of the forward pass and in the
    backward pass. Symbols: H hidden, I intermediate, h x d the query heads, kv x d the key/value heads, V the
    target's vocabulary, Vd the draft vocabulary, n x Ht the captured target states, S the TTT steps, K of them
    recomputed (``checkpoint_steps``, at most S), C ``loss_chunk``, R = T - 2 the loss rows of a step, P the
    trainable parameters. In bytes:

    weights, optimizer, autocast   4P, 8P (AdamW; Muon 4 a matrix parameter), 2P (the bf16 copies of a step)
    target        4 V H                 the frozen embedding and LM head, bf16
    batches       2 T (2 (n Ht + H) + 8 S + 21)   the step's packed row and the next one, copied ahead of it
    target_view   T (2 Vd + 17)         the target's logits over the draft vocabulary at the loss positions
    kept          T (6 H + S (2 H + 4 kv d))      the embeddings, each step's output, keys and values
    steps         (S - K) T A, A = 6 I + 8 H + 6 h d + 8 h   what each step kept (not recomputed) holds for its
                                        backward pass (MLP, norms, attention input and output)
    loss          S R 8 Vd when R <= C (each step's log-probabilities kept), else 0; plus the chunk being
                  computed: min(R, C) 18 Vd (forward), min(R, C) 24 Vd (backward, recomputed)
    ddp           4P                    DDP's gradient buckets, with ``world`` > 1 processes
    previous      4P + 8 T              an on-policy round's previous drafter, frozen, and its chains' first
                                        misses (its replay runs before the step's forward, without autograd)
    The previous step's gradients are dropped before the forward pass (``train.optimizer_step``). The backward
    pass peaks as it starts, every kept step's activations still held, on the loss chunks or on the last step's
    MLP gradients (T (6 I + 4 H)); or, with K > 0, once it reaches the recomputed steps (the first K: the kept
    steps' activations freed by then), holding the gradients (4P), one step recomputed (T A) and its MLP's
    gradients.

    peak = max(forward end, backward) x MARGIN + FIXED_BYTES
    """
    H, inter, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    h, kv, V, Vd = shape.num_attention_heads, shape.num_key_value_heads, shape.vocab_size, shape.draft_vocab_size
    S, R, P = cfg.ttt_steps, max(T - 2, 1), trainable_params(shape)
    K = min(cfg.checkpoint_steps, S)
    matrices = P - norm_params(shape)
    A = 6 * inter + 8 * H + 6 * h * d + 8 * h
    chunked = bool(cfg.loss_chunk) and R > cfg.loss_chunk
    chunk = min(R, cfg.loss_chunk) if cfg.loss_chunk else R
    held = {
        "weights": 4 * P, "optimizer": 8 * P if cfg.optimizer == "adamw" else 4 * matrices + 8 * (P - matrices),
        "autocast": 2 * P, "target": 4 * V * H,
        "batches": 2 * T * (2 * (shape.num_aux_hidden_states * shape.target_hidden_size + H) + 8 * S + 21),
        "target_view": T * (2 * Vd + 17), "kept": T * (6 * H + S * (2 * H + 4 * kv * d)),
        "steps": (S - K) * T * A, "loss": 0 if chunked else S * R * 8 * Vd,
        "ddp": 4 * P if world > 1 else 0, "previous": 4 * P + 8 * T if cfg.onpolicy_from else 0,
    }  # fmt: skip
    forward_end = {**held, "loss_chunk": chunk * 18 * Vd}
    step_backward = T * (6 * inter + 4 * H)
    moments = [{**held, "loss_chunk": chunk * 24 * Vd}]  # the loss chunks' backward
    if K < S:  # the last kept step's backward begun, every kept step's activations still held
        moments.append({**held, "step_backward": step_backward})
    if K:  # the first recomputed step reached: the kept steps' activations freed, the gradients made
        moments.append({**held, "steps": 0, "gradients": 4 * P, "recomputed_step": T * A,
                        "step_backward": step_backward})  # fmt: skip
    backward = max(moments, key=lambda t: sum(t.values()))
    return Estimate({k: float(v) for k, v in forward_end.items()}, {k: float(v) for k, v in backward.items()})


def norm_params(shape: "DrafterConfig") -> int:
    """The drafter's norm weights (AdamW's under Muon): the layer's three, the final one, the optional input one."""
    return 4 * shape.hidden_size + (shape.num_aux_hidden_states * shape.target_hidden_size if shape.norm_before_fc
                                    else 0)  # fmt: skip


def trainable_params(shape: "DrafterConfig") -> int:
    """The drafter's parameters: fc (and its norm), the layer's projections and norms, the final norm, lm_head."""
    H, inter, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    fused = shape.num_aux_hidden_states * shape.target_hidden_size
    attention = 2 * H * (shape.num_attention_heads + 2 * shape.num_key_value_heads) * d
    return (
        fused * H
        + attention
        + shape.num_attention_heads * d * H
        + 3 * H * inter
        + H * shape.draft_vocab_size
        + norm_params(shape)
    )


def rule_shape(text: dict, cfg: "TrainConfig") -> "DrafterConfig":
    """The drafter the trainer builds for a target's text config under ``cfg`` (its three captured layers)."""
    from eaglet.services.trainer.model import drafter_config

    V = text["vocab_size"]
    return drafter_config(text, vocab_size=V, draft_vocab_size=min(cfg.draft_vocab_size, V),
                          head_dim=cfg.draft_head_dim, kv_heads=cfg.draft_kv_heads,
                          norm_before_fc=cfg.norm_before_fc)  # fmt: skip


class MemoryRuleError(ValueError):
    """A batch the memory rule says would not fit the device's memory, and what would."""


def budget_gib(cfg: "TrainConfig", device: torch.device) -> float | None:
    """The memory the trainer plans for: ``cfg.memory_gib``, else on a GPU what this process holds plus what is
    free (another process's share is not ours); None on the CPU without a given budget (no check)."""
    if cfg.memory_gib > 0:
        return cfg.memory_gib
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device)) / 2**30


def check_fits(shape: "DrafterConfig", cfg: "TrainConfig", T: int, budget: float, world: int = 1) -> Estimate:
    """The estimate of rows of T tokens, or MemoryRuleError when it passes ``budget`` GiB, saying what would fit:
    the fewest recomputed steps (``checkpoint_steps``), shorter rows, or nothing at all."""
    need = estimate(shape, T, cfg, world)
    if need.total_gib <= budget:
        return need
    advice = []
    S = cfg.ttt_steps
    more = (
        (k, estimate(shape, T, replace(cfg, checkpoint_steps=k), world).total_gib)
        for k in range(min(cfg.checkpoint_steps, S) + 1, S + 1)
    )
    fewest, gib = next(((k, gib) for k, gib in more if gib <= budget), (None, 0.0))
    if fewest is not None:
        advice.append(f"--checkpoint-steps {fewest} fits them in about {gib:.1f} GiB ({fewest} of the {S} TTT steps "
                      f"recomputed in the backward pass, about {fewest / S / 3:.0%} more compute)")  # fmt: skip
    if longest := longest_fitting(shape, cfg, T, budget, world):
        advice.append(f"as configured rows of up to {longest:,} tokens fit (--max-len, --tokens-per-batch)")
    recompute = replace(cfg, checkpoint_steps=S)
    if cfg.checkpoint_steps < S and not advice and (longest := longest_fitting(shape, recompute, T, budget, world)):
        advice.append(f"with --checkpoint-steps {S} rows of up to {longest:,} tokens fit")
    if not advice:
        advice.append("not even short rows fit: a device with more memory (every process holds the whole drafter)")
    raise MemoryRuleError(
        f"rows of up to {T:,} tokens (max_len {cfg.max_len}, tokens_per_batch {cfg.tokens_per_batch}) need about "
        f"{need.total_gib:.1f} GiB by the memory rule (the trainer's memory.py), more than the "
        f"{budget:.1f} GiB planned for (--memory-gib, else the GPU's free memory): " + "; ".join(advice)
    )


def longest_fitting(shape: "DrafterConfig", cfg: "TrainConfig", T: int, budget: float, world: int = 1) -> int:
    """The longest row under T tokens (a multiple of 256) the rule fits in ``budget`` GiB; 0 when none does. A scan,
    not a bisection: the estimate drops where the loss starts being chunked."""
    return next((t for t in range(T - T % 256, 0, -256) if estimate(shape, t, cfg, world).total_gib <= budget), 0)
