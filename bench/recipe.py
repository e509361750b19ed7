"""Training recipe on CPU (SmolLM2): how many optimizer steps the schedule makes, and what held-out accuracy and
acceptance length they buy, for a few settings of the per-process token budget, epochs and learning rate.

Extracts the first ``--limit`` demo conversations once through the real pipeline (as ``bench/quality.py`` does),
then trains one run a setting on that same extraction, each by ``python -m eaglet.services.trainer.main`` in its
own process with its speculative-decoding evaluation on the held-out demo prompts.

    python -m bench.recipe                       # 300 conversations, 4 settings: ~40 min on 2 busy cores
    python -m bench.recipe --limit 150 --eval-prompts 4 --settings default=16384:1:1e-4,tpb2048=2048:1:1e-4
"""

import argparse
import json
import sys
from pathlib import Path

from redis import Redis

from bench.common import load, save_result
from bench.quality import derive_run, extract_source, start_bench, train_and_eval
from eaglet.shared.runstate import RunState

ROOT = Path(__file__).resolve().parents[1]


# name=tokens_per_batch:epochs:lr; the first is the trainer's default schedule
SETTINGS = "default=16384:1:1e-4,tpb2048=2048:1:1e-4,epochs3=16384:3:1e-4,tpb2048-epochs3=2048:3:1e-4"


def parse_settings(text: str) -> list[tuple[str, int, int, float]]:
    out = []
    for item in text.split(","):
        name, spec = item.split("=")
        tokens, epochs, lr = spec.split(":")
        out.append((name, int(tokens), int(epochs), float(lr)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=300, help="demo conversations extracted (training samples)")
    p.add_argument("--settings", default=SETTINGS, help="name=tokens_per_batch:epochs:lr, comma-separated")
    p.add_argument("--ttt-steps", type=int, default=3, help="fewer than the default 7: CPU time")
    p.add_argument("--eval-prompts", type=int, default=10)
    args = p.parse_args()
    settings_list = parse_settings(args.settings)
    load_before = load()
    bench = start_bench("recipe")
    folder, data_dir, env = bench.folder, bench.settings.data_dir, bench.env
    common = ["--ttt-steps", str(args.ttt_steps), "--draft-vocab-size", "4096", "--max-len", "512",
              "--loader-workers", "0", "--checkpoint-every", "100000", "--eval-k", "3", "--eval-max-new-tokens", "64",
              "--eval-num-prompts", str(args.eval_prompts)]  # fmt: skip
    figures: dict = {"conversations": args.limit, "train_flags": " ".join(common), "runs": []}
    cmd = " ".join(["python -m bench.recipe", *sys.argv[1:]])
    try:
        redis = Redis.from_url(bench.settings.redis_url, decode_responses=True)
        figures["extraction"] = extract_source(redis, bench, "recipe", args.limit)
        for name, tokens_per_batch, epochs, lr in settings_list:
            derive_run(redis, data_dir, "src", name, "bf16", args.limit)  # a run of its own: no checkpoint to resume
            flags = [*common, "--tokens-per-batch", str(tokens_per_batch), "--epochs", str(epochs), "--lr", str(lr)]
            row = {"setting": name, "tokens_per_batch": tokens_per_batch, "epochs": epochs, "lr": lr, "load": load()}
            row.update(train_and_eval(name, env, flags, folder / "logs"))
            state = RunState(redis, name)
            train, result = state.train(), state.eval()
            row.update(
                steps=train.step, train_samples=train.train_samples, train_tokens_per_s=train.tokens_per_s,
                final_loss=train.loss, heldout_loss=train.heldout_loss, heldout_acc=train.heldout_acc,
                accept_length=result.accept_length, accept_rate=result.accept_rate, eval_prompts=result.prompts,
            )  # fmt: skip
            figures["runs"].append(row)
            print(json.dumps(row), flush=True)
            save_result("recipe", cmd, figures, load_before)  # after each setting: a cut-short run keeps its figures
    finally:
        bench.close()
    print("wrote", save_result("recipe", cmd, figures, load_before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
