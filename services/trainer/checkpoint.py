"""Files the trainer reads and writes: the drafter that SGLang and vLLM load, and the trainer state that a resumed
run continues from (the target's embedding and LM head: shared/targettensors.py).

Drafter (``<run>/drafter/``), read by SGLang's ``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``) and
vLLM's ``Eagle3LlamaForCausalLM`` (``model_executor/models/llama_eagle3.py``)::

    fc.weight                                    [H, 3 * H_target]
    midlayer.hidden_norm.weight                  [H]       (both engines rename midlayer. -> layers.0.)
    midlayer.input_layernorm.weight              [H]
    midlayer.self_attn.{q,k,v}_proj.weight       [heads * d | kv_heads * d, 2H]
    midlayer.self_attn.o_proj.weight             [H, heads * d]
    midlayer.post_attention_layernorm.weight     [H]
    midlayer.mlp.{gate,up}_proj.weight           [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                  [H]
    lm_head.weight                               [Vd, H]
    d2t                                          int64 [Vd]  target_id - draft_id
    t2d                                          bool [V]    (both engines skip it)

No ``embed_tokens``: both engines use the target's when the draft has none (and hidden sizes match).

``load_drafter`` reads these folders back, and also those other trainers write in the same format (a config.json
without the ``eaglet`` section, shaped by the standard keys; an ``embed_tokens.weight`` of theirs is not read).

config.json is a Llama's of one layer, shaped by ``model.drafter_config`` (the target's attention shape, or for
latent-attention targets head_dim 128 with hidden / 128 heads and 8 KV heads). Its RoPE is plain: the target's
``rope_theta`` with ``rope_scaling: null`` and no ``rope_parameters``, so both engines build the default rotary
embedding, with no YaRN attention factor, exactly as the drafter was trained. ``max_position_embeddings`` is the
target's.

Auxiliary layer ids: the run's captured layers, as its dumps recorded them (``RunMeta.captured_layers``): the
stored states are the inputs of target layers ``aux_layer_ids`` (e.g. [2, 15, 27] for 30 layers). SGLang reads
``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures the input of layer id + 1, so it gets
``[i - 1 for i in aux_layer_ids]`` ([1, 14, 26]). vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids``
first, where id i is the input of layer i (id 0: the embeddings), so it gets ``aux_layer_ids`` unchanged. Each
engine finds its own convention in the one config.
"""

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.services.trainer.dflash import DFlashConfig, DFlashDrafter
from eaglet.services.trainer.model import Drafter, DrafterConfig, rope_theta
from eaglet.shared.layers import sglang_arg_ids
from eaglet.shared.targettensors import tensor_files

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A drafter or trainer checkpoint that cannot be read, or does not fit this run."""


# ---- the drafter as the engines load it ---------------------------------------------------------------------


def drafter_hf_config(cfg: DrafterConfig, target_config: dict, aux_layer_ids: list[int], dtype: torch.dtype) -> dict:
    """config.json of the drafter. ``aux_layer_ids``: the captured layer inputs (see the module docstring)."""
    text = target_config.get("text_config", target_config)
    keep = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **{k: text[k] for k in keep if k in text},
        # the drafter's own RoPE, never the target's scaling (see the module docstring)
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,  # SGLang would otherwise use the embedding as the LM head
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),  # vLLM: input of layer i
        "norm_before_fc": cfg.norm_before_fc,  # vLLM reads it here; SGLang in eagle_config first, then here
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_arg_ids(aux_layer_ids),  # SGLang adds 1
            "use_aux_hidden_state": True,
            "norm_before_fc": cfg.norm_before_fc,
        },
        "eaglet": {"aux_layer_ids_captured": list(aux_layer_ids), "drafter_config": cfg.to_dict()},
    }


def drafter_tensors(model: Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    out = {k: v.to(dtype).contiguous() for k, v in state.items() if v.is_floating_point()}
    out["d2t"] = state["d2t"].long().contiguous()
    out["t2d"] = state["t2d"].bool().contiguous()
    return out


def save_drafter(
    out_dir: Path, model: Drafter, target_config: dict, aux_layer_ids: list[int], dtype: torch.dtype
) -> Path:
    """Writes config.json + model.safetensors into ``out_dir`` (replaced whole, through a temp folder)."""
    config = drafter_hf_config(model.cfg, target_config, aux_layer_ids, dtype)
    return write_folder(Path(out_dir), drafter_tensors(model, dtype), config)


# ---- the DFlash drafter as SGLang loads it (models/dflash.py, DFlashDraftModel) --------------------------------


def dflash_hf_config(cfg: DFlashConfig, target_config: dict, dtype: torch.dtype) -> dict:
    """config.json of a DFlash drafter: a Qwen3 config of ``num_hidden_layers`` layers (per-head q/k norms) whose
    ``dflash_config`` names the target layers to capture, the block and the mask token. No ``layer_types``
    beyond full attention and no ``is_causal``: SGLang then runs the block non-causally, as it was trained."""
    text = target_config.get("text_config", target_config)
    keep = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **{k: text[k] for k in keep if k in text},
        "rope_theta": cfg.rope_theta,  # plain RoPE, never the target's scaling (as the EAGLE-3 drafter's)
        "rope_scaling": None,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),  # layer outputs; SGLang captures the input of id + 1
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
        },
        "eaglet": {"method": "dflash", "drafter_config": cfg.to_dict()},
    }


def save_dflash(out_dir: Path, model: DFlashDrafter, target_config: dict, dtype: torch.dtype) -> Path:
    """Writes a DFlash drafter's config.json + model.safetensors into ``out_dir`` (replaced whole)."""
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.served_state().items()}
    return write_folder(Path(out_dir), tensors, dflash_hf_config(model.cfg, target_config, dtype))


def load_dflash(drafter_dir: Path, embed: torch.Tensor) -> DFlashDrafter:
    """Rebuilds a DFlash drafter that eaglet wrote from its own config.json and weights; CheckpointError names the
    folder and what is missing or misshapen."""
    folder = Path(drafter_dir)
    config = json.loads((folder / "config.json").read_text())
    shape = (config.get("eaglet") or {}).get("drafter_config")
    if shape is None:
        raise CheckpointError(f"{folder}: config.json has no eaglet.drafter_config: not a DFlash drafter eaglet wrote")
    model = DFlashDrafter(DFlashConfig(**shape), embed)
    state = _drafter_state(folder)
    want = model.served_state()
    for key, value in want.items():
        if key not in state or tuple(state[key].shape) != tuple(value.shape):
            got = tuple(state[key].shape) if key in state else "missing"
            raise CheckpointError(f"{folder}: tensor {key}: {got}, expected {tuple(value.shape)}")
    model.load_state_dict({**{k: state[k].float() for k in want}, "input_scale": model.input_scale})  # folded
    return model


HELDOUT = "heldout.json"
"""Beside an exported drafter's weights: its held-out loss and accuracy per position at the step it was saved, which
``eaglet eval`` predicts the served accept length from (SGLang and vLLM read config.json and the weights only)."""


def carried_heldout(drafter_dir: Path) -> dict | None:
    """The held-out figures an exported drafter carries (``step``, ``heldout_loss``, ``heldout_acc``); None when it
    carries none (a foreign drafter, or one trained without a held-out split). ValueError naming the file when it
    is not such figures."""
    path = Path(drafter_dir) / HELDOUT
    try:
        figures = json.loads(path.read_text())
        if not isinstance(figures, dict) or not isinstance(figures.get("heldout_acc", []), list | None):
            raise TypeError("not an object with a heldout_acc list")
        return figures
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a drafter's held-out figures ({type(e).__name__}: {e})") from e


def is_dflash(drafter_dir: Path) -> bool:
    """True when the folder holds a DFlash drafter (SGLang's ``DFlashDraftModel``)."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    return "DFlashDraftModel" in (config.get("architectures") or [])


def write_folder(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """config.json + model.safetensors into ``out_dir``, replaced whole (``replace_folder``)."""

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    return replace_folder(out_dir, fill)


def replace_folder(out_dir: Path, fill: Callable[[Path], None]) -> Path:
    """``out_dir`` replaced whole by what ``fill`` writes into a temp folder beside it: an engine reading it
    meanwhile sees the old drafter or the new one, never half of each."""
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def load_drafter(drafter_dir: Path, embed: torch.Tensor) -> Drafter:
    """Rebuilds a drafter from its own config.json and weights (never from flags).

    A drafter eaglet wrote is shaped by its config's ``eaglet.drafter_config``. One another trainer wrote in
    SGLang's format (``LlamaForCausalLMEagle3``, no ``eaglet`` section) is shaped by the standard keys
    (``foreign_drafter_config``). Either way every tensor the model needs must be there with its shape: a
    CheckpointError names the folder and the key otherwise. ``embed`` [V, H]: the target's embedding."""
    folder = Path(drafter_dir)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such drafter folder")
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json; not a drafter folder")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
    check_plain_rope(config, folder)
    state = _drafter_state(folder)
    if "eaglet" in config:
        cfg = DrafterConfig(**config["eaglet"]["drafter_config"])
    else:
        cfg = foreign_drafter_config(config, state, folder)
    model = Drafter(cfg, embed)
    model.load_state_dict(_fit_state(model, state, folder), strict=False)
    if "t2d" not in state:  # both engines skip it; it follows from d2t
        model.set_vocab(torch.arange(cfg.draft_vocab_size) + model.d2t)
    return model


def declared_layers(drafter_dir: Path) -> list[int] | None:
    """The layers a drafter folder's config.json says the drafter reads, numbered as the store numbers them (the
    input of layer i): SGLang's ``eagle_config`` ids plus one (SGLang adds one to each), else vLLM's top-level ids;
    None where it says neither (another trainer's folder may not)."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if sglang is not None:
        return [int(i) + 1 for i in sglang]
    vllm = config.get("eagle_aux_hidden_state_layer_ids")
    return None if vllm is None else [int(i) for i in vllm]


EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's name, vLLM's
IGNORED_TENSORS = ("embed_tokens.weight",)
"""Tensors a drafter folder may hold that the model has no place for. ``embed_tokens.weight``: the drafter embeds
tokens with the target's embedding (a frozen buffer, not a parameter), so a copy saved with the drafter is not
read; the figures are those of the drafter on the target's embedding."""


def _drafter_state(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a drafter folder: ``model.safetensors``, or the shards its index names."""
    if not (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").is_file():
        raise CheckpointError(f"{folder}: no model.safetensors (nor model.safetensors.index.json); no drafter weights")
    state = {}
    for name, path in tensor_files(folder).items():
        with safe_open(str(path), framework="pt") as f:
            state[name] = f.get_tensor(name)
    return state


def check_plain_rope(config: dict, folder: Path) -> None:
    """CheckpointError unless the config declares plain RoPE: the drafter implements no scaling (model.py)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        kind = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
        if kind != "default":
            raise CheckpointError(
                f"{folder}: config.json declares {key} {json.dumps(value)}; the drafter implements plain RoPE "
                "only (rope_theta, no scaling), so its figures would not be this drafter's"
            )


def foreign_drafter_config(config: dict, state: dict[str, torch.Tensor], folder: Path) -> DrafterConfig:
    """The shape of a drafter another trainer saved in SGLang's format, from config.json's standard keys (absent
    optional ones take what the engines' Llama config gives them) and the number of aux states from ``fc.weight``
    [H, n * target_hidden_size]."""
    where = f"{folder}/config.json"
    arch = config.get("architectures") or []
    if arch and not any(a in EAGLE3_ARCHITECTURES for a in arch):
        raise CheckpointError(f"{where}: architectures {arch} is not an EAGLE-3 Llama drafter {EAGLE3_ARCHITECTURES}")
    for key, plain in (("num_hidden_layers", 1), ("hidden_act", "silu"), ("attention_bias", False),
                       ("mlp_bias", False)):  # fmt: skip
        if config.get(key, plain) != plain:
            raise CheckpointError(f"{where}: {key} is {config[key]!r}; the drafter model has {plain!r} only")

    def get(key: str, default=None, kind=int):
        value = config.get(key)
        if value is None:
            if default is None:
                raise CheckpointError(f"{where}: no {key}")
            return default
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"{where}: {key} is {value!r}, not a {kind.__name__}") from None

    for key in ("fc_norm", "use_aux_norm"):  # per-layer norms before fc: SGLang has them, this model does not
        if config.get(key):
            raise CheckpointError(f"{where}: {key} is set; the drafter model has only norm_before_fc")
    hidden, heads, vocab = get("hidden_size"), get("num_attention_heads"), get("vocab_size")
    target_hidden = get("target_hidden_size", hidden)
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[1] % target_hidden:
        shape = None if fc is None else list(fc.shape)
        raise CheckpointError(
            f"{folder}: fc.weight is {shape}; expected [hidden_size, n * target_hidden_size ({target_hidden})]"
        )
    try:
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=get("draft_vocab_size", vocab),  # absent: the full vocabulary, as SGLang reads it
            target_hidden_size=target_hidden,
            num_aux_hidden_states=fc.shape[1] // target_hidden,
            rms_norm_eps=get("rms_norm_eps", 1e-6, float),
            rope_theta=rope_theta(config),
            max_position_embeddings=get("max_position_embeddings", 2048),
            norm_before_fc=bool((config.get("eagle_config") or {}).get("norm_before_fc", config.get("norm_before_fc"))),
        )
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def _fit_state(model: Drafter, state: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors checked against the model's (names, shapes) and cast to its dtypes. ``t2d`` may be
    absent (both engines skip it), and ``d2t`` where the draft vocabulary is the whole vocabulary."""
    expected = model.state_dict()
    optional = {"t2d"} | ({"d2t"} if model.cfg.draft_vocab_size == model.cfg.vocab_size else set())
    missing = [k for k in expected if k not in state and k not in optional]
    if missing:
        raise CheckpointError(f"{folder}: tensors {missing} missing from the drafter's weights")
    wrong = [
        f"{k} is {list(state[k].shape)}, expected {list(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if wrong:
        raise CheckpointError(f"{folder}: {'; '.join(wrong)} (for the shape its config.json declares)")
    extra = sorted(k for k in state if k not in expected and k not in IGNORED_TENSORS)
    if extra:
        log.warning("%s: tensors %s have no place in the drafter model; not read", folder, extra)
    if "d2t" in state:
        d2t = state["d2t"]
        if d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise CheckpointError(f"{folder}: d2t is {d2t.dtype}; expected integer offsets (target_id - draft_id)")
        ids = torch.arange(len(d2t)) + d2t.long()
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= model.cfg.vocab_size or len(ids.unique()) < len(ids)):
            raise CheckpointError(
                f"{folder}: d2t does not map the draft ids to distinct target ids in 0..{model.cfg.vocab_size - 1}"
            )
    return {k: state[k].to(v.dtype) for k, v in expected.items() if k in state}


# ---- trainer state, for resume ------------------------------------------------------------------------------


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(folder: Path, step: int, state: dict, keep: int) -> Path:
    """``step_<n>.pt`` written as temp then rename (a file that exists is whole); older ones beyond ``keep`` go."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{CHECKPOINT_PREFIX}{step:08d}.pt"
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in list_states(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_states(folder: Path) -> list[Path]:
    """Trainer checkpoints, oldest first (a handful of files: listing this folder is cheap)."""
    if not Path(folder).is_dir():
        return []
    return sorted(p for p in Path(folder).glob(f"{CHECKPOINT_PREFIX}*.pt"))


def load_latest_state(folder: Path) -> dict | None:
    states = list_states(folder)
    if not states:
        return None
    log.info("resuming from %s", states[-1])
    # weights_only=False: the state holds Python RNG tuples and numpy arrays that we wrote ourselves
    return torch.load(states[-1], map_location="cpu", weights_only=False)
