"""SpecForge 0.2.0's own training entry point (``specforge train -c CONFIG``) run as is, then its own SGLang
export, with wall time and torch's peak GPU memory written down (the counterpart of train_probe.py).

    python bench/gpu/specforge_train.py CONFIG.json DRAFTER_DIR      (PROBE_OUT: where the JSON goes)
"""

import glob
import json
import os
import sys
import time

import torch


def export(config_path: str, drafter_dir: str) -> dict:
    """The newest checkpoint as an SGLang draft folder, through SpecForge's exporter and its resolved draft config:
    its SGLang exporter for EAGLE-3, its HF exporter for DFlash (the one it names for DFlash-family drafters,
    z-lab's format, which SGLang's DFlash worker loads)."""
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.export.to_hf import export_to_hf
    from specforge.export.to_sglang import export_to_sglang
    from specforge.training.model_loading import resolve_draft_config

    cfg = load_config(config_path, [])
    resolved = resolve_run(cfg)
    draft_config = resolve_draft_config(resolved.config, provider=resolved.algorithm.providers.model.draft_config)
    os.makedirs(cfg.output_dir, exist_ok=True)
    draft_config_path = os.path.join(cfg.output_dir, "draft_config.json")
    draft_config.to_json_file(draft_config_path)
    steps = sorted(glob.glob(os.path.join(cfg.output_dir, f"{cfg.run_id}-step*")),
                   key=lambda p: int(p.rsplit("-step", 1)[1]))  # fmt: skip
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {cfg.output_dir}")
    if cfg.training.strategy == "dflash":
        export_to_hf(steps[-1], draft_config_path, drafter_dir, embedding_source=cfg.model.target_model_path)
        return {"checkpoint": steps[-1], "dflash_config": complete_dflash_config(steps[-1], drafter_dir, config_path)}
    mappings = sorted(glob.glob(os.path.join(cfg.data.cache_dir, "vocab_mapping", "*")))
    export_to_sglang(steps[-1], draft_config_path, drafter_dir, vocab_mapping_path=mappings[-1] if mappings else None)
    return {"checkpoint": steps[-1], "vocab_mapping": mappings[-1] if mappings else None}


def complete_dflash_config(checkpoint: str, drafter_dir: str, config_path: str) -> dict:
    """The mask token and target layers SpecForge trained with, written into the exported config where its
    exporter left them out: the trainer resolves the mask token at start (its draft config file has none) and keeps
    both in the checkpoint's resume contract; SGLang reads them from ``dflash_config``."""
    from specforge.config import load_config
    from specforge.export.checkpoint_io import resolve_training_state

    state = resolve_training_state(checkpoint)
    path = os.path.join(drafter_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    dflash = config.setdefault("dflash_config", {})
    trained = {
        "mask_token_id": state.get("dflash_mask_token_id"),
        "target_layer_ids": state.get("dflash_target_layer_ids"),
    }
    for key, value in trained.items():
        if dflash.get(key) is None and value is not None:
            dflash[key] = list(value) if isinstance(value, tuple) else value
    if dflash.get("mask_token_id") is None:  # not in the checkpoint: resolved again as the trainer did at start
        from specforge.training.model_utils import resolve_mask_token_id
        from transformers import AutoTokenizer

        cfg = load_config(config_path, [])
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.target_model_path)
        dflash["mask_token_id"] = resolve_mask_token_id(explicit=cfg.model.mask_token_id, tokenizer=tokenizer,
                                                        embedding_vocab_size=int(config["vocab_size"]))  # fmt: skip
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return dflash


def run() -> int:
    config_path, drafter_dir = sys.argv[1], sys.argv[2]
    from specforge.cli import main

    t = time.time()
    rc = main(["train", "-c", config_path])
    cuda = torch.cuda.is_available()
    out = {
        "rc": rc,
        "wall_s": round(time.time() - t, 1),
        "peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
    }
    print(json.dumps(out), flush=True)
    if rc == 0:
        t = time.time()
        out["export"] = export(config_path, drafter_dir)
        out["export_s"] = round(time.time() - t, 1)
    path = os.environ.get("PROBE_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(run())
