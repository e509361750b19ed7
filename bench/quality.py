"""Drafter quality and trainer cost on CPU (SmolLM2): acceptance length vs training samples (learning curve),
fp8 vs bf16 stored hidden states on the same data and steps, trainer tokens/s and peak memory.

Extracts the first ``--limit`` demo conversations once through the real pipeline (Redis, reference server,
workers), then derives runs from that extraction: each stored sample re-encoded as bf16 or fp8 (the same
states, so the only difference is the storage), and bf16 runs restricted to the first n samples (the done
bitmap). Each run is trained by ``python -m eaglet.services.trainer.main`` in its own process (its peak RSS is
measured) and evaluated by real speculative decoding on the held-out demo prompts (``data/demo/eval.jsonl``).

    python -m bench.quality                                   # 60 conversations, curve 20/60: ~15 min on 2 busy cores
    python -m bench.quality --limit 300 --curve 75,150,300 --epochs 4
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from redis import Redis
from redis.client import NEVER_DECODE

from bench.common import load, save_result
from bench.pipeline import pipeline_phase
from eaglet.cli.stack import LocalStack
from eaglet.shared.config import Settings
from eaglet.shared.keys import RunKeys
from eaglet.shared.layout import Layout
from eaglet.shared.redisserver import RedisServer, free_port
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import open_sample, read_metadata, sample_path, samples_dir, write_sample
from eaglet.shared.topk import TOPK_TENSORS, encode_topk

ROOT = Path(__file__).resolve().parents[1]


EVAL = ROOT / "data" / "demo" / "eval.jsonl"


@dataclass(frozen=True)
class Bench:
    """A bench's own Redis and folder (under var/), and the settings and environment its services share."""

    folder: Path
    redis_server: RedisServer
    port: int
    """The reference server's."""
    settings: Settings
    env: dict[str, str]

    def close(self) -> None:
        self.redis_server.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_bench(name: str, model: str = "smollm2") -> Bench:
    """A bench whose services serve ``model`` (EAGLET_MODEL: a bundled model's name or a model directory)."""
    (ROOT / "var").mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=ROOT / "var"))
    data_dir = folder / "data"
    redis_server = RedisServer(folder / "redis")
    redis_server.start()
    redis_url = redis_server.url
    port = free_port()
    settings = Settings(redis_url=redis_url, data_dir=data_dir, dump_dir=folder / "dump",
                        inference_url=f"http://127.0.0.1:{port}", model=model)  # fmt: skip
    env = {"EAGLET_REDIS_URL": redis_url, "EAGLET_DATA_DIR": str(data_dir), "EAGLET_DUMP_DIR": str(folder / "dump"),
           "EAGLET_INFERENCE_URL": settings.inference_url, "EAGLET_MODEL": model}  # fmt: skip
    return Bench(folder, redis_server, port, settings, env)


@contextmanager
def serving(bench: Bench, name: str, *, ingest: bool = False) -> Iterator[LocalStack]:
    """The reference server and two extractor workers on the bench's Redis, and with ``ingest`` an ingest worker
    (for runs queued through the control queue: a regeneration, then its ingest); all stopped on exit."""
    with LocalStack(bench.folder / "logs", env=bench.env) as stack:
        stack.start("inference", "eaglet.services.inference.main", "--port", str(bench.port))
        stack.wait_http("inference", f"{bench.settings.inference_url}/health", timeout=300)
        for i in range(2):
            stack.start(f"worker-{i}", "eaglet.services.extractor.worker", "--name", f"{name}-worker-{i}")
        if ingest:
            stack.start("ingest", "eaglet.services.ingest.worker", "--name", f"{name}-ingest")
        yield stack


def extract_source(redis: Redis, bench: Bench, name: str, limit: int) -> dict:
    """The first ``limit`` demo conversations extracted once, as run ``src``, by the reference server and two
    workers; returns (and prints) the extraction's figures."""
    with serving(bench, name):
        seconds, tokens, nbytes = pipeline_phase(redis, bench.settings, "src", limit)
    figures = {"seconds": round(seconds, 1), "tokens": tokens, "bytes": nbytes}
    print(json.dumps(figures), flush=True)
    return figures


def derive_run(
    redis: Redis, data_dir: Path, src: str, run: str, store_dtype: str, first: int, layout: Layout = Layout(),
    lm_head: torch.Tensor | None = None,
) -> int:  # fmt: skip
    """A copy of run ``src`` whose samples are stored as ``store_dtype`` in ``layout`` and whose done samples are
    the first ``first``; returns the bytes of its hidden states. A top-k layout's distribution is computed from the
    stored final states with the target's ``lm_head`` [V, H] by the servers' own encoder, on the head's device."""
    shutil.copytree(samples_dir(data_dir, src), samples_dir(data_dir, run))
    samples = SampleSet(samples_dir(data_dir, src))
    nbytes = 0
    for i in range(min(first, len(samples))):
        sid = samples[i].sample_id
        path = sample_path(data_dir, src, sid)
        if not path.exists():
            continue  # a sample the extraction failed: the run's done bitmap leaves it out too
        tensors = open_sample(path)
        if layout.final == "topk":
            topk = encode_topk(tensors["hidden_states"].to(lm_head.device), lm_head, layout.topk)
            tensors.update(zip(TOPK_TENSORS, (t.cpu() for t in topk), strict=True))
        nbytes += write_sample(sample_path(data_dir, run, sid), tensors, read_metadata(path),
                               store_dtype=store_dtype, layout=layout)  # fmt: skip
    src_keys, keys = RunKeys(src), RunKeys(run)
    redis.hset(keys.meta, mapping=redis.hgetall(src_keys.meta))
    bitmap = bytearray(redis.execute_command("GET", src_keys.done, **{NEVER_DECODE: []}))
    for i in range(first, len(samples)):
        bitmap[i // 8] &= ~(0x80 >> (i % 8)) & 0xFF
    redis.set(keys.done, bytes(bitmap))
    return nbytes


def train_flags(*, epochs: int, lr: float, tokens_per_batch: int, eval_prompts: int,
                eval_max_new_tokens: int = 64) -> list[str]:  # fmt: skip
    """The trainer's flags sized for 2 CPU cores: TTT 3, a 4,096-token draft vocabulary, 512-token samples, and
    an evaluation of k = 3 drafts on ``eval_prompts`` held-out prompts."""
    return ["--ttt-steps", "3", "--draft-vocab-size", "4096", "--max-len", "512", "--loader-workers", "0",
            "--checkpoint-every", "100000", "--epochs", str(epochs), "--lr", str(lr),
            "--tokens-per-batch", str(tokens_per_batch), "--eval-k", "3",
            "--eval-max-new-tokens", str(eval_max_new_tokens), "--eval-num-prompts", str(eval_prompts)]  # fmt: skip


def train_and_eval(run: str, env: dict, flags: list[str], log_dir: Path) -> dict:
    """The trainer (with its evaluation) in its own process; wall seconds and peak RSS from wait4."""
    cmd = [sys.executable, "-m", "eaglet.services.trainer.main", "--run", run, *flags, "--eval-prompts", str(EVAL)]
    with open(log_dir / f"{run}.log", "wb") as log:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"trainer for {run} failed; see {log_dir / run}.log")
    return {"seconds": round(seconds, 1), "peak_rss_MB": round(usage.ru_maxrss / 1024, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=60, help="demo conversations extracted (training samples)")
    p.add_argument("--curve", default="20,60", help="sample counts of the bf16 learning curve")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens-per-batch", type=int, default=1024, help="padded tokens a batch")
    p.add_argument("--eval-prompts", type=int, default=20)
    p.add_argument("--no-fp8", action="store_true", help="only the learning curve")
    args = p.parse_args()
    load_before = load()
    bench = start_bench("quality")
    folder, data_dir, env = bench.folder, bench.settings.data_dir, bench.env
    flags = train_flags(epochs=args.epochs, lr=args.lr, tokens_per_batch=args.tokens_per_batch,
                        eval_prompts=args.eval_prompts)  # fmt: skip
    figures: dict = {"conversations": args.limit, "train_flags": " ".join(flags), "runs": []}
    try:
        redis = Redis.from_url(bench.settings.redis_url, decode_responses=True)
        figures["extraction"] = extract_source(redis, bench, "quality", args.limit)
        plan = [("bf16", int(n)) for n in args.curve.split(",")]
        if not args.no_fp8:
            plan.insert(plan.index(("bf16", max(n for _, n in plan))) + 1, ("fp8", max(n for _, n in plan)))
        for store_dtype, n in plan:
            run = f"{store_dtype}-{n}"
            stored = derive_run(redis, data_dir, "src", run, store_dtype, n)
            row = {"run": run, "store_dtype": store_dtype, "samples": n, "stored_bytes": stored, "load": load()}
            row.update(train_and_eval(run, env, flags, folder / "logs"))
            state = RunState(redis, run)
            train, result = state.train(), state.eval()
            row.update(
                train_samples=train.train_samples, steps=train.step, train_tokens_per_s=train.tokens_per_s,
                heldout_loss=train.heldout_loss, accept_length=result.accept_length, accept_rate=result.accept_rate,
                eval_mismatches=result.mismatches, eval_prompts=result.prompts,
            )  # fmt: skip
            figures["runs"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        bench.close()
    by = {r["run"]: r for r in figures["runs"]}
    top = max(int(n) for n in args.curve.split(","))
    if f"fp8-{top}" in by:
        bf16, fp8 = by[f"bf16-{top}"]["accept_length"], by[f"fp8-{top}"]["accept_length"]
        figures["fp8_accept_loss"] = round((bf16 - fp8) / bf16, 4)
    cmd = " ".join(["python -m bench.quality", *sys.argv[1:]])
    print("wrote", save_result("quality", cmd, figures, load_before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
