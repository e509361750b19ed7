"""The reference inference server: SGLang's HTTP contract (``/generate``, ``/health``,
``/get_model_info``, and OpenAI's ``/v1/chat/completions`` as SGLang serves it) over the reference engine,
writing ``<dump_dir>/<rid>.safetensors`` for every eaglet request exactly as SGLang with eaglet's plugin does.
"""

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, HTTPException
from jinja2 import TemplateError
from pydantic import BaseModel, Field

from eaglet.services.inference.batcher import Batcher
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.shared.dumpfile import DumpEncoding
from eaglet.shared.ids import UnsafeName, check_rid

log = logging.getLogger(__name__)
DEFAULT_CHAT_MAX_TOKENS = 256


class SamplingParams(BaseModel):
    max_new_tokens: int = Field(128, ge=0, le=32768)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    custom_params: dict | None = None
    """As SGLang's: read only for ``eaglet_dump``, ``eaglet_topk`` and ``eaglet_aux`` (what a dump holds,
    shared/dumpfile.py)."""


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    """OpenAI's chat completion request, the fields a regeneration sends; the rest are ignored, as servers do."""

    model: str = "default"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False


class GenerateRequest(BaseModel):
    input_ids: list[int] | None = None
    text: str | None = None
    rid: str | None = None
    sampling_params: SamplingParams = SamplingParams()


def create_app(engine: ReferenceEngine, batcher: Batcher) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.dump_dir.mkdir(parents=True, exist_ok=True)
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="eaglet reference inference server", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {
            "model_path": str(engine.model_dir),
            "is_generation": True,
            "hidden_size": engine.hidden_size,
            "num_layers": engine.num_layers,
            "vocab_size": engine.vocab_size,
            "aux_layer_ids": engine.aux_layer_ids,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "engine": "reference",
        }

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> dict:
        ids = _prompt_ids(engine, req)
        if req.rid is not None:
            try:
                check_rid(req.rid)
            except UnsafeName as e:
                raise HTTPException(400, str(e)) from e
        params = req.sampling_params
        started = time.perf_counter()
        if params.max_new_tokens <= 1:
            try:
                encoding = DumpEncoding.from_params(params.custom_params, engine.vocab_size)
            except ValueError as e:
                raise HTTPException(400, str(e)) from e
            prefill = await batcher.prefill(ids, req.rid, encoding)
            output_ids = [prefill.next_token] if params.max_new_tokens == 1 else []
        else:
            output_ids = await batcher.generate(ids, req.rid, params.max_new_tokens, params.temperature, params.top_p)
        stopped = bool(output_ids) and output_ids[-1] == engine.tokenizer.eos_token_id
        return {
            "text": engine.tokenizer.decode(output_ids, skip_special_tokens=True),
            "output_ids": output_ids,
            "meta_info": {
                "id": req.rid,
                "prompt_tokens": len(ids),
                "completion_tokens": len(output_ids),
                "finish_reason": {"type": "stop" if stopped else "length"},
                "e2e_latency": time.perf_counter() - started,
            },
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest) -> dict:
        """OpenAI's chat completions: the target's chat template (with the generation prompt), then the same batched
        generation as ``/generate``; greedy at temperature 0."""
        if req.stream:
            raise HTTPException(400, "stream is not supported; send stream: false")
        messages = [m.model_dump() for m in req.messages]
        try:
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError, TypeError) as e:
            raise HTTPException(400, f"chat template cannot render these messages: {e}") from e
        ids = engine.tokenizer(ids, add_special_tokens=False).input_ids
        max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        if len(ids) + max_tokens > engine.max_positions:
            raise HTTPException(400, f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                                f"context of {engine.max_positions}")  # fmt: skip
        output_ids = await batcher.generate(ids, None, max_tokens, req.temperature, req.top_p)
        stopped = bool(output_ids) and output_ids[-1] == engine.tokenizer.eos_token_id
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": engine.tokenizer.decode(output_ids, skip_special_tokens=True),
                    },
                    "finish_reason": "stop" if stopped else "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(output_ids),
                "total_tokens": len(ids) + len(output_ids),
            },
        }

    return app


def _prompt_ids(engine: ReferenceEngine, req: GenerateRequest) -> list[int]:
    if (req.input_ids is None) == (req.text is None):
        raise HTTPException(400, "give exactly one of input_ids and text")
    ids = req.input_ids if req.input_ids is not None else engine.tokenizer(req.text, add_special_tokens=False).input_ids
    if not ids:
        raise HTTPException(400, "empty prompt")
    if min(ids) < 0 or max(ids) >= engine.vocab_size:
        raise HTTPException(400, f"input_ids outside the vocabulary of {engine.vocab_size}")
    if len(ids) + req.sampling_params.max_new_tokens > engine.max_positions:
        raise HTTPException(400, f"{len(ids)} prompt tokens exceed the model's context of {engine.max_positions}")
    return ids
