"""On-policy rounds (``TrainConfig.onpolicy_from``): the previous drafter's chains replayed on stored states are the
chains speculative decoding drafts, the loss weights fall where they are first rejected, and a round trains end to
end from the previous drafter."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglet.services.trainer import checkpoint as ckpt
from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.model import Drafter, DrafterConfig, KVCache
from eaglet.services.trainer.onpolicy import ChainReplay, OnPolicyError
from eaglet.services.trainer.speculative import aux_states, greedy_generate, speculative_generate
from eaglet.services.trainer.train import epoch_batches, make_objective, start, train
from eaglet.shared.store import drafter_dir
from eaglet.shared.targettensors import load_target_tensors
from tests.trainer.fixtures import make_run, token_sequences
from tests.trainer.test_train import small

STEPS = 4


def tiny_drafter(seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=50, draft_vocab_size=30)  # fmt: skip
    d = Drafter(cfg, torch.randn(50, 16))
    d.set_vocab(torch.randperm(50)[:30].sort().values)  # a draft vocabulary of its own: drafts go through d2t
    return d.eval()


@torch.no_grad()
def text_it_drafts(drafter: Drafter, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [1, T], aux states [1, T, 3H]) whose tokens are mostly the drafter's own first drafts (every
    fourth one another token): chains that pass step 0 and chains that do not."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, drafter.cfg.num_aux_hidden_states * drafter.cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, drafter.cfg.vocab_size, (1, T), generator=g)
    for t in range(T - 2):
        out = next(drafter.unroll(ids[:, : t + 2], aux[:, : t + 2], 1))
        if t % 4 != 3:
            ids[0, t + 2] = drafter.draft_to_target(drafter.logits(out[0, t]).argmax())
    return ids, aux


@torch.no_grad()
def decoded_first_miss(drafter: Drafter, ids: torch.Tensor, aux: torch.Tensor, t: int, steps: int) -> int:
    """The first draft of the chain from position t that is not the text's next token, drafted as speculative
    decoding drafts it (``speculative.speculative_generate``: the cache filled with the prefix, then each draft fed
    back); ``steps`` when all are."""
    cache = KVCache()
    h = drafter.decode(ids[:, 1 : t + 2], drafter.fuse(aux[:, : t + 1]), 0, cache)[:, -1:]
    for j in range(steps):
        d = drafter.draft_to_target(drafter.logits(h)[0, -1].argmax())
        if t + 2 + j >= ids.shape[1] or int(d) != int(ids[0, t + 2 + j]):
            return j
        h = drafter.decode(d.view(1, 1), h, len(cache), cache)
    return steps


def test_the_replay_rejects_where_speculative_decoding_does():
    drafter = tiny_drafter()
    replay = ChainReplay(drafter, 2.0, "math", chunk=7)
    ids, aux = text_it_drafts(drafter, 24, seed=1)
    first = replay.first_misses(ids, aux, STEPS).tolist()
    assert first[:-1] == [decoded_first_miss(drafter, ids, aux, t, STEPS) for t in range(23)]
    assert first[-1] == 0  # the chain from the last token drafts past the text
    assert {0, 1} <= set(first)  # chains rejected at the first draft and later


def test_a_packed_rows_chains_stay_in_their_document():
    drafter = tiny_drafter()
    replay = ChainReplay(drafter, 2.0, "math", chunk=0)
    a, b = text_it_drafts(drafter, 14, seed=2), text_it_drafts(drafter, 11, seed=3)
    ids, aux = torch.cat([a[0], b[0]], 1), torch.cat([a[1], b[1]], 1)
    positions = torch.cat([torch.arange(14), torch.arange(11)])[None]
    documents = torch.tensor([0] * 14 + [1] * 11)[None]
    packed = replay.first_misses(ids, aux, STEPS, positions, documents)
    alone = torch.cat([replay.first_misses(*a, STEPS), replay.first_misses(*b, STEPS)])
    assert torch.equal(packed, alone)


def test_the_loss_weights_fall_where_the_chains_are_first_rejected(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "ow", n=2)
    previous = make_objective(tiny_model_dir, torch.arange(512), small(seed=1), Dist(), [1, 2, 3], None).drafter
    ids, aux = text_it_drafts(previous.eval(), 16, seed=4)
    mask = torch.ones(1, 16, dtype=torch.bool)
    hidden = torch.randn(1, 16, previous.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    losses = {}
    for weight in (1.0, 5.0):
        objective = make_objective(tiny_model_dir, torch.arange(512), small(onpolicy_weight=weight), Dist(),
                                   [1, 2, 3], None, previous)  # fmt: skip
        replay = objective.replay
        first = replay.first_misses(ids, aux, 3)
        assert {0, 1} <= set(first.tolist())  # the weights move each step's mean between its positions
        rows = [torch.arange(14 - i) for i in range(3)]  # every step's rows of an all-answer sample
        weights = replay.weights(first, rows)
        for i, (r, w) in enumerate(zip(rows, weights, strict=True)):
            assert torch.equal(w == weight, (first[r] == i) | (weight == 1.0))
        losses[weight] = objective(ids, mask, hidden, aux)[0]
        objective.eval()
        losses[weight, "eval"] = objective(ids, mask, hidden, aux)[0]
    plain = make_objective(tiny_model_dir, torch.arange(512), small(), Dist(), [1, 2, 3], None)
    plain.drafter.load_state_dict(previous.state_dict())
    assert torch.allclose(losses[1.0], plain(ids, mask, hidden, aux)[0])  # weight 1: the plain loss
    assert not torch.allclose(losses[5.0], losses[1.0])
    plain.eval()
    assert torch.allclose(losses[5.0, "eval"], plain(ids, mask, hidden, aux)[0])  # held-out figures unweighted


@torch.no_grad()
def greedy_texts(model_dir, n: int) -> list[list[int]]:
    """Prompts of a few tokens each followed by the target's greedy answer: the text a regenerated run holds, where
    a chain rejected against the sample's tokens is one the target rejects."""
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = token_sequences(n, 6, seed=5)
    return [p + greedy_generate(target, torch.tensor([p]), 30, eos=set()) for p in prompts]


def test_a_round_starts_from_the_previous_drafter_and_trains(redis, tmp_path, tiny_model_dir):
    texts = greedy_texts(tiny_model_dir, 12)
    make_run(redis, tmp_path, tiny_model_dir, "op", n=12, texts=texts)
    train(redis=redis, run_id="op", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=small(max_steps=2), env=Dist())
    previous = drafter_dir(tmp_path, "op")
    cfg = small(max_steps=3, log_every=1, onpolicy_from=str(previous), onpolicy_weight=4.0)
    s = start(None, "op", tmp_path, tiny_model_dir, cfg, Dist(), tmp_path / "round")
    s.rep.close()
    replayed = s.objective.replay.drafter
    assert all(torch.equal(v, replayed.state_dict()[k]) for k, v in s.objective.drafter.state_dict().items())
    assert not any(p.requires_grad for p in replayed.parameters())
    assert replayed.embed_tokens is s.objective.drafter.embed_tokens  # one copy of the target's embedding
    batch = next(
        iter(
            data.loader(
                data.BatchSet(epoch_batches(s.train_items, s.cfg, s.env, 0), tmp_path, "op", torch.float32, 8192, 3),
                0,
                0,
            )
        )
    )
    first = s.objective.replay.first_misses(batch["input_ids"], batch["aux_hidden_states"], 3,
                                            batch["position_ids"], batch["document_ids"])  # fmt: skip
    assert {0, 1, 2, 3} <= set(first.tolist())  # chains rejected at each draft, and accepted to the end
    # on the target's greedy text the sample's next token is the target's top token: a chain rejected against the
    # sample is one the target rejects
    head = load_target_tensors(tiny_model_dir)["lm_head"].float()
    tops = (batch["hidden_states"][0] @ head.T).argmax(-1)
    docs = batch["document_ids"][0]
    answers = (batch["position_ids"][0, :-1] >= 5) & (docs[:-1] == docs[1:])  # after each 6-token prompt
    assert torch.equal(tops[:-1][answers], batch["input_ids"][0, 1:][answers])
    first = {}
    for weight in (1.0, 4.0):
        out = tmp_path / f"round-{weight}"
        final = train(redis=None, run_id="op", data_dir=tmp_path, target_dir=tiny_model_dir,
                      cfg=small(max_steps=3, log_every=1, onpolicy_from=str(previous), onpolicy_weight=weight),
                      env=Dist(), out_dir=out)  # fmt: skip
        rows = [json.loads(x) for x in (out / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3] == [1, 2, final["step"]]
        assert (out / "drafter" / "model.safetensors").is_file()
        first[weight] = rows[0]["loss"]
    assert first[4.0] != pytest.approx(first[1.0], rel=1e-4)  # the same start and batch: only the weights differ


@torch.no_grad()
def replayed_and_accepted(model_dir, folder) -> list[tuple[int, int]]:
    """For each round of speculative decoding (``speculative_generate``, the drafter in ``folder``, chains of STEPS)
    of a few prompts whose drafts all lie within the decoded text: (the replay's first miss at the round's position,
    on the target's states of the decoded text; the drafts the round accepted)."""
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = ckpt.declared_layers(folder)
    drafter = ckpt.load_drafter(folder, target.get_input_embeddings().weight.detach().float()).eval()
    replay = ChainReplay(drafter, 2.0, "math", chunk=0)
    pairs = []
    for prompt in token_sequences(6, 6, seed=5):  # the training texts' prompts: chains it has learned, in part
        out, stats = speculative_generate(target, drafter, torch.tensor([prompt]), 40, STEPS, layers, eos=set())
        text = torch.tensor([prompt + out])
        first = replay.first_misses(text, aux_states(target(text, output_hidden_states=True).hidden_states, layers),
                                    STEPS)  # fmt: skip
        t = len(prompt) - 1  # a round drafts from the drafter's last cached position: the chain from t
        for accepted in stats.accepted:
            if t + 2 + STEPS < text.shape[1]:
                pairs.append((int(first[t]), accepted))
            t += 1 + accepted
    return pairs


def test_on_the_targets_greedy_text_the_replay_is_what_speculative_decoding_accepted(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "od", n=12, texts=greedy_texts(tiny_model_dir, 12))
    train(redis=redis, run_id="od", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=small(max_steps=2), env=Dist())
    pairs = replayed_and_accepted(tiny_model_dir, drafter_dir(tmp_path, "od"))
    assert len(pairs) > 20 and [replayed for replayed, _ in pairs] == [accepted for _, accepted in pairs]
    assert len({a for _, a in pairs}) > 1  # rounds that accepted few drafts and rounds that accepted more


def test_a_previous_drafter_that_does_not_fit_is_refused(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "ob", n=12)
    with pytest.raises(OnPolicyError, match="--onpolicy-from: .*no such drafter folder"):
        start(None, "ob", tmp_path, tiny_model_dir, small(onpolicy_from=str(tmp_path / "nothing")), Dist())
    train(redis=redis, run_id="ob", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=small(max_steps=1), env=Dist())
    folder = drafter_dir(tmp_path, "ob")
    written = (folder / "config.json").read_text()
    config = json.loads(written)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(OnPolicyError, match=r"reads the states of layers \[1, 2, 3\] but the run stored"):
        start(None, "ob", tmp_path, tiny_model_dir, small(onpolicy_from=str(folder)), Dist(), tmp_path / "r")
    (folder / "config.json").write_text(written)
    # the run's own checkpoints are of its first training: a round there would resume that one instead
    with pytest.raises(ValueError, match="are of a fresh drafter's training, resumed as an on-policy round from"):
        start(None, "ob", tmp_path, tiny_model_dir, small(onpolicy_from=str(folder)), Dist())
    with pytest.raises(ValueError, match="onpolicy_weight"):
        TrainConfig(onpolicy_weight=0)
