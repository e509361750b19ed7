"""Tiny random-weight target models, one per architecture family, for the GPU family check (families.py).

    python -m bench.gpu.familymodels OUT_DIR [TOKENIZER_DIR] [FAMILY...]   builds them on the CPU (a check)

Each model is built with transformers from a small config (8 layers, hidden 512), cast to bf16 and written
with ``save_pretrained`` (per-expert checkpoint names for the MoE families, as published checkpoints have),
plus the tokenizer. The weights are drawn from a fixed seed: the same directory serves TP 1 and TP 2.

- ``deepseek``: DeepSeek-V3 layout: MLA (q/kv LoRA ranks, 128+64 head dims, kv rank 512), YaRN rope,
  first layer dense, then 16 routed experts in 4 groups (sigmoid scores, noaux_tc) plus a shared expert.
- ``kimi``: Kimi-K2.5's wrapper (``KimiK25ForConditionalGeneration``, model_type ``kimi_k25``) around the
  very same DeepSeek-V3 language model (weights named ``language_model.*``), a small vision config whose
  tower gets no weights (text-only prompts never run it), and a stand-in processor loaded as remote code
  (SGLang builds a multimodal processor for this architecture at start-up; the real checkpoint ships one).
- Router weights of the MoE families are scaled so that gate logits spread by about 3 (std): the chosen
  experts win clearly, and TP 1 vs TP 2 differences are not lost in near-ties between experts.
- The LM head's rows outside PREDICTED_TOKENS (256 ids) are scaled by 0.05, so the model's top token is always
  one of them, and those 256 rows by 10, so its distribution is peaked as a trained model's is. A random model
  over the whole vocabulary maps each of its 49 K input tokens to an unrelated next token, which a drafter cannot
  learn from a few thousand tokens (trained on 32 such samples it reached 0.75 accuracy on them and 0.01 on
  held-out ones); over 256 tokens it sees each input token tens of times, and its greedy continuations of
  prompts drawn from them stay among them (families.py and familydrafters.py draw their prompts there). Drawn at
  std 0.02, the logits spread by about 0.46: the top token's probability was 8e-5, next to uniform, which leaves
  a distilled drafter nothing to learn and greedy decoding at bf16's near-ties; at 10x the top token has about
  half the mass, 1.5 logits ahead of the second. Even so, the next token after random ids hangs on the whole
  context: trained on random ids alone, a drafter reached 0.005 held-out accuracy, and 0.02–0.32 on random prompts
  followed by the target's own greedy continuations (2026-12-03). So families.py's samples are mostly demo prompts
  in the chat template (``chat_prompts``), each followed by the target's own continuation, as regeneration gives a
  real target's drafter its data and as the families table's CPU cells ran (held-out accuracy 0.91 for Llama).
"""

import itertools
import json
import os
import shutil
import sys
from pathlib import Path

FAMILIES = ("llama", "qwen3", "qwen3moe", "deepseek", "kimi", "gptoss", "gemma3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek": "DeepseekV3ForCausalLM",
    "kimi": "KimiK25ForConditionalGeneration",
    "gptoss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
LAYERS = 8  # SGLang's default capture points [2, L//2, L-3] = [2, 4, 5]: three distinct layers
HIDDEN = 512
ROUTER_LOGIT_STD = 3.0
PREDICTED_TOKENS = range(1000, 1256)  # clear of the special ids and of Kimi's media placeholder (the last id)
OTHER_ROWS_SCALE = 0.05
PREDICTED_ROWS_SCALE = 10.0
DEFAULT_VOCAB = 49152  # SmolLM2's tokenizer

# The stand-in for Kimi-K2.5's processor (remote code in the model directory): what SGLang's Kimi-K2.5
# multimodal processor reads at start-up. Text prompts never reach its image path.
KIMI_PROCESSOR = '''"""Stand-in multimodal processor of a tiny Kimi-K2.5-layout test model (text only)."""

from types import SimpleNamespace

from transformers import AutoTokenizer


class TinyKimiProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.image_processor = SimpleNamespace()
        self.media_processor = SimpleNamespace(
            media_proc_cfg={
                "patch_size": 14,
                "merge_kernel_size": [2, 2],
                "in_patch_limit": 16384,
                "patch_limit_on_one_side": 512,
                "fixed_output_tokens": None,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }
        )
        self.chat_template = getattr(tokenizer, "chat_template", None)

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        return cls(AutoTokenizer.from_pretrained(path))

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):
        pass

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("text-only test model: no media processing")
'''


def _config(family: str, vocab: int):
    import transformers as T

    common = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if family == "llama":
        return T.LlamaConfig(
            **common, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, rope_theta=500000.0
        )
    if family == "qwen3":
        return T.Qwen3Config(
            **common, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=64
        )
    if family == "qwen3moe":
        return T.Qwen3MoeConfig(
            **common,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
        )
    if family in ("deepseek", "kimi"):
        common["max_position_embeddings"] = 163840
        return T.DeepseekV3Config(
            **common,
            intermediate_size=1024,
            moe_intermediate_size=256,
            first_k_dense_replace=1,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            topk_method="noaux_tc",  # read by SGLang, not kept by transformers' config unless given
            scoring_func="sigmoid",
            norm_topk_prob=True,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=256,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
    if family == "gptoss":
        return T.GptOssConfig(
            **common,
            intermediate_size=512,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=128,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)],
        )
    if family == "gemma3":  # its traps: embeddings scaled by sqrt(hidden), (1 + w) norms, sliding layers
        # tied, as every Gemma checkpoint is: SGLang's and vLLM's Gemma classes score with the embedding and skip
        # lm_head.weight, so an untied head is one the engines never serve (the trainer refuses it)
        return T.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True},
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            sliding_window=64,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(LAYERS)],
        )
    raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")


def _model_class(family: str):
    import transformers as T

    return {
        "llama": T.LlamaForCausalLM,
        "qwen3": T.Qwen3ForCausalLM,
        "qwen3moe": T.Qwen3MoeForCausalLM,
        "deepseek": T.DeepseekV3ForCausalLM,
        "kimi": T.DeepseekV3ForCausalLM,
        "gptoss": T.GptOssForCausalLM,
        "gemma3": T.Gemma3ForCausalLM,
    }[family]


def _scale_routers(model, hidden: int) -> int:
    """Router weights to std ROUTER_LOGIT_STD / sqrt(hidden): logits spread by ~ROUTER_LOGIT_STD."""
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")) and p.dim() == 2:
                p.normal_(0.0, ROUTER_LOGIT_STD / hidden**0.5)
                n += 1
    return n


def _concentrate_head(model) -> None:
    """The LM head's rows outside PREDICTED_TOKENS scaled by OTHER_ROWS_SCALE, theirs by PREDICTED_ROWS_SCALE (the
    embeddings untied but Gemma 3's, which scales its tied embedding with its head)."""
    import torch

    with torch.no_grad():
        head = model.get_output_embeddings().weight
        keep = head[PREDICTED_TOKENS.start : PREDICTED_TOKENS.stop] * PREDICTED_ROWS_SCALE
        head.mul_(OTHER_ROWS_SCALE)
        head[PREDICTED_TOKENS.start : PREDICTED_TOKENS.stop] = keep


def build(family: str, vocab: int = DEFAULT_VOCAB, seed: int = 0):
    """The transformers model (bf16, eval) for ``family``; ``kimi`` gets DeepSeek-V3's language model."""
    import torch

    config = _config(family, vocab)
    torch.manual_seed(seed)
    model = _model_class(family)(config)
    _scale_routers(model, config.hidden_size)
    _concentrate_head(model)
    return model.to(torch.bfloat16).eval()


def make_model(family: str, out: Path, tokenizer_dir: Path | None = None, seed: int = 0) -> dict:
    """Writes ``family``'s tiny model to ``out`` (a Hugging Face directory); returns what it made.
    Kept when ``out/config.json`` exists (same seed, same weights)."""
    out = Path(out)
    if (out / "config.json").exists():
        return json.loads((out / "family.json").read_text())
    vocab = DEFAULT_VOCAB
    tok = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        vocab = len(tok)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = build(family, vocab, seed)
    model.save_pretrained(tmp)
    if tok is not None:
        tok.save_pretrained(tmp)
    _add_engine_keys(tmp / "config.json", family)
    if family == "kimi":
        _as_kimi(tmp, model.config, tok)
    info = {
        "family": family,
        "architecture": ARCHITECTURES[family],
        "hidden_size": model.config.hidden_size,
        "num_layers": model.config.num_hidden_layers,
        "vocab_size": vocab,
        "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "aux_layer_ids": [2, LAYERS // 2, LAYERS - 3],
        "router_logit_std": ROUTER_LOGIT_STD if family in ("qwen3moe", "deepseek", "kimi", "gptoss") else None,
        "predicted_tokens": [PREDICTED_TOKENS.start, PREDICTED_TOKENS.stop],
        "seed": seed,
    }
    (tmp / "family.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


def bundled_model(model: str, family: str, gguf: Path, out: Path) -> dict:
    """A real target of ``family``: eaglet's bundled ``model`` (shared/target.py: smollm2, gemma3) converted from its
    GGUF file ``gguf`` to ``out`` in bf16, as eaglet converts it for itself; returns what it made (as
    ``make_model``)."""
    from eaglet.shared.layers import default_layer_ids
    from eaglet.shared.target import convert_gguf, text_config

    out = Path(out)
    if not (out / "config.json").exists():
        convert_gguf(model, Path(gguf), out, dtype="bfloat16")
    if not (out / "family.json").exists():
        text = text_config(out)
        info = {
            "family": family,
            "architecture": ARCHITECTURES[family],
            "bundled": model,
            "hidden_size": text["hidden_size"],
            "num_layers": text["num_hidden_layers"],
            "vocab_size": text["vocab_size"],
            "aux_layer_ids": default_layer_ids(text["num_hidden_layers"]),
            "gguf": str(gguf),
        }
        (out / "family.json").write_text(json.dumps(info, indent=1))
    return json.loads((out / "family.json").read_text())


# Keys the released checkpoints carry and SGLang 0.5.17 reads, which the transformers config classes there
# neither write nor default: the rope in its older spelling, DeepSeek's MoE layer stride, GPT-OSS's clamp.
ENGINE_KEYS = {"deepseek": {"moe_layer_freq": 1}, "kimi": {"moe_layer_freq": 1}, "gptoss": {"swiglu_limit": 7.0}}


def _add_engine_keys(path: Path, family: str) -> None:
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        config.setdefault(
            "rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"} | {"type": rope["rope_type"]}
        )
    config.update(ENGINE_KEYS.get(family, {}))
    path.write_text(json.dumps(config, indent=1))


def _as_kimi(d: Path, text_config, tok) -> None:
    """Turns a saved DeepSeek-V3 directory into Kimi-K2.5's layout: wrapper config, ``language_model.`` names."""
    import torch
    from safetensors.torch import load_file, save_file

    index = d / "model.safetensors.index.json"
    files = sorted(d.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({f"language_model.{k}": v for k, v in load_file(str(f)).items()})
        f.unlink()
    index.unlink(missing_ok=True)
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    text = text_config.to_dict() | ENGINE_KEYS["kimi"]
    text.update(
        {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k in ("rope_theta", "rope_scaling")}
    )
    for k in ("architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        text.pop(k, None)
    text["model_type"] = "deepseek_v3"
    text["architectures"] = ["DeepseekV3ForCausalLM"]  # SGLang's DeepSeek class reads it (shared-expert fusion)
    # the last id stands for the media placeholder (the prompts here never carry it): the same vocab, and so
    # the same weights, as the ``deepseek`` model
    media_pad = text_config.vocab_size - 1
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {
            "patch_size": 14,
            "init_pos_emb_height": 16,
            "init_pos_emb_width": 16,
            "init_pos_emb_time": 4,
            "pos_emb_type": "divided_fixed",
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 128,
            "intermediate_size": 256,
            "merge_kernel_size": [2, 2],
            "video_attn_type": "spatial_temporal",
            "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmerger",
            "mm_hidden_size": 128,
            "vt_hidden_size": 128,  # the projector reads it; released configs carry it beside hidden_size
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-5,
            "text_hidden_size": text_config.hidden_size,
        },
        "media_placeholder_token_id": media_pad,
        "pad_token_id": 0,
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
    }
    (d / "config.json").write_text(json.dumps(config, indent=1))
    (d / "generation_config.json").unlink(missing_ok=True)
    (d / "processing_tiny_kimi.py").write_text(KIMI_PROCESSOR)
    (d / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "TinyKimiProcessor",
                "auto_map": {"AutoProcessor": "processing_tiny_kimi.TinyKimiProcessor"},
            }
        )
    )


def transformers_states(model_dir: Path, prompts: list[list[int]], aux_ids: list[int], device: str = "cuda"):
    """transformers' own forward of each prompt: (final [T, H], aux [T, 3H]) float32 on the CPU.

    final = the last hidden state (after the final norm); aux = hidden_states[i] for i in ``aux_ids``,
    the residual stream entering layer i: SGLang's convention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    inner = model.model
    out = []
    with torch.no_grad():
        for ids in prompts:
            o = inner(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
            hs = o.hidden_states
            final = o.last_hidden_state[0].float().cpu()
            aux = torch.cat([hs[i][0] for i in aux_ids], dim=-1).float().cpu()
            out.append((final, aux))
    del model, inner
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def chat_prompts(tokenizer: Path, path: Path, n: int) -> dict[str, list[int]]:
    """The first ``n`` demo prompts of ``path`` (a ``prompt``, or the first user message of ``messages``), each
    rendered by the chat template for the assistant's reply: id -> token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    out = {}
    with open(path) as f:
        for line in itertools.islice(f, n):
            row = json.loads(line)
            text = row.get("prompt") or next(m["content"] for m in row["messages"] if m["role"] == "user")
            chat = [{"role": "user", "content": text}]
            out[row["id"]] = list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
    return out


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    tokenizer = Path(sys.argv[2]) if len(sys.argv) > 2 and os.path.isdir(sys.argv[2]) else None
    wanted = [a for a in sys.argv[2:] if a in FAMILIES] or list(FAMILIES)
    for fam in wanted:
        print(fam, make_model(fam, out_dir / fam, tokenizer), flush=True)
