"""The DFlash drafter, as SGLang's ``DFlashDraftModel`` (``models/dflash.py``) runs it.

Pure math: no loading, no devices. DFlash drafts a whole block in one pass instead of a chain: the block is the
last verified token followed by ``block_size - 1`` mask tokens, and the output at block index j is the drafter's
guess of the token at the anchor's position + j. What it knows of the text is the target's context: the target's
hidden states at K layers for every token before the block, projected once and read by every layer::

    ctx     = hidden_norm(fc(concat(target states at K layers)))                   [B, S, H]  (S context tokens)
    per layer l, context keys/values: k_norm(k_proj_l(ctx)) with RoPE at the tokens' positions, v_proj_l(ctx)
    x       = embed(block tokens)                     (the target's embedding; mask tokens: mask_token_id's row)
    layer   : pre-norm Qwen3 layer (per-head q/k RMSNorm); its queries see every context key before the block
              and every key of their own block (non-causal within the block)
    out     = norm(x + residual)   ->  the target's LM head                         [B, N, V]

The context enters no layer's input norm (SGLang writes ``k_proj(ctx)`` straight into the draft KV cache), and the
residual stream is SGLang's fused add-norm: each norm reads ``x + residual`` and passes the sum on.

No embedding and no LM head of its own: the target's, frozen. Parameter names are SGLang's checkpoint names
(``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``), so the state dict is written as it is.
"""

from dataclasses import asdict, dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.services.trainer.model import MLP, RMSNorm, apply_rope, rope_inv_freq

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, the context's keys and values [B, kv, S, d] (keys after k_norm and RoPE)."""


@dataclass(kw_only=True, slots=True)
class DFlashConfig:
    hidden_size: int
    """H: the target's hidden size (the block is embedded with the target's embedding)."""
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    """0: hidden_size // num_attention_heads."""
    vocab_size: int
    """The target's vocabulary: DFlash drafts over all of it, through the target's LM head."""
    num_target_layers: int
    target_layer_ids: list[int] = field(default_factory=list)
    """The target layers whose outputs are the context (0-based, Hugging Face's convention: eaglet's capture ids
    minus one, as ``dflash_config.target_layer_ids`` says them to SGLang)."""
    block_size: int = 16
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"DFlashConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DFlashConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be at least 2 (one drafted token), got {self.block_size}")
        if not self.target_layer_ids or any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(
                f"DFlashConfig.target_layer_ids {self.target_layer_ids}: give one or more layers of the target's "
                f"{self.num_target_layers}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id {self.mask_token_id} is outside the vocabulary")

    def to_dict(self) -> dict:
        return asdict(self)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, as Qwen3's
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # [B, n, T, d]

    def kv(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_norm(self.heads(self.k_proj(x), self.n_kv))
        return apply_rope(k, positions, inv_freq), self.heads(self.v_proj(x), self.n_kv)

    def query(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        return apply_rope(self.q_norm(self.heads(self.q_proj(x), self.n_heads)), positions, inv_freq)

    def out(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


class DFlashDrafter(nn.Module):
    embed_tokens: torch.Tensor  # buffers, set in __init__
    inv_freq: torch.Tensor
    input_scale: torch.Tensor

    def __init__(self, cfg: DFlashConfig, embed_tokens: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)  # [V, H], the target's, frozen
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)
        # fc's inputs are multiplied by it while training (ones: as served); a checkpoint keeps it, the served
        # weights hold it folded into fc (``served_state``)
        self.register_buffer("input_scale", torch.ones(self.fc.in_features))

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """The context's keys and values per layer from the target's states ``aux`` [B, S, K * H] at ``positions``
        [B, S]: what SGLang writes into the draft KV cache for verified tokens."""
        ctx = self.hidden_norm(self.fc(aux * self.input_scale.to(aux.dtype)))
        return [layer.self_attn.kv(ctx, positions, self.inv_freq) for layer in self.blocks()]

    def served_state(self) -> dict[str, torch.Tensor]:
        """The weights under SGLang's names, as its ``DFlashDraftModel`` runs them: fc(aux * scale) is fc with each
        column scaled."""
        state = self.state_dict()
        scale = state.pop("input_scale")
        state["fc.weight"] = state["fc.weight"] * scale.to(state["fc.weight"].dtype)
        return state

    def blocks(self) -> list[DFlashLayer]:
        # what ``layers`` holds: nn.ModuleList's items are typed as any Module
        return cast(list[DFlashLayer], list(self.layers))

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """The blocks' tokens [A, block_size]: each anchor token [A] followed by mask tokens."""
        masks = torch.full((len(anchors), self.cfg.block_size - 1), self.cfg.mask_token_id, device=anchors.device)
        return torch.cat([anchors[:, None], masks.to(anchors.dtype)], 1)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, context: ContextKV, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The blocks' final hidden states [B, N, H] (before the LM head). token_ids, positions: [B, N] (blocks laid
        end to end); ``context``: ``context_kv``'s; ``mask`` [N, S + N] bool, True where a query sees a key (the
        context's keys first, then the blocks'), or None: every query sees every key (one block, as decoding)."""
        x = F.embedding(token_ids, self.embed_tokens).to(context[0][0].dtype)
        residual = None
        for layer, (k_ctx, v_ctx) in zip(self.blocks(), context, strict=True):
            residual = x if residual is None else x + residual
            h = layer.input_layernorm(residual)
            attn = layer.self_attn
            q = attn.query(h, positions, self.inv_freq)
            k, v = attn.kv(h, positions, self.inv_freq)
            y = F.scaled_dot_product_attention(
                q, torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2), attn_mask=mask, enable_gqa=True
            )
            residual = attn.out(y) + residual
            x = layer.mlp(layer.post_attention_layernorm(residual))
        assert residual is not None  # the config has at least one layer
        return self.norm(x + residual)
