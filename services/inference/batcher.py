"""Groups concurrent requests into batches for the engine, one batch at a time.

Requests wait at most ``wait_s`` for company. A batch holds requests of one kind (a prefill, or a
generation with the same sampling settings) and at most ``max_batch_tokens`` padded tokens.
"""

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.inference.engine import Prefill, ReferenceEngine
from shared.dumpfile import write_dump
from shared.ids import is_eaglet_rid

log = logging.getLogger(__name__)


@dataclass
class Work:
    key: tuple  # ("prefill",) or ("generate", max_new_tokens, temperature, top_p)
    input_ids: list[int]
    rid: str | None
    future: asyncio.Future = field(repr=False)


class Batcher:
    def __init__(
        self,
        engine: ReferenceEngine,
        dump_dir: Path,
        *,
        dump: bool = True,
        max_batch_tokens: int = 16384,
        max_batch_size: int = 64,
        wait_s: float = 0.005,
    ):
        self.engine = engine
        self.dump_dir = Path(dump_dir)
        self.dump = dump
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.pending: deque[Work] = deque()
        self.arrived = asyncio.Event()
        self.prefill_tokens = 0
        self.batches = 0

    async def prefill(self, input_ids: list[int], rid: str | None) -> Prefill:
        return await self._submit(("prefill",), input_ids, rid)

    async def generate(
        self, input_ids: list[int], rid: str | None, max_new_tokens: int, temperature: float, top_p: float
    ):
        return await self._submit(("generate", max_new_tokens, temperature, top_p), input_ids, rid)

    async def _submit(self, key: tuple, input_ids: list[int], rid: str | None):
        future = asyncio.get_running_loop().create_future()
        self.pending.append(Work(key, input_ids, rid, future))
        self.arrived.set()
        return await future

    async def run(self) -> None:
        """The batching loop; runs for the server's lifetime."""
        while True:
            await self.arrived.wait()
            await asyncio.sleep(self.wait_s)  # let concurrent requests join
            batch = self._take_batch()
            if not self.pending:
                self.arrived.clear()
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self._execute, batch)
            except Exception as e:  # a failed batch fails its requests, never the server
                log.exception("batch of %d failed", len(batch))
                for work in batch:
                    if not work.future.done():
                        work.future.set_exception(e)
                continue
            for work, result in zip(batch, results, strict=True):
                if not work.future.done():
                    work.future.set_result(result)

    def _take_batch(self) -> list[Work]:
        if not self.pending:
            return []
        key, batch, skipped = self.pending[0].key, [], deque()
        longest = 0
        while self.pending and len(batch) < self.max_batch_size:
            work = self.pending.popleft()
            if work.future.cancelled():
                continue
            width = max(longest, len(work.input_ids))
            if work.key != key or (batch and width * (len(batch) + 1) > self.max_batch_tokens):
                skipped.append(work)
                continue
            longest = width
            batch.append(work)
        self.pending.extendleft(reversed(skipped))
        return batch

    def _execute(self, batch: list[Work]) -> list:
        prompts = [w.input_ids for w in batch]
        self.batches += 1
        if batch[0].key[0] == "generate":
            _, max_new_tokens, temperature, top_p = batch[0].key
            prefills = self.engine.prefill(prompts) if self._dumps(batch) else None
            outputs = self.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
            if prefills:
                self._write_dumps(batch, prefills)
            return outputs
        prefills = self.engine.prefill(prompts)
        self.prefill_tokens += sum(len(p) for p in prompts)
        self._write_dumps(batch, prefills)
        return prefills

    def _dumps(self, batch: list[Work]) -> bool:
        return self.dump and any(is_eaglet_rid(w.rid) for w in batch)

    def _write_dumps(self, batch: list[Work], prefills: list[Prefill]) -> None:
        # Written before the response leaves, so a worker finds the file as soon as it has its answer.
        if not self.dump:
            return
        for work, prefill in zip(batch, prefills, strict=True):
            if is_eaglet_rid(work.rid):
                write_dump(
                    self.dump_dir,
                    work.rid,
                    prefill.hidden_states,
                    prefill.aux_hidden_states,
                    aux_layer_ids=self.engine.aux_layer_ids,
                    model=str(self.engine.model_dir.name),
                )
