"""An inference server that breaks its dumps on purpose: SGLang's HTTP contract over the real reference
engine (real hidden states), served by uvicorn on loopback from a thread of the test process.

``plan(sample_id, attempt)`` names the fault of one request, or None for a good dump. Every fault writes
a real file where the worker looks for it (or lies in its answer), as a broken server would.
"""

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from safetensors.torch import save_file

from eaglet.services.inference.engine import ReferenceEngine
from eaglet.shared.dumpfile import dump_path, write_dump

FAULTS = {
    "truncated": "unreadable",  # a partial file: the first half of a good dump
    "garbage": "unreadable",  # not a safetensors file at all
    "missing_tensor": "unreadable",  # no aux_hidden_states
    "short": "hidden_states shape",  # one token fewer, consistent metadata (a radix-cache hit)
    "nan": "NaN/Inf",
    "inf": "NaN/Inf",
    "int_dtype": "expected one floating dtype",
    "mixed_dtype": "expected one floating dtype",
    "wide": "hidden_states shape",  # hidden size H+1
    "aux_2h": "aux_hidden_states shape",  # two aux layers instead of three
    "wrong_rid": "metadata rid",  # another request's dump under this name
    "wrong_count": "metadata num_tokens",
    "prompt_tokens": "prompt tokens",  # the server says it saw fewer tokens than were sent
    "no_dump": "no dump for rid",
}


class GenerateRequest(BaseModel):
    input_ids: list[int]
    rid: str
    sampling_params: dict = {}


class FaultyServer:
    def __init__(self, engine: ReferenceEngine, dump_dir: Path, plan: Callable[[str, int], str | None]):
        self.engine, self.dump_dir, self.plan = engine, Path(dump_dir), plan
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.injected: dict[str, int] = {}
        self.hanging = threading.Event()  # set while a request hangs (fault "hang")
        self.lock = asyncio.Lock()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        def health() -> dict:
            return {"status": "ok"}

        @app.post("/generate")
        async def generate(req: GenerateRequest) -> dict:
            _, _, sample_id, attempt = req.rid.split(":")
            fault = self.plan(sample_id, int(attempt))
            if fault == "hang":
                self.hanging.set()
                await asyncio.sleep(3600)  # a request that kills its worker: the test kills it while it waits
            async with self.lock:  # one forward at a time, as the engine expects
                prefill = await asyncio.to_thread(self.engine.prefill, [req.input_ids])
            if fault is not None:
                self.injected[fault] = self.injected.get(fault, 0) + 1
            tokens = len(req.input_ids)
            self._write(req.rid, prefill[0].states["hidden_states"], prefill[0].states["aux_hidden_states"], fault)
            told = tokens - 1 if fault == "prompt_tokens" else tokens
            return {
                "text": "",
                "output_ids": [prefill[0].next_token],
                "meta_info": {"id": req.rid, "prompt_tokens": told},
            }

        return app

    def _write(self, rid: str, h: torch.Tensor, aux: torch.Tensor, fault: str | None) -> None:
        path = dump_path(self.dump_dir, rid)
        layers, model = self.engine.aux_layer_ids, "faulty"
        if fault in (None, "prompt_tokens"):
            write_dump(self.dump_dir, rid, h, aux, aux_layer_ids=layers, model=model)
        elif fault == "no_dump":
            return
        elif fault in ("truncated", "garbage"):
            write_dump(self.dump_dir, rid, h, aux, aux_layer_ids=layers, model=model)
            blob = path.read_bytes()
            path.write_bytes(blob[: len(blob) // 2] if fault == "truncated" else bytes(range(256)) * 8)
        elif fault == "short":
            write_dump(self.dump_dir, rid, h[:-1], aux[:-1], aux_layer_ids=layers, model=model)
        elif fault in ("nan", "inf"):
            h = h.clone()
            h[len(h) // 2, 3] = float("nan") if fault == "nan" else float("inf")
            write_dump(self.dump_dir, rid, h, aux, aux_layer_ids=layers, model=model)
        elif fault == "int_dtype":
            write_dump(self.dump_dir, rid, h.to(torch.int32), aux.to(torch.int32), aux_layer_ids=layers, model=model)
        elif fault == "mixed_dtype":
            write_dump(self.dump_dir, rid, h.to(torch.float16), aux, aux_layer_ids=layers, model=model)
        elif fault == "wide":
            wide = torch.cat([h, h[:, :1]], dim=1)
            write_dump(self.dump_dir, rid, wide, aux, aux_layer_ids=layers, model=model)
        elif fault == "aux_2h":
            write_dump(self.dump_dir, rid, h, aux[:, : 2 * h.shape[1]], aux_layer_ids=layers, model=model)
        elif fault == "wrong_rid":
            other = rid.rsplit(":", 1)[0] + ":999"
            write_dump(self.dump_dir, other, h, aux, aux_layer_ids=layers, model=model)
            dump_path(self.dump_dir, other).rename(path)
        elif fault == "wrong_count":
            meta = {"rid": rid, "num_tokens": str(len(h) + 5), "aux_layer_ids": json.dumps(layers), "model": model}
            save_file({"hidden_states": h, "aux_hidden_states": aux}, str(path), metadata=meta)
        elif fault == "missing_tensor":
            save_file({"hidden_states": h.contiguous()}, str(path), metadata={"rid": rid, "num_tokens": str(len(h))})
        else:
            raise ValueError(f"unknown fault {fault!r}")

    def serve(self, port: int) -> Callable[[], None]:
        server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("faulty server did not start")
            time.sleep(0.02)

        def stop() -> None:
            server.should_exit = True
            server.force_exit = True  # hanging requests would hold the shutdown
            thread.join(10)

        return stop
