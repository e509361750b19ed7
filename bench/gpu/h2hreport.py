"""The head-to-head's results file: from the phase results headtohead.py wrote (``h2h-*.json`` in a folder),
the table of both drafters x both chains x both prompt sets (accept length, output tokens/s, with the plain
target's tokens/s beside) and both trainers (tokens/s, peak memory, wall time), with the ratios.

    python -m bench.gpu.h2hreport GPU_OUT_DIR results [OTHER_CALLS_h2h-eval.json ...]
                                                              (writes gpu-headtohead.md and .json)
"""

import json
import statistics
import sys
from pathlib import Path

DRAFTERS = ("eaglet", "specforge")
PHASES = ("h2h-data", "h2h-extract", "h2h-eaglet", "h2h-specforge", "h2h-score", "h2h-eval", "h2h-trainspeed")
ABLATED = "h2h-ablations"
LAYOUTS = "h2h-layouts"
DEFAULT_FLAGS = "(default recipe)"  # headtohead.py's flags of a recipe that changes nothing
LAYOUT_RECIPE = "layout-"  # headtohead.py: recipe layout-<name>[.<variant>] trains on layout <name>'s run


def load(out_dir: Path) -> dict:
    """Each phase's results, {} for a phase that wrote none; the recipes compared (``h2h-ablations``) too."""
    results = {}
    for phase in (*PHASES, ABLATED, LAYOUTS):
        p = out_dir / f"{phase}.json"
        try:
            results[phase] = json.loads(p.read_text()) if p.exists() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a phase's JSON results ({e})") from e
    return results


def ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def number(x):
    """A figure as a number: Redis hashes hand back strings ("4168", "16600.5"); anything else is kept as is."""
    if isinstance(x, str):
        for kind in (int, float):
            try:
                return kind(x)
            except ValueError:
                pass
    return x


def fmt(x, nd: int = 2) -> str:
    x = number(x)
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def pct(x) -> str:
    return "—" if x is None else f"{x:+.1%}"


def rates(xs) -> str:
    return "—" if not xs else " / ".join(f"{x:.2f}" for x in xs)


def agree(a: dict | None) -> str:
    return "—" if not a else f"{a['same']}/{a['of']}"


def first_difference(a, b) -> int:
    """Where two sequences (texts or token ids) first differ: the length of their common prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def parted(outputs: list, reference: list) -> tuple[int, list[tuple[int, int]]]:
    """Outputs against the reference's, both present: how many are equal, and (which, where it first differs) for
    the others."""
    same, parts = 0, []
    for k, (a, b) in enumerate(zip(outputs, reference, strict=True)):
        if a is None or b is None:
            continue
        if a == b:
            same += 1
        else:
            parts.append((k, first_difference(a, b)))
    return same, parts


def agreement(texts: list, reference: list) -> dict:
    """How many greedy outputs equal the reference outputs, and where the others first differ (characters of the
    reference before the first difference, and that as a share of its length: late differences point at
    numerics rather than a wrong token)."""
    same, parts = parted(texts, reference)
    firsts = [n for _, n in parts]
    shares = [n / max(len(reference[k]), 1) for k, n in parts]
    mid = len(firsts) // 2
    return {"same": same, "of": len(texts), "first_difference_chars_median": sorted(firsts)[mid] if firsts else None,
            "first_difference_share_median": round(sorted(shares)[mid], 3) if shares else None}  # fmt: skip


def tie_agreement(ids: list, reference: list, reference_gaps: list, tie: float) -> dict:
    """Greedy outputs (token ids) against the reference's, where a difference may be numerics: per output that
    differs, the reference's log-probability gap between its top two tokens at the first differing token. A gap
    within ``tie`` is a near-tie (bf16 in other batch shapes may pick either token); a wider one is a wrong token."""
    same, parts = parted(ids, reference)
    gaps = [reference_gaps[k][n] if reference_gaps[k] and n < len(reference_gaps[k]) else None for k, n in parts]
    at_tie = sum(1 for g in gaps if g is not None and g <= tie)
    return {"same": same, "of": len(ids), "differ_at_near_tie": at_tie, "differ_otherwise": len(gaps) - at_tie,
            "tie_nats": tie, "first_difference_gaps": sorted(gaps, key=lambda g: (g is None, g))}  # fmt: skip


def beyond_tie(ids: list, reference: list, reference_gaps: list, tie: float, prompts: list) -> list[dict]:
    """The outputs that part from the reference's where its top two lie more than ``tie`` apart (or where no gap
    is known): which output, where, the prompt with the output's ids before that point (``prefix``), the output's
    token there and the reference's, and the reference's gap."""
    _, parts = parted(ids, reference)
    rows = []
    for k, n in parts:
        gap = reference_gaps[k][n] if reference_gaps[k] and n < len(reference_gaps[k]) else None
        if gap is not None and gap <= tie or n >= min(len(ids[k]), len(reference[k])):
            continue  # a near-tie, or one output a prefix of the other (a length, not a token, differs)
        rows.append({"output": k, "at": n, "prefix": [*prompts[k], *ids[k][:n]], "token": ids[k][n],
                     "reference_token": reference[k][n], "reference_gap": gap})  # fmt: skip
    return rows


def target_choices(rows: list[dict], first_ids: list, first_gaps: list, tie: float) -> dict:
    """``beyond_tie``'s rows against the target's own next token after each prefix (``first_ids``, one decoded
    token each, and its top-two gap): a row agrees when the target picks the output's token there, or its top two
    lie within ``tie``: the token is the target's own choice in that other batch shape, not the drafter's."""
    out = []
    for row, got, gaps in zip(rows, first_ids, first_gaps, strict=True):
        chose = got[0] if got else None
        gap = gaps[0] if gaps else None
        agrees = chose == row["token"] or (gap is not None and gap <= tie)
        out.append({k: row[k] for k in ("output", "at", "token", "reference_token", "reference_gap")}
                   | {"target_chose": chose, "target_gap": gap, "agrees": agrees})  # fmt: skip
    return {"rows": out, "agree": sum(r["agrees"] for r in out), "of": len(out)}


def summarize(results: dict, repeats: list[dict] = ()) -> dict:
    """The figures the table shows, and the ratios eaglet / SpecForge. ``repeats``: the evaluation phase's results
    of other calls on the same drafters (``h2h-eval.json``), shown beside the first: the spread of the speeds."""
    ev = results.get("h2h-eval", {})
    rows, ratios = [], {}
    for chain in ev.get("chains", []):
        for pset in ev.get("prompt_sets", []):
            base = ev.get("baseline", {}).get(pset, {}).get("output_tokens_per_s")
            row = {"chain": chain, "prompt_set": pset, "baseline_tokens_per_s": base}
            for d in DRAFTERS:
                r = ev.get(d, {}).get(chain, {}).get(pset, {})
                row[d] = {k: r.get(k) for k in ("accept_length", "output_tokens_per_s", "requests", "errors",
                                                "accept_rate_per_position", "same_text_as_target_alone")}  # fmt: skip
                row[d]["speedup"] = ratio(r.get("output_tokens_per_s"), base)
            row["accept_length_ratio"] = ratio(row["eaglet"]["accept_length"], row["specforge"]["accept_length"])
            row["runs"] = [run_figures(e, chain, pset) for e in [ev, *repeats]]
            ratios[f"accept_length {chain} {pset}"] = row["accept_length_ratio"]
            rows.append(row)
    trainers = {}
    for d in DRAFTERS:
        t = results.get(f"h2h-{d}", {})
        trainers[d] = {k: number(t.get(k)) for k in ("tokens_per_s", "peak_gpu_GiB", "wall_s", "train_tokens",
                                                      "epochs", "optimizer_steps", "rc", "error")}  # fmt: skip
        trainers[d]["peak_allocated_GiB"] = (t.get("probe") or {}).get("peak_allocated_GiB")
    ratios["trainer tokens/s"] = ratio(trainers["eaglet"]["tokens_per_s"], trainers["specforge"]["tokens_per_s"])
    ratios["trainer peak memory"] = ratio(trainers["eaglet"]["peak_gpu_GiB"], trainers["specforge"]["peak_gpu_GiB"])
    data = results.get("h2h-data", {})
    scores = results.get("h2h-score", {}).get("drafters", {})
    heldout = {d: {k: scores.get(d, {}).get(k) for k in ("heldout_acc", "heldout_loss", "samples", "tokens")}
               for d in DRAFTERS}  # fmt: skip
    base = ev.get("baseline", {})
    recipes_ = recipes(results, rows)
    return {
        "recipes": recipes_,
        "layouts": layouts(results, recipes_),
        "rows": rows,
        "heldout": heldout,
        "target_alone_repeat": {
            "concurrency": (base.get("humaneval_repeat") or {}).get("concurrency"),
            "first_concurrency": (base.get("humaneval") or {}).get("concurrency"),
            "same_text": (base.get("humaneval_repeat") or {}).get("same_text_as_target_alone"),
        },
        "trainers": trainers,
        "trainspeed": trainspeed(results.get("h2h-trainspeed", {}), trainers["specforge"]["tokens_per_s"]),
        "ratios": ratios,
        "data": {k: data.get(k) for k in ("conversations", "multi_turn", "heldout_prompts", "magpie", "wall_s")},
        "extract": {k: results.get("h2h-extract", {}).get(k) for k in ("samples", "tokens", "tokens_per_s", "wall_s")},
        "eval_settings": {k: ev.get(k) for k in ("max_new_tokens", "concurrency", "server_flags")},
        "errors": {p: results[p]["error"] for p in PHASES if results.get(p, {}).get("error")} | eval_errors(ev),
    }


def trainspeed(R: dict, specforge_tokens_per_s) -> list[dict]:
    """Per variant of h2h-trainspeed: its runs' tokens/s (the whole run, and the trainer's last report window),
    the median, range and spread ((max - min) / median) of the runs without a cold compile, the median's ratio to
    SpecForge's, held-out accuracy."""
    out = []
    for name, flags in (R.get("variants") or {}).items():
        runs = [r for r in R.get("rows", []) if r["variant"] == name]
        # a cold compile is a once-a-machine cost, not the variant's rate: shown, kept out of the median
        rates_ = sorted(r["tokens_per_s"] for r in runs if r.get("tokens_per_s") and not r.get("cold_compile"))
        mid = statistics.median(rates_) if rates_ else None
        out.append({
            "variant": name, "flags": flags, "runs": len(runs), "failed": sum(1 for r in runs if r.get("rc") != 0),
            "tokens_per_s": [r.get("tokens_per_s") for r in runs],
            "cold_compile": [r.get("cold_compile") for r in runs],
            "steady_tokens_per_s": [r.get("steady_tokens_per_s") for r in runs],
            "median_tokens_per_s": mid, "range": [rates_[0], rates_[-1]] if rates_ else None,
            "spread": round((rates_[-1] - rates_[0]) / mid, 3) if rates_ else None,
            "ratio_to_specforge": ratio(mid, specforge_tokens_per_s),
            "peak_allocated_GiB": max((r.get("peak_allocated_GiB") or 0 for r in runs), default=None),
            "heldout_acc": next((r["heldout_acc"] for r in runs if r.get("heldout_acc")), None),
        })  # fmt: skip
    return out


def recipes(results: dict, rows: list[dict]) -> list[dict]:
    """eaglet's default recipe and each one-change recipe: accept length per prompt set at the first chain (and
    its ratio to SpecForge's), acceptance per position and held-out accuracy per position, steps and wall time."""
    if not results.get(ABLATED):
        return []
    chain = rows[0]["chain"] if rows else None
    sf = {r["prompt_set"]: r["specforge"]["accept_length"] for r in rows if r["chain"] == chain}
    if not rows:  # recipes evaluated without the head-to-head (a storage run): their own prompt sets
        evals = [rec.get("eval") or {} for rec in results[ABLATED].values()]
        sf = dict.fromkeys(k for e in evals for k, v in e.items() if isinstance(v, dict))
    ev = results.get("h2h-eval", {}).get("eaglet", {}).get(chain, {})
    eaglet = results.get("h2h-eaglet", {})
    default = {"name": "h2h-eaglet", "flags": "",
               "train": {"wall_s": eaglet.get("wall_s"), "probe": eaglet.get("probe")},
               "score": results.get("h2h-score", {}).get("drafters", {}).get("eaglet"), "eval": ev}  # fmt: skip
    out = []
    ran = [default] if eaglet else []  # the head-to-head's own default drafter, where this run trained one
    for r in [*ran, *({"name": n, **rec} for n, rec in results[ABLATED].items())]:
        e, t, final = r.get("eval") or {}, r.get("train") or {}, ((r.get("train") or {}).get("probe") or {})
        row = {"name": r["name"], "flags": r.get("flags"), "wall_s": t.get("wall_s"), "error": t.get("error"),
               "trained_beside": t.get("trained_beside"), "as_run": as_run(final.get("config")),
               "steps": number((final.get("final") or final.get("train_hash") or {}).get("step")),
               "heldout_acc": (r.get("score") or {}).get("heldout_acc")}  # fmt: skip
        for pset, theirs in sf.items():
            al = (e.get(pset) or {}).get("accept_length")
            row[pset] = {"accept_length": al, "ratio_to_specforge": ratio(al, theirs),
                         "accept_rate_per_position": (e.get(pset) or {}).get("accept_rate_per_position")}  # fmt: skip
        out.append(row)
    return out


def layouts(results: dict, recipes_: list[dict]) -> list[dict]:
    """Per recipe trained on a storage layout's run (``layout-<name>``), and ``base`` (h2h-extract's run, the bf16
    reference): stored bytes per token, their ratio to the reference's, accept length per prompt set and its change
    against ``base``'s."""
    runs = results.get(LAYOUTS, {}).get("runs") or {}
    extract = results.get("h2h-extract", {})
    ref_bytes = ratio(number((extract.get("counts") or {}).get("bytes")), extract.get("tokens"))
    by_name = {r["name"]: r for r in recipes_}
    base = by_name.get("base")
    if not runs or not base:
        return []
    out = []
    for r in recipes_:
        if r["name"] != "base" and not r["name"].startswith(LAYOUT_RECIPE):
            continue
        if r is base:
            run = {"spec": "all:0:full", "bytes_per_token": ref_bytes}
        else:
            run = runs.get(r["name"].removeprefix(LAYOUT_RECIPE).partition(".")[0], {})
        per_token = run.get("bytes_per_token")
        row = {"name": r["name"], "flags": r["flags"], "spec": run.get("spec"), "bytes_per_token": per_token,
               "ratio_to_bf16": ratio(per_token, ref_bytes), "error": r.get("error")}  # fmt: skip
        for pset in (k for k in r if isinstance(r[k], dict)):
            al, ref = r[pset]["accept_length"], base[pset]["accept_length"]
            row[pset] = {"accept_length": al, "change": round(al / ref - 1, 4) if al and ref else None}
        out.append(row)
    return out


def as_run(config: dict | None) -> str:
    """The recipe's settings that the default recipe changed on 2026-12-02 (learning rate, norm before fc, noise on
    the auxiliary states), as the trainer resolved them: a recipe's flags are changes from the default of its day."""
    if not config:
        return "—"
    norm = "norm" if config.get("norm_before_fc") else "no norm"
    return f"lr {config.get('lr'):g}, {norm}, noise {config.get('aux_noise'):g}"


def run_figures(ev: dict, chain: str, pset: str) -> dict:
    """One evaluation call's accept lengths and output tokens/s for a chain and prompt set."""
    out = {"target alone tok/s": ev.get("baseline", {}).get(pset, {}).get("output_tokens_per_s")}
    for d in DRAFTERS:
        r = ev.get(d, {}).get(chain, {}).get(pset, {})
        out |= {f"{d} accept length": r.get("accept_length"), f"{d} tok/s": r.get("output_tokens_per_s")}
    return out


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
    if any(len(r["runs"]) > 1 for r in s["rows"]):
        keys = list(s["rows"][0]["runs"][0])
        head = "| chain | prompts | call | " + " | ".join(keys) + " |"
        lines += ["", "Each evaluation call (the same drafters, servers started again):", "", head,
                  "|---|---|---|" + "---|" * len(keys)]  # fmt: skip
        for r in s["rows"]:
            for i, run in enumerate(r["runs"], 1):
                figures = " | ".join(fmt(run[k], 3 if "length" in k else 0) for k in keys)
                lines.append(f"| {r['chain']} | {r['prompt_set']} | {i} | {figures} |")
    lines += ["", "Acceptance per draft position (share of verify steps that accepted the draft at position k) and "
              "greedy outputs equal to the target alone's:", "",
              "| chain | prompts | eaglet per position | SpecForge per position | eaglet same text | "
              "SpecForge same text |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in s["rows"]:
        e, f = r["eaglet"], r["specforge"]
        lines.append(
            f"| {r['chain']} | {r['prompt_set']} | {rates(e['accept_rate_per_position'])} | "
            f"{rates(f['accept_rate_per_position'])} | {agree(e['same_text_as_target_alone'])} | "
            f"{agree(f['same_text_as_target_alone'])} |"
        )
    rep = s["target_alone_repeat"]
    if rep["same_text"]:
        lines += ["", f"The target alone, HumanEval decoded again at concurrency {rep['concurrency']} (first at "
                  f"{rep['first_concurrency']}): {agree(rep['same_text'])} outputs the same (median first difference "
                  f"at {fmt(rep['same_text'].get('first_difference_share_median'))} of the text)."]  # fmt: skip
    if s["recipes"]:
        sets = [k for k in s["recipes"][0] if isinstance(s["recipes"][0][k], dict)]
        lines += ["", "eaglet's recipes, same data and SGLang build (accept length at the first chain, its ratio to "
                  "SpecForge's; flags: the changes from the trainer's default when the recipe ran, `as run` its "
                  "resolved learning rate, norm before fc and noise):", "",
                  "| recipe | flags | as run | "
                  + "".join(f"{p} accept length (÷ SpecForge); per position | " for p in sets)
                  + "held-out accuracy per position | steps | wall s (recipes trained beside it) |",
                  "|---|---|---|" + "---|" * len(sets) + "---|---|---|"]  # fmt: skip
        for r in s["recipes"]:
            cells = "".join(f"{fmt(r[p]['accept_length'], 3)} ({fmt(r[p]['ratio_to_specforge'], 3)}); "
                            f"{rates(r[p]['accept_rate_per_position'])} | " for p in sets)  # fmt: skip
            note = f" ({' '.join(str(r['error']).split())[:80]})" if r.get("error") else ""
            beside = f" ({r['trained_beside']})" if r.get("trained_beside") else ""
            lines.append(
                f"| {r['name']}{note} | {r['flags'] or '—'} | {r['as_run']} | {cells}"
                f"{rates(r['heldout_acc'])} | {fmt(r['steps'])} | {fmt(r['wall_s'], 1)}{beside} |"
            )
    if s["layouts"]:
        sets = [k for k in s["layouts"][0] if isinstance(s["layouts"][0][k], dict)]
        lines += ["", "Storage layouts (final state:k:auxiliary states; `base` is the extraction's bf16 run, every "
                  "other the same samples stored again in the layout), the default recipe on each:", "",
                  "| recipe | layout | bytes per token | ÷ bf16 | "
                  + "".join(f"{p} accept length (change against base) | " for p in sets),
                  "|---|---|---|---|" + "---|" * len(sets)]  # fmt: skip
        for r in s["layouts"]:
            cells = "".join(f"{fmt(r[p]['accept_length'], 4)} ({pct(r[p]['change'])}) | " for p in sets)
            note = f" ({' '.join(str(r['error']).split())[:80]})" if r.get("error") else ""
            flags = f" {r['flags']}" if r["flags"] and r["flags"] != DEFAULT_FLAGS else ""
            lines.append(f"| {r['name']}{note} | {r['spec'] or '—'}{flags} | {fmt(r['bytes_per_token'], 1)} | "
                         f"{fmt(r['ratio_to_bf16'], 3)} | {cells}".rstrip())  # fmt: skip
    lines += ["", "Held-out accuracy per draft position (eaglet's scorer, the same held-out samples for both):", "",
              "| drafter | samples | tokens | accuracy per position | loss |", "|---|---|---|---|---|"]  # fmt: skip
    for d, h in s["heldout"].items():
        lines.append(f"| {d} | {fmt(h['samples'])} | {fmt(h['tokens'])} | {rates(h['heldout_acc'])} | "
                     f"{fmt(h['heldout_loss'], 4)} |")  # fmt: skip
    lines += ["", "| trainer | tokens/s | peak GPU memory GiB (nvidia-smi) | peak allocated GiB (torch) | wall s | "
              "tokens trained | epochs | optimizer steps |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for d, t in s["trainers"].items():
        lines.append(
            f"| {d} | {fmt(t['tokens_per_s'], 0)} | {fmt(t['peak_gpu_GiB'])} | {fmt(t['peak_allocated_GiB'])} | "
            f"{fmt(t['wall_s'], 1)} | {fmt(t['train_tokens'])} | {fmt(t['epochs'])} | {fmt(t['optimizer_steps'])} |"
        )
    if s.get("trainspeed"):
        lines += ["", "eaglet's trainer alone, each variant in turn, repeated (`h2h-trainspeed`; tokens/s over the "
                  "whole run: start, compile and final held-out pass included; *steady*: the trainer's last report "
                  "window; *cold*: compiled with the machine's compile cache empty, left out of the median):", "",
                  "| variant | flags | runs: tokens/s (steady) | median | spread | ÷ SpecForge | peak allocated GiB | "
                  "held-out accuracy per position |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for v in s["trainspeed"]:
            runs = ", ".join(
                f"{fmt(t, 0)} ({fmt(st, 0)}){' cold' if cold else ''}"
                for t, st, cold in zip(v["tokens_per_s"], v["steady_tokens_per_s"], v["cold_compile"], strict=True)
            )
            lines.append(
                f"| {v['variant']} | `{v['flags'] or '(defaults)'}` | {runs} | {fmt(v['median_tokens_per_s'], 0)} | "
                f"{fmt(v['spread'], 3)} | {fmt(v['ratio_to_specforge'], 3)} | {fmt(v['peak_allocated_GiB'])} | "
                f"{rates(v['heldout_acc'])} |"
            )
    lines += ["", "Ratios (eaglet / SpecForge; aims: accept length >= 1.05, trainer tokens/s >= 1.5):", ""]
    lines += [f"- {k}: {fmt(v, 3)}" for k, v in s["ratios"].items()]
    if s["errors"]:
        lines += ["", "Failed phases:", ""] + [f"- {p}: {' '.join(str(e).split())}" for p, e in s["errors"].items()]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, results_dir: Path, repeats: list[Path] = ()) -> dict:
    s = summarize(load(out_dir), [json.loads(Path(p).read_text()) for p in repeats])
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "gpu-headtohead.json").write_text(json.dumps(s, indent=1))
    (results_dir / "gpu-headtohead.md").write_text(markdown(s))
    return s


if __name__ == "__main__":
    write(Path(sys.argv[1]), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
