"""eaglet's drafter against SpecForge 0.2.0's on the bundled SmolLM2-135M-Instruct, on one H200, in phases
(bench/gpu/README.md has the call sequence). Results in $OUT/<phase>.json; the table via bench/gpu/h2hreport.py.

    python3 -m bench.gpu.headtohead PHASE [PHASE...]     (from the repo root, after bench/gpu/install.sh)

Phases (each skipped when an earlier call finished it; state in $GPUBENCH_ROOT/gpubench-results.json):
  h2h-data       the conversations committed under data/h2h/ when there are any; else SGLang with eaglet's
                 plugin on the real SmolLM2: the target writes its own prompts (Magpie: sampled from its chat
                 template's user prefix, deduplicated, filtered); a share of conversations gets a second user
                 turn, sampled after the target's first answer; eaglet's regeneration stage (extractor workers ->
                 the server's /v1/chat/completions, greedy) answers every user turn; a held-out share of prompts
                 is set apart and never ingested. The files are written to $OUT, to be committed.
  h2h-extract    the conversations through eaglet: ingest, the same server with the plugin, extractor workers,
                 the store.
  h2h-eaglet     eaglet's trainer, default recipe, H2H_EPOCHS epochs (checkpoints only at the end).
  h2h-specforge  the same training samples (eaglet's own held-out split left out) as SpecForge offline features,
                 SpecForge's `specforge train` (its defaults; same epochs, same samples per optimizer step),
                 its SGLang export.
  h2h-score      both drafters' accuracy per draft position on eaglet's held-out samples, by eaglet's scorer.
  h2h-eval       one plain SGLang build, every server in one call: the target alone (HumanEval twice, at two
                 concurrencies), then each drafter at H2H_CHAINS ((3, 1, 4)), on the 164 HumanEval prompts and the
                 held-out prompts, greedy: accept length, acceptance per draft position, output tokens/s, outputs
                 equal to the target alone's.
  h2h-trainspeed eaglet's trainer alone, each variant of H2H_TRAINSPEED (eager, compiled) in turn, repeated: tokens/s
                 beside h2h-specforge's, held-out figures.
  h2h-layouts    h2h-extract's samples stored again in each storage layout of H2H_LAYOUTS (the top-k computed on the
                 GPU from the stored final states by the servers' encoder), one run a layout; the recipes
                 ``layout-<name>`` of H2H_ABLATIONS train the default recipe on them (h2h-ablate-train/-eval).
  h2h-report     $OUT/gpu-headtohead.md and .json.
"""

import gzip
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path

import httpx

from bench.gpu import h2hreport, magpie
from bench.gpu import harness as P

N_CONV = int(os.environ.get("H2H_CONVERSATIONS", "10000"))
HELDOUT = int(os.environ.get("H2H_HELDOUT", "200"))
MULTI_TURN = float(os.environ.get("H2H_MULTI_TURN", "0.25"))
PROMPT_TOKENS = int(os.environ.get("H2H_PROMPT_TOKENS", "128"))
ANSWER_TOKENS = int(os.environ.get("H2H_ANSWER_TOKENS", "256"))
GEN_CONCURRENCY = int(os.environ.get("H2H_GEN_CONCURRENCY", "256"))
WORKERS = int(os.environ.get("H2H_WORKERS", "16"))
EPOCHS = int(os.environ.get("H2H_EPOCHS", "2"))
EVAL_TOKENS = int(os.environ.get("H2H_EVAL_TOKENS", "256"))
EVAL_CONCURRENCY = int(os.environ.get("H2H_EVAL_CONCURRENCY", "64"))
# (steps, topk, draft tokens); more as "3,1,4;5,1,6"
CHAINS = tuple(tuple(int(x) for x in c.split(",")) for c in os.environ.get("H2H_CHAINS", "3,1,4").split(";"))
# the target alone decoded a second time at another concurrency: how often greedy text changes with the batch alone
REPEAT_CONCURRENCY = int(os.environ.get("H2H_REPEAT_CONCURRENCY", "16"))
EVAL_DRAFTERS = os.environ.get("H2H_EVAL_DRAFTERS", "eaglet,specforge").split(",")
TOKENS_PER_BATCH, TRAINER_HELDOUT = 2048, 0.05  # eaglet's TrainConfig defaults, which the run keeps

H2H = P.ROOT / "h2h"
KEPT = P.REPO / "data" / "h2h"  # the conversations an earlier run wrote, committed: later runs reuse them
SMOL = P.MODELS / "smollm2"
SERVER = "h2h-sgl"
# SpecForge's own environment: its staged folder, the `datasets` stand-in, SGLang 0.5.17's transformers
PY_SPECFORGE = os.environ.get("H2H_SPECFORGE_PATH", f"{P.S}/sfsite:{P.REPO}/bench/gpu/shims:{P.S}/site")
GEN_EXTRA = ["--mem-fraction-static", "0.6", "--cuda-graph-max-bs", "256", "--chunked-prefill-size", "8192"]
EVAL_EXTRA = ["--mem-fraction-static", "0.5", "--disable-cuda-graph"]


def time_left(margin: float = 20) -> float:
    """Seconds left of this call's GPUBENCH_DEADLINE_S (the runner's own deadline), less a margin for saving."""
    return float(os.environ.get("GPUBENCH_DEADLINE_S", "1e9")) - (time.time() - P.T0) - margin


def ensure_model() -> None:
    if not (SMOL / "config.json").exists():
        subprocess.run([sys.executable, "-m", "bench.gpu.mkmodel", "gguf", str(SMOL), str(P.S / "gguf" / "model.gguf")],
                       check=True, env={**os.environ, "PYTHONPATH": P.PY_EAGLET})  # fmt: skip


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOL)


def done(phase: str) -> bool:
    if P.RESULTS.get(phase, {}).get("done"):
        P.log(f"{phase}: done in an earlier call")
        return True
    return False


def plugin_server(graphs: bool = True) -> None:
    """SGLang with eaglet's plugin (eaglet's launch command), kept up from h2h-data through the extractions (the
    trainers' and evaluations' phases stop it). CUDA graphs on for generation speed (``graphs``), off again if the
    server does not come up with them; off for extraction alone (prefill only: they would cost the start a minute
    and serve no request)."""
    if SERVER in P.PROCS:
        return
    P.redis_up()
    P.DUMPS.mkdir(parents=True, exist_ok=True)
    R = P.RESULTS.setdefault("h2h-data", {})
    plain = GEN_EXTRA[:2] + ["--chunked-prefill-size", "8192", "--disable-cuda-graph"]
    if graphs:
        try:
            R["server_startup_s"] = P.sglang(SERVER, SMOL, plugin=True, extra=GEN_EXTRA)
            R["server_flags"] = " ".join(GEN_EXTRA + P.SGL_BASE)
            return
        except RuntimeError as e:
            P.stop(SERVER)
            R["cuda_graph_error"] = str(e)[-1500:]
    R["server_startup_s"] = P.sglang(SERVER, SMOL, plugin=True, extra=plain)
    R["server_flags"] = " ".join(plain + P.SGL_BASE)


HTTP_ERRORS: list[str] = []  # requests the server refused while writing the data: counted, the first kept


def refused(r: httpx.Response) -> bool:
    if r.status_code == 200:
        return False
    HTTP_ERRORS.append(f"{r.request.url.path} {r.status_code} {r.text[:200]}")
    return True


def fan_out(fn, items: list, concurrency: int) -> list:
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(fn, items))


def sample_turns(client: httpx.Client, prefixes: list[list[int]], stop_id: int) -> list[str]:
    """One user turn sampled from each prefix (temperature 1: Magpie's diversity comes from sampling)."""

    def one(ids: list[int]) -> str:
        sp = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": PROMPT_TOKENS, "stop_token_ids": [stop_id]}
        r = client.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        return "" if refused(r) else r.json().get("text", "")

    return fan_out(one, prefixes, GEN_CONCURRENCY)


def answer(client: httpx.Client, model: str, conversations: list[list[dict]]) -> list[str]:
    """Greedy answers to each conversation's last user turn, through SGLang's OpenAI-compatible endpoint."""

    def one(messages: list[dict]) -> str:
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": ANSWER_TOKENS}
        r = client.post("/v1/chat/completions", json=body)
        return "" if refused(r) else (r.json()["choices"][0]["message"].get("content") or "").strip()

    return fan_out(one, conversations, GEN_CONCURRENCY)


def gzip_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, gzip.GzipFile(dst, "wb", mtime=0) as g:  # mtime 0: the same data, the same bytes
        g.write(f.read())


def kept_data() -> bool:
    """The committed conversations and held-out prompts unpacked where the phases read them, with the figures of
    the run that wrote them; False when none are committed (or H2H_NEW_DATA is set)."""
    if os.environ.get("H2H_NEW_DATA") or not (KEPT / "train.jsonl.gz").exists():
        return False
    H2H.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "heldout.jsonl"):
        with gzip.open(KEPT / f"{name}.gz", "rb") as g:
            (H2H / name).write_bytes(g.read())
    R = P.RESULTS.setdefault("h2h-data", {})
    R.update(json.loads((KEPT / "data.json").read_text()), source=str(KEPT.relative_to(P.REPO)), done=True)
    P.log(f"h2h-data: {R.get('conversations')} conversations from {R['source']}")
    return True


def phase_data() -> None:
    if done("h2h-data") or kept_data():
        return
    t0 = time.time()
    ensure_model()
    plugin_server()
    R = P.RESULTS.setdefault("h2h-data", {})
    tok = tokenizer()
    stop_id = tok.convert_tokens_to_ids("<|im_end|>")
    client = httpx.Client(base_url=f"http://127.0.0.1:{P.SGL_PORT}", timeout=600,
                          limits=httpx.Limits(max_connections=GEN_CONCURRENCY + 8))  # fmt: skip
    model = client.get("/v1/models").json()["data"][0]["id"]
    dedupe = magpie.Deduper()
    first = tok.encode(magpie.user_prefix(tok, []), add_special_tokens=False)
    want = N_CONV + HELDOUT
    prompts, rounds = [], []
    while len(prompts) < want and len(rounds) < 4:
        kept, stats = magpie.filter_prompts(sample_turns(client, [first] * int((want - len(prompts)) * 1.3 + 64),
                                                         stop_id), dedupe)  # fmt: skip
        prompts += kept
        rounds.append(stats)
    R["magpie"] = {"rounds": rounds, "prefix": magpie.user_prefix(tok, [])}
    P.log(f"h2h-data: {len(prompts)} prompts after {rounds}")
    convs = [{"id": f"mp-{i:06d}", "messages": [{"role": "user", "content": p}]} for i, p in enumerate(prompts[:want])]
    frac = HELDOUT / want
    held = [c for c in convs if magpie.is_heldout(c["id"], frac)]
    train = [c for c in convs if not magpie.is_heldout(c["id"], frac)]
    # a second user turn is sampled after the target's first answer: those first answers are needed here
    second = [c for c in train if random.Random(c["id"]).random() < MULTI_TURN]
    for c, a in zip(second, answer(client, model, [c["messages"] for c in second]), strict=True):
        c["messages"].append({"role": "assistant", "content": a})
    second = [c for c in second if c["messages"][-1]["content"]]
    prefixes = [tok.encode(magpie.user_prefix(tok, c["messages"]), add_special_tokens=False) for c in second]
    dedupe2 = magpie.Deduper()
    for c, raw in zip(second, sample_turns(client, prefixes, stop_id), strict=True):
        turn = magpie.clean_turn(raw)
        if turn is not None and dedupe2.keep(turn):
            c["messages"].append({"role": "user", "content": turn})
    H2H.mkdir(parents=True, exist_ok=True)
    with open(H2H / "prompts.jsonl", "w") as f:
        for c in train:  # every user turn is answered again by the regeneration stage, earlier answers dropped
            f.write(json.dumps({"id": c["id"], "messages": [m for m in c["messages"] if m["role"] == "user"]}) + "\n")
    with open(H2H / "heldout.jsonl", "w") as f:
        for c in held:
            f.write(json.dumps({"id": c["id"], "prompt": c["messages"][0]["content"]}) + "\n")
    R["regenerate"] = regenerate(H2H / "prompts.jsonl", H2H / "train.jsonl")
    convs = [json.loads(line) for line in open(H2H / "train.jsonl")]
    R.update(conversations=len(convs), multi_turn=sum(1 for c in convs if len(c["messages"]) > 2),
             heldout_prompts=len(held), second_turn_repeats=dedupe2.repeats, wall_s=round(time.time() - t0, 1),
             example=convs[0] if convs else None, http_errors=len(HTTP_ERRORS), first_http_errors=HTTP_ERRORS[:3],
             done=len(convs) > 0)  # fmt: skip
    P.log(f"h2h-data: {len(convs)} conversations, {R['multi_turn']} multi-turn, {len(held)} held out")
    # kept for later runs (commit them under data/h2h/ with data.json: bench/gpu/README.md)
    gzip_copy(H2H / "train.jsonl", P.OUT / "h2h-train.jsonl.gz")
    gzip_copy(H2H / "heldout.jsonl", P.OUT / "h2h-heldout.jsonl.gz")


def regenerate(source: Path, out: Path) -> dict:
    """Every user turn of ``source`` answered by eaglet's regeneration stage (a run that stops once its file is
    written): the extractor workers send them to the server's /v1/chat/completions, greedy, each turn after the
    target's own earlier answers. Writes the conversations to ``out``; returns the stage's counts."""
    from redis import Redis

    from eaglet.services.regenerate.jobs import plan_run
    from eaglet.services.regenerate.results import output_path
    from eaglet.shared.regeneration import Progress
    from eaglet.shared.runoptions import RegenerateOptions, RunOptions
    from eaglet.shared.runs import create_run
    from eaglet.shared.runstate import Stage

    os.environ.update(P.eaglet_env(SMOL, P.SGL_PORT))
    redis, rq_redis = Redis.from_url(P.REDIS_URL, decode_responses=True), Redis.from_url(P.REDIS_URL)
    run_id = f"h2h-regen-{int(time.time())}"
    options = RegenerateOptions(max_tokens=ANSWER_TOKENS, concurrency=max(1, GEN_CONCURRENCY // WORKERS),
                                stop_after=True)  # fmt: skip
    names = P.start_workers(run_id, SMOL, P.SGL_PORT, WORKERS)
    t = time.time()
    state = create_run(redis, run_id, source, RunOptions(regenerate=options))
    plan_run(redis, rq_redis, run_id)
    timeout = min(float(os.environ.get("H2H_REGENERATE_TIMEOUT", "420")), time_left(30))
    while state.stage() == Stage.regenerating and time.time() - t < timeout:
        time.sleep(0.2)
    for n in names:
        P.stop(n, 10)
    counts = Progress(redis, run_id).counts()
    if state.stage() != Stage.done:
        raise RuntimeError(f"regeneration run {run_id}: stage {state.stage()} after {time.time() - t:.0f}s, {counts}")
    os.replace(output_path(P.DATA, run_id), out)
    return {"run": run_id, "wall_s": round(time.time() - t, 1), "options": str(options), **asdict(counts)}


def phase_extract() -> None:
    if done("h2h-extract"):
        return
    ensure_model()
    plugin_server(graphs=False)
    R = P.RESULTS.setdefault("h2h-extract", {})
    run_id = f"h2h-{int(time.time())}"
    R["run_id"] = run_id
    timeout = min(float(os.environ.get("H2H_EXTRACT_TIMEOUT", "420")), time_left(40))
    with StatusCapture(P.OUT / "h2h-status.txt"):
        R.update(P.pipeline(run_id, SMOL, H2H / "train.jsonl", P.SGL_PORT, WORKERS, 2048, timeout=timeout))
    R["done"] = bool(R.get("complete"))


class StatusCapture(P.Sampler):
    """The operator's view of a real run on the GPU machine: ``eaglet status --brief`` every 10 s and the whole
    ``eaglet status`` every fourth time, appended to ``path``. SGLang runs here without eaglet's inference
    supervisor, so this publishes the server's GPUs as the supervisor does (``eaglet.shared.gpustats``), for the
    status to show them."""

    interval_s = 10.0

    def __init__(self, path: Path):
        self.path, self.n = path, 0

    def sample(self) -> None:
        from redis import Redis

        from eaglet.shared import gpustats
        from eaglet.shared.records import GpuRole

        env = {**os.environ, **P.eaglet_env(SMOL, P.SGL_PORT), "PYTHONPATH": P.PY_EAGLET}
        args = ["status"] + ([] if self.n % 4 == 3 else ["--brief"])
        try:
            gpustats.publish(Redis.from_url(P.REDIS_URL), gpustats.GpuReader(env), role=GpuRole.inference,
                             host=socket.gethostname())  # fmt: skip
            out = subprocess.run([sys.executable, "-m", "eaglet.cli.main", *args], env=env, capture_output=True,
                                 text=True, timeout=30)  # fmt: skip
            text = out.stdout + (f"(exit {out.returncode}) {out.stderr[-800:]}" if out.returncode else "")
        except Exception as e:  # the capture never stops the run it watches
            text = f"capture failed: {type(e).__name__}: {e}"
        with open(self.path, "a") as f:
            f.write(f"--- {time.strftime('%H:%M:%S')} eaglet {' '.join(args)}\n{text}\n")
        self.n += 1


class GpuMemory(P.Sampler):
    """Peak GPU memory in use on device 0 (nvidia-smi every 0.5 s), the same measure for both trainers."""

    peak_mib = 0

    def sample(self) -> None:
        self.peak_mib = max(self.peak_mib, P.gpu_memory_mib().get(0, 0))


def training_rows() -> list[tuple[int, str, int]]:
    """(index, sample_id, length) of the stored samples eaglet's trainer trains on."""
    from bench.gpu.specforge_features import training_split
    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import sample_path, samples_dir

    run_id = P.RESULTS["h2h-extract"]["run_id"]
    samples = SampleSet(samples_dir(P.DATA, run_id))
    rows = []
    for i in range(len(samples)):
        row = samples.index[i]
        sid = row["id"].decode()
        if sample_path(P.DATA, run_id, sid).exists():
            rows.append((i, sid, int(row["length"])))
    return training_split(rows, TRAINER_HELDOUT)


def run_trainer(
    R: dict, name: str, argv: list[str], pythonpath: str, env: dict, timeout: float, probe_dir: Path = P.OUT
) -> dict:
    """Runs a trainer process ``name`` to its end (or ``timeout``, or the call's deadline) and writes into the
    record ``R``: its command, wall time, exit code, log tail, peak GPU memory and its probe's JSON."""
    return run_trainers([(R, name, argv)], pythonpath, env, timeout, probe_dir)[0]


STOP_GRACE_S = 15  # a stopped trainer's checkpoint, within the call's margin past its deadline


def run_trainers(
    jobs: list[tuple[dict, str, list[str]]], pythonpath: str, env: dict, timeout: float, probe_dir: Path = P.OUT
) -> list[dict]:
    """Trainer processes (record, name, argv) started together on the one GPU and waited for together, as
    ``run_trainer`` does for one; the peak GPU memory is theirs together."""
    timeout = min(timeout, time_left())
    t = time.time()
    with GpuMemory() as mem:
        for R, name, argv in jobs:
            R["cmd"] = " ".join(argv[1:])
            P.start(name, argv, pythonpath, {**env, "PROBE_OUT": str(probe_dir / f"{name}-probe.json")})
        ended: dict[str, float] = {}
        while len(ended) < len(jobs) and time.time() - t < timeout:
            ended |= {n: time.time() for _, n, _ in jobs if n not in ended and P.PROCS[n].poll() is not None}
            time.sleep(0.5)
        cut = [n for _, n, _ in jobs if n not in ended and P.PROCS[n].poll() is None]
        for name in cut:  # all at once: each writes a checkpoint of its last step, then ends (exit 143)
            os.killpg(P.PROCS[name].pid, signal.SIGTERM)
        grace_end = time.time() + STOP_GRACE_S
        while time.time() < grace_end and any(P.PROCS[n].poll() is None for n in cut):
            time.sleep(0.2)
    for R, name, _ in jobs:
        proc = P.PROCS[name]
        P.stop(name, 0)  # what is left of it (the process group), at once
        R["rc"] = proc.wait()
        if name not in ended:
            R["error"] = f"timed out after {timeout:.0f}s"
        R["wall_s"] = round(ended.get(name, time.time()) - t, 1)
        R["log_tail"] = P.tail(name, 40)
        if R["rc"] not in (0, None) and "error" not in R:
            R["error"] = f"exit {R['rc']}: {(R['log_tail'].splitlines() or [''])[-1][:300]}"
        R["peak_gpu_GiB"] = round(mem.peak_mib / 1024, 2)
        probe = probe_dir / f"{name}-probe.json"
        R["probe"] = json.loads(probe.read_text()) if probe.exists() else None
    return [R for R, _, _ in jobs]


def specforge_batch(rows: list[tuple[int, str, int]]) -> tuple[int, int]:
    """eaglet's batches per epoch, and SpecForge's batch size giving the same samples per optimizer step as
    eaglet's length-grouped batches of 2,048 tokens."""
    from eaglet.services.trainer.data import Item, make_batches

    batches = len(make_batches([Item(i, sid, n) for i, sid, n in rows], TOKENS_PER_BATCH, 0, 0))
    return batches, max(1, round(len(rows) / max(batches, 1)))


# Rates measured on one H200 (2 epochs of 9,529 samples, 6.8 M tokens): eaglet's trainer 16,600 tokens/s and
# ~40 s to start; SpecForge about 3,350 of 3,812 steps in 396 s. A trainer runs to the end unless the call's time
# ends first: a phase is started only when its estimate from these rates fits the call.
EAGLET_TOKENS_PER_S, EAGLET_START_S = 16_600, 40
SPECFORGE_S_PER_STEP, SPECFORGE_START_S = 0.118, 60
TRAIN_TIMEOUT = float(os.environ.get("H2H_TRAIN_TIMEOUT", "1e9"))


def estimate_eaglet() -> float:
    rows = training_rows() if P.RESULTS.get("h2h-extract", {}).get("done") else []
    return EAGLET_START_S + sum(r[2] for r in rows) * EPOCHS / EAGLET_TOKENS_PER_S if rows else 300


def estimate_specforge() -> float:
    rows = training_rows() if P.RESULTS.get("h2h-extract", {}).get("done") else []
    if not rows:
        return 330
    _, batch_size = specforge_batch(rows)
    convert_s = sum(r[2] for r in rows) / 200_000  # torch.save of the states, 12 processes
    return SPECFORGE_START_S + convert_s + -(-len(rows) // batch_size) * EPOCHS * SPECFORGE_S_PER_STEP


def phase_eaglet() -> None:
    if done("h2h-eaglet"):
        return
    P.stop(SERVER)  # the GPU to the trainer alone
    rows = training_rows()
    run_id = P.RESULTS["h2h-extract"]["run_id"]
    argv = [sys.executable, "-m", "bench.gpu.train_probe", "--run", run_id, "--epochs", str(EPOCHS),
            "--checkpoint-every", "1000000"]  # fmt: skip
    R = run_trainer(P.RESULTS.setdefault("h2h-eaglet", {}), "h2h-eaglet", argv, P.PY_EAGLET,
                    P.eaglet_env(SMOL, P.SGL_PORT), TRAIN_TIMEOUT)  # fmt: skip
    train_hash = (R.get("probe") or {}).get("train_hash", {})
    R.update(epochs=EPOCHS, train_samples=len(rows), train_tokens=sum(r[2] for r in rows) * EPOCHS,
             optimizer_steps=train_hash.get("step"), trainer_reported_tokens_per_s=train_hash.get("tokens_per_s"),
             drafter_dir=train_hash.get("drafter_dir"))  # fmt: skip
    probe_wall = (R.get("probe") or {}).get("wall_s")  # the trainer's own run, as for SpecForge's
    R["tokens_per_s"] = round(R["train_tokens"] / probe_wall, 1) if R["rc"] == 0 and probe_wall else None
    R["done"] = R["rc"] == 0 and bool(R["drafter_dir"])


def phase_specforge() -> None:
    if done("h2h-specforge"):
        return
    from bench.gpu.specforge_features import convert, run_config, target_view
    from eaglet.shared.store import sample_path

    P.stop(SERVER)  # the GPU to the trainer alone
    R = P.RESULTS.setdefault("h2h-specforge", {})
    run_id = P.RESULTS["h2h-extract"]["run_id"]
    rows = training_rows()
    feats = H2H / "sf-features"
    feats.mkdir(parents=True, exist_ok=True)
    t = time.time()
    jobs = [(i, sid, str(sample_path(P.DATA, run_id, sid))) for i, sid, _ in rows]
    with ProcessPoolExecutor(12) as ex:
        tokens = sum(ex.map(convert, [jobs[k : k + 256] for k in range(0, len(jobs), 256)], [str(feats)] * len(jobs)))
    R["convert"] = {"samples": len(jobs), "tokens": tokens, "wall_s": round(time.time() - t, 1)}
    P.save("h2h-specforge")
    batches, batch_size = specforge_batch(rows)
    cfg = run_config(target_view(SMOL, P.MODELS / "smollm2-specforge"), feats, H2H / "sf-run", epochs=EPOCHS,
                     batch_size=batch_size, max_length=2048)  # fmt: skip
    (H2H / "sf-run").mkdir(parents=True, exist_ok=True)
    cfg_path = H2H / "sf-run" / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    drafter = H2H / "sf-drafter"
    argv = [sys.executable, "bench/gpu/specforge_train.py", str(cfg_path), str(drafter)]
    R["config"] = cfg
    R = run_trainer(R, "h2h-specforge", argv, PY_SPECFORGE, {}, TRAIN_TIMEOUT)
    R.update(epochs=EPOCHS, batch_size=batch_size, eaglet_batches_per_epoch=batches, train_samples=len(rows),
             train_tokens=sum(r[2] for r in rows) * EPOCHS, optimizer_steps=-(-len(rows) // batch_size) * EPOCHS,
             drafter_dir=str(drafter))  # fmt: skip
    ok = R["rc"] == 0 and (drafter / "config.json").exists()
    probe_wall = (R.get("probe") or {}).get("wall_s")
    R["tokens_per_s"] = round(R["train_tokens"] / probe_wall, 1) if ok and probe_wall else None
    R["done"] = ok


def eval_prompts(tok) -> dict[str, list[list[int]]]:
    """Chat-formatted prompt ids: the 164 HumanEval prompts and the held-out Magpie prompts."""

    def ids(text: str) -> list[int]:
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    with gzip.open(P.S / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        humaneval = [ids(json.loads(line)["prompt"]) for line in f]
    heldout = [ids(json.loads(line)["prompt"]) for line in open(H2H / "heldout.jsonl")]
    return {"humaneval": humaneval, "heldout": heldout}


def decode(
    prompts: list[list[int]],
    concurrency: int = EVAL_CONCURRENCY,
    port: int = 0,
    max_new_tokens: int = EVAL_TOKENS,
    ids: bool = False,
    gaps: bool = False,
) -> dict:
    """Greedy decoding of every prompt, ``concurrency`` in flight: SGLang's accept length (completion tokens over
    verify steps), the acceptance per draft position (from its per-request histogram of drafts accepted per verify
    step), and the output tokens/s the client sees. ``ids``: also each output's token ids; ``gaps``: also, per output
    token, how far the chosen token's log-probability lies above the runner-up's (near 0 is a near-tie, where
    another batch shape may pick the other token)."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{port or P.SGL_PORT}", timeout=600,
                          limits=httpx.Limits(max_connections=concurrency + 4))  # fmt: skip

    def one(prompt: list[int]) -> dict:
        sp = {"max_new_tokens": max_new_tokens, "temperature": 0}
        req = {"input_ids": prompt, "sampling_params": sp}
        if gaps:
            req.update(return_logprob=True, top_logprobs_num=2)
        r = client.post("/generate", json=req)
        if r.status_code != 200:
            return {"error": r.text[:200]}
        body, meta = r.json(), r.json()["meta_info"]
        hist = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram") or []
        out = {"text": body["text"], "hist": hist,
               **{k: meta.get(k) for k in ("completion_tokens", "spec_verify_ct")}}  # fmt: skip
        if ids:
            out["ids"] = body.get("output_ids")
        if gaps:
            out["gaps"] = [round(t[0][0] - t[1][0], 4) if len(t) > 1 else None
                           for t in meta.get("output_top_logprobs") or []]  # fmt: skip
        return out

    fan_out(one, prompts[:4], 4)  # warm-up
    t = time.time()
    outs = fan_out(one, prompts, concurrency)
    wall = time.time() - t
    ok = [o for o in outs if "error" not in o]
    tokens = sum(o["completion_tokens"] for o in ok)
    verifies = sum(o["spec_verify_ct"] or 0 for o in ok)
    return {
        "requests": len(prompts),
        "concurrency": concurrency,
        "errors": len(outs) - len(ok),
        "first_error": next((o["error"] for o in outs if "error" in o), None),
        "completion_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 1),
        "accept_length": round(tokens / verifies, 4) if verifies else None,
        **h2hreport.position_acceptance([o["hist"] for o in ok]),
        "texts": [o.get("text") for o in outs],
        **{k: [o.get(k) for o in outs] for k, on in (("ids", ids), ("gaps", gaps)) if on},
    }


def eagle3_flags(drafter_dir: str, chain: tuple) -> list[str]:
    """SGLang's flags to serve ``drafter_dir`` as EAGLE-3 at ``chain`` (steps, topk, draft tokens)."""
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter_dir,
            "--speculative-num-steps", str(chain[0]), "--speculative-eagle-topk", str(chain[1]),
            "--speculative-num-draft-tokens", str(chain[2])]  # fmt: skip


def start_sharing(name: str, model: Path, extra: list[str], port: int) -> float:
    """Plain SGLang on ``port`` beside other servers starting on the same GPU (``phases.once_more_if_refused``).
    Returns its startup s."""
    start = partial(P.sglang, name, model, plugin=False, extra=extra, timeout=300, port=port)
    return P.once_more_if_refused(name, start, time_left() >= 130)


def evaluate(
    key: str, ddir: str | None, chain: tuple | None, prompts: dict, base_texts: dict, port: int = 0, mem: float = 0
) -> dict:
    """One server on ``port`` (the target alone when ``chain`` is None, else with the drafter at that chain) over
    every prompt set; a failure is recorded in place of the figures. The target alone decodes HumanEval a second
    time at another concurrency: the same greedy decoding in other batches, the yardstick for the drafters'
    agreement. ``mem``: the server's --mem-fraction-static when several share the GPU (0: EVAL_EXTRA's)."""
    extra = list(EVAL_EXTRA)
    if mem:
        extra[extra.index("--mem-fraction-static") + 1] = str(mem)
    if chain is not None:
        extra += eagle3_flags(ddir, chain)
    name = f"h2h-eval-{key.replace(' ', '').replace(',', '-')}"
    try:
        startup = start_sharing(name, SMOL, extra, port)
        res = {"server_startup_s": round(startup, 1)}
        for pset, ids in prompts.items():
            out = decode(ids, port=port)
            texts = out.pop("texts")
            if chain is None:
                base_texts[pset] = texts
            elif pset in base_texts:  # greedy: a drafter changes the speed, not (up to numerics) the text
                out["same_text_as_target_alone"] = h2hreport.agreement(texts, base_texts[pset])
            res[pset] = out
            P.log(f"h2h-eval {key} {pset}: {out}")
        if chain is None and "humaneval" in prompts:
            again = decode(prompts["humaneval"], REPEAT_CONCURRENCY, port)
            texts = again.pop("texts")
            again["same_text_as_target_alone"] = h2hreport.agreement(texts, base_texts["humaneval"])
            res["humaneval_repeat"] = again
            P.log(f"h2h-eval {key} humaneval again at concurrency {REPEAT_CONCURRENCY}: {again}")
        return res
    except Exception as e:  # one configuration failing leaves the others to run
        return {s: {"error": f"{type(e).__name__}: {str(e)[-1500:]}"} for s in prompts}
    finally:
        P.stop(name)


def drafter_dirs() -> dict[str, str | None]:
    return {d: P.RESULTS.get(f"h2h-{d}", {}).get("drafter_dir") for d in h2hreport.DRAFTERS}


def phase_score() -> None:
    """Both drafters' accuracy per draft position on eaglet's held-out samples (the trainer's own held-out 5 %,
    which neither trainer saw), by one piece of code: eaglet's scorer, which reads any drafter in SGLang's format."""
    if done("h2h-score"):
        return
    R = P.RESULTS.setdefault("h2h-score", {})
    found = {d: p for d, p in drafter_dirs().items() if p and Path(p, "config.json").exists()}
    R["missing"] = sorted(set(h2hreport.DRAFTERS) - set(found))
    R.update(score("h2h-score", found, P.OUT / "h2h-score-figures.json"))
    R["done"] = R["rc"] == 0 and not R["missing"]


def score(name: str, drafters: dict[str, str], out: Path) -> dict:
    """``eaglet score`` of ``drafters`` (name -> folder) on the stored run's held-out samples, as process ``name``:
    its command, exit code, wall time, log tail and each drafter's figures (``drafters``)."""
    argv = [sys.executable, "-m", "eaglet.services.trainer.score", "--run", P.RESULTS["h2h-extract"]["run_id"],
            "--model", str(SMOL), "--out", str(out)]  # fmt: skip
    argv += [a for d, p in drafters.items() for a in ("--drafter", f"{d}={p}")]
    t = time.time()
    P.start(name, argv, P.PY_EAGLET, P.eaglet_env(SMOL, P.SGL_PORT))
    rc = P.PROCS[name].wait(timeout=max(30, time_left()))
    R = {"cmd": " ".join(argv[1:]), "rc": rc, "wall_s": round(time.time() - t, 1), "log_tail": P.tail(name, 20)}
    P.stop(name)
    R["drafters"] = json.loads(out.read_text()) if out.exists() else {}
    return R


def phase_eval() -> None:
    """Every server in this one call (the target alone included): figures compared across calls would mix
    machines and warm-ups."""
    if done("h2h-eval"):
        return
    R = P.RESULTS.setdefault("h2h-eval", {})
    ensure_model()
    prompts = eval_prompts(tokenizer())
    R.update(chains=[str(c) for c in CHAINS], prompt_sets=list(prompts), max_new_tokens=EVAL_TOKENS,
             concurrency=EVAL_CONCURRENCY, repeat_concurrency=REPEAT_CONCURRENCY,
             server_flags=" ".join(EVAL_EXTRA + P.SGL_BASE))  # fmt: skip
    drafters = {d: p for d, p in drafter_dirs().items() if d in EVAL_DRAFTERS}
    P.stop_all()  # the GPU to the evaluation servers alone
    runs = [("baseline", None, None)] + [(d, drafters[d], c) for d in drafters for c in CHAINS]
    base_texts = {}
    for name, ddir, chain in runs:
        key = name if chain is None else f"{name} {chain}"
        if chain is not None and not (ddir and Path(ddir, "config.json").exists()):
            res = {s: {"error": "no drafter"} for s in prompts}
        elif time_left() < 100:  # a server start and two prompt sets
            res = {s: {"error": "not run: out of this call's time"} for s in prompts}
        else:
            res = evaluate(key, ddir, chain, prompts, base_texts)
        if chain is None:
            R["baseline"] = res
        else:
            R.setdefault(name, {})[str(chain)] = res
        P.save("h2h-eval")
    R["done"] = not h2hreport.eval_errors(R)


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
    return estimate_eaglet() + (COMPILE_COLD_S if "--compile on" in flags and cold else 0)


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
    P.stop(SERVER)  # the GPU to the trainer alone
    run_id = P.RESULTS["h2h-extract"]["run_id"]
    train_tokens = sum(r[2] for r in training_rows()) * EPOCHS
    R.update(variants=trainspeed_variants(), repeats=TRAINSPEED_REPEATS, epochs=EPOCHS, train_tokens=train_tokens)
    for repeat in range(TRAINSPEED_REPEATS):
        for name, flags in trainspeed_variants().items():
            if any(r["variant"] == name and r["repeat"] == repeat for r in rows):
                continue
            cold = "--compile on" in flags and compile_cache_empty()
            need = estimate_trainspeed_row(flags, cold)
            if need > time_left():
                P.log(f"h2h-trainspeed: {name} #{repeat} needs ~{need:.0f}s, {time_left():.0f}s left: next call")
                R["done"] = False
                return
            out = H2H / "trainspeed" / f"{name}-{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            argv = [sys.executable, "-m", "bench.gpu.ablate", "--run", run_id, "--out", str(out), "--model", str(SMOL),
                    "--epochs", str(EPOCHS), "--checkpoint-every", "1000000", *shlex.split(flags)]  # fmt: skip
            rec = run_trainer({}, f"h2h-trainspeed-{name}-{repeat}", argv, P.PY_EAGLET,
                              P.eaglet_env(SMOL, P.SGL_PORT), TRAIN_TIMEOUT, H2H)  # fmt: skip
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


def phase_extract_fp8() -> None:
    """The same conversations extracted again, stored fp8 (encoded by the plugin on the GPU): the cost of fp8
    storage in acceptance, measured by the `fp8` recipe."""
    if done("h2h-extract-fp8"):
        return
    ensure_model()
    plugin_server(graphs=False)
    R = P.RESULTS.setdefault("h2h-extract-fp8", {})
    R["run_id"] = f"h2h-fp8-{int(time.time())}"
    R.update(P.pipeline(R["run_id"], SMOL, H2H / "train.jsonl", P.SGL_PORT, WORKERS, 2048,
                        timeout=time_left(40), store="fp8"))  # fmt: skip
    R["done"] = bool(R.get("complete"))


LAYOUTS = os.environ.get("H2H_LAYOUTS", "loss=loss:0:full;fp4=all:0:fp4;top32-fp4=topk:32:fp4;top24-fp4=topk:24:fp4")
LAYOUT_RECIPE = "layout-"  # a recipe named layout-<name>[.<variant>] trains on the run of layout <name> (phase
# h2h-layouts): variants of one layout (other trainer flags, say --topk-tail uniform) share its stored run


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

    if done("h2h-layouts"):
        return
    # The extraction's server busy-polls its CPU cores, which the 4-bit encoder here needs: on 2026-12-04 the fp4
    # layout ran past a call's 570 s beside it (the likely cause), and top24-fp4's 1.4 M tokens took 34 s without it.
    P.stop(SERVER)
    P.redis_up()
    R = P.RESULTS.setdefault("h2h-layouts", {})
    for attempt in R.get("earlier_attempts", []):  # a layout stored by a call cut short is whole: keep it
        R.setdefault("runs", {}).update(attempt.get("runs", {}))
    src = P.RESULTS["h2h-extract"]["run_id"]
    redis = Redis.from_url(P.REDIS_URL, decode_responses=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm_head = load_target_tensors(SMOL, ("lm_head",))["lm_head"].to(device)
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
    P.stop(SERVER)  # the GPU to the trainers
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
        out = H2H / "recipes" / name
        argv = [sys.executable, "-m", "bench.gpu.ablate", "--run", run_id, "--out", str(out), "--model", str(SMOL),
                "--epochs", str(EPOCHS), "--checkpoint-every", str(ABLATE_CHECKPOINT_EVERY),
                *trainer_flags]  # fmt: skip
        rec["drafter_dir"] = str(out / "drafter")
        jobs.append((rec, {}, f"h2h-recipe-{name}", argv))  # (recipe, this call's trainer record, process, argv)
    jobs = jobs[:ABLATE_PARALLEL]
    if jobs and time_left() > 60:
        P.log(f"h2h-ablate-train: {', '.join(n for _, _, n, _ in jobs)} together, {time_left():.0f}s left")
        threads = str(max(1, (os.cpu_count() or 16) // len(jobs)))  # the machine's cores shared, not each one's
        # the GPU's memory shared too (one trainer peaks near 12 GiB reserved), in segments that grow in place so
        # that varying batch shapes do not fragment each process's cache
        share = f"{0.95 / len(jobs):.3f}"
        env = {**P.eaglet_env(SMOL, P.SGL_PORT), "OMP_NUM_THREADS": threads, "ABLATE_GPU_SHARE": share,
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip
        run_trainers([(R, n, argv) for _, R, n, argv in jobs], P.PY_EAGLET, env, TRAIN_TIMEOUT, H2H)
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
    prompts = eval_prompts(tokenizer())
    ports = list(range(P.SGL_PORT + 10, P.SGL_PORT + 10 + EVAL_PARALLEL))
    lock = threading.Lock()

    def one(name: str) -> None:
        with lock:
            port = ports.pop()
        try:
            if time_left() < 130:  # a server start and two prompt sets
                A[name]["eval"] = {s: {"error": "not run: out of this call's time"} for s in prompts}
            else:
                A[name]["eval"] = evaluate(f"recipe {name}", A[name]["drafter_dir"], CHAINS[0], prompts, {}, port,
                                           EVAL_PARALLEL_MEM)  # fmt: skip
        finally:
            with lock:
                ports.append(port)
                P.save(ABLATED)

    unscored = {n: r["drafter_dir"] for n, r in ready.items() if not (r.get("score") or {}).get("heldout_acc")}
    with ThreadPoolExecutor(EVAL_PARALLEL + 1) as ex:
        scored = ex.submit(score, "h2h-recipe-score", unscored, H2H / "h2h-recipes-score.json") if unscored else None
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
    chain = str(CHAINS[0])
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


def phase_report() -> None:
    for phase in (*h2hreport.PHASES, ABLATED):
        P.save(phase)
    h2hreport.write(P.OUT, P.OUT)


PHASES = {
    "h2h-data": phase_data,
    "h2h-extract": phase_extract,
    "h2h-eaglet": phase_eaglet,
    "h2h-specforge": phase_specforge,
    "h2h-score": phase_score,
    "h2h-eval": phase_eval,
    "h2h-trainspeed": phase_trainspeed,
    "h2h-extract-fp8": phase_extract_fp8,
    "h2h-layouts": phase_layouts,
    "h2h-ablate-train": phase_ablate_train,
    "h2h-ablate-eval": phase_ablate_eval,
    "h2h-gate": phase_gate,
    "h2h-report": phase_report,
}


def conversations() -> int:
    """The conversations the run extracts: the kept ones' count, else the number it writes."""
    kept = KEPT / "data.json"
    return (
        json.loads(kept.read_text())["conversations"]
        if kept.exists() and not os.environ.get("H2H_NEW_DATA")
        else N_CONV
    )


ESTIMATE_S = {
    # 10,002 conversations took 487 s, their extraction 60 s (one H200): per conversation, plus a server start
    "h2h-data": lambda: 5 if (KEPT / "train.jsonl.gz").exists() else 70 + N_CONV * 0.045,
    "h2h-extract": lambda: 70 + conversations() * 0.01,
    "h2h-eaglet": estimate_eaglet,
    "h2h-specforge": estimate_specforge,
    "h2h-score": 60,
    "h2h-eval": 450,  # three server starts of ~55 s, five prompt-set decodes of ~45 s, the repeat
    "h2h-trainspeed": lambda: estimate_trainspeed_row("", True),  # one row at least; the rest by their own
    "h2h-extract-fp8": lambda: 70 + conversations() * 0.01,
    "h2h-layouts": lambda: 10 + conversations() * 0.004,  # a re-encode of each sample a layout, no server
    "h2h-ablate-train": 90,  # the recipes resume from their checkpoints: any minute of training is kept
    "h2h-ablate-eval": 150,
    "h2h-gate": 1,
    "h2h-report": 5,
}

if __name__ == "__main__":
    from bench.gpu import phases

    raise SystemExit(P.main({**phases.PHASES, **PHASES}, {**phases.ESTIMATE_S, **ESTIMATE_S}))
