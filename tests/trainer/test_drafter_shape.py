"""The drafter's shape for each target family, and a config.json SGLang's ``LlamaForCausalLMEagle3`` reads whole.

Targets' text configs are their published config.json values that the shape depends on. What SGLang 0.5.23 reads
(``srt/models/llama_eagle3.py`` ``LlamaForCausalLMEagle3`` / ``LlamaModel`` / ``LlamaDecoderLayer``, over
``srt/models/llama.py`` ``LlamaAttention``): head_dim from ``config.head_dim``, q/k/v on ``2 * hidden_size``
inputs (the embedding and the hidden state side by side), o_proj from ``heads * head_dim`` to ``hidden_size``.
"""

import json

import pytest
import torch
from transformers import LlamaConfig

from eaglet.services.trainer.checkpoint import drafter_hf_config
from eaglet.services.trainer.model import Drafter, drafter_config

YARN = {"type": "yarn", "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}  # fmt: skip
MLA = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128, "num_key_value_heads": 128,
    "num_hidden_layers": 61, **MLA, "rope_theta": 10000, "rope_scaling": {**YARN, "factor": 40},
    "max_position_embeddings": 163840, "vocab_size": 129280, "rms_norm_eps": 1e-6, "bos_token_id": 0,
    "eos_token_id": 1,
}  # fmt: skip
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {
        **DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
        "rope_theta": 50000.0, "rope_scaling": {**YARN, "factor": 64}, "max_position_embeddings": 262144,
        "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163585,
    },
    "vision_config": {"hidden_size": 1152},
}  # fmt: skip
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_hidden_layers": 48, "rope_theta": 1000000.0, "rope_scaling": None,
    "max_position_embeddings": 40960, "vocab_size": 151936, "rms_norm_eps": 1e-6,
}  # fmt: skip
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 36,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "vocab_size": 201088, "rms_norm_eps": 1e-5, "sliding_window": 128,
}  # fmt: skip
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "vocab_size": 128256, "rms_norm_eps": 1e-5,
}  # fmt: skip

CASES = {  # target -> (heads, KV heads, head_dim)
    "deepseek-v3": (DEEPSEEK_V3, (56, 8, 128)),  # latent attention: the rule, not 128 heads of 56
    "kimi-k2.5": (KIMI_K25, (56, 8, 128)),  # the same, through the wrapper's text_config
    "qwen3-moe": (QWEN3_MOE, (32, 4, 128)),  # the target's: heads * head_dim (4096) twice hidden, as the target has
    "gpt-oss": (GPT_OSS, (64, 8, 64)),  # the target's; 2880 is no multiple of 128, the rule could not apply
    "llama": (LLAMA, (32, 8, 128)),
}


def text_of(config: dict) -> dict:
    return config.get("text_config", config)


def build(config: dict, **kw):
    text = text_of(config)
    return drafter_config(text, vocab_size=text["vocab_size"], draft_vocab_size=32000, **kw)


@pytest.mark.parametrize("name", CASES)
def test_drafter_shape_and_config_sglang_reads(name):
    target, shape = CASES[name]
    cfg = build(target)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == shape
    text = text_of(target)
    assert cfg.hidden_size == cfg.target_hidden_size == text["hidden_size"]
    assert cfg.max_position_embeddings == text["max_position_embeddings"]

    written = json.loads(json.dumps(drafter_hf_config(cfg, target, [2, 30, 58], torch.bfloat16)))
    read = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers", "hidden_act", "rms_norm_eps", "vocab_size", "draft_vocab_size", "target_hidden_size",
            "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling", "eagle_config"}  # fmt: skip
    assert read <= set(written), read - set(written)
    assert written["architectures"] == ["LlamaForCausalLMEagle3"] and written["num_hidden_layers"] == 1
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]

    # The engine's layer, sized from config.json as transformers hands it over, against the drafter's tensors
    config = LlamaConfig.from_dict(written)
    H, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    with torch.device("meta"):
        drafter = Drafter(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size))
    attn = drafter.midlayer.self_attn
    assert (attn.q_proj.in_features, attn.k_proj.in_features, attn.v_proj.in_features) == (2 * H,) * 3
    q, k, v = attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features
    assert q + k + v == (heads + 2 * kv) * d  # SGLang's fused qkv_proj
    assert (attn.o_proj.in_features, attn.o_proj.out_features) == (heads * d, H)
    assert heads % kv == 0 and d % 8 == 0


def test_overrides():
    assert shape_of(build(DEEPSEEK_V3, kv_heads=4)) == (56, 4, 128)
    assert shape_of(build(DEEPSEEK_V3, head_dim=64)) == (112, 8, 64)
    assert shape_of(build(LLAMA, head_dim=64)) == (64, 8, 64)  # forced for any target: heads follow hidden
    with pytest.raises(ValueError, match="draft_head_dim"):
        build(GPT_OSS, head_dim=128)


def test_a_target_without_a_usable_head_shape_gets_the_rule():
    odd = {**LLAMA, "num_attention_heads": 48, "num_key_value_heads": 8}  # 4096 / 48: no exact head size
    assert shape_of(build(odd)) == (32, 8, 128)


def shape_of(cfg) -> tuple[int, int, int]:
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
