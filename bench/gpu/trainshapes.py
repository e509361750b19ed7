"""The target shapes the trainer's GPU bench (trainspeed.py) and its memory accounting (trainmem.py) share: config.json
as a target directory holds it. ``TEXT``: each shape's text config, what the drafter is built from."""

from bench.gpu import mkmodel

# Kimi-K2.5: a multimodal wrapper around a DeepSeek-V3-shaped language model with multi-head latent attention;
# its drafter gets eaglet's latent-attention rule (56 heads x 128, 8 KV heads).
KIMI_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "rope_theta": 50000.0,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "torch_dtype": "bfloat16",
}
# The CPU test's shape: every code path of the big ones in milliseconds.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
)
KIMI = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": KIMI_TEXT,
    "tie_word_embeddings": False,
}
TEXT = {
    "kimi": KIMI_TEXT,
    "l8b": mkmodel.llama_config(mkmodel.SHAPES["8b"]),
    "smol": mkmodel.llama_config(mkmodel.SHAPES["smol"]),
    "tiny": mkmodel.llama_config(TINY),
}
