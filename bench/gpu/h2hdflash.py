"""DFlash in the head-to-head: eaglet's DFlash drafters trained on the kept conversations and served by SGLang's
DFLASH worker, beside the target alone, in one call sequence (bench/gpu/README.md has the commands).

  dfl-extract  the conversations through eaglet again, stored for a DFlash drafter (``--method dflash``: DFlash's
               five layers of the target, every state kept as h2h-extract keeps them) by the plugin server, which
               captures them (H2H_AUX_LAYER_IDS).
  dfl-train    eaglet's DFlash trainer on that run, one drafter a learning rate of DFL_LRS (``--dflash-lr``), and
               SpecForge 0.2.0's DFlash trainer on the same stored states (its offline features, converted), one
               drafter a learning rate of DFL_SPECFORGE_LRS, all together on the GPU, H2H_EPOCHS epochs; a drafter
               cut off by the call's end resumes from its checkpoint (SpecForge's: its last save) in the next call.
  dfl-eval     one plain SGLang build: the target alone, then every trained drafter at once (a server each,
               ``--speculative-algorithm DFLASH``), on HumanEval and the held-out prompts, greedy: accept length,
               acceptance per block position, output tokens/s, outputs equal to the target alone's.
  dfl-served   the product's served stage (``eaglet eval --engine sglang``) on eaglet's drafter, the bf16 target then
               an fp8 one: the run's record, served beside predicted, and its status lines.
  dfl-report   $OUT/dflash.json: ``rows`` of {method, trainer, prompt_set, accept_length, tokens_per_s}, this call's
               target alone beside them, and EAGLE-3 at (3, 1, 4): eaglet's and SpecForge's as this sequence's
               h2h-eval served them, else eaglet's default as the committed 2026-12-04 run served it (labelled).
"""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bench.gpu import h2h, h2heval, h2htrain
from bench.gpu import harness as P

LRS = [x.strip() for x in os.environ.get("DFL_LRS", "6e-4").split(",") if x.strip()]
# more eaglet drafters at the first of DFL_LRS, each with trainer flags of its own: "name=flags;name=flags"
# (e.g. "scaled=--dflash-scale-inputs")
RECIPES = dict(r.split("=", 1) for r in os.environ.get("DFL_RECIPES", "").split(";") if r.strip())
# SpecForge's sweep (its default 1e-4 first); empty: eaglet's drafters alone
SPECFORGE_LRS = [x.strip() for x in os.environ.get("DFL_SPECFORGE_LRS", "1e-4,3e-4,1e-3").split(",") if x.strip()]
# the layers the DFlash run stores (eaglet's ids); unset: DFlash's default for the target (SmolLM2: 2, 9, 15, 21, 28).
# The CPU rehearsal's tiny target has too few layers for the default's five.
LAYERS = [int(x) for x in os.environ.get("DFL_AUX_LAYER_IDS", "").split(",") if x.strip()]
CHECKPOINT_EVERY = int(os.environ.get("DFL_CHECKPOINT_EVERY", "200"))
# the served stage's targets: bf16, and fp8 as it may be served (a short call: bf16 alone)
SERVED_TARGETS = [x.strip() for x in os.environ.get("DFL_SERVED_TARGETS", "bf16,fp8").split(",") if x.strip()]
SPECFORGE_SAVES = 6  # SpecForge's checkpoints over its run
EVAL_MEM = 0.12  # --mem-fraction-static of each drafter's server: several share the GPU (as h2h-ablate-eval's)
# eaglet's EAGLE-3 default at (3, 1, 4) on the kept data, served by SGLang 0.5.17 (one H200, 2026-12-04): the recipes'
# run's `base` row
EAGLE3_COMMITTED = P.REPO / "results" / "gpu-storage-modes-2026-12-04" / "h2h-ablations.json"


def drafter_name(lr: str) -> str:
    return f"dflash-lr{lr}"


def eaglet_drafters() -> list[tuple[str, str, str]]:
    """(name, learning rate, extra trainer flags) of every eaglet drafter the call trains: DFL_LRS's, then
    DFL_RECIPES' at the first rate."""
    return [(drafter_name(lr), lr, "") for lr in LRS] + [
        (f"dflash-{name.strip()}", LRS[0], flags.strip()) for name, flags in RECIPES.items()
    ]


def specforge_name(lr: str) -> str:
    return f"sf-dflash-lr{lr}"


def phase_extract() -> None:
    if h2h.done("dfl-extract"):
        return
    from eaglet.shared.runoptions import EVERY_STATE

    h2h.ensure_model()
    h2h.plugin_server(graphs=False)
    R = P.RESULTS.setdefault("dfl-extract", {})
    R["run_id"] = f"h2h-dflash-{int(time.time())}"
    options = {**EVERY_STATE, "method": "dflash", **({"aux_layer_ids": LAYERS} if LAYERS else {})}
    R.update(P.pipeline(R["run_id"], h2h.SMOL, h2h.H2H / "train.jsonl", P.SGL_PORT, h2h.WORKERS, 2048,
                        timeout=h2h.time_left(40), store_options=options))  # fmt: skip
    R["done"] = bool(R.get("complete"))


def specforge_jobs(run_id: str, R: dict) -> tuple[list[tuple[dict, str, list[str]]], dict]:
    """SpecForge 0.2.0's DFlash trainer, one run a learning rate of DFL_SPECFORGE_LRS not trained to its end yet, on
    the same stored states (features converted once): its defaults but the epochs, the batch (eaglet's samples a
    step) and the drafter's layer count (eaglet's, so that both read the same stored target layers: checked).
    Returns the jobs and their own environment (SpecForge's folder)."""
    from bench.gpu.specforge_features import run_config, target_view
    from eaglet.services.trainer.config import TrainConfig
    from eaglet.shared.layers import dflash_layer_ids

    drafters = R.setdefault("drafters", {})
    todo = [lr for lr in SPECFORGE_LRS if drafters.get(specforge_name(lr), {}).get("rc") != 0]
    if not todo:
        return [], {}
    n_layers = TrainConfig().dflash_layers
    target_layers = int(json.loads((h2h.SMOL / "config.json").read_text())["num_hidden_layers"])
    try:  # SpecForge's rule for the layers, as SGLang's (eaglet's ids)
        theirs: list[int] | str = dflash_layer_ids(target_layers, n_layers)
    except ValueError as e:
        theirs = str(e)
    stored = LAYERS or theirs
    if theirs != stored or isinstance(theirs, str):
        for lr in todo:
            drafters[specforge_name(lr)] = {"dflash_lr": lr, "trainer": "specforge", "rc": None,
                                            "error": f"SpecForge's {n_layers}-layer drafter reads layers {theirs}, "
                                                     f"the run stored {stored}"}  # fmt: skip
        return [], {}
    rows = h2htrain.training_rows(run_id)
    feats = h2h.H2H / "sf-dflash-features"
    if not R.get("specforge_convert"):
        R["specforge_convert"] = h2htrain.specforge_features(run_id, rows, feats, "dflash")
        P.save("dfl-train")
    batches, batch_size = h2htrain.specforge_batch(rows)
    target = target_view(h2h.SMOL, P.MODELS / "smollm2-specforge")
    jobs, own = [], {}
    for lr in todo:
        name = specforge_name(lr)
        out = h2h.H2H / "sf-dflash" / name
        out.mkdir(parents=True, exist_ok=True)
        steps = -(-len(rows) // batch_size) * h2h.EPOCHS
        cfg = run_config(target, feats, out, epochs=h2h.EPOCHS, batch_size=batch_size, max_length=2048, lr=float(lr),
                         dflash_layers=n_layers)  # fmt: skip
        # saves along the way (SpecForge keeps none when stopped): one cut off by the call's end resumes from its last
        cfg["training"]["save_interval"] = max(1, steps // SPECFORGE_SAVES)
        if list((out / "output").glob("h2h-step*")):
            cfg["training"]["resume_from"] = str(out / "output")
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
        rec = drafters.setdefault(name, {})
        rec.update(dflash_lr=lr, trainer="specforge", config=cfg, batch_size=batch_size, layers=stored,
                   optimizer_steps=steps, drafter_dir=str(out / "drafter"),
                   train_tokens=sum(r[2] for r in rows) * h2h.EPOCHS)  # fmt: skip
        jobs.append((rec, f"dfl-train-{name}", [sys.executable, "bench/gpu/specforge_train.py",
                                                str(out / "config.json"), str(out / "drafter")]))  # fmt: skip
        own[f"dfl-train-{name}"] = (h2h.PY_SPECFORGE, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    return jobs, own


def phase_train() -> None:
    """Every drafter not trained to its end yet, eaglet's (a learning rate of DFL_LRS each) and SpecForge's (one of
    DFL_SPECFORGE_LRS each), together on the GPU, each into a folder of its own."""
    R = P.RESULTS.setdefault("dfl-train", {})
    run_id = P.RESULTS.get("dfl-extract", {}).get("run_id")
    if not P.RESULTS.get("dfl-extract", {}).get("done"):
        R["error"] = "no DFlash extraction (phase dfl-extract)"
        return
    P.stop(h2h.SERVER)  # the GPU to the trainers
    drafters = R.setdefault("drafters", {})
    for earlier in R.get("earlier_attempts", []):  # a call cut short: its trainers resume where they stopped
        drafters.update(earlier.get("drafters", {}))
        if earlier.get("specforge_convert"):
            R["specforge_convert"] = earlier["specforge_convert"]
    train_tokens = sum(r[2] for r in h2htrain.training_rows(run_id)) * h2h.EPOCHS
    jobs = []
    for name, lr, flags in eaglet_drafters():
        rec = drafters.setdefault(name, {"dflash_lr": lr, "trainer": "eaglet", "flags": flags})
        if rec.get("rc") == 0:
            continue
        out = h2h.H2H / "dflash" / name
        argv = [sys.executable, "-m", "bench.gpu.ablate", "--run", run_id, "--out", str(out), "--model", str(h2h.SMOL),
                "--method", "dflash", "--dflash-lr", lr, "--epochs", str(h2h.EPOCHS),
                "--checkpoint-every", str(CHECKPOINT_EVERY), *flags.split()]  # fmt: skip
        rec.update(drafter_dir=str(out / "drafter"), train_tokens=train_tokens)
        jobs.append((rec, f"dfl-train-{name}", argv))
    sf_jobs, own = specforge_jobs(run_id, R)
    jobs += sf_jobs
    if jobs and h2h.time_left() > 60:
        threads = str(max(1, (os.cpu_count() or 16) // len(jobs)))
        env = {**P.eaglet_env(h2h.SMOL, P.SGL_PORT), "OMP_NUM_THREADS": threads,
               "ABLATE_GPU_SHARE": f"{0.95 / len(jobs):.3f}",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip
        own = {n: (path, {**e, "OMP_NUM_THREADS": threads}) for n, (path, e) in own.items()}
        runs = [{} for _ in jobs]
        h2htrain.run_trainers([(this, n, argv) for this, (_, n, argv) in zip(runs, jobs, strict=True)], P.PY_EAGLET,
                              env, h2htrain.TRAIN_TIMEOUT, h2h.H2H, own)  # fmt: skip
        for this_call, (rec, _, _) in zip(runs, jobs, strict=True):
            probe = this_call.get("probe") or {}
            wall = this_call["wall_s"] + rec.get("wall_s", 0)  # the calls' sum: a run cut off resumes in the next
            rec.update(rc=this_call["rc"], error=this_call.get("error"), wall_s=round(wall, 1),
                       trained_beside=len(jobs) - 1, peak_gpu_GiB=this_call.get("peak_gpu_GiB"),
                       peak_allocated_GiB=probe.get("peak_allocated_GiB"), final=probe.get("final"),
                       export=probe.get("export"),
                       log_tail=None if this_call["rc"] == 0 else this_call.get("log_tail"))  # fmt: skip
            if this_call["rc"] == 0:  # start-ups included, beside the others on the GPU
                rec["tokens_per_s"] = round(rec["train_tokens"] / wall, 1)
        P.save("dfl-train")
    R["done"] = all(
        drafters.get(n, {}).get("rc") == 0
        for n in [*(d[0] for d in eaglet_drafters()), *map(specforge_name, SPECFORGE_LRS)]
    )


def phase_eval() -> None:
    """The target alone first (the texts the drafters' outputs are held against), then every trained drafter's
    server at once, on ports of their own: accept length does not depend on what shares the GPU."""
    trained = {n: r["drafter_dir"] for n, r in P.RESULTS.get("dfl-train", {}).get("drafters", {}).items()
               if r.get("rc") == 0}  # fmt: skip
    R = P.RESULTS.setdefault("dfl-eval", {})
    drafters = R.setdefault("drafters", {})
    # a drafter trained after an earlier call's evaluation is served in this one
    trained = {n: d for n, d in trained.items() if not served_well(drafters.get(n))}
    if h2h.done("dfl-eval") and not trained:
        return
    h2h.ensure_model()
    prompts = h2heval.eval_prompts(h2h.tokenizer())
    R.update(prompt_sets=list(prompts), max_new_tokens=h2h.EVAL_TOKENS, concurrency=h2h.EVAL_CONCURRENCY,
             server_flags=" ".join(h2h.EVAL_EXTRA + P.SGL_BASE))  # fmt: skip
    P.stop_all()
    base_texts: dict = {}
    R["baseline"] = h2heval.evaluate("baseline", None, None, prompts, base_texts)
    P.save("dfl-eval")
    ports = list(range(P.SGL_PORT + 10, P.SGL_PORT + 10 + max(1, len(trained))))
    lock = threading.Lock()

    def one(name: str) -> None:
        with lock:
            port = ports.pop()
        try:
            if h2h.time_left() < 130:  # a server start and two prompt sets
                drafters[name] = {s: {"error": "not run: out of this call's time"} for s in prompts}
            else:
                drafters[name] = h2heval.evaluate(name, trained[name], h2heval.DFLASH, prompts, base_texts, port,
                                                  EVAL_MEM)  # fmt: skip
        finally:
            with lock:
                ports.append(port)
                P.save("dfl-eval")

    with ThreadPoolExecutor(max(1, len(trained))) as ex:
        list(ex.map(one, trained))
    R["done"] = bool(trained) and all(
        "error" not in res for d in drafters.values() for res in d.values() if isinstance(res, dict)
    )


def served_well(sets: dict | None) -> bool:
    """True when a drafter's evaluation holds every prompt set, none of them an error."""
    return bool(sets) and all(isinstance(r, dict) and "error" not in r for r in sets.values())


def phase_served() -> None:
    """The product's served stage on eaglet's DFlash drafter (the first of DFL_LRS): ``eaglet eval --engine sglang``
    on the held-out prompts with the bf16 target, then with ``--target-quantization fp8``, each writing the run's
    evaluation record (served beside the accept length the drafter's own held-out figures predict); then the run's
    status lines, the earlier evaluation among them. DFL_SERVED_TARGETS: the targets (bf16,fp8);
    DFL_SERVED_ENGINE=reference: the CPU rehearsal's, bf16 only."""
    from redis import Redis

    from eaglet.shared.alerts import StatusConfig
    from eaglet.shared.runstate import RunState
    from eaglet.shared.status import read_run

    if h2h.done("dfl-served"):
        return
    R = P.RESULTS.setdefault("dfl-served", {})
    run_id = P.RESULTS.get("dfl-extract", {}).get("run_id")
    drafter = P.RESULTS.get("dfl-train", {}).get("drafters", {}).get(drafter_name(LRS[0]), {})
    if not run_id or drafter.get("rc") != 0:
        R["error"] = "no trained eaglet DFlash drafter (phases dfl-extract, dfl-train)"
        return
    P.stop_all()
    engine = os.environ.get("DFL_SERVED_ENGINE", "sglang")
    # the same server flags as dfl-eval's servers
    env = {**P.eaglet_env(h2h.SMOL, P.SGL_PORT), "EAGLET_EVAL_SGLANG_ARGS": " ".join(h2h.EVAL_EXTRA + P.SGL_BASE)}
    redis = Redis.from_url(P.REDIS_URL, decode_responses=True)
    for target in SERVED_TARGETS if engine == "sglang" else ["bf16"]:
        quantization = "" if target == "bf16" else target
        name = f"dfl-served-{target}"
        argv = [sys.executable, "-m", "eaglet.cli.main", "eval", "--run", run_id, "--engine", engine,
                "--prompts", str(h2h.H2H / "heldout.jsonl"), "--model", str(h2h.SMOL), "--drafter",
                drafter["drafter_dir"], "--max-new-tokens", str(h2h.EVAL_TOKENS),
                *(["--concurrency", str(h2h.EVAL_CONCURRENCY)] if engine == "sglang" else []),
                *(["--target-quantization", quantization] if quantization else [])]  # fmt: skip
        if h2h.time_left() < 150:  # two server starts and the prompts
            R[name] = {"error": "not run: out of this call's time"}
            continue
        proc = P.start(name, argv, P.PY_EAGLET, env)
        try:
            rc: int | None = proc.wait(max(1, h2h.time_left(10)))
        except subprocess.TimeoutExpired:
            P.stop(name)  # its servers with it: the whole process group
            rc = None
        R[name] = {"rc": rc, "cmd": " ".join(argv[2:]), "record": RunState(redis, run_id).eval().to_redis(),
                   "log_tail": None if rc == 0 else P.tail(name, 30)}  # fmt: skip
        P.save("dfl-served")
    report = read_run(redis, run_id, config=StatusConfig())
    if report is not None:
        run = report.run
        R.update(lines=run.lines, earlier_evaluations=run.earlier_evaluations,
                 alerts=[a.message for a in run.alerts if a.kind == "served_acceptance"])  # fmt: skip
    R["done"] = all(r.get("rc") == 0 for k, r in R.items() if k.startswith("dfl-served-"))


def rows() -> list[dict]:
    """The committed table's rows: each served drafter and the target alone on each prompt set."""
    ev = P.RESULTS.get("dfl-eval", {})
    out = []
    for pset, res in ev.get("baseline", {}).items():
        if isinstance(res, dict):
            out.append({"method": "target alone", "trainer": None, "prompt_set": pset, "accept_length": None,
                        "tokens_per_s": res.get("output_tokens_per_s"), "call": "this"})  # fmt: skip
    trains = P.RESULTS.get("dfl-train", {}).get("drafters", {})
    for name, sets in ev.get("drafters", {}).items():
        for pset, res in sets.items():
            if not isinstance(res, dict):
                continue
            train = trains.get(name) or {}
            final = train.get("final") or {}
            out.append({"method": "dflash", "trainer": train.get("trainer", "eaglet"),
                        "dflash_lr": train.get("dflash_lr"), "flags": train.get("flags"),
                        "trainer_tokens_per_s": train.get("tokens_per_s"),
                        "prompt_set": pset, "accept_length": res.get("accept_length"),
                        "tokens_per_s": res.get("output_tokens_per_s"),
                        "accept_rate_per_position": res.get("accept_rate_per_position"),
                        "same_text_as_target_alone": res.get("same_text_as_target_alone"), "error": res.get("error"),
                        "heldout_acc": final.get("heldout_acc"), "train_wall_s": train.get("wall_s"),
                        "peak_gpu_GiB_all_trainers": train.get("peak_gpu_GiB"),
                        "peak_allocated_GiB": train.get("peak_allocated_GiB"), "call": "this"})  # fmt: skip
    return out + eagle3_rows()


def eagle3_rows() -> list[dict]:
    """EAGLE-3 at (3, 1, 4) beside DFlash: eaglet's and SpecForge's drafters as this call sequence's h2h-eval served
    them (h2h-eaglet, h2h-specforge at H2H_SPECFORGE_LR), else eaglet's default as the committed 2026-12-04 run served
    it (labelled: another day's call)."""
    chain, ev = str((3, 1, 4)), P.RESULTS.get("h2h-eval", {})
    lr = P.RESULTS.get("h2h-specforge", {}).get("lr")
    out = [{"method": "eagle3 (3, 1, 4)", "trainer": trainer, "prompt_set": pset,
            "accept_length": res.get("accept_length"), "tokens_per_s": res.get("output_tokens_per_s"),
            "accept_rate_per_position": res.get("accept_rate_per_position"), "error": res.get("error"),
            "specforge_lr": lr if trainer == "specforge" else None, "call": "this sequence"}
           for trainer in ("eaglet", "specforge")
           for pset, res in (ev.get(trainer, {}).get(chain) or {}).items() if isinstance(res, dict)]  # fmt: skip
    if out:
        return out
    if EAGLE3_COMMITTED.exists():
        served = json.loads(EAGLE3_COMMITTED.read_text())["base"]["eval"]
        out = [{"method": "eagle3 (3, 1, 4)", "trainer": "eaglet", "prompt_set": pset,
                "accept_length": served[pset]["accept_length"], "tokens_per_s": served[pset]["output_tokens_per_s"],
                "call": "2026-12-04 (another call and machine: one H200)"}
               for pset in ("humaneval", "heldout")]  # fmt: skip
    return out


def phase_report() -> None:
    for phase in ("dfl-extract", "dfl-train", "dfl-eval", "dfl-served"):
        P.save(phase)
    report = {
        "rows": rows(),
        "extract": P.RESULTS.get("dfl-extract", {}),
        "lrs": LRS,
        "recipes": RECIPES,
        "specforge_lrs": SPECFORGE_LRS,
        "epochs": h2h.EPOCHS,
        "served_stage": P.RESULTS.get("dfl-served", {}),
    }
    (P.OUT / "dflash.json").write_text(json.dumps(report, indent=1, default=str))
    P.RESULTS.setdefault("dfl-report", {})["done"] = True


PHASES = {
    "dfl-extract": phase_extract,
    "dfl-train": phase_train,
    "dfl-eval": phase_eval,
    "dfl-served": phase_served,
    "dfl-report": phase_report,
}

ESTIMATE_S = {
    "dfl-extract": lambda: 70 + h2h.conversations() * 0.01,
    "dfl-train": 120,  # any minute of training is kept: a drafter cut off resumes in the next call
    "dfl-eval": 300,  # the target alone (a start, two sets, the repeat), then the drafters' servers together
    "dfl-served": lambda: 130 * len(SERVED_TARGETS),  # each target: a server alone and one with the drafter
    "dfl-report": 5,
}
