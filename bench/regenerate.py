"""Regeneration through the stage vs the chat endpoint alone, side by side in one run (CPU, SmolLM2).

Starts a Redis of its own, the reference server and extractor workers, then alternates two phases over the same
prompts (the demo's), ``rounds`` times each:

    endpoint  the prompts sent straight to /v1/chat/completions, workers x concurrency requests in flight
    stage     a run that starts with regeneration: plan -> batch jobs -> workers -> endpoint -> durable results ->
              Redis marks -> the final file, timed from the plan to the file (the run stops there)

Both phases are greedy with the same max_tokens, so both write the same tokens; the figures are prompts/s and
tokens/s out, and the stage's share of the endpoint's.

    python -m bench.regenerate                        # 32 prompts, 48 new tokens, 2 workers x 4, 3 rounds
    python -m bench.regenerate --prompts 64 --max-new-tokens 96 --workers 2 --concurrency 8
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from redis import Redis

from bench.common import load, save_result
from eaglet.cli.stack import LocalStack
from eaglet.services.regenerate.chatclient import ChatClient
from eaglet.services.regenerate.jobs import plan_run
from eaglet.shared.redisserver import RedisServer, free_port
from eaglet.shared.regeneration import Progress
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runs import create_run
from eaglet.shared.runstate import RunState, Stage

ROOT = Path(__file__).resolve().parents[1]


PROMPTS = ROOT / "data" / "demo" / "prompts-train.jsonl"


def endpoint_alone(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    client = ChatClient(f"{url}/v1", model="default", connections=concurrency)

    def one(prompt: str) -> int:
        c = client.complete([{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, top_p=1)
        return c.completion_tokens

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    seconds = time.perf_counter() - t
    client.close()
    return {"seconds": seconds, "prompts_per_s": len(prompts) / seconds, "tokens_per_s": tokens / seconds,
            "tokens_out": tokens}  # fmt: skip


def through_stage(redis: Redis, rq_redis: Redis, run_id: str, source: Path, n: int, options: RegenerateOptions):
    state = create_run(redis, run_id, source, RunOptions(regenerate=options))
    t = time.perf_counter()
    plan_run(redis, rq_redis, run_id)
    while state.stage() == Stage.regenerating:
        time.sleep(0.05)
    seconds = time.perf_counter() - t
    counts = Progress(redis, run_id).counts()
    assert state.stage() == Stage.done and counts.done == n, (state.meta(), counts)
    return {"seconds": seconds, "prompts_per_s": n / seconds, "tokens_per_s": counts.tokens_out / seconds,
            "tokens_out": counts.tokens_out, "retries": counts.retries}  # fmt: skip


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "runs": values}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per worker")
    p.add_argument("--batch-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--result", default="regenerate", help="results to results/cpu-RESULT.json")
    args = p.parse_args()
    before = load()
    folder = Path(tempfile.mkdtemp(prefix="eaglet-bench-regen-"))
    lines = PROMPTS.read_text().splitlines()[: args.prompts]
    source = folder / "prompts.jsonl"
    source.write_text("\n".join(lines) + "\n")
    prompts = [json.loads(line)["prompt"] for line in lines]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = RegenerateOptions(max_tokens=args.max_new_tokens, concurrency=args.concurrency,
                                batch_prompts=args.batch_prompts, stop_after=True)  # fmt: skip
    phases: dict[str, list[dict]] = {"endpoint": [], "stage": []}
    try:
        with RedisServer(folder / "redis") as server, LocalStack(folder / "logs") as stack:
            stack.env.update({"EAGLET_REDIS_URL": server.url, "EAGLET_DATA_DIR": str(folder / "data"),
                              "EAGLET_DUMP_DIR": str(folder / "dump"), "EAGLET_MODEL": args.model,
                              "EAGLET_INFERENCE_URL": url})  # fmt: skip
            stack.start("inference", "eaglet.services.inference.main", "--port", str(port))
            stack.wait_http("inference", f"{url}/health", timeout=300)
            for i in range(args.workers):
                stack.start(f"worker-{i}", "eaglet.services.extractor.worker", "--name", f"bench-{i}")
            redis, rq_redis = Redis.from_url(server.url, decode_responses=True), Redis.from_url(server.url)
            endpoint_alone(url, prompts[:4], 4, 4)  # warm-up: the first batches load lazily
            through_stage(redis, rq_redis, "warm-up", source, len(prompts), options)  # workers up and warm
            for r in range(args.rounds):
                phases["endpoint"].append(endpoint_alone(url, prompts, args.workers * args.concurrency,
                                                         args.max_new_tokens))  # fmt: skip
                phases["stage"].append(through_stage(redis, rq_redis, f"round-{r}", source, len(prompts), options))
                print(
                    f"round {r}: endpoint {phases['endpoint'][-1]['prompts_per_s']:.2f} prompts/s, "
                    f"stage {phases['stage'][-1]['prompts_per_s']:.2f} prompts/s",
                    flush=True,
                )
            assert RunState(redis, "round-0").stage() == Stage.done
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    figures = {
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "workers": args.workers,
        "concurrency_per_worker": args.concurrency, "batch_prompts": args.batch_prompts, "model": args.model,
        **{f"{phase}_{k}": spread([x[k] for x in runs]) for phase, runs in phases.items()
           for k in ("prompts_per_s", "tokens_per_s")},
        "stage_over_endpoint_prompts": spread([s["prompts_per_s"] / e["prompts_per_s"]
                                               for s, e in zip(phases["stage"], phases["endpoint"], strict=True)]),
        "stage_over_endpoint_tokens": spread([s["tokens_per_s"] / e["tokens_per_s"]
                                              for s, e in zip(phases["stage"], phases["endpoint"], strict=True)]),
        "phases": phases,
    }  # fmt: skip
    command = "python -m bench.regenerate " + " ".join(sys.argv[1:])
    out = save_result(args.result, command.strip(), figures, before)
    print(json.dumps({k: v for k, v in figures.items() if k != "phases"}, indent=2))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
