"""Target families on CPU at one budget: each bundled target (SmolLM2-135M-Instruct, a Llama; Gemma 3 270M) from
the regeneration of the demo prompts' answers by the target itself to its drafter's acceptance length.

For each target, a bench of its own (Redis, the reference server on that target, two extractor workers and an
ingest worker) takes one run through eaglet's stages, as ``POST /runs`` with ``options.regenerate`` does: the first
``--prompts`` demo prompts (``data/demo/prompts-train.jsonl``) answered again by the target through the regeneration
stage (greedy, ``--max-new-tokens``), the answers ingested with the target's chat template, extracted by the reference
server. Then the trainer with bench/quality.py's CPU flags (the same epochs and batch size for every target) and its
speculative evaluation on the held-out demo prompts (``data/demo/eval.jsonl``): k = 3 drafts a round, every output
compared with plain greedy decoding.

    python -m bench.families_cpu                                  # smollm2 and gemma3: ~45 min on 2 busy cores
    python -m bench.families_cpu --models gemma3 --prompts 16 --epochs 1 --eval-prompts 1   # a quick look
"""

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import load, save_result
from bench.quality import Bench, serving, start_bench, train_and_eval, train_flags
from eaglet.shared import regeneration
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect, connect_raw
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runs import queue_run
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.store import drafter_dir
from eaglet.shared.target import BUNDLED, resolve_model_dir, text_config

ROOT = Path(__file__).resolve().parents[1]


PROMPTS = ROOT / "data" / "demo" / "prompts-train.jsonl"
RUN = "src"


def target_facts(model: str) -> dict:
    """What sets a family's traps apart: its class, widths, vocabulary, attention layout, and where its chat
    template comes from (a base model's GGUF carries none)."""
    config = text_config(resolve_model_dir(model, Settings().model_cache_dir))
    bundled = BUNDLED.get(model)
    return {
        "model_type": config.get("model_type"), "architectures": config.get("architectures"),
        "hidden_size": config["hidden_size"], "layers": config["num_hidden_layers"], "vocab_size": config["vocab_size"],
        "heads": [config["num_attention_heads"], config.get("num_key_value_heads"), config.get("head_dim")],
        "sliding_window": config.get("sliding_window"), "tie_word_embeddings": config.get("tie_word_embeddings"),
        "chat_template": "eaglet's, set at conversion (the GGUF has none)" if bundled and bundled.chat_template
        else "the model's own",
    }  # fmt: skip


def regenerate_and_extract(bench: Bench, model: str, source: Path, options: RegenerateOptions) -> dict:
    """One run from the prompts to its stored hidden states, through the control queue: regeneration, then ingest
    and extraction in the same run. Returns each stage's figures."""
    redis = connect(bench.settings.redis_url)
    started = time.perf_counter()
    with serving(bench, model, ingest=True):
        queue_run(redis, connect_raw(bench.settings.redis_url), run_id=RUN, dataset=source,
                  options=RunOptions(max_tokens=2048, regenerate=options))  # fmt: skip
        state = RunState(redis, RUN)
        while not state.extraction_complete():
            if state.stage() in (Stage.failed, Stage.cancelled):
                raise RuntimeError(f"run {RUN} on {model}: {state.meta().error}")
            time.sleep(0.5)
    regen, meta, counts = regeneration.Progress(redis, RUN).counts(), state.meta(), state.counts()
    regen_s, extract_s = regen.complete - regen.started_at, meta.extraction_complete - meta.extraction_started_at
    if regen.failed or counts.failed:
        raise RuntimeError(f"run {RUN} on {model}: {regen.failed} prompts and {counts.failed} samples failed")
    return {
        "stack_seconds": round(time.perf_counter() - started, 1),
        "regeneration": {"prompts": regen.done, "seconds": round(regen_s, 1),
                         "tokens_in": regen.tokens_in, "tokens_out": regen.tokens_out,
                         "tokens_out_per_s": round(regen.tokens_out / regen_s, 2)},
        "extraction": {"samples": counts.done, "tokens": counts.tokens, "loss_tokens": meta.loss_tokens,
                       "bytes": counts.bytes, "seconds": round(extract_s, 1),
                       "aux_layer_ids": meta.captured_layers},
    }  # fmt: skip


def measure(model: str, source: Path, options: RegenerateOptions, flags: list[str], keep: Path) -> dict:
    """A target's row; its drafter is copied to ``keep/<model>`` (another engine can serve it), and a failing
    stage's logs to ``keep/<model>-logs``."""
    bench = start_bench(f"families-{Path(model).name}", model)
    try:
        row = {"model": model, **target_facts(model), "load_before": load()}
        row.update(regenerate_and_extract(bench, model, source, options))
        print(json.dumps(row), flush=True)
        row["trainer"] = train_and_eval(RUN, bench.env, flags, bench.folder / "logs")
        state = RunState(connect(bench.settings.redis_url), RUN)
        train, result = state.train(), state.eval()
        row["trainer"].update(
            steps=train.step, train_samples=train.train_samples, heldout_samples=train.heldout_samples,
            tokens_per_s=train.tokens_per_s, loss=train.loss, heldout_loss=train.heldout_loss,
            heldout_acc=train.heldout_acc,
        )  # fmt: skip
        row["eval"] = {
            "accept_length": result.accept_length, "accept_rate": result.accept_rate, "k": result.k,
            "prompts": result.prompts, "new_tokens": result.new_tokens, "mismatches": result.mismatches,
            "outputs_equal_greedy": result.mismatches == 0, "speedup": result.speedup,
            "target_tok_s": result.target_tok_s, "spec_tok_s": result.spec_tok_s,
        }  # fmt: skip
        row["load_after"] = load()
        shutil.copytree(drafter_dir(bench.settings.data_dir, RUN), keep / Path(model).name, dirs_exist_ok=True)
        return row
    except BaseException:
        shutil.copytree(bench.folder / "logs", keep / f"{Path(model).name}-logs", dirs_exist_ok=True)
        raise
    finally:
        bench.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,gemma3", help="bundled models or model directories, comma-separated")
    p.add_argument("--prompts", type=int, default=100, help="demo prompts regenerated (the training samples)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="most new tokens of a regenerated answer")
    p.add_argument("--concurrency", type=int, default=16, help="regeneration requests in flight per worker")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens-per-batch", type=int, default=1024)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-max-new-tokens", type=int, default=40)
    p.add_argument("--keep", type=Path, default=ROOT / "var" / "drafters", help="the drafters are copied here")
    p.add_argument("--result", default="gemma3", help="results to results/cpu-RESULT.json")
    args = p.parse_args()
    load_before = load()
    args.keep.mkdir(parents=True, exist_ok=True)
    source = args.keep / "prompts.jsonl"
    with open(PROMPTS) as f:
        source.write_text("".join(line for _, line in zip(range(args.prompts), f, strict=False)))
    options = RegenerateOptions(max_tokens=args.max_new_tokens, concurrency=args.concurrency,
                                batch_prompts=args.concurrency)  # fmt: skip
    flags = train_flags(epochs=args.epochs, lr=args.lr, tokens_per_batch=args.tokens_per_batch,
                        eval_prompts=args.eval_prompts, eval_max_new_tokens=args.eval_max_new_tokens)  # fmt: skip
    figures: dict = {"prompts": args.prompts, "regenerate": asdict(options),
                     "train_flags": " ".join(flags), "targets": []}  # fmt: skip
    command = " ".join(["python -m bench.families_cpu", *sys.argv[1:]])
    for model in args.models.split(","):
        started = time.perf_counter()
        row = measure(model, source, options, flags, args.keep)
        row["wall_seconds"] = round(time.perf_counter() - started, 1)
        figures["targets"].append(row)
        print(json.dumps(row), flush=True)
        save_result(args.result, command, figures, load_before)  # after each target: a cut-short run keeps its rows
    print("wrote", save_result(args.result, command, figures, load_before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
