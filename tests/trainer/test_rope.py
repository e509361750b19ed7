"""The drafter's RoPE as trained is the RoPE SGLang and vLLM build from its config.json: plain RoPE over the
target's base, with no scaling and so no YaRN attention factor, for a YaRN target as for a plain one.

The engines' side is their own formulas, re-implemented here from their released source:

* SGLang 0.5.23. ``srt/models/llama.py`` ``LlamaDecoderLayer.__init__``: ``rope_theta`` and ``rope_scaling`` from
  ``config.rope_parameters`` when set, else from ``config.rope_theta`` / ``config.rope_scaling``;
  ``LlamaAttention.__init__``: ``head_dim = getattr(config, "head_dim", hidden // heads)``, rotary dim
  ``partial_rotary_factor * head_dim``, neox style. ``srt/layers/rotary_embedding/factory.py`` ``get_rope``:
  ``rope_scaling`` None, or of rope_type ``default`` without ``mrope_section`` / ``use_fope``, gives the plain
  ``RotaryEmbedding``; any other type a scaled one. ``srt/layers/rotary_embedding/base.py``
  ``RotaryEmbedding._compute_inv_freq`` / ``_compute_cos_sin_cache``; ``utils.py`` ``apply_rotary_emb``.
* vLLM 0.33.0. ``model_executor/models/llama.py`` ``LlamaAttention._init_rotary_emb``:
  ``get_rope(head_dim, max_position=max_position_embeddings, rope_parameters=config.rope_parameters,
  is_neox_style=True)``; ``model_executor/layers/rotary_embedding/__init__.py`` ``get_rope``: base
  ``rope_parameters.get("rope_theta", 10000)``, rope_type ``rope_parameters.get("rope_type", "default")``, rotary dim
  ``head_size * partial_rotary_factor``; ``default`` without ``mrope_section`` / ``use_fope`` is the plain
  ``RotaryEmbedding`` of ``rotary_embedding/base.py`` (the same cache formula as SGLang's).

Both read config.json through transformers (``model_type: llama``: ``LlamaConfig``), as here.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from eaglet.services.trainer.checkpoint import drafter_hf_config
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.model import apply_rope
from eaglet.services.trainer.train import build_drafter
from eaglet.shared.target import model_config

# DeepSeek-V3's rope_scaling (its config.json): YaRN, factor 40, mscale and mscale_all_dim 1
DEEPSEEK_YARN = {
    "type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
    "original_max_position_embeddings": 4096,
}  # fmt: skip


def target_with(folder: Path, tiny_model_dir: Path, **config) -> Path:
    """The tiny Llama's weights and tokenizer under another config.json."""
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    base = {k: v for k, v in model_config(tiny_model_dir).items() if k not in ("rope_parameters", "rope_theta")}
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    return folder


@pytest.fixture(params=["plain", "deepseek-yarn"])
def target(request, tmp_path, tiny_model_dir) -> Path:
    if request.param == "plain":  # a Llama-3-style base in the transformers 5 form
        return target_with(tmp_path / "plain", tiny_model_dir,
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # fmt: skip
    return target_with(tmp_path / "yarn", tiny_model_dir, rope_theta=10000.0, rope_scaling=DEEPSEEK_YARN,
                       max_position_embeddings=163840)  # fmt: skip


def sglang_rope(config: LlamaConfig) -> tuple[float, int, dict | None]:
    """(base, rotary dim, scaling) as SGLang 0.5.23's Llama layer hands them to ``get_rope``."""
    rope_parameters = getattr(config, "rope_parameters", None)
    if rope_parameters is not None:
        theta, scaling = rope_parameters.get("rope_theta", 10000), rope_parameters
    else:
        theta, scaling = getattr(config, "rope_theta", 10000), getattr(config, "rope_scaling", None)
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return theta, int(getattr(config, "partial_rotary_factor", 1) * head_dim), scaling


def vllm_rope(config: LlamaConfig) -> tuple[float, int, dict | None]:
    """(base, rotary dim, scaling) as vLLM 0.33.0's ``get_rope`` reads them from ``config.rope_parameters``."""
    params = getattr(config, "rope_parameters", None) or {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return params.get("rope_theta", 10000), int(head_dim * params.get("partial_rotary_factor", 1.0)), params


def is_plain(scaling: dict | None) -> bool:
    """Both engines' ``get_rope``: the unscaled ``RotaryEmbedding`` (no mscale on cos/sin) or a scaled one."""
    if not scaling:
        return True
    kind = scaling.get("rope_type", scaling.get("type"))
    return kind == "default" and "mrope_section" not in scaling and not scaling.get("use_fope", False)


def cos_sin_cache(base: float, rotary_dim: int, max_position: int) -> torch.Tensor:
    """``RotaryEmbedding._compute_cos_sin_cache`` (SGLang and vLLM): [max_position, rotary_dim] of cos | sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def engine_apply(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_emb``, neox style, on x [T, heads, head_dim] (rotary dim = head_dim here)."""
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("engine", [sglang_rope, vllm_rope], ids=["sglang", "vllm"])
def test_the_engines_rotate_as_training_does(target, engine):
    target_config = model_config(target)
    drafter, _ = build_drafter(target, torch.arange(64), TrainConfig(draft_vocab_size=64), [2, 3, 3])
    written = json.loads(json.dumps(drafter_hf_config(drafter.cfg, target_config, [2, 3, 3], torch.bfloat16)))
    assert written["rope_scaling"] is None and "rope_parameters" not in written
    assert written["max_position_embeddings"] == target_config["max_position_embeddings"]
    config = LlamaConfig.from_dict(written)

    base, rotary_dim, scaling = engine(config)
    assert is_plain(scaling), scaling  # else the engine would scale cos/sin (YaRN's mscale) as training does not
    # the target's own RoPE, which config.json used to copy, is what the engines would have scaled
    target_scaling = engine(LlamaConfig.from_dict({**target_config, "head_dim": written["head_dim"]}))[2]
    assert is_plain(target_scaling) == ("rope_scaling" not in target_config)
    assert rotary_dim == drafter.cfg.head_dim == written["head_dim"]
    theta = target_config.get("rope_theta") or target_config["rope_parameters"]["rope_theta"]
    assert base == theta == drafter.cfg.rope_theta

    max_position = written["max_position_embeddings"]
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 4096, 30000, max_position - 1])
    positions = positions[positions < max_position]
    heads, d = drafter.cfg.num_attention_heads, drafter.cfg.head_dim
    x = torch.randn(len(positions), heads, d, generator=torch.Generator().manual_seed(0))
    served = engine_apply(x, positions, cos_sin_cache(base, rotary_dim, max_position))
    trained = apply_rope(x.transpose(0, 1)[None], positions[None], drafter.inv_freq)[0].transpose(0, 1)
    torch.testing.assert_close(trained, served, rtol=1e-5, atol=1e-5)
