"""The target's tensors as the trainer reads them for Gemma: its final norm's (1 + w) convention turned into a plain
weight, and its LM head the embedding, as the engines serve it."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from eaglet.services.trainer.model import RMSNorm
from eaglet.shared.targettensors import TargetTensorsError, load_target_tensors


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


def tiny_gemma(tied: bool) -> Gemma3ForCausalLM:
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           tie_word_embeddings=tied)  # fmt: skip
    return Gemma3ForCausalLM(cfg)


def test_a_gemma_head_apart_from_its_embedding_is_refused_naming_why(tmp_path):
    # SGLang's and vLLM's Gemma classes score with embed_tokens and skip lm_head.weight: a drafter trained against a
    # separate head accepted no draft at all in SGLang (the tiny Gemma 3 family target of 2026-12-03)
    untied = tiny_gemma(tied=False)
    with torch.no_grad():
        untied.lm_head.weight.normal_()
    untied.save_pretrained(tmp_path / "untied")
    with pytest.raises(
        TargetTensorsError, match=r"(?s)untied: a Gemma checkpoint whose lm_head.weight differs.*Tie them"
    ):
        load_target_tensors(tmp_path / "untied")


def test_a_tied_gemma_scores_with_its_embedding(tmp_path):
    tiny_gemma(tied=True).save_pretrained(tmp_path)
    tensors = load_target_tensors(tmp_path)
    assert torch.equal(tensors["lm_head"], tensors["embed"])
