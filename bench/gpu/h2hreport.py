"""The head-to-head's results file: from the phase results headtohead.py wrote (``h2h-*.json`` in a folder),
the table of both drafters x both chains x both prompt sets (accept length, output tokens/s, with the plain
target's tokens/s beside) and both trainers (tokens/s, peak memory, wall time), with the ratios.

    python bench/gpu/h2hreport.py GPU_OUT_DIR bench/results      (writes gpu-headtohead.md and .json)
"""

import json
import sys
from pathlib import Path

DRAFTERS = ("eaglet", "specforge")
PHASES = ("h2h-data", "h2h-extract", "h2h-eaglet", "h2h-specforge", "h2h-eval")


def load(out_dir: Path) -> dict:
    """Each phase's results, {} for a phase that wrote none."""
    results = {}
    for phase in PHASES:
        p = out_dir / f"{phase}.json"
        try:
            results[phase] = json.loads(p.read_text()) if p.exists() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a phase's JSON results ({e})") from e
    return results


def ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def fmt(x, nd: int = 2) -> str:
    return "—" if x is None else (f"{x:,.{nd}f}" if isinstance(x, float) else f"{x:,}")


def summarize(results: dict) -> dict:
    """The figures the table shows, and the ratios eaglet / SpecForge."""
    ev = results.get("h2h-eval", {})
    rows, ratios = [], {}
    for chain in ev.get("chains", []):
        for pset in ev.get("prompt_sets", []):
            base = ev.get("baseline", {}).get(pset, {}).get("output_tokens_per_s")
            row = {"chain": chain, "prompt_set": pset, "baseline_tokens_per_s": base}
            for d in DRAFTERS:
                r = ev.get(d, {}).get(chain, {}).get(pset, {})
                row[d] = {k: r.get(k) for k in ("accept_length", "output_tokens_per_s", "requests", "errors")}
                row[d]["speedup"] = ratio(r.get("output_tokens_per_s"), base)
            row["accept_length_ratio"] = ratio(row["eaglet"]["accept_length"], row["specforge"]["accept_length"])
            ratios[f"accept_length {chain} {pset}"] = row["accept_length_ratio"]
            rows.append(row)
    trainers = {}
    for d in DRAFTERS:
        t = results.get(f"h2h-{d}", {})
        trainers[d] = {k: t.get(k) for k in ("tokens_per_s", "peak_gpu_GiB", "wall_s", "train_tokens", "epochs",
                                              "optimizer_steps", "rc", "error")}  # fmt: skip
    ratios["trainer tokens/s"] = ratio(trainers["eaglet"]["tokens_per_s"], trainers["specforge"]["tokens_per_s"])
    ratios["trainer peak memory"] = ratio(trainers["eaglet"]["peak_gpu_GiB"], trainers["specforge"]["peak_gpu_GiB"])
    data = results.get("h2h-data", {})
    return {
        "rows": rows,
        "trainers": trainers,
        "ratios": ratios,
        "data": {k: data.get(k) for k in ("conversations", "multi_turn", "heldout_prompts", "magpie", "wall_s")},
        "extract": {k: results.get("h2h-extract", {}).get(k) for k in ("samples", "tokens", "tokens_per_s", "wall_s")},
        "eval_settings": {k: ev.get(k) for k in ("max_new_tokens", "concurrency", "server_flags")},
        "errors": {p: results[p]["error"] for p in PHASES if results.get(p, {}).get("error")} | eval_errors(ev),
    }


def eval_errors(ev: dict) -> dict:
    """Each evaluated configuration that failed, by server and prompt set."""
    runs = {"baseline": ev.get("baseline", {})} | {f"{d} {c}": ev.get(d, {}).get(c, {}) for d in DRAFTERS
                                                      for c in ev.get("chains", [])}  # fmt: skip
    return {f"h2h-eval {k} {pset}": str(r["error"])[:300] for k, sets in runs.items() for pset, r in sets.items()
            if isinstance(r, dict) and r.get("error")}  # fmt: skip


def markdown(s: dict) -> str:
    lines = [
        "# Drafter head-to-head: eaglet vs SpecForge 0.2.0 on SmolLM2-135M-Instruct (one H200)",
        "",
        "Written by `bench/gpu/h2hreport.py` from the phases of `bench/gpu/headtohead.py` (commands: "
        "`bench/gpu/README.md`). Greedy decoding, SGLang 0.5.17, speculative algorithm EAGLE3.",
        "",
        f"Data: {fmt(s['data'].get('conversations'))} conversations written by the target "
        f"({fmt(s['data'].get('multi_turn'))} multi-turn), {fmt(s['data'].get('heldout_prompts'))} held-out "
        f"prompts; extraction {fmt(s['extract'].get('samples'))} samples, {fmt(s['extract'].get('tokens'))} tokens.",
        f"Evaluation: {s['eval_settings']}",
        "",
        "| chain (steps, topk, draft) | prompts | eaglet accept length | SpecForge accept length | ratio | "
        "eaglet tok/s | SpecForge tok/s | target alone tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        e, f = r["eaglet"], r["specforge"]
        lines.append(
            f"| {r['chain']} | {r['prompt_set']} | {fmt(e['accept_length'], 3)} | {fmt(f['accept_length'], 3)} | "
            f"{fmt(r['accept_length_ratio'], 3)} | {fmt(e['output_tokens_per_s'], 0)} | "
            f"{fmt(f['output_tokens_per_s'], 0)} | {fmt(r['baseline_tokens_per_s'], 0)} |"
        )
    lines += ["", "| trainer | tokens/s | peak GPU memory GiB | wall s | tokens trained | epochs | optimizer steps |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for d, t in s["trainers"].items():
        lines.append(
            f"| {d} | {fmt(t['tokens_per_s'], 0)} | {fmt(t['peak_gpu_GiB'])} | {fmt(t['wall_s'], 1)} | "
            f"{fmt(t['train_tokens'])} | {fmt(t['epochs'])} | {fmt(t['optimizer_steps'])} |"
        )
    lines += ["", "Ratios (eaglet / SpecForge; aims: accept length >= 1.05, trainer tokens/s >= 1.5):", ""]
    lines += [f"- {k}: {fmt(v, 3)}" for k, v in s["ratios"].items()]
    if s["errors"]:
        lines += ["", "Failed phases:", ""] + [f"- {p}: {' '.join(str(e).split())}" for p, e in s["errors"].items()]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, results_dir: Path) -> dict:
    s = summarize(load(out_dir))
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "gpu-headtohead.json").write_text(json.dumps(s, indent=1))
    (results_dir / "gpu-headtohead.md").write_text(markdown(s))
    return s


if __name__ == "__main__":
    write(Path(sys.argv[1]), Path(sys.argv[2]))
