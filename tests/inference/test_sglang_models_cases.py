"""The model-family table behind test_sglang_models.py, played inside the SGLang venv (no tests here).

``python test_sglang_models_cases.py OUT`` writes ``OUT/results.json``. Each served class is laid out
as its ``__init__`` lays it out (the wrapper's ``language_model`` / ``model``, the inner model's
``layers`` and ``layers_to_capture``, the ``logits_processor``), on bare modules: the real layers need
a GPU and an initialized process group. The classes' own ``set_eagle3_layers_to_capture`` run.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

# (served class, its module, the text model class it wraps, that model's module)
FAMILIES = {
    "LlamaForCausalLM": ("llama", "LlamaModel", "llama"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3Model", "qwen3"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeModel", "qwen3_moe"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV2Model", "deepseek_v2"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssModel", "gpt_oss"),
    "Gemma3ForCausalLM": ("gemma3_causal", "Gemma3TextModel", "gemma3_causal"),
    "KimiK25ForConditionalGeneration": ("kimi_k25", None, None),  # wraps DeepseekV3ForCausalLM
}
LAYERS = 12
ASKED = {
    "default": None,  # the plugin's default rule: [2, 6, 9]
    "low": [1, 2, 3],
    "spread": [3, 7, 10],
    "last": [9, 10, 11],
}


def _cases() -> dict:
    import importlib

    import sglang
    from eaglet_sglang import versions
    from eaglet_sglang.plugin import DumpPlugin, DumpSettings, capture_site, check_prefill_graph
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from torch import nn

    from eaglet.shared.layers import default_layer_ids

    def bare(cls: type, **attrs) -> nn.Module:
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        for k, v in attrs.items():
            setattr(obj, k, v)
        return obj

    def causal_lm(cls_name: str, module: str, inner_cls: str, inner_module: str, num_layers: int) -> nn.Module:
        cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls_name)
        inner = getattr(importlib.import_module(f"sglang.srt.models.{inner_module}"), inner_cls)
        model = bare(inner, layers=nn.ModuleList(nn.Identity() for _ in range(num_layers)), layers_to_capture=[])
        return bare(
            cls,
            config=SimpleNamespace(num_hidden_layers=num_layers),
            pp_group=SimpleNamespace(is_last_rank=True, is_first_rank=True),
            model=model,
            logits_processor=bare(LogitsProcessor),
            capture_aux_hidden_states=False,
        )

    def build(name: str, num_layers: int = LAYERS) -> nn.Module:
        module, inner_cls, inner_module = FAMILIES[name]
        if inner_cls is not None:
            return causal_lm(name, module, inner_cls, inner_module, num_layers)
        cls = importlib.import_module(f"sglang.srt.models.{module}").KimiK25ForConditionalGeneration
        text = causal_lm("DeepseekV3ForCausalLM", "deepseek_v2", "DeepseekV2Model", "deepseek_v2", num_layers)
        return bare(cls, config=SimpleNamespace(text_config=text.config), language_model=text)

    def marked(model: nn.Module) -> list[int]:
        layers = capture_site(model).layers_owner.layers
        return [i for i, layer in enumerate(layers) if getattr(layer, "_is_layer_to_capture", False)]

    out: dict = {"version": sglang.__version__, "default_rule": {n: default_layer_ids(n) for n in range(4, 9)}}
    for name in FAMILIES:
        model = build(name)
        site = capture_site(model)
        row = {
            "layers_owner": type(site.layers_owner).__name__,
            "logits_owner": type(site.logits_owner).__name__,
            "num_layers": site.num_layers,
            "model_property_is_language_model": getattr(model, "model", None) is getattr(model, "language_model", 0),
            "asked": {},
        }
        for label, asked in ASKED.items():
            model = build(name)
            model.set_eagle3_layers_to_capture(None)  # what SGLang's capture flag does first
            plugin = DumpPlugin(DumpSettings(dump_dir=Path(os.devnull), aux_layer_ids=asked))
            try:
                plugin.enable_capture(model)
            except RuntimeError as e:
                row["asked"][label] = {"refused": str(e)}
                continue
            site = capture_site(model)
            row["asked"][label] = {
                "captured": [int(i) for i in site.layers_owner.layers_to_capture],
                "marked": marked(model),
                "flag_on": bool(getattr(site.logits_owner, "capture_aux_hidden_states", False)),
            }
        out[name] = row

    # A 4-layer model: SGLang's own default is [2, 2, 1]; the plugin's is [1, 2, 3].
    small = build("LlamaForCausalLM", num_layers=4)
    DumpPlugin(DumpSettings(dump_dir=Path(os.devnull))).enable_capture(small)
    out["small"] = [int(i) for i in capture_site(small).layers_owner.layers_to_capture]
    try:
        DumpPlugin(DumpSettings(dump_dir=Path(os.devnull), aux_layer_ids=[2, 6, 12])).enable_capture(
            build("Qwen3ForCausalLM")
        )
        out["out_of_range"] = None
    except RuntimeError as e:
        out["out_of_range"] = str(e)

    # No capture list anywhere under the model: refused, naming the class.
    class Opaque(nn.Module):
        def set_eagle3_layers_to_capture(self, layer_ids=None) -> None:
            pass

    try:
        DumpPlugin(DumpSettings(dump_dir=Path(os.devnull))).enable_capture(Opaque())
        out["opaque"] = None
    except RuntimeError as e:
        out["opaque"] = str(e)

    graph = SimpleNamespace(cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend=versions.TC_PIECEWISE)))
    try:
        check_prefill_graph(graph)
        out["tc_piecewise"] = None
    except RuntimeError as e:
        out["tc_piecewise"] = str(e)
    return out


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    out_dir = Path(sys.argv[1])
    (out_dir / "results.json").write_text(json.dumps(_cases()))
