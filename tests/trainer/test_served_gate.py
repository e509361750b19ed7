"""The served-acceptance gate on the CPU: the accept length the held-out accuracy predicts, written beside the
served one by ``eaglet eval``, and the run's alert when a drafter is served wrong (a vocabulary map shuffled on
purpose after training, the drafter otherwise intact)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglet.services.trainer import evaluate
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.acceptance import predicted_accept_length, served_shortfall
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.runstate import RunState
from eaglet.shared.status import read_status
from eaglet.shared.store import drafter_dir
from tests.trainer.fixtures import make_run

PROMPTS = [f"Tell me about topic number {i}." for i in range(24)]


def test_prediction_is_the_chain_of_accuracies():
    assert predicted_accept_length([0.5, 0.5, 0.5], 3) == 1 + 0.5 + 0.25 + 0.125
    assert predicted_accept_length([0.9, 0.8], 1) == 1.9  # a chain of one: the first position alone
    assert predicted_accept_length([0.9], 3) == 1.9  # positions never measured count as misses
    assert predicted_accept_length(None, 3) is None
    assert served_shortfall(1.5, 2.0) and not served_shortfall(1.7, 2.0) and not served_shortfall(1.0, None)


def served_alerts(redis, run_id: str) -> list[str]:
    [run] = [r for r in read_status(redis, config=StatusConfig()).runs if r.run_id == run_id]
    return [a.message for a in run.alerts if a.kind == "served_acceptance"]


def test_a_shuffled_vocabulary_map_raises_the_served_acceptance_alert(redis, tmp_path, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                     return_dict=False) for p in PROMPTS]  # fmt: skip
    # the target's own greedy text: a drafter learns it in seconds and the target accepts it
    texts = [target.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0].tolist() for ids in chats]
    make_run(redis, tmp_path, tiny_model_dir, "gate", texts=texts)
    cfg = TrainConfig(ttt_steps=3, draft_vocab_size=512, tokens_per_batch=400, max_steps=60, loader_workers=0, lr=3e-3,
                      heldout_fraction=0.25)  # fmt: skip
    train(redis=redis, run_id="gate", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    heldout = RunState(redis, "gate").train().heldout_acc
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:6]))

    def served() -> float:
        figures = evaluate.evaluate_run(redis=redis, run_id="gate", data_dir=tmp_path, target_dir=tiny_model_dir,
                                        prompts=prompts, k=3, max_new_tokens=24)  # fmt: skip
        stored = RunState(redis, "gate").eval()
        assert stored.engine == "reference" and stored.predicted_accept_length == round(
            predicted_accept_length(heldout, 3), 4
        )
        return figures["accept_length"]

    intact = served()
    assert intact >= 0.8 * predicted_accept_length(heldout, 3) and served_alerts(redis, "gate") == []
    # the map of draft ids to target ids permuted: still a valid map (distinct ids), so it loads; wrong tokens
    folder = drafter_dir(tmp_path, "gate")
    weights = load_file(folder / "model.safetensors")
    draft_ids = torch.arange(len(weights["d2t"]))
    target_ids = weights["d2t"] + draft_ids  # d2t holds offsets, SGLang's convention
    weights["d2t"] = target_ids[torch.randperm(len(draft_ids), generator=torch.Generator().manual_seed(0))] - draft_ids
    save_file(weights, folder / "model.safetensors")
    assert served() < intact
    [message] = served_alerts(redis, "gate")
    assert "vocabulary map" in message and "predicts" in message


def test_a_drafter_outside_the_run_is_predicted_from_the_figures_it_carries(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "carry", n=12)
    cfg = TrainConfig(ttt_steps=2, draft_vocab_size=256, tokens_per_batch=160, max_steps=4, loader_workers=0,
                      heldout_fraction=0.25)  # fmt: skip
    variant = tmp_path / "variants" / "one"
    final = train(redis=None, run_id="carry", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist(),
                  out_dir=variant)  # fmt: skip
    folder = variant / "drafter"
    carried = json.loads((folder / "heldout.json").read_text())
    assert carried["step"] == 4 and carried["heldout_acc"] == final["heldout_acc"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello."}) + "\n")
    run = dict(redis=redis, run_id="carry", data_dir=tmp_path, target_dir=tiny_model_dir, prompts=prompts, k=2,
               max_new_tokens=4, drafter_path=folder)  # fmt: skip
    evaluate.evaluate_run(**run)
    assert RunState(redis, "carry").eval().predicted_accept_length == round(
        predicted_accept_length(final["heldout_acc"], 2), 4
    )
    (folder / "heldout.json").write_text("{")
    with pytest.raises(ValueError, match=r"heldout\.json: not a drafter's held-out figures"):
        evaluate.evaluate_run(**run)
