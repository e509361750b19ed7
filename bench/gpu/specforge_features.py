"""eaglet's stored samples as SpecForge 0.2.0's offline features, and the rest of what its offline training needs.

SpecForge trains offline from a folder of ``.ckpt`` files (``torch.save`` of a dict), one a sample, read by its
``OfflineManifestReader`` and ``normalize_offline_sample``: ``input_ids`` [T], ``loss_mask`` [T],
``hidden_state`` [1, T, H] (the target's final states after its final norm: SpecForge's target head is the LM
head alone) and ``aux_hidden_state`` [1, T, 3H] (the captured layers, concatenated). eaglet's store holds the
same tensors from the same SGLang forward, so both trainers see identical states.

A DFlash run (``method="dflash"``) is read by SpecForge's DFlash-family normalizer instead: ``input_ids``,
``loss_mask`` and ``hidden_states`` [1, T, nH], the captured target layers concatenated in layer order, which is
eaglet's ``aux_hidden_states`` of a DFlash run (its five layers); no final states.
"""

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.services.trainer.data import is_heldout, load_sample


def to_specforge(sample: dict[str, torch.Tensor], method: str = "eagle3") -> dict[str, torch.Tensor]:
    """One eaglet sample (``load_sample``'s tensors) as SpecForge's offline feature dict for ``method``."""
    ids = {"input_ids": sample["input_ids"].long(), "loss_mask": sample["loss_mask"].long()}
    if method == "dflash":
        return {**ids, "hidden_states": sample["aux_hidden_states"].unsqueeze(0).contiguous()}
    return {
        **ids,
        "hidden_state": sample["hidden_states"].unsqueeze(0).contiguous(),
        "aux_hidden_state": sample["aux_hidden_states"].unsqueeze(0).contiguous(),
    }


def convert(
    paths: list[tuple[int, str, str]], out_dir: str, dtype: torch.dtype = torch.bfloat16, method: str = "eagle3"
) -> int:
    """Writes each (index, sample_id, store path) as ``out_dir/<index>.ckpt``; returns the tokens written."""
    tokens = 0
    for index, _sample_id, path in paths:
        feats = to_specforge(load_sample(Path(path), dtype), method)
        dst = Path(out_dir) / f"{index:08d}.ckpt"
        tmp = dst.with_suffix(".tmp")
        torch.save(feats, tmp)
        os.replace(tmp, dst)
        tokens += int(feats["input_ids"].numel())
    return tokens


def training_split(rows: list[tuple[int, str, int]], heldout_fraction: float) -> list[tuple[int, str, int]]:
    """The (index, sample_id, length) rows eaglet's trainer trains on: its own held-out split left out."""
    return [r for r in rows if not is_heldout(r[1], heldout_fraction)]


def target_view(model_dir: Path, out: Path) -> Path:
    """The target as SpecForge's loaders read it: they look up ``lm_head.weight`` and the embedding through a
    ``*.index.json`` weight map, which a tied single-file model such as SmolLM2 lacks. Links the model's files
    and adds a map to one file holding both (the tied LM head is the embedding)."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = out / f.name
        if not link.exists() and not f.name.endswith(".index.json"):
            link.symlink_to(f.resolve())
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        head = f.get_tensor("lm_head.weight") if "lm_head.weight" in names else embed.clone()
    if not (out / "heads.safetensors").exists():  # written once: SpecForge resumes only where its files are unchanged
        save_file({"model.embed_tokens.weight": embed.contiguous(), "lm_head.weight": head.contiguous()},
                  str(out / "heads.safetensors"))  # fmt: skip
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "heads.safetensors",
                                            "lm_head.weight": "heads.safetensors"}}  # fmt: skip
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def run_config(
    target: Path,
    features: Path,
    out: Path,
    *,
    epochs: int,
    batch_size: int,
    max_length: int,
    lr: float | None = None,
    dflash_layers: int | None = None,
) -> dict:
    """SpecForge's run config: its published defaults (EAGLE-3, TTT 7, lr 1e-4 cosine, warmup 1.5 %, clip 0.5,
    draft vocab 32,000, flex attention, one process) except the epochs and the batch size, set to give the same
    passes and the same samples per optimizer step as eaglet's run; ``lr``: a point of its learning-rate sweep.

    ``dflash_layers``: a DFlash drafter of that many layers (``training.strategy: dflash``, its DFlash defaults:
    block 16, 512 anchors, loss ``dflash``), which reads the target layers SpecForge derives for that count, the
    layers eaglet's DFlash run stored for its drafter of the same count. SpecForge's own default is one layer
    reading one target layer; the same five-layer shape as eaglet's is the comparison of trainers, not shapes."""
    training: dict = {"num_epochs": epochs, "batch_size": batch_size, "save_interval": 0}
    model: dict = {"target_model_path": str(target), "torch_dtype": "bfloat16"}
    if lr is not None:
        training["learning_rate"] = lr
    if dflash_layers is not None:
        training.update(strategy="dflash", loss_type="dflash")
        model["draft_num_hidden_layers"] = dflash_layers
    return {
        "model": model,
        "data": {"hidden_states_path": str(features), "max_length": max_length, "cache_dir": str(out / "cache")},
        "training": training,
        "output_dir": str(out / "output"),
        "run_id": "h2h",
    }
