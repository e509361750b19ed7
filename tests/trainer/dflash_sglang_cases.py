"""Run with the SGLang venv's Python (test_dflash_sglang.py does; not a test module: it imports SGLang): loads
an eaglet DFlash drafter through SGLang's
own classes (its transformers config, ``parse_dflash_draft_config``, ``DFlashDraftModel`` and its
``load_weights``) and computes what the DFlash worker computes of a verified context: the projected features and
each layer's keys and values. Writes them to ``<out>/sglang.safetensors`` and the config it resolved to
``<out>/resolved.json``.

    python dflash_sglang_cases.py DRAFTER_DIR INPUTS.safetensors OUT_DIR

A single-process gloo group stands in for TP 1 (SGLang's parallel layers need one); RoPE is SGLang's torch-native
path (its module's CPU flag set: the CPU engine's kernels are not installed here)."""

import json
import socket
import sys
from pathlib import Path

import sglang
import torch
from safetensors.torch import load_file, save_file
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
from sglang.srt.runtime_context import get_context
from transformers import AutoConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(folder: str, inputs: str, out: str) -> None:
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
    initialize_model_parallel(1)
    get_context().override_server_args().install()
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True  # the torch-native rotary path
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    config = AutoConfig.from_pretrained(folder)
    parsed = parse_dflash_draft_config(draft_hf_config=config)
    model = DFlashDraftModel(config).float()
    model.load_weights(load_file(str(Path(folder) / "model.safetensors")).items())
    given = load_file(inputs)
    with torch.no_grad():
        ctx = model.project_target_hidden(given["aux"])
        result = {"ctx": ctx}
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
            result[f"k{i}"] = attn.apply_k_rope(given["positions"], attn.apply_k_norm(k))
            result[f"v{i}"] = v
    save_file({k: t.contiguous() for k, t in result.items()}, str(Path(out) / "sglang.safetensors"))
    resolved = {
        "version": sglang.__version__,
        "target_layer_ids": parsed.resolve_target_layer_ids(target_num_layers=parsed.num_target_layers),
        "block_size": model.block_size,
        "mask_token_id": parsed.mask_token_id,
        "num_context_features": model.num_context_features,
        "attention_type": model.layers[0].self_attn.attn.attn_type.name,
        "rope_base": float(model.layers[0].self_attn.rotary_emb.base),
        "is_neox_style": bool(model.layers[0].self_attn.rotary_emb.is_neox_style),
    }
    (Path(out) / "resolved.json").write_text(json.dumps(resolved))


if __name__ == "__main__":
    main(*sys.argv[1:4])
