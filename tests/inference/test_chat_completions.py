"""The reference server's OpenAI chat completions over real HTTP: the chat template, then the model's own greedy
answer; OpenAI's answer shape and usage; bad requests refused with the reason."""

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def greedy(model, tokenizer, messages: list[dict], max_new_tokens: int) -> tuple[str, int, int]:
    """The answer a plain transformers greedy decode gives: text, prompt tokens, new tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids) :]
    new = out.tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(new, skip_special_tokens=True), len(ids), len(new)


@pytest.fixture(scope="module")
def target(reference_server):
    model = AutoModelForCausalLM.from_pretrained(reference_server.model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(reference_server.model_dir)


def chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_chat_completion_is_the_greedy_answer(reference_server, target):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "And another one?"},
    ]
    response = chat(reference_server.url, {"model": "x", "messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    text, prompt_tokens, new_tokens = greedy(*target, messages, 12)
    assert body["object"] == "chat.completion" and body["model"] == "x"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": new_tokens,
        "total_tokens": prompt_tokens + new_tokens,
    }


def test_sampled_answers_follow_the_settings(reference_server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 6, "temperature": 1.5}
    answers = {chat(reference_server.url, body).json()["choices"][0]["message"]["content"] for _ in range(4)}
    assert len(answers) > 1  # a random tiny model sampled at 1.5 does not repeat itself four times
    usage = chat(reference_server.url, body).json()["usage"]
    assert 1 <= usage["completion_tokens"] <= 6


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream is not supported"),
        ({"messages": [{"role": "user", "content": "x " * 3000}], "max_tokens": 10}, "exceed the model's context"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(reference_server, body, reason):
    response = chat(reference_server.url, body)
    assert response.status_code in (400, 422) and reason in response.text, response.text
