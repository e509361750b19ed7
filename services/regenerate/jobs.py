"""The RQ jobs of regeneration: planning a run's input into batches (control queue, an ingest worker), and
regenerating one batch (the run's queue, an extractor worker). Arguments are ids; the rest is resolved here.

A batch is a contiguous range of the input's prompts. Its job reads its lines, skips the prompts its result file
already holds (an earlier attempt's), answers the others through the chat endpoint with ``concurrency`` requests in
flight, and writes each result durably before counting it. The job that finds every prompt with an outcome
assembles the final file, in input order, and hands it to ingest in the same run (or ends the run there).
"""

import functools
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jinja2 import TemplateError
from redis import Redis
from rq import get_current_job
from rq.exceptions import AbandonedJobError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from eaglet.services.regenerate.chatclient import ChatClient, EndpointError
from eaglet.services.regenerate.conversations import Prompt, parse_prompt, read_lines
from eaglet.services.regenerate.results import ResultFile, assemble, batch_path, output_path
from eaglet.shared.chatlines import BadLine
from eaglet.shared.config import Settings
from eaglet.shared.jobqueue import enqueue_batches, enqueue_ingest, owner_of
from eaglet.shared.records import RunMeta, Stage
from eaglet.shared.regeneration import Batch, Progress, requeue_batch
from eaglet.shared.runoptions import RegenerateOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.target import resolve_model_dir, text_config
from eaglet.shared.workerloop import job_process

log = logging.getLogger(__name__)


class NoRegenerationToPlan(ValueError):
    """The run is unknown or not regenerating."""


def plan_job(run_id: str) -> int:
    """RQ job (control queue): ``plan_run`` with the worker's clients."""
    process = job_process()
    return plan_run(process.redis, process.rq_redis, run_id)


def plan_run(redis: Redis, rq_redis: Redis, run_id: str) -> int:
    """Cuts the run's input into batches (once) and queues every batch whose job has not run to its end; returns
    the prompts in the run. Reads the input once, line by line."""
    state = RunState(redis, run_id)
    meta = state.meta()
    if meta.stage != Stage.regenerating:
        raise NoRegenerationToPlan(f"run {run_id!r} is not regenerating (stage {meta.stage})")
    options, source = _regeneration(meta)
    progress = Progress(redis, run_id)
    if not progress.planned():
        try:
            batches, total = cut_batches(source, options.batch_prompts)
        except OSError as e:
            state.fail(f"regeneration input {meta.regenerate_input}: {type(e).__name__}: {e}")
            raise
        if total == 0:
            state.fail(f"no prompt in {meta.regenerate_input}: nothing to regenerate")
            return 0
        progress.plan(batches, total)
        log.info("run %s: %d prompts in %d batches to regenerate", run_id, total, len(batches))
    enqueue_batches(rq_redis, run_id, progress.unfinished_batches())
    return progress.counts().total


def _regeneration(meta: RunMeta) -> tuple[RegenerateOptions, Path]:
    """The run's regeneration options and input, as its record keeps them."""
    options = meta.options.regenerate if meta.options else None
    if options is None or meta.regenerate_input is None:
        raise NoRegenerationToPlan(f"run {meta.run_id!r} records no regeneration options or input")
    return options, Path(meta.regenerate_input)


def cut_batches(path: Path, size: int) -> tuple[list[Batch], int]:
    """Batches of ``size`` non-blank lines; returns them and the prompts in all."""
    batches: list[Batch] = []
    line, prompt = 1, 0
    with open(path, "rb") as f:
        while True:
            offset, numbers = f.tell(), [number for number, _, _ in read_lines(f, line, size)]
            n = len(numbers)
            if n == 0:
                return batches, prompt
            batches.append(Batch(offset=offset, line=line, prompt=prompt, count=n))
            prompt, line = prompt + n, numbers[-1] + 1


def regenerate_batch(run_id: str, batch: int, give_up: str = "") -> str:
    """RQ job (the run's queue): regenerates the prompts of ``batch`` that have no result yet. With ``give_up``, asks
    nothing and records them as failed with that reason (their batch killed its worker too often)."""
    process = job_process()
    settings, redis = process.settings, process.redis
    state = RunState(redis, run_id)
    meta = state.meta()
    if meta.stage != Stage.regenerating:
        return f"run {run_id} is {meta.stage}: batch {batch} not run"
    options, source = _regeneration(meta)
    spec = Progress(redis, run_id).batch(batch)
    runner = BatchRunner(redis, state, options, settings, source, _worker_name())
    results = ResultFile(batch_path(settings.data_dir, run_id, batch))
    try:
        written = results.open()
        for entry in written.values():  # counted again: the last attempt may have died between file and Redis
            runner.count(entry)
        todo = [p for p in runner.read(spec) if p[0] not in written]
        if give_up:
            for prompt in todo:
                runner.give_up(results, *prompt, give_up)
        else:
            with ThreadPoolExecutor(options.concurrency, thread_name_prefix=f"regen-{batch}") as pool:
                list(pool.map(lambda p: runner.regenerate(results, *p), todo))
    finally:
        results.close()
        runner.close()
    if state.stage() != Stage.regenerating:
        return f"run {run_id} left regeneration: batch {batch} stopped"
    runner.progress.finish_batch(batch)
    finish_if_complete(redis, process.rq_redis, settings.data_dir, state, options)
    return f"batch {batch}: {len(todo)} prompts regenerated or given up, {len(written)} found done"


def on_batch_failure(job, connection, exc_type, exc_value, traceback) -> None:
    """A batch job that raised (a bug, a full disk, Redis gone for too long) or that RQ found abandoned: queued again,
    its finished prompts kept, until it has failed ``max_attempts`` times; then its unfinished prompts are failed."""
    run_id, batch, give_up = job.args
    process = job_process()  # RQ's ``connection`` is its bytes client; run state is text
    redis = process.redis
    if give_up:
        RunState(redis, run_id).record_error(-1, "", f"batch {batch}: could not record its prompts as given up: "
                                             f"{exc_type.__name__}: {exc_value}", job.worker_name or "")  # fmt: skip
        return
    why = "its worker died" if exc_type is AbandonedJobError else f"its job crashed: {exc_type.__name__}: {exc_value}"
    RunState(redis, run_id).record_error(-1, "", f"regeneration batch {batch}: {why}", job.worker_name or "")
    requeue_batch(redis, connection, run_id, batch, why, process.settings.max_attempts)


def finish_if_complete(redis: Redis, rq_redis: Redis, data_dir: Path, state: RunState, opts: RegenerateOptions) -> bool:
    """Once every prompt has an outcome: the final file, then the run moves on (to ingest, or ``done``). Safe to
    run twice, or at once in two workers: the file is written whole under a temp name, and the stage moves once."""
    progress = Progress(redis, state.run_id)
    if not progress.complete() or state.stage() != Stage.regenerating:
        return False
    out = output_path(data_dir, state.run_id)
    written, failed = assemble((batch_path(data_dir, state.run_id, b) for b in range(progress.batches())), out)
    if written == 0:  # nothing to ingest or keep: the run failed, and says why
        reason = f"regeneration gave up all {failed} prompts; their reasons are in the run's errors"
        if state.fail(reason) is not None:
            log.warning("run %s: %s", state.run_id, reason)
        return False
    if not state.finish_regeneration(str(out), stop=opts.stop_after):
        return False
    log.info("run %s: %d conversations regenerated into %s, %d prompts given up", state.run_id, written, out, failed)
    if not opts.stop_after:
        enqueue_ingest(rq_redis, state.run_id)
    return True


class BatchRunner:
    """What one batch job shares across its threads: the endpoint's client, the target's tokenizer, the counters."""

    def __init__(
        self, redis: Redis, state: RunState, options: RegenerateOptions, settings: Settings, source: Path, worker: str
    ):
        self.state, self.options, self.source, self.worker = state, options, source, worker
        self.progress = Progress(redis, state.run_id)
        endpoint = options.endpoint or f"{settings.inference_url.rstrip('/')}/v1"
        key = os.environ.get(options.api_key_env) if options.api_key_env else None
        if options.api_key_env and not key:
            log.warning("run %s: %s is not set in this worker's environment; asking without a key", state.run_id,
                        options.api_key_env)  # fmt: skip
        self.client = ChatClient(endpoint, model=options.model, api_key=key, timeout_s=options.request_timeout_s,
                                 max_tries=options.max_tries, connections=options.concurrency)  # fmt: skip
        self.tokenizer, self.context = _target(str(resolve_model_dir(settings.model, settings.model_cache_dir)))

    def close(self) -> None:
        self.client.close()

    def read(self, spec: Batch) -> list[tuple[int, int, bytes | None]]:
        """(prompt index, line number, line) of the batch's prompts; its lines only, never the whole input."""
        with open(self.source, "rb") as f:
            f.seek(spec.offset)
            lines = read_lines(f, spec.line, spec.count)
            return [(spec.prompt + i, line, raw) for i, (line, raw, _) in enumerate(lines)]

    def regenerate(self, results: ResultFile, index: int, line: int, raw: bytes | None) -> None:
        if self.state.stage() != Stage.regenerating:
            return  # cancelled or failed meanwhile: what is left stays undone
        entry = {"index": index, "line": line, "id": ""}
        try:
            prompt = _parse(raw, line)
            entry["id"] = prompt.prompt_id
            self._check_context(prompt)
            entry.update(self._answer(prompt))
        except (BadLine, EndpointError) as e:
            entry["error"] = str(e)
        self.finish(results, entry)

    def give_up(self, results: ResultFile, index: int, line: int, raw: bytes | None, why: str) -> None:
        """The prompt recorded as failed without asking the endpoint, under its own id; a bad line keeps its own
        reason, since asking again would not have helped it."""
        entry = {"index": index, "line": line, "id": "", "error": why}
        try:
            entry["id"] = _parse(raw, line).prompt_id
        except BadLine as e:
            entry["error"] = str(e)
        self.finish(results, entry)

    def finish(self, results: ResultFile, entry: dict) -> None:
        results.append(entry)  # durable first: a prompt counted in Redis is always in its file
        self.count(entry)

    def count(self, entry: dict) -> None:
        if "error" in entry:
            if self.progress.mark(entry["index"], "failed"):
                where = f"{self.source.name}:{entry['line']}"
                what = f"prompt {entry['id']}: {entry['error']}" if entry["id"] else entry["error"]
                self.state.record_error(-1, where, what, self.worker, final=True)
                log.warning("run %s %s: %s", self.state.run_id, where, what)
            return
        self.progress.mark(entry["index"], "done", entry["tokens_in"], entry["tokens_out"], entry.get("retries", 0))

    def _check_context(self, prompt: Prompt) -> None:
        """A prompt the target cannot answer within its context is bad input, said so before any request."""
        try:
            text = self.tokenizer.apply_chat_template(prompt.turns, add_generation_prompt=True, tokenize=False)
        except (TemplateError, ValueError, TypeError) as e:
            raise BadLine(f"chat template cannot render this conversation: {type(e).__name__}: {e}") from e
        n = len(self.tokenizer(text, add_special_tokens=False).input_ids)
        if self.context is not None and n + self.options.max_tokens > self.context:
            raise BadLine(f"{n} prompt tokens + max_tokens {self.options.max_tokens} exceed the target's context of "
                          f"{self.context}")  # fmt: skip

    def _answer(self, prompt: Prompt) -> dict:
        """Each user turn answered after the target's own earlier answers. The endpoint is sent the earlier answers
        without their reasoning, as reasoning templates render past turns; the kept conversation has it."""
        o = self.options
        sent, kept, tokens_in, tokens_out, retries = [], [], 0, 0, 0
        for turn in prompt.turns:
            sent.append(turn)
            kept.append(turn)
            if turn["role"] != "user":
                continue
            c = self.client.complete(sent, max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p)
            tokens_in, tokens_out, retries = tokens_in + c.prompt_tokens, tokens_out + c.completion_tokens, \
                retries + c.tries - 1  # fmt: skip
            sent.append({"role": "assistant", "content": c.content})
            answer = c.content
            if c.reasoning and o.reasoning == "think_tags":
                answer = f"<think>\n{c.reasoning.strip()}\n</think>\n\n{c.content.lstrip()}"
            kept.append({"role": "assistant", "content": answer})
        return {"messages": kept, "tokens_in": tokens_in, "tokens_out": tokens_out, "retries": retries}


def _parse(raw: bytes | None, line: int) -> Prompt:
    """The line's prompt; BadLine with the reason when it is not one (``raw`` None: the line was over the limit)."""
    if raw is None:
        raise BadLine("line over the size limit")
    return parse_prompt(raw, line)


@functools.lru_cache(maxsize=2)
def _target(model_dir: str) -> tuple[PreTrainedTokenizerBase, int | None]:
    """The target's tokenizer and context, once per worker process."""
    return AutoTokenizer.from_pretrained(model_dir), text_config(Path(model_dir)).get("max_position_embeddings")


def _worker_name() -> str:
    job = get_current_job()
    owner = owner_of(job.worker_name or "") if job else None
    return owner[0] if owner else f"{socket.gethostname()}:{os.getpid()}"
