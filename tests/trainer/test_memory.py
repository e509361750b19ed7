"""The memory rule and the trainer's check against it: a run whose rows the rule says would not fit the planned
memory is refused before its first step, the error saying what would fit; on the CPU without a budget, no check.
The rule against what a step really allocates: tests/bench/test_trainmem.py."""

import re

import pytest
import torch

from eaglet.services.trainer import memory
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.memory import MemoryRuleError, check_fits, estimate, longest_fitting
from eaglet.services.trainer.model import Drafter, DrafterConfig
from eaglet.services.trainer.train import train
from eaglet.shared.store import checkpoints_dir
from tests.trainer.fixtures import make_run

# Kimi-K2.5's drafter (eaglet's latent-attention rule: 56 heads x 128, 8 KV heads)
KIMI = DrafterConfig(hidden_size=7168, intermediate_size=18432, num_attention_heads=56, num_key_value_heads=8,
                     head_dim=128, vocab_size=163840, draft_vocab_size=32768)  # fmt: skip


def test_the_parameter_count_is_the_drafters():
    with torch.device("meta"):
        drafter = Drafter(KIMI, torch.empty(KIMI.vocab_size, KIMI.hidden_size))
    assert memory.trainable_params(KIMI) == sum(p.numel() for p in drafter.parameters())


def test_the_rule_grows_with_the_length_and_each_checkpointed_step_shrinks_it():
    cfg = TrainConfig()
    lengths = (8192, 16384, 32768, 65536)
    plain = [estimate(KIMI, T, cfg).total_gib for T in lengths]
    steps = [estimate(KIMI, T, TrainConfig(checkpoint_steps=7)).total_gib for T in lengths]
    assert plain == sorted(plain) and steps == sorted(steps)
    assert all(s < p for s, p in zip(steps[1:], plain[1:], strict=True))
    assert plain[-1] > 139 > 75 > steps[-2]  # 64 K tokens need checkpointed steps on an H200; 32 K fit 80 GB with them
    at_32k = [estimate(KIMI, 32768, TrainConfig(checkpoint_steps=k)).total_gib for k in range(8)]
    # each step recomputed saves memory until the backward pass's recomputation itself is the peak (the last one)
    assert at_32k == sorted(at_32k, reverse=True) and len(set(at_32k[:7])) == 7
    assert estimate(KIMI, 32768, TrainConfig(checkpoint_steps=99)).total_gib == at_32k[7]  # past ttt_steps: all
    assert at_32k[2] < 75  # two recomputed steps of seven fit 32 K in 75 GiB (an 80 GB GPU)
    assert estimate(KIMI, 8192, cfg, world=2).total_gib > plain[0]  # DDP's buckets
    rounds = estimate(KIMI, 8192, TrainConfig(onpolicy_from="previous"))  # an on-policy round's previous drafter
    assert rounds.forward_end["previous"] == rounds.backward["previous"] == 4 * memory.trainable_params(KIMI) + 8 * 8192
    assert rounds.total_gib > plain[0]


def test_a_row_too_long_is_refused_with_what_would_fit():
    with pytest.raises(MemoryRuleError, match=r"--checkpoint-steps 1 fits them in about [\d.]+ GiB \(1 of the 7") as e:
        check_fits(KIMI, TrainConfig(max_len=65536), 65536, budget=139.0)
    assert "65,536 tokens" in str(e.value) and "rows of up to" in str(e.value)
    assert check_fits(KIMI, TrainConfig(checkpoint_steps=1), 65536, budget=139.0).total_gib < 139.0
    with pytest.raises(MemoryRuleError, match=r"--checkpoint-steps (\d) fits them") as e:  # more than the one given
        check_fits(KIMI, TrainConfig(checkpoint_steps=1), 65536, budget=80.0)
    fewest = int(re.search(r"--checkpoint-steps (\d)", str(e.value))[1])
    assert estimate(KIMI, 65536, TrainConfig(checkpoint_steps=fewest)).total_gib <= 80.0
    assert estimate(KIMI, 65536, TrainConfig(checkpoint_steps=fewest - 1)).total_gib > 80.0 and fewest > 2
    longest = longest_fitting(KIMI, TrainConfig(), 65536, 139.0)
    assert 0 < longest < 65536 and estimate(KIMI, longest, TrainConfig()).total_gib <= 139.0
    assert estimate(KIMI, longest + 256, TrainConfig()).total_gib > 139.0
    with pytest.raises(MemoryRuleError, match="not even short rows fit"):
        check_fits(KIMI, TrainConfig(), 2048, budget=10.0)  # the weights and the optimizer alone: about 20 GiB
    assert check_fits(KIMI, TrainConfig(checkpoint_steps=7), 65536, budget=139.0).total_gib < 139.0


def test_the_budget_is_the_given_one_and_none_on_the_cpu():
    assert memory.budget_gib(TrainConfig(), torch.device("cpu")) is None
    assert memory.budget_gib(TrainConfig(memory_gib=80), torch.device("cpu")) == 80
    with pytest.raises(ValueError, match="memory_gib"):
        TrainConfig(memory_gib=-1)


def test_the_trainer_refuses_before_its_first_step(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "m1")
    cfg = TrainConfig(ttt_steps=2, draft_vocab_size=256, tokens_per_batch=160, loader_workers=0, max_steps=2,
                      memory_gib=0.01)  # fmt: skip
    with pytest.raises(MemoryRuleError, match="rows of up to 160 tokens"):
        train(redis=redis, run_id="m1", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    assert not (checkpoints_dir(tmp_path, "m1") / "metrics.jsonl").exists()  # no step ran
