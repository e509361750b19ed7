"""The EAGLE-3 drafter, as SGLang's ``LlamaForCausalLMEagle3`` and vLLM's ``Eagle3LlamaForCausalLM`` run it.

Pure math: no loading, no devices, no parallelism. One step of the drafter::

    x   = fc(concat(aux states))        on the first step; the previous step's output after that   [B, T, H]
    h   = concat(input_layernorm(embed(token)), hidden_norm(x))                                    [B, T, 2H]
    r   = x + o_proj(attn(h))
    out = r + mlp(post_attention_layernorm(r))          fed to the next step (pre-norm, as SGLang does)
    logits = lm_head(norm(out))                         over the draft vocabulary                   [B, T, Vd]

Parameter names are the checkpoint's names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``), so the state dict
is written as it is. The token embedding is the target's, frozen, and is not a parameter.

The drafter is a Llama layer whatever the target (``drafter_config``):

* Attention shape. A target with grouped-query attention of a usable shape (head size known exactly and a
  multiple of 8, heads a multiple of KV heads) lends it: GPT-OSS's 64 heads x 64 with 8 KV heads, Qwen3-MoE's
  32 x 128 with 4, Llama's own. A target with multi-head latent attention (DeepSeek-V3, Kimi-K2: ``kv_lora_rank``
  or ``q_lora_rank`` in its config) has no such shape to lend: its heads are latent projections (128 + 64 dims
  for queries and keys, 128 for values), and copying its head count would make 128 heads of hidden / 128 = 56
  dims with 128 KV heads. It, and any target whose head shape is not usable, gets head_dim 128, hidden / 128
  heads and 8 KV heads (the greatest divisor of the heads up to 8): DeepSeek-V3 and Kimi-K2 get 56 x 128 with
  8 KV heads. The trainer's ``draft_head_dim`` / ``draft_kv_heads`` other than 0 override the rule (heads are
  then hidden / draft_head_dim for any target). SGLang's ``LlamaForCausalLMEagle3`` takes any such shape: it
  reads ``head_dim`` from config.json and sizes q/k/v on 2 * hidden inputs.
* RoPE. Plain RoPE over the target's ``rope_theta``, with no scaling: the target's YaRN or Llama-3 scaling stays
  out of the drafter. The engines rebuild the drafter's RoPE from its config.json, and for YaRN they also scale
  cos/sin by an attention factor (mscale) that training would have to reproduce exactly; a drafter trained and
  served with plain RoPE has nothing to get wrong. Training uses exactly what config.json declares.
"""

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    hidden_size: int
    """H: the drafter's width, the target's hidden size (SGLang uses the target's embedding as is)."""
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    """0: hidden_size // num_attention_heads."""
    vocab_size: int
    """The target's vocabulary."""
    draft_vocab_size: int
    target_hidden_size: int = 0
    """0: hidden_size."""
    num_aux_hidden_states: int = 3
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    """The target's base, for plain (unscaled) RoPE."""
    max_position_embeddings: int = 4096
    """The target's context length."""
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated auxiliary states before ``fc`` (``input_norm``; SGLang's and vLLM's
    ``norm_before_fc``): the three layers' states differ in scale by orders of magnitude."""

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size == 0:
            self.target_hidden_size = self.hidden_size
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DrafterConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"DrafterConfig.draft_vocab_size must be in 1..vocab_size ({self.vocab_size}), "
                f"got {self.draft_vocab_size}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 at least: statistics (norms, softmax, scores) of bf16 values in float32, and of float64 ones
    (the tests' exact comparisons) in float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class RMSNormFunction(torch.autograd.Function):
    """weight * normalize(x) with float32 statistics, as the Llama reference (bf16 variance loses the small hidden
    states), its result in x's dtype: under autocast every consumer is a matmul that would cast it so anyway.
    The backward pass keeps only x (often kept already: the previous step's output) and the inverse RMS per row,
    and recomputes the normalized rows, where autograd would keep a float32 copy of x and the normalized rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (weight * (xf * rstd).to(x.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        xhat = wide(x) * rstd
        g = wide(grad)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # what the forward multiplied the weight by: the normalized rows in x's dtype
            grad_weight = (g * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gx = g * weight
        grad_x = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE frequencies [head_dim / 2]: the drafter's, and what the engines compute for a config with
    ``rope_theta`` and no ``rope_scaling``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_theta(text_config: dict) -> float:
    params = text_config.get("rope_parameters") or {}
    return float(params.get("rope_theta", text_config.get("rope_theta", 10000.0)))


MLA_KEYS = ("kv_lora_rank", "q_lora_rank")
"""A config with either names a multi-head latent attention target (DeepSeek-V2/V3, Kimi-K2)."""
RULE_HEAD_DIM = 128
RULE_KV_HEADS = 8


def target_attention(text_config: dict) -> tuple[int, int, int] | None:
    """The target's (heads, KV heads, head_dim) when a Llama attention can take them over: grouped-query attention
    whose head size is known exactly and a multiple of 8 (what attention kernels take). None for latent attention
    and for shapes that do not add up."""
    if any(text_config.get(k) is not None for k in MLA_KEYS):
        return None
    hidden, heads = text_config["hidden_size"], text_config["num_attention_heads"]
    kv = text_config.get("num_key_value_heads") or heads
    head_dim = text_config.get("head_dim") or (hidden // heads if hidden % heads == 0 else 0)
    if head_dim <= 0 or head_dim % 8 or heads % kv:
        return None
    return heads, kv, head_dim


def attention_shape(text_config: dict, head_dim: int = 0, kv_heads: int = 0) -> tuple[int, int, int]:
    """The drafter's (heads, KV heads, head_dim) for a target (see the module docstring). ``head_dim`` and
    ``kv_heads``: 0 for the rule, else forced (heads = hidden / head_dim)."""
    hidden = text_config["hidden_size"]
    kept = target_attention(text_config) if head_dim == 0 else None
    if kept is not None:
        heads, kv, head_dim = kept
    else:
        head_dim = head_dim or RULE_HEAD_DIM
        if hidden % head_dim:
            raise ValueError(
                f"hidden_size {hidden} is not a multiple of the drafter's head_dim {head_dim}: "
                "set draft_head_dim to a divisor of it"
            )
        heads = hidden // head_dim
        kv = math.gcd(heads, RULE_KV_HEADS)
    return heads, kv_heads or kv, head_dim


def drafter_config(
    text_config: dict[str, Any],
    *,
    vocab_size: int,
    draft_vocab_size: int,
    num_aux_hidden_states: int = 3,
    head_dim: int = 0,
    kv_heads: int = 0,
    norm_before_fc: bool = False,
) -> DrafterConfig:
    """The drafter shaped after a target's text config (a wrapper's ``text_config``, or the config itself)."""
    heads, kv, head_dim = attention_shape(text_config, head_dim, kv_heads)
    return DrafterConfig(
        hidden_size=text_config["hidden_size"],
        intermediate_size=text_config["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        num_aux_hidden_states=num_aux_hidden_states,
        rms_norm_eps=text_config.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta(text_config),
        max_position_embeddings=text_config.get("max_position_embeddings", 4096),
        norm_before_fc=norm_before_fc,
    )


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # x: [B, h, T, d], positions: [B, T]; rotate_half layout, as Hugging Face and SGLang's neox style
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class KVCache:
    """Keys and values of past steps for incremental drafting (inference): [1, kv_heads, S, d], after RoPE."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def ttt_attention(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], causal: "CausalAttention"
) -> torch.Tensor:
    """Attention of training-time-test step i = len(ks) - 1.

    q: [B, h, T, d]; ks[j], vs[j]: [B, kv, T, d] of step j (grouped-query: h a multiple of kv, never expanded).
    The query at (i, t) sees step 0's keys at positions <= t of its own document (the target's own context) and,
    of every later step j <= i, only position t: the chain the drafter itself extended from t. The causal part
    is ``causal`` (block-sparse FlexAttention, or the blockwise math path), which also returns its log-sum-exp;
    the diagonal keys are merged in by their scores, so no tensor is T x T, nor T x steps keys laid end to end.
    """
    out, lse = causal(q, ks[0], vs[0])  # [B, h, T, d], [B, h, T] float32
    if len(ks) == 1:
        return out
    B, h, T, d = q.shape
    groups = (B, ks[0].shape[1], h // ks[0].shape[1], T)
    qg = q.view(*groups, d)
    # float32 sums of the bf16 products: the scores as precise as the fused kernel's, no float32 copy of q kept
    stats = torch.promote_types(q.dtype, torch.float32)
    diag = [torch.sum(qg * k[:, :, None], -1, dtype=stats).view(B, h, T) / math.sqrt(d) for k in ks[1:]]
    total = torch.logsumexp(torch.stack([lse, *diag]), 0)  # [B, h, T]
    merged = torch.exp(lse - total)[..., None] * out
    for s, v in zip(diag, vs[1:], strict=True):
        merged = merged + (torch.exp(s - total).view(*groups, 1) * v[:, :, None]).view(B, h, T, d)
    return merged.to(q.dtype)


class CausalAttention:
    """Causal attention within documents over one set of keys: (q [B, h, T, d], k, v [B, kv, T, d]) -> (out
    [B, h, T, d], log-sum-exp of the scores [B, h, T] float32). ``documents``: [B, T] ascending document ids of a
    packed row (None: one document a row), so a query sees only the earlier positions of its own document.

    ``flex``: FlexAttention (compiled on GPU) under a block mask built block by block, never cell by cell.
    ``math``: scores materialized a block of queries at a time (CPU, tests), each block recomputed in the backward
    pass when there are several, so memory stays O(rows x T) per block instead of T x T."""

    MATH_CELLS = 2**24  # scores per math block (x heads): 64 MiB of float32 at a time

    def __init__(self, impl: str, T: int, device: torch.device, documents: torch.Tensor | None = None) -> None:
        self.impl, self.documents = impl, documents
        self.block_mask = causal_block_mask(T, device, documents) if impl == "flex" else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.impl == "flex":
            from torch.nn.attention.flex_attention import AuxRequest

            out, aux = _flex_attention()(q, k, v, block_mask=self.block_mask, enable_gqa=True,
                                         return_aux=AuxRequest(lse=True))  # fmt: skip
            return out, aux.lse
        T = q.shape[2]
        rows = max(1, self.MATH_CELLS // (T * q.shape[1]))
        if rows >= T:  # one block: no loop over the length, so a compiled step does not specialize on it
            return self.rows(q, k, v, 0, T)
        spans = [(lo, min(lo + rows, T)) for lo in range(0, T, rows)]
        parts = [
            torch.utils.checkpoint.checkpoint(self.rows, q, k, v, lo, hi, use_reentrant=False)
            if torch.is_grad_enabled()
            else self.rows(q, k, v, lo, hi)
            for lo, hi in spans
        ]
        return torch.cat([o for o, _ in parts], 2), torch.cat([s for _, s in parts], 2)

    def rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The math path for queries [lo, hi): the keys up to hi - 1 are all a causal query there can see."""
        B, h, _, d = q.shape
        kv = k.shape[1]
        qg = q[:, :, lo:hi].reshape(B, kv, h // kv, hi - lo, d)
        scores = wide(qg @ k[:, :, None, :hi].transpose(-1, -2)) / math.sqrt(d)  # [B, kv, g, rows, hi]
        t, s = torch.arange(lo, hi, device=q.device)[:, None], torch.arange(hi, device=q.device)[None]
        seen = s <= t  # [rows, hi]
        if self.documents is not None:
            seen = seen & (self.documents[:, lo:hi, None] == self.documents[:, None, :hi])[:, None, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        out = torch.exp(scores - lse[..., None]).to(v.dtype) @ v[:, :, None, :hi]
        return out.reshape(B, h, hi - lo, d), lse.reshape(B, h, hi - lo)


_flex_masks: dict[tuple, "BlockMask"] = {}


def causal_block_mask(
    T: int, device: torch.device, documents: torch.Tensor | None = None, block: int = 128
) -> "BlockMask":
    """The causal (within-document) mask as a FlexAttention BlockMask, from block-level facts alone: a block of
    keys is fully seen when it lies wholly before the query block and both hold one same document, partly seen
    when it is on the diagonal or its documents overlap the query block's. ``documents`` must ascend along the
    row (packing lays documents end to end). torch's ``create_block_mask`` would evaluate all T x T cells; here
    it is (T / block)^2 comparisons. The plain causal mask of a length is built once per process."""
    from torch.nn.attention.flex_attention import BlockMask

    key = (T, block, device)
    if documents is None and key in _flex_masks:
        return _flex_masks[key]
    n = -(-T // block)
    r, c = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None]
    ragged = torch.zeros(n, 1, dtype=torch.bool, device=device)
    ragged[-1] = T % block != 0  # a last block of rows past T: never called full, as torch's own builder does
    if documents is None:
        full = ((c < r) & ~ragged)[None]
        partial = (c <= r) & ~full
    else:
        pad = documents[:, -1:].expand(-1, n * block - T)  # the padded tail continues the last document
        d = torch.cat([documents, pad], 1).view(documents.shape[0], n, block)
        first, last = d[..., 0], d[..., -1]  # ascending: a block's smallest and largest document
        overlap = (first[:, :, None] <= last[:, None, :]) & (first[:, None, :] <= last[:, :, None])
        alone = first == last
        same = alone[:, :, None] & alone[:, None, :] & (first[:, :, None] == first[:, None, :])
        full = (c < r) & ~ragged & same
        partial = (c <= r) & overlap & ~full

    def indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)  # the blocks that are set first, ascending
        return m.sum(-1).to(torch.int32)[:, None], order.to(torch.int32)[:, None]

    if documents is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    (num, idx), (full_num, full_idx) = indices(partial), indices(full)
    mask = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(T, T))  # fmt: skip
    if documents is None:
        if len(_flex_masks) > 256:
            _flex_masks.clear()
        _flex_masks[key] = mask
    return mask


_compiled_flex = None


def _flex_attention():
    global _compiled_flex  # compiled once per process, with dynamic shapes: every length and step count shares it
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _compiled_flex


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q/k/v read [embedding ; hidden]: 2H inputs
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, kv, T, d]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """The gated SiLU MLP of a Llama layer: the EAGLE-3 drafter's and each DFlash layer's."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up for the backward pass and recomputing silu(gate) there: autograd would
    also keep silu(gate), a fourth tensor of T x intermediate a step."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate)
        return torch.ops.aten.silu_backward(grad * up, gate), grad_up


class MidLayer(nn.Module):
    """The one decoder layer. Named ``midlayer`` in the checkpoint; SGLang and vLLM map it to ``layers.0``."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def attn_input(self, normed_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([normed_embeds, self.hidden_norm(hidden)], -1)  # [B, T, 2H]

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        r = hidden + attn_out
        return r + self.mlp(self.post_attention_layernorm(r))


class Drafter(nn.Module):
    embed_tokens: torch.Tensor  # buffers, set in __init__
    d2t: torch.Tensor
    t2d: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, cfg: DrafterConfig, embed_tokens: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        fused = cfg.num_aux_hidden_states * cfg.target_hidden_size
        self.input_norm = RMSNorm(fused, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(fused, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Frozen target embedding [V, H] and the vocabulary maps: buffers, so DDP leaves them alone
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # target_id - draft_id
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # target id is in the draft vocab
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [Vd]: the target ids of the draft vocabulary, in draft-id order."""
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids), device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated auxiliary states [.., n * H_target] -> the first step's hidden [.., H]."""
        return self.fc(aux if self.input_norm is None else self.input_norm(aux))

    def embed(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The tokens' embeddings after the layer's input norm [B, n, H]: what a step reads of its tokens."""
        return self.midlayer.input_layernorm(F.embedding(token_ids, self.embed_tokens).to(dtype))

    def step(self, normed_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """One drafter pass over ``embed``'s rows. ``attend(q [B, h, T, d], k, v [B, kv, T, d]) -> [B, h, T, d]``
        owns the cache: training's steps or decoding's. Returns the pre-norm output [B, T, H] (the next step's
        ``hidden``)."""
        layer = self.midlayer
        x = layer.attn_input(normed_embeds, hidden)
        q, k, v = layer.self_attn.qkv(x, positions, self.inv_freq)
        y = attend(q, k, v)
        return layer.finish(hidden, layer.self_attn.out(y))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def unroll(
        self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int, attn_impl: str = "math", checkpoint: int = 0,
        position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:  # fmt: skip
        """Training-time test: ``steps`` unrolled passes on the drafter's own outputs, each yielded as it is made:
        a loss the caller takes on it before asking for the next step has its backward pass run right after the
        next step's, so each output's gradient lives only while it is needed.

        input_ids: [B, T] target ids; aux: [B, T, 3H]. Step i at position t reads token ``input_ids[t + 1 + i]``
        (shifted in here, zero past the end) and predicts token t + 2 + i. Yields each step's pre-norm output
        [B, T, H]; the caller applies ``logits`` only where the loss needs them. ``checkpoint``: the first that
        many steps' activations are recomputed in the backward pass instead of kept (their outputs, keys and values
        are kept): a third more of their compute for long samples' memory. The first ones, because the backward
        pass reaches them last, when the later steps' kept activations are already freed. A packed row (several
        documents end to end) gives each token's ``position_ids`` in its document [B, T] and ``document_ids`` [B, T]
        (ascending): attention stays within a document, and a position whose chain runs into the next document
        reads its tokens but is never one the loss or another document sees.
        """
        B, T = input_ids.shape
        attention = CausalAttention(attn_impl, T, input_ids.device, document_ids)
        base = torch.arange(T, device=input_ids.device).expand(B, T) if position_ids is None else position_ids
        hidden = self.fuse(aux)
        # step i reads the tokens t + 1 + i: one embedding of the tokens 1 .. T - 1 (zeros past the end), each step
        # a shifted view of it, kept once for every step's backward pass
        embedded = self.embed(F.pad(input_ids[:, 1:], (0, steps)), hidden.dtype)  # [B, T - 1 + steps, H]
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for i in range(steps):
            args = (embedded[:, i : i + T], hidden, base + i, tuple(ks), tuple(vs), attention)
            if i < checkpoint:
                hidden, k, v = torch.utils.checkpoint.checkpoint(self.ttt_step, *args, use_reentrant=False)
            else:
                hidden, k, v = self.ttt_step(*args)
            ks.append(k)
            vs.append(v)
            yield hidden

    def ttt_step(self, embeds, hidden, positions, ks: tuple, vs: tuple, attention) -> tuple[torch.Tensor, ...]:
        """One unrolled step over the earlier steps' keys and values: (output, its keys, its values). A function
        of its inputs alone, so a checkpointed step recomputes exactly what it computed."""
        kv: list[torch.Tensor] = []

        def attend(q, k, v):
            kv[:] = [k, v]
            return ttt_attention(q, [*ks, k], [*vs, v], attention)

        out = self.step(embeds, hidden, positions, attend)
        return out, kv[0], kv[1]

    def decode(self, token_ids: torch.Tensor, hidden: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """Incremental pass for speculative decoding (batch 1): token_ids [1, n] at positions start..start+n-1,
        hidden [1, n, H] (already projected by ``fc`` for target features). Causal over the cache."""
        positions = torch.arange(start, start + token_ids.shape[1], device=token_ids.device)[None]
        n = token_ids.shape[1]

        def attend(q, k, v):
            kk, vv = cache.append(k, v)
            S = kk.shape[2]
            mask = torch.ones(n, S, dtype=torch.bool, device=q.device).tril(S - n)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)

        return self.step(self.embed(token_ids, hidden.dtype), hidden, positions, attend)
