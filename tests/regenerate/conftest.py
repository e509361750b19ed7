"""Fixtures of the regeneration tests: real Redis, the reference server on the tiny Llama, real worker processes."""

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request, Response
from redis import Redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglet.services.regenerate.jobs import plan_run
from eaglet.shared.records import Stage
from eaglet.shared.redisserver import free_port
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runs import create_run
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


class ChatProxy:
    """An OpenAI-compatible endpoint in front of the reference server, that answers 429 or 500 at random
    (``fault_rate``), as a loaded hosted API or a restarting SGLang does, and 401 without its ``key``."""

    def __init__(self, upstream: str, fault_rate: float = 0.0, key: str | None = None, seed: int = 3):
        self.upstream, self.fault_rate, self.key, self.rng = upstream, fault_rate, key, random.Random(seed)
        self.faults = {429: 0, 500: 0}
        self.client = httpx.AsyncClient(base_url=upstream, timeout=120)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
                return Response('{"error": {"message": "invalid key"}}', status_code=401)
            if self.rng.random() < self.fault_rate:
                code = self.rng.choice([429, 500])
                self.faults[code] += 1
                headers = {"retry-after": "0"} if code == 429 else {}
                return Response('{"error": {"message": "busy"}}', status_code=code, headers=headers)
            upstream = await self.client.post("/v1/chat/completions", content=await request.body(),
                                              headers={"content-type": "application/json"})  # fmt: skip
            return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

        return app

    def serve(self):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)

        def stop() -> None:
            server.should_exit = True
            thread.join(10)

        return f"http://127.0.0.1:{port}/v1", stop
