"""The target's token embedding, LM head and final norm, read alone from its safetensors files: what the trainer
builds the drafter and its loss from, and what a server computing the target's top-k scores with. A 70B target
costs two matrices of memory, not the model.

The LM head is the one the serving engines score with: the embedding when the checkpoint ties them, and for Gemma
always the embedding (SGLang's and vLLM's Gemma classes ignore ``lm_head.weight``), so a Gemma checkpoint whose head
differs from its embedding is refused rather than trained or scored against a head no engine serves.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open


class TargetTensorsError(RuntimeError):
    """The target checkpoint lacks a tensor the drafter needs, or holds one the engines would not use."""


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a checkpoint folder (a target's, a drafter's), from the index if sharded;
    only headers are read."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TargetTensorsError(f"{model_dir}: no safetensors files; the target must be a safetensors checkpoint")
    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update({k: f for k in st.keys()})
    return names


def _find(names: dict[str, Path], suffix: str) -> str | None:
    """The one tensor whose name ends with ``suffix`` (``model.`` or ``language_model.model.`` prefixes vary)."""
    hits = sorted(n for n in names if n == suffix or n.endswith("." + suffix))
    return hits[0] if hits else None


PARTS = ("embed", "lm_head", "norm")


def load_target_tensors(model_dir: Path, parts: tuple[str, ...] = PARTS) -> dict[str, torch.Tensor]:
    """Of the target's ``embed`` [V, H], ``lm_head`` [V, H] (the embedding itself when tied) and final ``norm`` [H],
    the ``parts`` asked for, read alone from its safetensors files, each tensor once: a 70B target costs at most two
    matrices of memory, not the model; a server scoring top-k asks the head alone (one matrix)."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"load_target_tensors: unknown parts {unknown}; known: {list(PARTS)}")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text_config = config.get("text_config", config)
    names = tensor_files(model_dir)
    embed = _find(names, "embed_tokens.weight")
    head = _find(names, "lm_head.weight")
    tied = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    if "lm_head" in parts and head is None and not tied:
        raise TargetTensorsError(f"{model_dir}: no lm_head.weight and tie_word_embeddings is false")
    # model.norm.weight, not a layer's norm: prefer the shortest name ending in "norm.weight" under the model
    norms = [n for n in names if n.endswith("model.norm.weight") or n == "norm.weight"]
    wanted = {
        "embed": embed,
        "lm_head": head if head is not None else embed,
        "norm": min(norms, key=len) if norms else None,
    }
    gemma = str(text_config.get("model_type", "")).startswith("gemma")
    # a Gemma head is checked against the embedding, so asking for it reads both
    needed = set(parts) | ({"embed", "lm_head"} if gemma and head is not None and "lm_head" in parts else set())
    found = {k: name for k in needed if (name := wanted[k]) is not None}
    missing = sorted(needed - found.keys())
    if missing:
        raise TargetTensorsError(f"{model_dir}: tensors for {missing} not found in the safetensors files")
    read: dict[str, torch.Tensor] = {}
    for name in sorted(set(found.values())):
        with safe_open(str(names[name]), framework="pt") as st:
            read[name] = st.get_tensor(name)
    out = {k: read[name] for k, name in found.items()}
    if gemma:
        if "lm_head" in needed and head is not None and not torch.equal(out["lm_head"], out["embed"]):
            # SGLang's and vLLM's Gemma classes score with the embedding and skip lm_head.weight when loading: a
            # drafter trained against this head would be verified against another model's choices (accepts none)
            raise TargetTensorsError(
                f"{model_dir}: a Gemma checkpoint whose lm_head.weight differs from its embed_tokens.weight; SGLang "
                "and vLLM serve Gemma with the embedding as its LM head and ignore lm_head.weight, so the drafter "
                "would learn a head the engines never use. Tie them (tie_word_embeddings: true, no lm_head.weight)"
            )
        if "norm" in out:
            # Gemma's RMSNorm scales by (1 + w) and its checkpoints store w; the drafter's norm scales by its weight
            out["norm"] = out["norm"].float() + 1
    return {k: out[k] for k in parts}
