"""Storage layouts on CPU (SmolLM2): stored bytes per token and acceptance length of each layout against bf16, the
demo's default recipe trained on each, same data, same steps, repeated over seeds.

Extracts the first ``--limit`` demo conversations once through the real pipeline (Redis, reference server, workers;
as ``bench/quality.py`` does), then derives one run a layout from that extraction: each sample stored again as bf16
in the layout (the top-k computed from the stored final states by the servers' own encoder), so the only difference
between runs is the storage. Each run is trained with the demo's recipe by ``python -m eaglet.services.trainer.main``
in its own process and evaluated by eaglet's speculative decoding on the held-out demo prompts; every seed trains
every layout.

    python -m bench.layouts                      # 300 conversations, 5 layouts x 2 seeds: ~50 min on 2 busy cores
    python -m bench.layouts --limit 40 --seeds 0 --layouts bf16=all:0:full,top32=topk:32:full --eval-prompts 2
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from redis import Redis

from bench.common import load, save_result
from bench.quality import derive_run, extract_source, start_bench, train_and_eval
from eaglet.cli.demo import DEMO_EVAL_FLAGS, DEMO_TRAIN_FLAGS
from eaglet.shared.layout import Layout, bytes_per_token
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import samples_dir
from eaglet.shared.target import resolve_model_dir
from eaglet.shared.targettensors import load_target_tensors

ROOT = Path(__file__).resolve().parents[1]


# name=final:k:aux; the first is the reference every other is compared with
LAYOUTS = "bf16=all:0:full,loss=loss:0:full,fp4=all:0:fp4,top32=topk:32:full,top32-fp4=topk:32:fp4"
SHAPES = {"SmolLM2-135M": 576, "Kimi-K2.5": 7168}


def parse_layouts(text: str) -> list[tuple[str, Layout, list[str]]]:
    """``name=final:k:aux[:trainer flags]``, comma-separated: each layout and the flags its run trains with beside
    the recipe's (``top24u=topk:24:fp4:--topk-tail uniform``)."""
    out = []
    for item in text.split(","):
        name, spec = item.split("=", 1)
        final, k, aux, *flags = spec.split(":", 3)
        out.append((name, Layout(final=final, topk=int(k), aux=aux), flags[0].split() if flags else []))
    return out


def summarize(runs: list[dict], reference: str) -> dict:
    """Per layout: accept length over the seeds (mean, min, max), its change against the reference run of the same
    seed (mean, min, max), bytes per token and their ratio to the reference's."""
    by = {(r["layout"], r["seed"]): r for r in runs}
    out = {}
    for name in dict.fromkeys(r["layout"] for r in runs):
        rows = [r for r in runs if r["layout"] == name]
        accept = [r["accept_length"] for r in rows]
        change = [r["accept_length"] / by[(reference, r["seed"])]["accept_length"] - 1 for r in rows
                  if (reference, r["seed"]) in by]  # fmt: skip
        ref_bytes = by[(reference, rows[0]["seed"])]["bytes_per_token"] if (reference, rows[0]["seed"]) in by else None
        out[name] = {
            "seeds": len(rows),
            "accept_length_mean": round(statistics.mean(accept), 4),
            "accept_length_min": min(accept),
            "accept_length_max": max(accept),
            "accept_change_mean": round(statistics.mean(change), 4) if change else None,
            "accept_change_min": round(min(change), 4) if change else None,
            "accept_change_max": round(max(change), 4) if change else None,
            "heldout_loss_mean": round(statistics.mean(r["heldout_loss"] for r in rows), 4),
            "bytes_per_token": rows[0]["bytes_per_token"],
            "bytes_ratio": round(rows[0]["bytes_per_token"] / ref_bytes, 4) if ref_bytes else None,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=300, help="demo conversations extracted (training samples)")
    p.add_argument("--layouts", default=LAYOUTS,
                   help="name=final:k:aux[:trainer flags], comma-separated; the first is the reference")  # fmt: skip
    p.add_argument("--seeds", default="0,1", help="trainer seeds; every seed trains every layout")
    p.add_argument("--eval-prompts", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=0, help="cap the training steps (0: the recipe's epochs)")
    p.add_argument("--result", default="layouts", help="results to results/cpu-RESULT.json")
    args = p.parse_args()
    layouts, seeds = parse_layouts(args.layouts), [int(s) for s in args.seeds.split(",")]
    load_before = load()
    bench = start_bench("layouts")
    folder, data_dir, env = bench.folder, bench.settings.data_dir, bench.env
    flags = [*DEMO_TRAIN_FLAGS, "--max-steps", str(args.max_steps), *DEMO_EVAL_FLAGS,
             "--eval-num-prompts", str(args.eval_prompts)]  # fmt: skip
    figures: dict = {"conversations": args.limit, "train_flags": " ".join(flags), "runs": []}
    cmd = " ".join(["python -m bench.layouts", *sys.argv[1:]])
    try:
        redis = Redis.from_url(bench.settings.redis_url, decode_responses=True)
        figures["extraction"] = extract_source(redis, bench, "layouts", args.limit)
        samples = SampleSet(samples_dir(data_dir, "src"))
        tokens = sum(samples.length(i) for i in range(min(args.limit, len(samples))))
        loss_rows = sum(int(samples[i].loss_mask[1:].sum()) for i in range(min(args.limit, len(samples))))
        figures["loss_fraction"] = round(loss_rows / tokens, 4)
        model_dir = resolve_model_dir(bench.settings.model, bench.settings.model_cache_dir)
        lm_head = load_target_tensors(model_dir, ("lm_head",))["lm_head"]
        figures["bytes_per_token_formula"] = {
            shape: {name: round(bytes_per_token(hidden, layout, "bf16", loss_fraction=figures["loss_fraction"]), 1)
                    for name, layout, _ in layouts}
            for shape, hidden in SHAPES.items()
        }  # fmt: skip
        for seed in seeds:
            for name, layout, extra in layouts:
                run = f"{name}-s{seed}"  # a run of its own: no checkpoint to resume
                stored = derive_run(redis, data_dir, "src", run, "bf16", args.limit, layout, lm_head)
                row = {"layout": name, "spec": layout.name, "flags": " ".join(extra), "seed": seed,
                       "stored_bytes": stored, "bytes_per_token": round(stored / tokens, 1),
                       "load": load()}  # fmt: skip
                row.update(train_and_eval(run, env, [*flags, *extra, "--seed", str(seed)], folder / "logs"))
                train, result = RunState(redis, run).train(), RunState(redis, run).eval()
                row.update(
                    steps=train.step, heldout_loss=train.heldout_loss, heldout_acc=train.heldout_acc,
                    accept_length=result.accept_length, accept_rate=result.accept_rate, eval_prompts=result.prompts,
                )  # fmt: skip
                figures["runs"].append(row)
                print(json.dumps(row), flush=True)
                figures["summary"] = summarize(figures["runs"], layouts[0][0])
                save_result(args.result, cmd, figures, load_before)  # after each run: a cut-short bench keeps its rows
    finally:
        bench.close()
    print(json.dumps(figures.get("summary"), indent=1))
    print("wrote", save_result(args.result, cmd, figures, load_before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
