"""Fixtures of the regeneration tests: real Redis, the reference server on the tiny Llama, real worker processes."""

import json
import time
from pathlib import Path

import pytest
import torch
from redis import Redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglet.services.ingest.runs import create_run
from eaglet.services.regenerate.jobs import plan_run
from eaglet.shared.records import Stage
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runstate import RunState
from tests.reliability.helpers import env_of, settings, wait_for  # noqa: F401


def write_jsonl(path: Path, lines: list) -> Path:
    """Objects as JSON lines; a str is written as it is (a malformed line on purpose)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def start_run(redis: Redis, redis_url: str, run_id: str, source: Path, **regenerate) -> RunState:
    """What ``eaglet regenerate`` does: the run, its batches queued for the workers."""
    state = create_run(redis, run_id, source, RunOptions(regenerate=RegenerateOptions(**regenerate)))
    plan_run(redis, Redis.from_url(redis_url), run_id)
    return state


def wait_regenerated(state: RunState, timeout: float) -> Stage:
    wait_for("the regeneration to end", lambda: state.stage() != Stage.regenerating, timeout, 0.2)
    return state.stage()


def start_workers(stack, worker_settings, names: list[str]) -> None:
    for name in names:
        stack.start(name, "eaglet.services.extractor.worker", "--name", name, env=env_of(worker_settings))


class Greedy:
    """The target's own greedy answers, from transformers in this process: what regeneration must give."""

    def __init__(self, model_dir: Path):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def answer(self, messages: list[dict], max_new_tokens: int) -> str:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        new = out[0, len(ids) :].tolist()
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode(new[: new.index(eos) + 1] if eos in new else new, skip_special_tokens=True)


@pytest.fixture(scope="session")
def greedy(reference_server) -> Greedy:
    return Greedy(reference_server.model_dir)


def elapsed(since: float) -> str:
    return f"{time.monotonic() - since:.1f}s"
