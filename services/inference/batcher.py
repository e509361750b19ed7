"""Groups concurrent requests into batches for the engine, one batch at a time.

Requests wait at most ``wait_s`` for company. A batch holds requests of one kind (a prefill, or a
generation with the same sampling settings) and at most ``max_batch_tokens`` padded tokens.

Dumps are written by the writer's threads while the engine runs the next batch: at an 8B shape a batch of
16 K tokens makes 512 MB of dumps, and writing them between batches left the GPU idle a quarter of the time.
Each request is answered once its own dump is written. The writer holds at most its cap of bytes
(shared/dumpwriter.py): when full, the engine thread waits before the next batch, so a slow dump dir
holds the engine back instead of filling the host's memory.
"""

import asyncio
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from eaglet.services.inference.engine import Prefill, ReferenceEngine
from eaglet.shared.dumpfile import DumpEncoding, write_dump_parts
from eaglet.shared.dumpwriter import DumpWriter
from eaglet.shared.ids import is_eaglet_rid

log = logging.getLogger(__name__)


@dataclass
class Work:
    key: tuple  # ("prefill",) or ("generate", max_new_tokens, temperature, top_p)
    input_ids: list[int]
    rid: str | None
    future: asyncio.Future = field(repr=False)
    encoding: DumpEncoding = DumpEncoding()
    """What the request asked its dump to hold encoded (shared/dumpfile.py)."""


class Batcher:
    def __init__(
        self,
        engine: ReferenceEngine,
        writer: DumpWriter,
        *,
        dump: bool = True,
        max_batch_tokens: int = 16384,
        max_batch_size: int = 64,
        wait_s: float = 0.005,
    ):
        self.engine = engine
        self.writer = writer
        self.dump_dir = writer.dump_dir
        self.dump = dump
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.delivering: set[asyncio.Task] = set()
        self.pending: deque[Work] = deque()
        self.arrived = asyncio.Event()
        self.prefill_tokens = 0
        self.batches = 0

    async def prefill(self, input_ids: list[int], rid: str | None, encoding: DumpEncoding = DumpEncoding()) -> Prefill:
        return await self._submit(("prefill",), input_ids, rid, encoding)

    async def generate(
        self, input_ids: list[int], rid: str | None, max_new_tokens: int, temperature: float, top_p: float
    ):
        return await self._submit(("generate", max_new_tokens, temperature, top_p), input_ids, rid)

    async def _submit(self, key: tuple, input_ids: list[int], rid: str | None, encoding: DumpEncoding = DumpEncoding()):
        future = asyncio.get_running_loop().create_future()
        self.pending.append(Work(key, input_ids, rid, future, encoding))
        self.arrived.set()
        return await future

    async def run(self) -> None:
        """The batching loop; runs for the server's lifetime."""
        loop = asyncio.get_running_loop()
        while True:
            await self.arrived.wait()
            await asyncio.sleep(self.wait_s)  # let concurrent requests join
            batch = self._take_batch()
            if not self.pending:
                self.arrived.clear()
            if not batch:
                continue
            try:
                results, dumps = await loop.run_in_executor(self.engine_thread, self._execute, batch)
            except Exception as e:  # a failed batch fails its requests, never the server
                log.exception("batch of %d failed", len(batch))
                for work in batch:
                    if not work.future.done():
                        work.future.set_exception(e)
                continue
            task = asyncio.create_task(self._deliver(batch, results, dumps))
            self.delivering.add(task)  # a reference, so the task is not collected before it ends
            task.add_done_callback(self.delivering.discard)

    async def _deliver(self, batch: list[Work], results: list, dumps: list[Future | None]) -> None:
        """Answers each request as soon as its own dump is written."""

        async def one(work: Work, result, dump: Future | None) -> None:
            try:
                if dump is not None:
                    await asyncio.wrap_future(dump)
            except Exception as e:  # a dump that cannot be written fails its request: the worker retries
                if not work.future.done():
                    work.future.set_exception(e)
                return
            if not work.future.done():
                work.future.set_result(result)

        await asyncio.gather(*(one(w, r, d) for w, r, d in zip(batch, results, dumps, strict=True)))

    def _take_batch(self) -> list[Work]:
        if not self.pending:
            return []
        key = self.pending[0].key
        batch: list[Work] = []
        skipped: deque[Work] = deque()
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

    def _execute(self, batch: list[Work]) -> tuple[list, list[Future | None]]:
        """Runs a batch on the engine (engine thread); returns each request's result and its dump's future.
        Handing the dumps to the writer may wait for room: that wait is the engine's back-pressure."""
        prompts = [w.input_ids for w in batch]
        encodings = [w.encoding for w in batch]
        self.batches += 1
        due = [w.rid if self.dump and is_eaglet_rid(w.rid) else None for w in batch]  # the rids to dump
        if batch[0].key[0] == "generate":
            _, max_new_tokens, temperature, top_p = batch[0].key
            prefills = self.engine.prefill(prompts, encodings) if any(due) else [None] * len(batch)
            results = self.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        else:
            results = prefills = self.engine.prefill(prompts, encodings)
            self.prefill_tokens += sum(len(p) for p in prompts)
        return results, [
            self._submit_dump(rid, p) if rid is not None else None for rid, p in zip(due, prefills, strict=True)
        ]

    def _submit_dump(self, rid: str, prefill: Prefill) -> Future:
        write = partial(write_dump_parts, self.dump_dir, rid, prefill.states, aux_layer_ids=self.engine.aux_layer_ids,
                        model=str(self.engine.model_dir.name), model_dtype=self.engine.dtype)  # fmt: skip
        return self.writer.submit(prefill.nbytes, write, f"rid {rid}")
