import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglet.services.trainer import evaluate
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.model import Drafter, DrafterConfig
from eaglet.services.trainer.speculative import greedy_generate, speculative_generate
from eaglet.services.trainer.train import train
from eaglet.shared.layers import default_layer_ids
from eaglet.shared.runstate import RunState
from tests.trainer.fixtures import make_run


def drafter_for(target, seed=0) -> Drafter:
    c = target.config
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size)  # fmt: skip
    d = Drafter(cfg, target.get_input_embeddings().weight.detach())
    d.set_vocab(torch.arange(c.vocab_size))
    return d.eval()


class Oracle(Drafter):
    """Proposes the target's greedy tokens (known in advance), wrong at every ``wrong``-th position: exercises
    full, partial and zero acceptance, and the rollback of both caches."""

    def setup(self, prompt_len: int, reference: list[int], wrong: int):
        self.prompt_len, self.reference, self.wrong, self.pos = prompt_len, reference, wrong, 0
        return self

    def decode(self, token_ids, hidden, start, cache):
        self.pos = start + token_ids.shape[1] - 1  # last position fed: its output predicts token pos + 2
        return super().decode(token_ids, hidden, start, cache)

    def logits(self, out):
        i = self.pos + 2 - self.prompt_len  # index in the generated tokens
        tok = self.reference[i] if i < len(self.reference) else 0
        if i % self.wrong == self.wrong - 1:
            tok = (tok + 1) % self.cfg.vocab_size
        z = torch.full((*out.shape[:-1], self.cfg.draft_vocab_size), -1e4)
        z[..., tok] = 0.0
        return z


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_output_equals_greedy(target, k):
    layers = default_layer_ids(target.config.num_hidden_layers)
    prompt = torch.tensor([[1, 510, 2344, 300, 77, 9001, 12]])
    ref = greedy_generate(target, prompt, 40, eos=set())
    assert len(ref) == 40
    got, stats = speculative_generate(target, drafter_for(target), prompt, 40, k, layers, eos=set())
    assert got == ref
    for wrong in (3, 4, 7):
        oracle = Oracle(drafter_for(target).cfg, target.get_input_embeddings().weight.detach())
        oracle.set_vocab(torch.arange(target.config.vocab_size))
        oracle.setup(prompt.shape[1], ref, wrong)
        got, stats = speculative_generate(target, oracle.eval(), prompt, 40, k, layers, eos=set())
        assert got == ref, (k, wrong)
        assert stats.accept_length() > 1.5 or k == 1


def test_stops_at_eos_like_greedy(target):
    layers = default_layer_ids(target.config.num_hidden_layers)
    prompt = torch.tensor([[5, 6, 7]])
    ref = greedy_generate(target, prompt, 30, eos=set())
    eos = {ref[10]}
    expect = greedy_generate(target, prompt, 30, eos=eos)
    assert expect[-1] == ref[10] and len(expect) <= 11
    got, _ = speculative_generate(target, drafter_for(target), prompt, 30, 4, layers, eos=eos)
    assert got == expect


def test_eval_prompt_forms():
    assert evaluate.prompt_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    msgs = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                         {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]}  # fmt: skip
    assert [m["content"] for m in evaluate.prompt_messages(msgs)] == ["s", "u"]
    share = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    assert evaluate.prompt_messages(share) == [{"role": "user", "content": "q"}]


def test_eval_of_a_trained_run_reports_to_redis(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "ev", n=12)
    cfg = TrainConfig(ttt_steps=2, draft_vocab_size=512, tokens_per_batch=160, max_steps=4, loader_workers=0)
    train(redis=redis, run_id="ev", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Why is the sky blue?"}]}) + "\n")
    figures = evaluate.evaluate_run(redis=redis, run_id="ev", data_dir=tmp_path, target_dir=tiny_model_dir,
                                    prompts=prompts, k=3, max_new_tokens=12)  # fmt: skip
    assert figures["mismatches"] == 0 and figures["accept_length"] >= 1.0
    stored = RunState(redis, "ev").eval()
    assert stored.state == "done" and len(stored.accept_rate) == 3 and stored.speedup > 0
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert evaluate.load_prompts(prompts, tok)[0][-3:] == tok.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue?"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)[-3:]  # fmt: skip
