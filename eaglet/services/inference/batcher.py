"""Groups concurrent requests into batches for the engine, one batch at a time.

Requests wait at most ``wait_s`` for company. A batch holds requests of one kind (a prefill, or a
generation with the same sampling settings) and at most ``max_batch_tokens`` padded tokens.

Dumps are written by threads while the engine runs the next batch: at an 8B shape a batch of 16 K tokens
makes 512 MB of dumps, and writing them between batches left the GPU idle a quarter of the time. Each
request is answered once its own dump is written; at most ``dump_batches`` batches are being written at
once, so a slow dump dir holds the engine back instead of filling the host's memory.
"""

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.services.inference.engine import Prefill, ReferenceEngine
from eaglet.shared.dumpfile import write_dump
from eaglet.shared.ids import is_eaglet_rid

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
        dump_batches: int = 2,
        dump_threads: int = 8,
    ):
        self.engine = engine
        self.dump_dir = Path(dump_dir)
        self.dump = dump
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.writing = asyncio.Semaphore(dump_batches)
        # Own pools: dump writes queued in the default one would make the next batch wait behind them.
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.dump_writers = ThreadPoolExecutor(dump_threads, thread_name_prefix="dump")
        self.delivering: set[asyncio.Task] = set()
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
        loop = asyncio.get_running_loop()
        while True:
            await self.arrived.wait()
            await self.writing.acquire()  # before the batch is formed: requests arriving meanwhile join it
            await asyncio.sleep(self.wait_s)  # let concurrent requests join
            batch = self._take_batch()
            if not self.pending:
                self.arrived.clear()
            if not batch:
                self.writing.release()
                continue
            try:
                results, prefills = await loop.run_in_executor(self.engine_thread, self._execute, batch)
            except Exception as e:  # a failed batch fails its requests, never the server
                self.writing.release()
                log.exception("batch of %d failed", len(batch))
                for work in batch:
                    if not work.future.done():
                        work.future.set_exception(e)
                continue
            task = asyncio.create_task(self._deliver(batch, results, prefills))
            self.delivering.add(task)  # a reference, so the task is not collected before it ends
            task.add_done_callback(self.delivering.discard)

    async def _deliver(self, batch: list[Work], results: list, prefills: list[Prefill] | None) -> None:
        """Writes the batch's dumps in threads, answering each request as soon as its own dump is there."""

        async def one(work: Work, result, prefill: Prefill | None) -> None:
            try:
                if prefill is not None and self.dump and is_eaglet_rid(work.rid):
                    await asyncio.get_running_loop().run_in_executor(self.dump_writers, self._write_dump, work.rid,
                                                                     prefill)  # fmt: skip
            except Exception as e:  # a dump that cannot be written fails its request: the worker retries
                log.exception("dump for %s failed", work.rid)
                if not work.future.done():
                    work.future.set_exception(e)
                return
            if not work.future.done():
                work.future.set_result(result)

        try:
            await asyncio.gather(*(one(w, r, p) for w, r, p in zip(batch, results, prefills or [None] * len(batch),
                                                                     strict=True)))  # fmt: skip
        finally:
            self.writing.release()

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

    def _execute(self, batch: list[Work]) -> tuple[list, list[Prefill] | None]:
        """Runs a batch on the engine; returns each request's result and, where dumps are due, its states."""
        prompts = [w.input_ids for w in batch]
        self.batches += 1
        if batch[0].key[0] == "generate":
            _, max_new_tokens, temperature, top_p = batch[0].key
            prefills = self.engine.prefill(prompts) if self._dumps(batch) else None
            outputs = self.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
            return outputs, prefills
        prefills = self.engine.prefill(prompts)
        self.prefill_tokens += sum(len(p) for p in prompts)
        return prefills, prefills

    def _dumps(self, batch: list[Work]) -> bool:
        return self.dump and any(is_eaglet_rid(w.rid) for w in batch)

    def _write_dump(self, rid: str, prefill: Prefill) -> None:
        write_dump(
            self.dump_dir,
            rid,
            prefill.hidden_states,
            prefill.aux_hidden_states,
            aux_layer_ids=self.engine.aux_layer_ids,
            model=str(self.engine.model_dir.name),
        )
