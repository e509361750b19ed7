"""The head-to-head's variants: the trainers' speed side by side (``h2h-trainspeed``), the storage layouts
(``h2h-layouts``), the recipes trained and evaluated against the default (``h2h-ablate-train``, ``h2h-ablate-eval``)
and the gate on SpecForge's committed figures (``h2h-gate``).
"""

import json
import os
import re
import shlex
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.gpu import h2h, h2heval, h2hreport, h2htrain
from bench.gpu import harness as P

# The trainer's speed on the head-to-head's data (issue 25): eaglet's trainer alone on the GPU, each variant of
# H2H_TRAINSPEED (``name=trainer flags`` separated by ``;``) in turn, H2H_TRAINSPEED_REPEATS rounds of all of them, so
# a drift of the machine falls on every variant. A compiled run with the machine's compile cache empty compiles cold;
# later ones find its graphs on disk, as a resumed or repeated training does.
TRAINSPEED = os.environ.get("H2H_TRAINSPEED", "eager=--compile off;compiled=--compile on")


TRAINSPEED_REPEATS = int(os.environ.get("H2H_TRAINSPEED_REPEATS", "2"))


TRAINSPEED_RUNS = "h2h-trainspeed-runs"  # the rows of every call, kept apart from the phase's record (never reset)


# seconds a compiled trainer takes beyond eager's run when its compile cache is empty: 2026-12-04, one H200, 340 s
# against eager's 135 s on the same run (with the cache filled: 141-153 s)
COMPILE_COLD_S = 210


def trainspeed_variants() -> dict[str, str]:
    return {n.strip(): f.strip() for n, _, f in (item.partition("=") for item in TRAINSPEED.split(";") if item.strip())}


def compile_cache_empty() -> bool:
    """Whether torch's compile cache on this machine holds no compiled graph yet (inductor's FX graph cache)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return not any((Path(cache_dir()) / "fxgraph").glob("*/*"))


def estimate_trainspeed_row(flags: str, cold: bool) -> float:
    """A variant's run: eager's rate and start, plus a cold compile for a compiled run with the cache empty."""
    return h2htrain.estimate_eaglet() + (COMPILE_COLD_S if "--compile on" in flags and cold else 0)


def steady_tokens_per_s(log_tail: str) -> float | None:
    """The trainer's own rate over its last report window (its log line ``... N tok/s``): the steps alone."""
    rates = re.findall(r"(\d+) tok/s", log_tail)
    return float(rates[-1]) if rates else None


def phase_trainspeed() -> None:
    """Each variant of H2H_TRAINSPEED trained on h2h-extract's run as h2h-eaglet is (the default recipe, H2H_EPOCHS
    epochs, checkpoints only at the end), alone on the GPU, into a folder of its own, round after round: tokens/s
    over the trainer's whole run (its start, compile and final held-out pass included, as h2h-eaglet and
    h2h-specforge count), its own rate over its last report window, peak memory, held-out figures. A row not
    started for the call's time is left for the next call."""
    R = P.RESULTS.setdefault("h2h-trainspeed", {})
    rows = P.RESULTS.setdefault(TRAINSPEED_RUNS, {}).setdefault("rows", [])
    R["rows"] = rows  # the report's copy: this phase's record starts clean in a call that runs it again
    P.stop(h2h.SERVER)  # the GPU to the trainer alone
    run_id = P.RESULTS["h2h-extract"]["run_id"]
    train_tokens = sum(r[2] for r in h2htrain.training_rows()) * h2h.EPOCHS
    R.update(variants=trainspeed_variants(), repeats=TRAINSPEED_REPEATS, epochs=h2h.EPOCHS, train_tokens=train_tokens)
    for repeat in range(TRAINSPEED_REPEATS):
        for name, flags in trainspeed_variants().items():
            if any(r["variant"] == name and r["repeat"] == repeat for r in rows):
                continue
            cold = "--compile on" in flags and compile_cache_empty()
            need = estimate_trainspeed_row(flags, cold)
            if need > h2h.time_left():
                P.log(f"h2h-trainspeed: {name} #{repeat} needs ~{need:.0f}s, {h2h.time_left():.0f}s left: next call")
                R["done"] = False
                return
            out = h2h.H2H / "trainspeed" / f"{name}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            argv = [sys.executable, "-m", "bench.gpu.ablate", "--run", run_id, "--out", str(out),
                    "--model", str(h2h.SMOL),
                    "--epochs", str(h2h.EPOCHS), "--checkpoint-every", "1000000", *shlex.split(flags)]  # fmt: skip
            rec = h2htrain.run_trainer({}, f"h2h-trainspeed-{name}-{repeat}", argv, P.PY_EAGLET,
                              P.eaglet_env(h2h.SMOL, P.SGL_PORT), h2htrain.TRAIN_TIMEOUT, h2h.H2H)  # fmt: skip
            probe = rec.get("probe") or {}
            final = probe.get("final") or {}
            wall = probe.get("wall_s")
            ok = rec.get("rc") == 0 and bool(wall)
            rows.append({
                "variant": name, "repeat": repeat, "flags": flags, "rc": rec.get("rc"), "error": rec.get("error"),
                "cold_compile": cold,
                "wall_s": wall, "tokens_per_s": round(train_tokens / wall, 1) if ok else None,
                "steady_tokens_per_s": steady_tokens_per_s(rec.get("log_tail", "")),
                "optimizer_steps": final.get("step"), "peak_allocated_GiB": probe.get("peak_allocated_GiB"),
                "peak_gpu_GiB": rec.get("peak_gpu_GiB"), "heldout_loss": final.get("heldout_loss"),
                "heldout_acc": final.get("heldout_acc"), "log_tail": None if ok else rec.get("log_tail"),
            })  # fmt: skip
            P.log(f"h2h-trainspeed: {name} #{repeat}: {rows[-1]['tokens_per_s']} tokens/s over {wall}s")
            P.save(TRAINSPEED_RUNS)
            P.save("h2h-trainspeed")
            shutil.rmtree(out, ignore_errors=True)
    R["done"] = True


def ablations() -> dict[str, str]:
    """H2H_ABLATIONS: ``name=trainer flags`` separated by ``;`` (``base``: the default recipe, trained beside the
    others; ``fp8``: the default recipe on the conversations extracted again with fp8 storage; a flag ``@name``:
    recipe name's drafter folder, so ``onpolicy`` is an on-policy round from ``base``'s drafter, trained once base
    is). Each is one change from eaglet's default recipe but ``combo``, the promising ones together."""
    spec = os.environ.get("H2H_ABLATIONS", DEFAULT_ABLATIONS)
    return {n.strip(): f.strip() for n, _, f in (item.partition("=") for item in spec.split(";") if item.strip())}


# The default recipe (lr 1e-3, norm before fc, noise 0.05 on the auxiliary states: chosen from the 2026-12-02
# table, results/gpu-headtohead.md), the one it replaced, each of its three changes taken back one at a time,
# and the levers not in it
DEFAULT_ABLATIONS = (
    "base=;fp8=;was=--lr 1e-4 --no-norm-before-fc --aux-noise 0;lr3=--lr 3e-4;nonorm=--no-norm-before-fc;"
    "nonoise=--aux-noise 0;lk=--loss lk-lambda;muon=--optimizer muon;posmask=--loss-mask-align position;"
    "onpolicy=--onpolicy-from @base --epochs 1;onpolicy-w1=--onpolicy-from @base --epochs 1 --onpolicy-weight 1"
)


ABLATED = "h2h-ablations"  # one record for every recipe, kept apart from the phases' own (never reset)


# The recipes train together on the one GPU (a 135M target's drafter leaves it mostly idle), checkpointing every
# ABLATE_CHECKPOINT_EVERY steps: one cut off by the call's end resumes there in the next call.
ABLATE_PARALLEL = int(os.environ.get("H2H_ABLATE_PARALLEL", "8"))


ABLATE_CHECKPOINT_EVERY = int(os.environ.get("H2H_ABLATE_CHECKPOINT_EVERY", "200"))


# Evaluation servers at once, each with this --mem-fraction-static: SGLang sizes its pool from the memory free at
# its start, so each takes at most an eighth of the GPU (the 135M target's KV for 64 requests is under 1 GB)
EVAL_PARALLEL = int(os.environ.get("H2H_EVAL_PARALLEL", "7"))


EVAL_PARALLEL_MEM = 0.12


LAYOUTS = os.environ.get("H2H_LAYOUTS", "loss=loss:0:full;fp4=all:0:fp4;top32-fp4=topk:32:fp4;top24-fp4=topk:24:fp4")


LAYOUT_RECIPE = "layout-"  # a recipe named layout-<name>[.<variant>] trains on the run of layout <name> (phase


def phase_layouts() -> None:
    """Each layout of H2H_LAYOUTS (``name=final:k:aux`` separated by ``;``) derived from h2h-extract's stored
    samples, bf16, into a run of its own: the layouts differ in their storage only, on the very same states."""
    import torch
    from redis import Redis

    from bench.quality import derive_run
    from eaglet.shared.layout import Layout
    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import samples_dir
    from eaglet.shared.targettensors import load_target_tensors

    if h2h.done("h2h-layouts"):
        return
    # The extraction's server busy-polls its CPU cores, which the 4-bit encoder here needs: on 2026-12-04 the fp4
    # layout ran past a call's 570 s beside it (the likely cause), and top24-fp4's 1.4 M tokens took 34 s without it.
    P.stop(h2h.SERVER)
    P.redis_up()
    R = P.RESULTS.setdefault("h2h-layouts", {})
    for attempt in R.get("earlier_attempts", []):  # a layout stored by a call cut short is whole: keep it
        R.setdefault("runs", {}).update(attempt.get("runs", {}))
    src = P.RESULTS["h2h-extract"]["run_id"]
    redis = Redis.from_url(P.REDIS_URL, decode_responses=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm_head = load_target_tensors(h2h.SMOL, ("lm_head",))["lm_head"].to(device)
    samples = SampleSet(samples_dir(P.DATA, src))
    tokens = sum(samples.length(i) for i in range(len(samples)))
    runs = R.setdefault("runs", {})
    for item in filter(None, LAYOUTS.split(";")):
        name, spec = item.split("=")
        final, k, aux = spec.split(":")
        if name in runs:
            continue
        run, t = f"{src}-{name}", time.time()
        stored = derive_run(redis, P.DATA, src, run, "bf16", 1 << 62, Layout(final=final, topk=int(k), aux=aux),
                            lm_head)  # fmt: skip
        runs[name] = {"run_id": run, "spec": spec, "bytes_per_token": round(stored / tokens, 1),
                      "wall_s": round(time.time() - t, 1)}  # fmt: skip
        P.log(f"h2h-layouts: {name} -> {run}, {runs[name]['bytes_per_token']} B/token")
        P.save("h2h-layouts")
    R["done"] = True


def recipe_run(name: str) -> tuple[str | None, str | None]:
    """(the stored run recipe ``name`` trains on, why none): the fp8 extraction for ``fp8``, a layout's run for
    ``layout-<name>``, else h2h-extract's."""
    if name == "fp8":
        R = P.RESULTS.get("h2h-extract-fp8", {})
        return (R["run_id"], None) if R.get("done") else (None, "no fp8 extraction (phase h2h-extract-fp8)")
    if name.startswith(LAYOUT_RECIPE):
        layout = name.removeprefix(LAYOUT_RECIPE).partition(".")[0]
        run = P.RESULTS.get("h2h-layouts", {}).get("runs", {}).get(layout)
        return (run["run_id"], None) if run else (None, f"no run of layout {name} (phase h2h-layouts)")
    R = P.RESULTS.get("h2h-extract", {})
    return (R["run_id"], None) if R.get("done") else (None, "no extraction (phase h2h-extract)")


def drafter_flags(flags: str, recipes: dict) -> tuple[list[str], str | None]:
    """A recipe's trainer flags with each ``@name`` as recipe name's drafter folder, or why it cannot train yet
    (that recipe is not trained to its end). ValueError for a name that is no recipe."""
    out = []
    for flag in flags.split():
        if flag.startswith("@"):
            name = flag[1:]
            if name not in ablations():
                raise ValueError(f"H2H_ABLATIONS: {flags!r} names {flag}, which is no recipe of H2H_ABLATIONS")
            if recipes.get(name, {}).get("train", {}).get("rc") != 0:
                return [], f"starts from recipe {name}'s drafter: trained once {name} is"
            flag = recipes[name]["drafter_dir"]
        out.append(flag)
    return out, None


def phase_ablate_train() -> None:
    """Every recipe not trained yet, together on the GPU (up to ABLATE_PARALLEL): eaglet's trainer, the default
    recipe with one change, on the same stored run, each into its own folder (the run's drafter untouched). A recipe
    cut off by the call's end keeps its checkpoints and resumes from them in the next call; its wall time is the
    sum over calls, spent beside the others (``trained_beside``)."""
    A = P.RESULTS.setdefault(ABLATED, {})
    P.stop(h2h.SERVER)  # the GPU to the trainers
    jobs = []
    for name, flags in ablations().items():
        rec = A.setdefault(name, {"flags": flags or "(default recipe)"})
        if rec.get("train", {}).get("rc") == 0:
            continue
        run_id, missing = recipe_run(name)
        if missing:
            rec["train"] = {"error": missing}
            continue
        trainer_flags, waiting = drafter_flags(flags, A)
        if waiting:  # not an error: trained in a later call
            rec["train"] = {"waiting": waiting}
            continue
        out = h2h.H2H / "recipes" / name
        argv = [sys.executable, "-m", "bench.gpu.ablate", "--run", run_id, "--out", str(out),
                "--model", str(h2h.SMOL),
                "--epochs", str(h2h.EPOCHS), "--checkpoint-every", str(ABLATE_CHECKPOINT_EVERY),
                *trainer_flags]  # fmt: skip
        rec["drafter_dir"] = str(out / "drafter")
        jobs.append((rec, {}, f"h2h-recipe-{name}", argv))  # (recipe, this call's trainer record, process, argv)
    jobs = jobs[:ABLATE_PARALLEL]
    if jobs and h2h.time_left() > 60:
        P.log(f"h2h-ablate-train: {', '.join(n for _, _, n, _ in jobs)} together, {h2h.time_left():.0f}s left")
        threads = str(max(1, (os.cpu_count() or 16) // len(jobs)))  # the machine's cores shared, not each one's
        # the GPU's memory shared too (one trainer peaks near 12 GiB reserved), in segments that grow in place so
        # that varying batch shapes do not fragment each process's cache
        share = f"{0.95 / len(jobs):.3f}"
        env = {**P.eaglet_env(h2h.SMOL, P.SGL_PORT), "OMP_NUM_THREADS": threads, "ABLATE_GPU_SHARE": share,
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip
        h2htrain.run_trainers(
            [(R, n, argv) for _, R, n, argv in jobs], P.PY_EAGLET, env, h2htrain.TRAIN_TIMEOUT, h2h.H2H
        )
        for rec, R, _, _ in jobs:
            R["trained_beside"] = len(jobs) - 1
            R["wall_s"] = round(R["wall_s"] + rec.get("train", {}).get("wall_s", 0), 1)  # the calls' sum
            rec["train"] = R
        P.save(ABLATED)
    P.RESULTS.setdefault("h2h-ablate-train", {})["done"] = all(
        A.get(n, {}).get("train", {}).get("rc") == 0 for n in ablations()
    )


def phase_ablate_eval() -> None:
    """Each trained recipe not evaluated yet: eaglet's scorer on the held-out samples (all recipes in one process),
    beside SGLang at the first chain on both prompt sets, EVAL_PARALLEL servers at once on ports of their own
    (accept length does not depend on what shares the GPU: h2h-eval measured it twice, in other batches)."""
    A = P.RESULTS.setdefault(ABLATED, {})
    ready = {  # trained to the end: a recipe cut off or failed has a drafter of its last checkpoint, not its own
        n: r for n, r in A.items() if not evaluated(r) and r.get("train", {}).get("rc") == 0
    }
    if not ready:
        P.RESULTS.setdefault("h2h-ablate-eval", {})["done"] = bool(A) and all(evaluated(r) for r in A.values())
        return
    P.stop_all()  # the GPU to the evaluation servers
    prompts = h2heval.eval_prompts(h2h.tokenizer())
    ports = list(range(P.SGL_PORT + 10, P.SGL_PORT + 10 + EVAL_PARALLEL))
    lock = threading.Lock()

    def one(name: str) -> None:
        with lock:
            port = ports.pop()
        try:
            if h2h.time_left() < 130:  # a server start and two prompt sets
                A[name]["eval"] = {s: {"error": "not run: out of this call's time"} for s in prompts}
            else:
                A[name]["eval"] = h2heval.evaluate(
                    f"recipe {name}", A[name]["drafter_dir"], h2h.CHAINS[0], prompts, {}, port,
                    EVAL_PARALLEL_MEM)  # fmt: skip
        finally:
            with lock:
                ports.append(port)
                P.save(ABLATED)

    unscored = {n: r["drafter_dir"] for n, r in ready.items() if not (r.get("score") or {}).get("heldout_acc")}
    with ThreadPoolExecutor(EVAL_PARALLEL + 1) as ex:
        scored = (
            ex.submit(h2heval.score, "h2h-recipe-score", unscored, h2h.H2H / "h2h-recipes-score.json")
            if unscored
            else None
        )
        list(ex.map(one, ready))
        if scored is not None:
            figures = scored.result()
            for n in unscored:
                A[n]["score"] = figures["drafters"].get(n) or {"error": f"no score: {figures['log_tail'][-300:]}"}
    P.save(ABLATED)
    P.RESULTS.setdefault("h2h-ablate-eval", {})["done"] = all(evaluated(r) for r in A.values())


def evaluated(recipe: dict) -> bool:
    """The recipe was decoded on every prompt set without an error."""
    sets = [r for r in (recipe.get("eval") or {}).values() if isinstance(r, dict)]  # beside server_startup_s
    return bool(sets) and not any("error" in r for r in sets)


def phase_gate() -> None:
    """The release gate: eaglet's default recipe as this call's h2h-eval measured it, per position, against the
    committed SpecForge figures (results/gpu-headtohead.json): ratio >= 1.05 on every prompt set passes."""
    R = P.RESULTS.setdefault("h2h-gate", {})
    committed = json.loads((P.REPO / "results" / "gpu-headtohead.json").read_text())
    ev = P.RESULTS.get("h2h-eval", {})
    chain = str(h2h.CHAINS[0])
    rows = []
    for row in committed["rows"]:
        if row["chain"] != chain:
            continue
        mine = ev.get("eaglet", {}).get(chain, {}).get(row["prompt_set"], {})
        theirs = row["specforge"]["accept_length"]
        rows.append({"prompt_set": row["prompt_set"], "accept_length": mine.get("accept_length"),
                     "accept_rate_per_position": mine.get("accept_rate_per_position"),
                     "specforge_accept_length": theirs,
                     "ratio": h2hreport.ratio(mine.get("accept_length"), theirs)})  # fmt: skip
    R["rows"] = rows
    R["passed"] = bool(rows) and all((r["ratio"] or 0) >= 1.05 for r in rows)
    for r in rows:
        P.log(
            f"gate {r['prompt_set']}: accept length {r['accept_length']}, per position "
            f"{r['accept_rate_per_position']}; SpecForge {r['specforge_accept_length']}; ratio {r['ratio']}"
        )
    P.log(f"gate: {'passed' if R['passed'] else 'NOT passed'} (>= 1.05 on every prompt set)")
    R["done"] = True
