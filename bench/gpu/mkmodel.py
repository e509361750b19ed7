"""Llama-architecture target models for the GPU runs, written as Hugging Face directories.

    python -m bench.gpu.mkmodel smol OUT TOKENIZER_DIR     SmolLM2-135M's shape, random bf16 weights
    python -m bench.gpu.mkmodel 8b OUT TOKENIZER_DIR       Llama-3-8B's shape, random bf16 weights
    python -m bench.gpu.mkmodel gguf OUT GGUF_FILE [MODEL] a bundled model (smollm2, gemma3), from its GGUF

Random weights are drawn on the GPU (normal, std 0.02; norms 1) and written straight to safetensors:
an 8B model takes seconds, not the minutes of a Hugging Face init on the CPU.
"""

import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    # SmolLM2-135M-Instruct's config (the bundled target), with its tokenizer
    "smol": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    # Llama-3-8B's config
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
}


def llama_config(c: dict) -> dict:
    """config.json of a Llama of shape ``c`` (one of ``SHAPES``' entries, or another of the same keys)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "head_dim": c["hidden_size"] // c["num_attention_heads"],
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
        "rope_parameters": {"rope_theta": c["rope_theta"], "rope_type": "default"},
        **c,
    }


def random_bf16(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal (std 0.02) bf16 weights drawn on ``g``'s device, returned on the CPU for safetensors."""
    return (torch.randn(*shape, generator=g, device=g.device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()


def random_llama(shape: str, out: str, tokenizer_dir: str) -> None:
    c = SHAPES[shape]
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    rnd = functools.partial(random_bf16, torch.Generator(device="cuda").manual_seed(0))

    t = {"model.embed_tokens.weight": rnd(c["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = rnd(c["vocab_size"], h)
    for layer in range(n):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = rnd(h, h)
        t[p + "self_attn.k_proj.weight"] = rnd(kv, h)
        t[p + "self_attn.v_proj.weight"] = rnd(kv, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, h)
        t[p + "mlp.gate_proj.weight"] = rnd(i, h)
        t[p + "mlp.up_proj.weight"] = rnd(i, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, i)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(llama_config(c), f, indent=2)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    print(f"{shape}: {sum(v.numel() for v in t.values()) / 1e6:.1f} M params -> {out}", flush=True)


def from_gguf(out: str, gguf_file: str, model: str = "smollm2") -> None:
    """The bundled model's conversion (shared/target.py), from a GGUF file given by path, in bf16 for SGLang."""
    from eaglet.shared.target import convert_gguf

    convert_gguf(model, Path(gguf_file), Path(out), dtype="bfloat16")
    print(f"gguf: {gguf_file} -> {out}", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    kind, out, src = sys.argv[1:4]
    if os.path.exists(os.path.join(out, "config.json")):
        print(f"{out} exists")
    elif kind == "gguf":
        from_gguf(out, src, *sys.argv[4:5])
    else:
        random_llama(kind, out, src)
    print(f"model ready in {time.time() - t0:.1f}s", flush=True)
