"""The reference server over real HTTP: its dumps are the model's own states, each rid its own rows."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglet.shared.dumpfile import dump_path, read_dump, validate_dump
from eaglet.shared.layers import default_layer_ids


def direct_states(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the dump must hold, from a plain transformers forward of one prompt."""
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    layers = default_layer_ids(model.config.num_hidden_layers)
    return out.last_hidden_state[0], torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)


def prefill(url: str, ids: list[int], rid: str) -> httpx.Response:
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


@pytest.fixture(scope="module")
def tiny_model(reference_server):
    return AutoModelForCausalLM.from_pretrained(reference_server.model_dir, dtype=torch.float32).eval()


def test_dump_equals_a_direct_forward(reference_server, tiny_model):
    ids = list(range(100, 137))
    response = prefill(reference_server.url, ids, "eaglet:t:one:1")
    assert response.status_code == 200 and response.json()["meta_info"]["prompt_tokens"] == len(ids)
    dump = read_dump(dump_path(reference_server.dump_dir, "eaglet:t:one:1"))
    validate_dump(dump, rid="eaglet:t:one:1", num_tokens=len(ids), hidden_size=tiny_model.config.hidden_size)
    final, aux = direct_states(tiny_model, ids)
    torch.testing.assert_close(dump.hidden_states, final, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dump.aux_hidden_states, aux, atol=1e-5, rtol=1e-4)
    assert dump.aux_layer_ids == default_layer_ids(tiny_model.config.num_hidden_layers)
    with torch.inference_mode():
        expected_next = int(tiny_model.lm_head(final[-1]).argmax())
    assert response.json()["output_ids"] == [expected_next]


def test_concurrent_requests_each_get_their_own_rows(reference_server, tiny_model):
    prompts = {f"eaglet:t:c{i}:1": [(7 * i + j) % 900 + 10 for j in range(5 + 9 * i)] for i in range(16)}
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda item: prefill(reference_server.url, item[1], item[0]), prompts.items()))
    assert all(r.status_code == 200 for r in responses)
    for rid, ids in prompts.items():
        dump = read_dump(dump_path(reference_server.dump_dir, rid))
        final, aux = direct_states(tiny_model, ids)
        assert dump.hidden_states.shape[0] == len(ids)
        torch.testing.assert_close(dump.hidden_states, final, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(dump.aux_hidden_states, aux, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("rid", ["../../escape", "a/b", "eaglet:x/../y:1", "x\x00y"])
def test_unsafe_rids_are_refused(reference_server, rid):
    response = prefill(reference_server.url, [1, 2, 3], rid)
    assert response.status_code == 400 and "safe file name" in response.text
    assert not any("escape" in p.name for p in reference_server.dump_dir.parent.rglob("*"))


def test_requests_without_eaglet_rid_write_no_dump(reference_server):
    before = set(reference_server.dump_dir.iterdir())
    assert prefill(reference_server.url, [5, 6, 7], "warmup-1").status_code == 200
    assert set(reference_server.dump_dir.iterdir()) == before


def test_generation_equals_greedy_decoding(reference_server, tiny_model):
    ids = list(range(300, 320))
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    out = httpx.post(f"{reference_server.url}/generate", json=body, timeout=120).json()
    expected = tiny_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    eos = tiny_model.config.eos_token_id
    if eos in expected:
        expected = expected[: expected.index(eos) + 1]
    assert out["output_ids"] == expected and out["meta_info"]["completion_tokens"] == len(expected)


def test_bad_prompts_are_refused_with_a_reason(reference_server):
    url = f"{reference_server.url}/generate"
    assert "vocabulary" in httpx.post(url, json={"input_ids": [10**9]}).text
    assert "exactly one" in httpx.post(url, json={}).text
    assert "context" in httpx.post(url, json={"input_ids": [1] * 3000, "sampling_params": {"max_new_tokens": 1}}).text


def test_a_dump_that_cannot_be_written_fails_only_its_own_request(reference_server):
    """Dumps are written while the next batch runs; one that fails (here a folder stands where its file goes)
    answers its request with an error, the rest of its batch are answered with their dumps."""
    blocked = "eaglet:t:blocked:1"
    dump_path(reference_server.dump_dir, blocked).mkdir()
    rids = [blocked] + [f"eaglet:t:beside{i}:1" for i in range(7)]
    with ThreadPoolExecutor(len(rids)) as pool:
        responses = dict(zip(rids, pool.map(lambda rid: prefill(reference_server.url, [11, 12, 13, 14], rid), rids),
                             strict=True))  # fmt: skip
    assert responses[blocked].status_code == 500
    for rid in rids[1:]:
        assert responses[rid].status_code == 200, responses[rid].text
        assert read_dump(dump_path(reference_server.dump_dir, rid)).hidden_states.shape[0] == 4
    assert prefill(reference_server.url, [1, 2], "eaglet:t:after:1").status_code == 200  # the server goes on


def test_default_layout_request_gets_the_topk_and_4bit_aux_states_of_the_same_forward(reference_server, tiny_model):
    """The default layout's dump: no final state; the aux states as the workers' encoder makes them of a full-width
    dump of the same prompt, and the top-k over the model's head."""
    from eaglet.shared.fp4 import encode_fp4
    from eaglet.shared.store import FP4_AUX_TENSORS
    from eaglet.shared.topk import encode_topk

    ids = list(range(200, 241))
    sp = {"max_new_tokens": 1, "temperature": 0}
    url, dumps = reference_server.url, reference_server.dump_dir
    assert prefill(url, ids, "eaglet:t:wide:1").status_code == 200
    asked = {**sp, "custom_params": {"eaglet_topk": 8, "eaglet_aux": "e2m1_b32"}}
    body = {"input_ids": ids, "rid": "eaglet:t:default:1", "sampling_params": asked}
    assert httpx.post(f"{url}/generate", json=body, timeout=120).status_code == 200
    wide, dump = (read_dump(dump_path(dumps, rid)) for rid in ("eaglet:t:wide:1", "eaglet:t:default:1"))
    H, V = tiny_model.config.hidden_size, tiny_model.config.vocab_size
    validate_dump(
        dump, rid="eaglet:t:default:1", num_tokens=len(ids), hidden_size=H, topk=8, vocab_size=V, aux_fp4=True
    )
    assert dump.hidden_states is None and dump.aux_hidden_states is None
    for name, want in zip(FP4_AUX_TENSORS, encode_fp4(wide.aux_hidden_states), strict=True):
        assert torch.equal(dump.aux_fp4[name], want)
    want_ids, want_logp = encode_topk(wide.hidden_states, tiny_model.lm_head.weight.detach(), 8)
    assert torch.equal(dump.topk["topk_ids"], want_ids)
    torch.testing.assert_close(dump.topk["topk_logp"], want_logp, atol=2e-3, rtol=0)
