"""The target's final norm as the drafter starts from it: Gemma's (1 + w) convention turned into a plain weight."""

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from eaglet.services.trainer.checkpoint import load_target_tensors
from eaglet.services.trainer.model import RMSNorm


def test_gemmas_final_norm_becomes_the_drafters_plain_weight(tmp_path):
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    target = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        target.model.norm.weight.uniform_(-0.5, 0.5)  # stored w: the norm scales by 1 + w
    target.save_pretrained(tmp_path)
    norm = load_target_tensors(tmp_path)["norm"]
    mine = RMSNorm(32, cfg.rms_norm_eps)
    with torch.no_grad():
        mine.weight.copy_(norm)
    x = torch.randn(3, 32)
    assert torch.allclose(mine(x), target.model.norm(x), atol=1e-5)
