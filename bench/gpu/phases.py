"""The GPU runs of eaglet's SGLang dump plugin and pipeline, in phases, on an H200 machine after bench/gpu/install.sh.

    python3 -m bench.gpu.phases PHASE [PHASE...]     (from the repo root; results in $OUT, default ./gpu-out)

Each call's logs stay apart: the servers', workers' and trainer's in $OUT/logs/<call>/logs.tgz, where <call>
is GPUBENCH_CALL (bench/gpu/run.sh sets it; default: the start time).

Phases:
  smol      SGLang 0.5.17 + eaglet's plugin on a SmolLM2-135M-shape Llama (random bf16 weights), radix cache
            off, chunked prefill 256: the real extractor workers extract N samples (lengths 16..3000 tokens);
            the same prompts go through the reference server on the same GPU and the hidden states are
            compared per tensor; prefill tokens/s of the server alone (plugin on, no dump) and of the pipeline.
  real      the same on the bundled SmolLM2-135M-Instruct (real weights, from its GGUF), on the demo
            conversations; keeps the store for `drafter`.
  speed8b   Llama-3-8B shape (random bf16), 2,048-token prompts, concurrency 32, three repetitions each: plain
            SGLang's prefill tokens/s (1,000 requests), the disk's fsync bandwidth, and the bf16 pipeline's
            end-to-end tokens/s with 32 workers (1,200 samples, > 60 s), the server's memory sampled.
  plain8b   speed8b's first half (plain SGLang and the disk); bf16speed8b its second (the bf16 pipeline).
  fp8speed8b  the same pipeline storing fp8 (encoded by the plugin on the GPU), three repetitions, and the GPU
            encoder checked bit for bit against the workers' CPU encoder.
  layoutspeed8b  the same pipeline on the default storage layout (the top-24 in place of the final state and the
            4-bit aux states, both by the plugin on the GPU, checked first against the workers' encoders), three
            repetitions. Every pipeline repetition probes the disk just before it.
  fp4speed8b  the same pipeline with the 4-bit aux states alone (the final state whole, no top-k).
  diskpatterns  the data disk under the store's write pattern (sample-sized files, sendfile from shared memory,
            fsync, rename, folder fsync; 8 to 64 writers; removed behind or kept) beside the plain probe.
  ref8b     the reference server at the 8B shape: server alone (--no-dump) vs the pipeline.
  train8b   eaglet's trainer on the 8B store files that speed8b wrote (hidden 4096, TTT 7, 2,048-token
            samples): tokens/s and peak GPU memory.
  drafter   trains a drafter with eaglet's trainer on the `real` (else `smol`) run, loads it in SGLang as an
            EAGLE-3 draft and decodes; reports SGLang's acceptance length.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from eaglet.shared.redisserver import RedisServer, ensure

REPO = Path.cwd()
ROOT = Path(os.environ.get("GPUBENCH_ROOT", "/root"))  # everything the runs write, outside the tree
S = ROOT / "stage"
OUT = Path(os.environ.get("OUT") or REPO / "gpu-out")
CALL = os.environ.get("GPUBENCH_CALL") or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
CALL_OUT = OUT / "logs" / CALL
CALL_OUT.mkdir(parents=True, exist_ok=True)
LOGS = ROOT / "logs" / CALL  # the raw logs: on the machine, tarred into CALL_OUT at the end
LOGS.mkdir(parents=True, exist_ok=True)
MODELS = ROOT / "models"
DATA = ROOT / "data"
DUMPS = Path(os.environ.get("GPUBENCH_DUMPS", "/dev/shm/eaglet-dumps"))
REDIS = RedisServer(
    ROOT / "redis",
    int(os.environ.get("GPUBENCH_REDIS_PORT", "6379")),
    appendonly=False,
    executable=f"{S}/redis/bin/redis-server",
    env={"LD_LIBRARY_PATH": f"{S}/redis/lib"},
    log=LOGS / "redis.log",
)
REDIS_URL = REDIS.url
SGL_PORT, REF_PORT = int(os.environ.get("GPUBENCH_SGL_PORT", "30000")), 30001
PY_EAGLET = f"{REPO}:{S}/esite:{S}/site"
PY_SGL_PLAIN = f"{S}/site"
PY_SGL_PLUGIN = f"{REPO}:{S}/plugin_site:{S}/esite:{S}/site"
SGL_BASE = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--log-level", "info"]
T0 = time.time()
RESULTS: dict = {}
PROCS: dict[str, subprocess.Popen] = {}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def save(phase: str) -> None:
    (OUT / f"{phase}.json").write_text(json.dumps(RESULTS.get(phase, {}), indent=1, default=str))


# --- processes -----------------------------------------------------------------------------------------


def start(name: str, argv: list[str], pythonpath: str, env: dict | None = None) -> subprocess.Popen:
    e = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **(env or {})}
    e.pop("SGLANG_PLUGINS", None) if "SGLANG_PLUGINS" not in (env or {}) else None
    f = open(LOGS / f"{name}.log", "ab")
    p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=e, start_new_session=True)
    PROCS[name] = p
    return p


def stop(name: str, timeout: float = 30) -> None:
    p = PROCS.pop(name, None)
    if p is None:
        return
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the server's scheduler and detokenizer children: our own group
    except ProcessLookupError:
        pass


def stop_all() -> None:
    for name in list(PROCS):
        stop(name, 15)


def tail(name: str, n: int = 40) -> str:
    try:
        return "\n".join((LOGS / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_health(name: str, port: int, timeout: float) -> float:
    t = time.time()
    while time.time() - t < timeout:
        if PROCS[name].poll() is not None:
            raise RuntimeError(f"{name} exited ({PROCS[name].returncode}):\n{tail(name, 60)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.time() - t
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name}: no /health after {timeout}s:\n{tail(name, 60)}")


# SGLang refuses to start when the memory its weights took looks larger than its fraction, and servers starting at
# the same moment count each other's loading as their own (seen: "minimum viable 0.107" at 0.1): such a start is
# tried once more, once no other start is under way (a retry among the others' loads was refused again, 2026-12-04)
KV_REFUSED = "leave no GPU memory for the KV cache"
_STARTS = threading.Condition()  # guards _starting: the starts under way through once_more_if_refused
_starting = 0
SETTLE_S = 300  # the longest a refused start waits for the others'


def _counted(start) -> float:
    global _starting
    with _STARTS:
        _starting += 1
    try:
        return start()
    finally:
        with _STARTS:
            _starting -= 1
            _STARTS.notify_all()


def once_more_if_refused(name: str, start, may_retry: bool = True) -> float:
    """``start()``: a server's start beside others on the same GPU, returning its startup s. One that refused the KV
    cache while the others loaded is stopped and, once none of the others is still starting, started once more (when
    ``may_retry``: the call has time for it)."""
    try:
        return _counted(start)
    except RuntimeError as e:
        if KV_REFUSED not in str(e) or not may_retry:
            raise
        log(f"{name}: refused for memory while others started; once more when none is starting")
        stop(name)
        with _STARTS:
            _STARTS.wait_for(lambda: _starting == 0, timeout=SETTLE_S)
        return _counted(start)


def redis_up() -> None:
    """One redis-server for all phases and calls (never stopped here: run state stays for later phases)."""
    ensure(REDIS)


def sglang(name: str, model: Path, *, plugin: bool, extra: list[str], timeout: float = 420, port: int = 0) -> float:
    """Starts SGLang on ``port`` (0: SGL_PORT): with the plugin through eaglet's launch command, without it as plain
    launch_server."""
    port = port or SGL_PORT
    if plugin:
        argv = (
            [
                sys.executable,
                "-m",
                "eaglet.services.inference.sglang_launch",
                "--model-path",
                str(model),
                "--dump-dir",
                str(DUMPS),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            + extra
            + SGL_BASE
        )
        env = {"EAGLET_DUMP_DIR": str(DUMPS)}
        pp = PY_SGL_PLUGIN
    else:
        argv = (
            [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-radix-cache",
            ]
            + extra
            + SGL_BASE
        )
        env, pp = {}, PY_SGL_PLAIN
    log(f"{name}: {' '.join(argv[1:])}")
    start(name, argv, pp, env)
    up = wait_health(name, port, timeout)
    log(f"{name}: healthy after {up:.0f}s")
    return up


def reference(name: str, model: Path, *, dump: bool, timeout: float = 300) -> float:
    argv = [sys.executable, "-m", "eaglet.services.inference.main", "--port", str(REF_PORT)] + (
        [] if dump else ["--no-dump"]
    )
    env = {
        "EAGLET_MODEL": str(model),
        "EAGLET_DUMP_DIR": str(DUMPS),
        "EAGLET_DEVICE": "cuda",
        "EAGLET_DTYPE": "bfloat16",
        "EAGLET_HOST": "127.0.0.1",
    }
    log(f"{name}: reference server on {model}")
    start(name, argv, PY_EAGLET, env)
    up = wait_health(name, REF_PORT, timeout)
    log(f"{name}: healthy after {up:.0f}s")
    return up


# --- data ----------------------------------------------------------------------------------------------


def pretokenized(path: Path, lengths: list[int], vocab: int, seed: int, low: int = 3) -> int:
    """Samples of random ids in [low, vocab), the second half of each its loss positions; returns the tokens."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            ids = [rng.randrange(low, vocab) for _ in range(n)]
            mask = [0] * (n // 2) + [1] * (n - n // 2)
            f.write(json.dumps({"id": f"s{i:05d}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return sum(lengths)


def eaglet_env(model: Path, port: int, store: str = "model") -> dict:
    return {
        "EAGLET_STORE_DTYPE": store,
        "EAGLET_REDIS_URL": REDIS_URL,
        "EAGLET_DATA_DIR": str(DATA),
        "EAGLET_DUMP_DIR": str(DUMPS),
        "EAGLET_MODEL": str(model),
        "EAGLET_INFERENCE_URL": f"http://127.0.0.1:{port}",
        "EAGLET_REQUEST_TIMEOUT_S": "600",
        "EAGLET_DUMP_WAIT_S": "60",
    }


def pipeline(
    run_id: str,
    model: Path,
    dataset: Path,
    port: int,
    workers: int,
    max_tokens: int,
    timeout: float,
    store: str = "model",
    sink: bool = False,
    store_options: dict | None = None,
) -> dict:
    """The real thing: extractor worker processes, a run ingested and queued, waited on until complete.
    ``sink``: each stored sample is removed once it is marked done (written and fsynced), so a run longer
    than the disk holds can go on. ``store_options``: the run's storage options, every state when None (as the speed
    rows and the head-to-head's conversion to SpecForge's features need); ``{}``: the product's default layout."""
    os.environ.update(eaglet_env(model, port, store))
    from redis import Redis

    from eaglet.services.ingest.jobs import ingest_new_run
    from eaglet.shared.config import Settings
    from eaglet.shared.keys import RunKeys
    from eaglet.shared.runoptions import EVERY_STATE, RunOptions
    from eaglet.shared.runstate import RunState

    redis = Redis.from_url(REDIS_URL, decode_responses=True)
    names = start_workers(run_id, model, port, workers, store)
    t_start = time.time()
    options = RunOptions(max_tokens=max_tokens, **(EVERY_STATE if store_options is None else store_options))
    res = ingest_new_run(redis, Settings(), run_id, dataset, options)
    state = RunState(redis, run_id)
    first = None
    removed = [0]
    if sink:
        import threading

        threading.Thread(target=remove_stored, args=(state, dataset, res.samples, removed), daemon=True).start()
    while time.time() - t_start < timeout:
        c = redis.hgetall(RunKeys(run_id).counts)
        done, failed = int(c.get("done", 0)), int(c.get("failed", 0))
        if first is None and done:
            first = time.time() - t_start
        if state.extraction_complete() or done + failed >= res.samples:
            break
        time.sleep(0.05)
    wall = time.time() - t_start
    counts = redis.hgetall(RunKeys(run_id).counts)
    failures = redis.hgetall(RunKeys(run_id).failures)
    for n in names:
        stop(n, 10)
    out = {"stage_mean_s": stage_means(names)}
    out |= {
        "run": run_id,
        "workers": workers,
        "samples": res.samples,
        "tokens": res.tokens,
        "bad_lines": res.bad_lines,
        "counts": counts,
        "failures": dict(list(failures.items())[:10]),
        "complete": state.extraction_complete(),
        "wall_s": round(wall, 2),
        "first_done_s": first,
        "tokens_per_s": round(int(counts.get("tokens", 0)) / wall, 1),
        "bytes_per_s": round(int(counts.get("bytes", 0)) / wall, 1),
        "store": store,
        "layout": options.layout().name,
        "removed_behind": removed[0],
    }
    log(f"{run_id}: {json.dumps(out)[:600]}")
    return out


def start_workers(prefix: str, model: Path, port: int, workers: int, store: str = "model") -> list[str]:
    """Extractor worker processes (they take a run's regeneration and extraction jobs), waited on until their
    heartbeats show; returns their names."""
    from redis import Redis

    from eaglet.shared import heartbeats

    redis = Redis.from_url(REDIS_URL, decode_responses=True)
    DATA.mkdir(parents=True, exist_ok=True)  # the workers' heartbeat reads its free space
    names = [f"{prefix}-w{i}" for i in range(workers)]
    for n in names:
        start(
            n,
            [sys.executable, "-m", "eaglet.services.extractor.worker", "--name", n],
            PY_EAGLET,
            eaglet_env(model, port, store),
        )
    t = time.time()
    while time.time() - t < 45:
        alive = set(heartbeats.workers(redis))
        if sum(1 for n in names if n in alive) == workers or len(heartbeats.workers(redis)) >= workers:
            break
        time.sleep(0.5)
    log(f"{prefix}: {workers} workers up in {time.time() - t:.0f}s")
    return names


def remove_stored(state, dataset: Path, total: int, removed: list[int]) -> None:
    """Removes each sample file of the run once the run marks it done, in index order."""
    from eaglet.shared.store import sample_path

    ids = [json.loads(line)["id"] for line in dataset.open()]
    for i in range(total):
        while not state.is_done(i) and not state.extraction_complete():
            time.sleep(0.05)
        try:
            sample_path(DATA, state.run_id, ids[i]).unlink()
            removed[0] += 1
        except FileNotFoundError:
            pass


def stage_means(workers: list[str]) -> dict[str, float]:
    """Mean seconds per stage of a stored sample, from the workers' job log lines ("done (prefill 1.2s, ...)")."""
    sums: dict[str, float] = {}
    count = 0
    for name in workers:
        for line in (LOGS / f"{name}.log").read_text(errors="replace").splitlines():
            m = re.search(r": done \((.*)\)$", line)
            if not m:
                continue
            count += 1
            for part in m.group(1).split(", "):
                stage, seconds = part.rsplit(" ", 1)
                sums[stage] = sums.get(stage, 0.0) + float(seconds.rstrip("s"))
    return {"samples": count, **{k: round(v / max(count, 1), 4) for k, v in sums.items()}}


def bench(port: int, prompts: list[list[int]], concurrency: int, rid_prefix: str, wait_dumps: bool) -> dict:
    """Prefill throughput as a client sees it: max_new_tokens 1, `concurrency` requests in flight.
    With eaglet rids the dump of each request is awaited and deleted (what a worker does, minus storage)."""
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)
    )
    errors, missing = [], [0]

    def one(i: int) -> int:
        rid = f"{rid_prefix}{i}"
        r = client.post(
            "/generate",
            json={"input_ids": prompts[i], "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        )
        if r.status_code != 200:
            errors.append(f"{r.status_code} {r.text[:200]}")
            return 0
        if wait_dumps:
            p = DUMPS / f"{rid}.safetensors"
            t = time.time()
            while not p.exists():
                if time.time() - t > 60:
                    missing[0] += 1
                    return len(prompts[i])
                time.sleep(0.002)
            p.unlink()
        return len(prompts[i])

    t = time.time()
    with ThreadPoolExecutor(concurrency) as ex:
        tokens = sum(ex.map(one, range(len(prompts))))
    wall = time.time() - t
    return {
        "requests": len(prompts),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "concurrency": concurrency,
        "errors": errors[:5],
        "n_errors": len(errors),
        "dumps_missing": missing[0],
    }


def compare_with_reference(run_id: str, model: Path, limit: int | None = None) -> dict:
    """Each stored sample (from SGLang's dumps) against the reference server's dump of the same prompt."""
    import torch
    from safetensors.torch import load_file

    from eaglet.shared.dumpfile import read_dump
    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import sample_path, samples_dir

    samples = SampleSet(samples_dir(DATA, run_id))
    client = httpx.Client(base_url=f"http://127.0.0.1:{REF_PORT}", timeout=600)
    names = ["hidden_states", "aux_hidden_states[0]", "aux_hidden_states[1]", "aux_hidden_states[2]"]
    agg = {n: {"max_abs": 0.0, "sum_abs": 0.0, "n": 0, "max_ref": 0.0, "cos_min": 1.0} for n in names}
    per_sample, mismatched, missing = [], [], []
    n_cmp = len(samples) if limit is None else min(limit, len(samples))
    for i in range(n_cmp):
        s = samples[i]
        stored_path = sample_path(DATA, run_id, s.sample_id)
        if not stored_path.exists():
            missing.append(s.sample_id)
            continue
        stored = load_file(str(stored_path))
        if stored["input_ids"].tolist() != s.input_ids.tolist():
            mismatched.append(f"{s.sample_id}: input_ids differ")
            continue
        rid = f"eaglet:ref-{run_id}:{s.sample_id}:1"
        r = client.post(
            "/generate",
            json={
                "input_ids": s.input_ids.tolist(),
                "rid": rid,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            },
        )
        r.raise_for_status()
        p = DUMPS / f"{rid}.safetensors"
        for _ in range(3000):
            if p.exists():
                break
            time.sleep(0.01)
        ref = read_dump(p)
        p.unlink()
        h = ref.hidden_states.shape[-1]
        pairs = {"hidden_states": (stored["hidden_states"], ref.hidden_states)}
        for k in range(3):
            pairs[f"aux_hidden_states[{k}]"] = (
                stored["aux_hidden_states"][:, k * h : (k + 1) * h],
                ref.aux_hidden_states[:, k * h : (k + 1) * h],
            )
        row = {"sample": s.sample_id, "tokens": len(s.input_ids)}
        for n, (a, b) in pairs.items():
            if a.shape != b.shape:
                mismatched.append(f"{s.sample_id}: {n} shape {tuple(a.shape)} vs {tuple(b.shape)}")
                continue
            a32, b32 = a.float(), b.float()
            d = (a32 - b32).abs()
            cos = torch.nn.functional.cosine_similarity(a32, b32, dim=-1).min().item()
            g = agg[n]
            g["max_abs"] = max(g["max_abs"], d.max().item())
            g["sum_abs"] += d.sum().item()
            g["n"] += d.numel()
            g["max_ref"] = max(g["max_ref"], b32.abs().max().item())
            g["cos_min"] = min(g["cos_min"], cos)
            row[n] = {
                "max_abs": round(d.max().item(), 5),
                "mean_abs": round(d.mean().item(), 6),
                "cos_min": round(cos, 5),
            }
        per_sample.append(row)
    summary = {
        n: {
            "max_abs_diff": g["max_abs"],
            "mean_abs_diff": g["sum_abs"] / max(g["n"], 1),
            "max_abs_ref": g["max_ref"],
            "min_cosine": g["cos_min"],
            "elements": g["n"],
        }
        for n, g in agg.items()
    }
    return {
        "compared": len(per_sample),
        "missing": missing,
        "mismatched": mismatched,
        "per_tensor": summary,
        "per_sample_first": per_sample[:12],
        "worst_samples": sorted(per_sample, key=lambda r: -r.get("hidden_states", {}).get("max_abs", 0))[:5],
    }


def plugin_lines(name: str) -> list[str]:
    try:
        lines = (LOGS / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    keys = ("eaglet", "EAGLE-3", "dump", "Traceback", "Error", "chunk")
    clock = [ln[:300] for ln in lines if "capture: " in ln]  # one a minute: what the capture cost the forwards
    return [ln[:300] for ln in lines if any(k in ln for k in keys) and "capture: " not in ln][:40] + clock[-40:]


# --- phases --------------------------------------------------------------------------------------------


def phase_extract(
    phase: str,
    model: Path,
    dataset: Path,
    *,
    n_workers: int,
    chunk: int,
    compare: bool,
    bench_prompts: list[list[int]] | None,
    max_tokens: int = 8192,
) -> None:
    R = RESULTS.setdefault(phase, {})
    redis_up()
    DUMPS.mkdir(parents=True, exist_ok=True)
    extra = ["--chunked-prefill-size", str(chunk), "--mem-fraction-static", "0.5", "--disable-cuda-graph"]
    R["server"] = {
        "cmd": "python -m eaglet.services.inference.sglang_launch --model-path M --dump-dir D "
        + " ".join(extra + SGL_BASE),
        "startup_s": sglang(f"{phase}-sgl", model, plugin=True, extra=extra),
    }
    save(phase)
    run_id = f"{phase}-{int(time.time())}"
    R["pipeline"] = pipeline(run_id, model, dataset, SGL_PORT, n_workers, max_tokens, timeout=300)
    R["run_id"] = run_id
    save(phase)
    if bench_prompts:
        R["server_alone_plugin_loaded_no_dump"] = bench(SGL_PORT, bench_prompts, n_workers, f"bench-{phase}-", False)
        R["server_with_dumps_client"] = bench(SGL_PORT, bench_prompts, n_workers, f"eaglet:bench-{phase}:s:", True)
        log(f"{phase}: bench {R['server_alone_plugin_loaded_no_dump']} / {R['server_with_dumps_client']}")
    R["plugin_log"] = plugin_lines(f"{phase}-sgl")
    stop(f"{phase}-sgl")
    save(phase)
    if compare:
        R["reference_startup_s"] = reference(f"{phase}-ref", model, dump=True)
        R["comparison"] = compare_with_reference(run_id, model)
        log(f"{phase}: comparison {json.dumps(R['comparison']['per_tensor'])}")
        stop(f"{phase}-ref")
        save(phase)


def phase_smol() -> None:
    model = MODELS / "smol"
    subprocess.run(
        [sys.executable, "-m", "bench.gpu.mkmodel", "smol", str(model), f"{S}/tokenizer"],
        check=True,
        env={**os.environ, "PYTHONPATH": PY_EAGLET},
    )
    rng = random.Random(1)
    lengths = [int(16 * (3000 / 16) ** rng.random()) for _ in range(96)] + [256, 257, 512, 3000]
    ds = ROOT / "smol.jsonl"
    tokens = pretokenized(ds, lengths, 49152, seed=2)
    RESULTS["smol"] = {
        "model": "SmolLM2-135M shape (hidden 576, 30 layers, 9/3 heads, vocab 49152), random bf16",
        "samples": len(lengths),
        "tokens": tokens,
        "min_len": min(lengths),
        "max_len": max(lengths),
        "chunked_prefill_size": 256,
        "long_prompts_split": sum(1 for n in lengths if n > 256),
    }
    prompts = [json.loads(line)["input_ids"] for line in open(ds)]
    phase_extract("smol", model, ds, n_workers=4, chunk=256, compare=True, bench_prompts=prompts)


def phase_real() -> None:
    model = MODELS / "smollm2"
    gg = S / "gguf" / "model.gguf"
    subprocess.run(
        [sys.executable, "-m", "bench.gpu.mkmodel", "gguf", str(model), str(gg)],
        check=True,
        env={**os.environ, "PYTHONPATH": PY_EAGLET},
    )
    src = REPO / "data/demo/train.jsonl"
    if not src.exists():
        src = REPO / "data/demo/train.tmp"  # being regenerated: its complete lines
    ds = ROOT / "real.jsonl"
    lines = [ln for ln in src.read_text().splitlines() if ln.strip().endswith("}")]
    ds.write_text("\n".join(lines) + "\n")
    RESULTS["real"] = {
        "model": "SmolLM2-135M-Instruct (the bundled GGUF, dequantized, bf16)",
        "dataset": f"{src.relative_to(REPO)} ({len(lines)} conversations)",
        "chunked_prefill_size": 128,
    }
    phase_extract("real", model, ds, n_workers=4, chunk=128, compare=True, bench_prompts=None, max_tokens=2048)


L8B_EXTRA = ["--chunked-prefill-size", "8192", "--mem-fraction-static", "0.8", "--cuda-graph-max-bs", "8"]
L8B_LENGTH, L8B_CONCURRENCY, L8B_REPS = 2048, 32, 3


def l8b_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(L8B_LENGTH)] for _ in range(n)]


def phase_speed8b() -> None:
    """Plain SGLang and the bf16 pipeline at the Llama-3-8B shape, each repeated, with the disk probed between.

    Steady: >= 1,000 requests a plain repetition, >= 1,000 samples and >= 60 s a pipeline repetition. The store
    is removed behind the pipeline as samples complete (written and fsynced first): a bf16 repetition writes
    ~70 GB, more than the machine's disk holds. On a fresh machine both halves do not fit one call (the first
    SGLang start compiles its kernels): ``plain8b`` then ``bf16speed8b`` in two calls record the same.
    """
    phase_plain8b()
    pipeline_reps("speed8b", "bf16", MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")))


def phase_plain8b() -> None:
    """speed8b's first half: plain SGLang's prefill tokens/s, repeated, the disk probed after each (recorded as
    speed8b's, where the speed report reads them)."""
    R = RESULTS.setdefault("speed8b", {})
    model = MODELS / "l8b"
    if not (model / "config.json").exists():
        phase_models()
    R["model"] = "Llama-3-8B shape (hidden 4096, 32 layers, 32/8 heads, vocab 128256), random bf16"
    R["flags"] = " ".join(L8B_EXTRA + SGL_BASE) + " (radix cache off in both)"
    n_plain = int(os.environ.get("N8B", "1000"))
    redis_up()
    DUMPS.mkdir(parents=True, exist_ok=True)
    R["plain_startup_s"] = sglang("s8b-plain", model, plugin=False, extra=L8B_EXTRA)
    bench(SGL_PORT, l8b_prompts(32, 1), L8B_CONCURRENCY, "warm-", False)
    R["plain"], R["disk"] = [], []
    for rep in range(L8B_REPS):
        R["plain"].append(bench(SGL_PORT, l8b_prompts(n_plain, 10 + rep), L8B_CONCURRENCY, f"plain{rep}-", False))
        R["disk"].append(disk_probe())
        log(f"speed8b plain {rep}: {R['plain'][-1]} disk {R['disk'][-1]}")
        save("speed8b")
    stop("s8b-plain")


def phase_bf16speed8b() -> None:
    """More repetitions of speed8b's bf16 pipeline (``BF16_REPS``), added to its list."""
    redis_up()
    RESULTS.setdefault("speed8b", {})
    pipeline_reps("speed8b", "bf16", MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")),
                  int(os.environ.get("BF16_REPS", str(L8B_REPS))))  # fmt: skip


def phase_fp8speed8b() -> None:
    """The fp8 pipeline at the 8B shape (the server encodes on the GPU), repeated; the GPU encoder checked
    bit for bit against the workers' CPU encoder on dumps of the same prompts."""
    R = RESULTS.setdefault("fp8speed8b", {})
    model = MODELS / "l8b"
    redis_up()
    R["gpu_encoder_vs_cpu"] = fp8_bits_check(l8b_prompts(16, 99))  # first: a fault shows even if time runs out
    save("fp8speed8b")
    pipeline_reps("fp8speed8b", "fp8", model, int(os.environ.get("NPIPE8B", "1200")))
    stop("s8b-plugin")
    save("fp8speed8b")


def pipeline_reps(
    phase: str, store: str, model: Path, n: int, reps: int = L8B_REPS, store_options: dict | None = None
) -> None:
    """``reps`` pipeline runs of ``n`` 2,048-token samples on one plugin server, each after a probe of the disk
    (its ceiling then), with the scheduler's memory sampled throughout; added to the phase's list."""
    R = RESULTS[phase]
    plugin_server(model)
    R.setdefault("pipeline", [])
    for rep in range(len(R["pipeline"]), len(R["pipeline"]) + reps):
        ds = ROOT / f"l8b-{rep}.jsonl"
        pretokenized(ds, [L8B_LENGTH] * n, 49152, seed=20 + rep)
        disk = disk_probe()
        with MemorySampler(PROCS["s8b-plugin"].pid) as memory:
            out = pipeline(f"{phase}-{rep}-{int(time.time())}", model, ds, SGL_PORT, L8B_CONCURRENCY, 8192,
                           timeout=400, store=store, sink=True, store_options=store_options)  # fmt: skip
        out["server_memory"], out["disk"] = memory.result(), disk
        counts = out.get("counts") or {}
        # the stored bytes a token as counted by the workers (a layout's are not the dumps' fixed width)
        out["bytes_per_token"] = round(int(counts.get("bytes", 0)) / max(int(counts.get("tokens", 0)), 1), 1)
        R["pipeline"].append(out)
        log(f"{phase} pipeline {rep}: {out['tokens_per_s']} tok/s, memory {out['server_memory']}")
        save(phase)
    R["plugin_log"] = plugin_lines("s8b-plugin")


def phase_layoutspeed8b() -> None:
    """The default storage layout's pipeline at the 8B shape, repeated: the plugin computes the top-24 in place of the
    final state and the 4-bit aux states on the GPU; both checked first against the workers' encoders."""
    R = RESULTS.setdefault("layoutspeed8b", {})
    redis_up()
    from eaglet.shared.runoptions import DEFAULT_TOPK

    R["encoders_vs_cpu"] = layout_bits_check(l8b_prompts(8, 98), DEFAULT_TOPK)  # a fault shows first
    save("layoutspeed8b")
    pipeline_reps("layoutspeed8b", "bf16", MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")), store_options={})
    stop("s8b-plugin")
    save("layoutspeed8b")


def phase_fp4speed8b() -> None:
    """The 4-bit aux states alone (the final state kept whole: 0.46x bf16, no top-k) at the 8B shape, repeated
    (``FP4_REPS``): the small layout's speed without the vocabulary head's product."""
    RESULTS.setdefault("fp4speed8b", {})
    redis_up()
    fp4_alone = {"store_final": "all", "store_aux": "fp4"}
    reps = int(os.environ.get("FP4_REPS", str(L8B_REPS)))
    pipeline_reps("fp4speed8b", "bf16", MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")), reps, fp4_alone)
    stop("s8b-plugin")
    save("fp4speed8b")


class Sampler:
    """Calls ``sample()`` every ``interval_s`` in a thread, from ``start()`` (or entering) to ``stop()``."""

    interval_s = 0.5

    def sample(self) -> None:
        raise NotImplementedError

    def start(self):
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


def gpu_memory_mib() -> dict[int, int]:
    """Memory in use on each GPU (MiB), as nvidia-smi reports it; empty if it does not answer."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return {int(i): int(m) for i, m in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


class MemorySampler(Sampler):
    """Peak resident memory of each process of a server's process group (the scheduler holds the dumps)."""

    def __init__(self, pgid: int):
        self.pgid, self.peaks, self.first = pgid, {}, {}

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) != self.pgid:
                    continue
                name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[-40:]
                rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
            key = f"{pid} {name}"
            self.first.setdefault(key, rss)
            self.peaks[key] = max(self.peaks.get(key, 0), rss)

    def result(self) -> dict:
        return {k: {"start_GB": round(self.first[k] / 1e9, 2), "peak_GB": round(v / 1e9, 2)}
                for k, v in self.peaks.items() if v > 1e9}  # fmt: skip


def plugin_server(model: Path) -> None:
    if "s8b-plugin" not in PROCS:
        RESULTS["plugin8b_startup_s"] = sglang("s8b-plugin", model, plugin=True, extra=L8B_EXTRA)
        bench(SGL_PORT, l8b_prompts(32, 1), L8B_CONCURRENCY, "eaglet:warm:s:", True)


def fp8_bits_check(prompts: list[list[int]]) -> dict:
    """The GPU encoder against the workers' CPU encoder, bit for bit: on the same tensors (the full-width dumps
    moved to the GPU), and through the plugin (the same prompt dumped full width, again full width to see
    whether two forwards agree at all, and fp8-encoded on the GPU)."""
    import torch

    from eaglet.shared.dumpfile import read_dump
    from eaglet.shared.store import FP8_DEVICE_BLOCK_BYTES, encode_fp8

    plugin_server(MODELS / "l8b")
    client = httpx.Client(base_url=f"http://127.0.0.1:{SGL_PORT}", timeout=600)
    same_tensor = equal = checked = forwards_agree = 0
    for i, ids in enumerate(prompts):
        paths = dumps_of(client, ids, f"{i}", {"w": {}, "v": {}, "e": {"eaglet_dump": "fp8"}})
        wide, again, enc = (read_dump(p) for p in paths)
        for name in ("hidden_states", "aux_hidden_states"):
            x = getattr(wide, name)
            values, scale = encode_fp8(x)
            gpu_values, gpu_scale = encode_fp8(x.cuda(), FP8_DEVICE_BLOCK_BYTES)
            checked += 1
            same_tensor += bool(torch.equal(gpu_values.cpu().view(torch.uint8), values.view(torch.uint8))
                                and torch.equal(gpu_scale.cpu(), scale))  # fmt: skip
            forwards_agree += bool(torch.equal(x, getattr(again, name)))
            equal += bool(torch.equal(getattr(enc, name).view(torch.uint8), values.view(torch.uint8))
                          and torch.equal(enc.scales[f"{name}_scale"], scale))  # fmt: skip
        for path in paths:
            path.unlink()
    return {
        "tensors_checked": checked,
        "gpu_vs_cpu_same_tensor_identical": same_tensor,
        "two_full_width_forwards_identical": forwards_agree,
        "plugin_fp8_dump_vs_cpu_encoding_of_full_width_dump_identical": equal,
    }


def dumps_of(client: httpx.Client, ids: list[int], tag: str, kinds: dict[str, dict]) -> list[Path]:
    """The plugin's dump of one prompt for each kind of request (its ``custom_params``), one after another."""
    paths = []
    for kind, params in kinds.items():
        rid = f"eaglet:bits:{kind}{tag}:0"
        sp = {"max_new_tokens": 1, "temperature": 0, "custom_params": params}
        client.post("/generate", json={"input_ids": ids, "rid": rid, "sampling_params": sp}).raise_for_status()
        path = DUMPS / f"{rid}.safetensors"
        t = time.time()
        while not path.exists() and time.time() - t < 60:
            time.sleep(0.01)
        paths.append(path)
    return paths


def layout_bits_check(prompts: list[list[int]], k: int) -> dict:
    """The default layout's dump against the workers' CPU encoders on the full-width dump of the same prompt: the
    4-bit aux states bit for bit; the top-k against ``encode_topk`` on the GPU from the full-width final states (the
    plugin scores every asking request's rows in one product, whose kernel may round otherwise)."""
    import torch

    from eaglet.shared.dumpfile import read_dump
    from eaglet.shared.fp4 import encode_fp4
    from eaglet.shared.store import FP4_AUX_TENSORS
    from eaglet.shared.targettensors import load_target_tensors
    from eaglet.shared.topk import encode_topk

    plugin_server(MODELS / "l8b")
    client = httpx.Client(base_url=f"http://127.0.0.1:{SGL_PORT}", timeout=600)
    head = load_target_tensors(MODELS / "l8b", ("lm_head",))["lm_head"].cuda()
    out = {"prompts": 0, "fp4_identical": 0, "final_state_omitted": 0, "topk_ids_equal_fraction": [],
           "topk_logp_max_abs_diff": []}  # fmt: skip
    for i, ids in enumerate(prompts):
        paths = dumps_of(client, ids, f"l{i}", {"w": {}, "d": {"eaglet_topk": k, "eaglet_aux": "e2m1_b32"}})
        wide, default = (read_dump(p) for p in paths)
        out["prompts"] += 1
        codes = encode_fp4(wide.aux_hidden_states)
        out["fp4_identical"] += all(
            torch.equal(default.aux_fp4[n], c) for n, c in zip(FP4_AUX_TENSORS, codes, strict=True)
        )
        out["final_state_omitted"] += default.hidden_states is None
        top_ids, top_logp = encode_topk(wide.hidden_states.cuda(), head, k)
        got_ids, got_logp = default.topk["topk_ids"], default.topk["topk_logp"]
        out["topk_ids_equal_fraction"].append(round(float((got_ids == top_ids.cpu()).float().mean()), 5))
        out["topk_logp_max_abs_diff"].append(round(float((got_logp.float() - top_logp.cpu().float()).abs().max()), 5))
        for path in paths:
            path.unlink()
    return out


def disk_probe() -> dict:
    """Write bandwidth of the data disk with fsync (128 MiB files), the pipeline's other ceiling."""
    buf = os.urandom(128 << 20)
    DATA.mkdir(parents=True, exist_ok=True)
    t = time.time()
    for i in range(8):
        with open(DATA / f"probe{i}", "wb") as f:
            f.write(buf)
            f.flush()
            os.fsync(f.fileno())
    wall = time.time() - t
    for i in range(8):
        (DATA / f"probe{i}").unlink()
    return {"fsync_write_GBps": round(8 * len(buf) / wall / 1e9, 3)}


DISKPAT_FILE_MB = 64  # a 2,048-token sample at the 8B shape in bf16: 2,048 x 32,773 B


def phase_diskpatterns() -> None:
    """The data disk under the store's own write pattern, beside the plain probe (no GPU): which part of it keeps a
    disk-bound pipeline under the probe. Each pattern writes ``DISKPAT_FILES`` 64 MiB sample-sized files copied by
    sendfile from a shared-memory dump, as the workers do; bytes a second over the pattern's wall."""
    R = RESULTS.setdefault("diskpatterns", {})
    DATA.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(f"findmnt -n -o SOURCE,FSTYPE,OPTIONS -T {DATA} || df -T {DATA}", shell=True,
                           capture_output=True, text=True)  # fmt: skip
    R["mount"] = (mount.stdout + mount.stderr).strip()
    R["probe_before"] = disk_probe()
    DUMPS.mkdir(parents=True, exist_ok=True)
    dump = DUMPS / "diskpattern.dump"
    dump.write_bytes(os.urandom(DISKPAT_FILE_MB << 20))
    n = int(os.environ.get("DISKPAT_FILES", "128"))
    patterns = {  # name: (writers, fsync the file, fsync the folder, remove each file behind)
        "store x32, removed behind (the pipeline bench)": (32, True, True, True),
        "store x32, kept": (32, True, True, False),
        "store x32, no folder fsync": (32, True, False, False),
        "store x8": (8, True, True, False),
        "store x64": (64, True, True, False),
        "x32, no fsync, one syncfs at the end (the disk streaming)": (32, False, False, False),
    }
    R["patterns"] = {}
    try:
        for name, spec in patterns.items():
            R["patterns"][name] = write_pattern(dump, n, *spec)
            log(f"diskpatterns {name}: {R['patterns'][name]}")
            save("diskpatterns")
    finally:
        dump.unlink(missing_ok=True)
    R["probe_after"] = disk_probe()


def write_pattern(dump: Path, n: int, writers: int, fsync: bool, dir_fsync: bool, remove: bool) -> dict:
    """``n`` copies of ``dump`` written by ``writers`` threads as the store writes a sample (temp file, sendfile,
    fsync, rename, fsync of the folder), spread over 256 folders as the store spreads them; GB a second."""
    root = DATA / "diskpattern"
    for i in range(256):
        (root / f"{i:02x}").mkdir(parents=True, exist_ok=True)
    size = dump.stat().st_size

    def one(i: int) -> None:
        folder = root / f"{i * 97 % 256:02x}"
        tmp, final = folder / f".{i}.partial", folder / f"{i}.safetensors"
        src, fd = os.open(dump, os.O_RDONLY), os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            while offset < size:
                offset += os.sendfile(fd, src, offset, size - offset)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
            os.close(src)
        os.replace(tmp, final)
        if dir_fsync:
            dfd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        if remove:
            final.unlink()

    t = time.time()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(one, range(n)))
    if not fsync:
        os.sync()
    wall = time.time() - t
    shutil.rmtree(root)
    return {"GBps": round(n * size / wall / 1e9, 3), "wall_s": round(wall, 2), "files": n, "writers": writers}


def phase_ref8b() -> None:
    R = RESULTS.setdefault("ref8b", {})
    model = MODELS / "l8b"
    rng = random.Random(5)
    n = int(os.environ.get("REF8B_SAMPLES", "96"))
    prompts = [[rng.randrange(3, 49152) for _ in range(2048)] for _ in range(n)]
    redis_up()
    R["startup_no_dump_s"] = reference("r8b-nodump", model, dump=False)
    bench(REF_PORT, prompts[:16], 32, "warm-", False)
    R["server_alone"] = bench(REF_PORT, prompts, 32, "eaglet:r8b:s:", False)
    stop("r8b-nodump")
    save("ref8b")
    R["startup_dump_s"] = reference("r8b-dump", model, dump=True)
    ds = ROOT / "r8b.jsonl"
    pretokenized(ds, [2048] * n, 49152, seed=6)
    R["pipeline"] = pipeline(f"r8b-{int(time.time())}", model, ds, REF_PORT, 32, 8192, timeout=300)
    R["ratio_pipeline_vs_server"] = round(R["pipeline"]["tokens_per_s"] / R["server_alone"]["tokens_per_s"], 4)
    stop("r8b-dump")
    save("ref8b")


def phase_train8b() -> None:
    R = RESULTS.setdefault("train8b", {})
    # speed8b removes its store behind it: train on a run kept whole (an earlier speed8b, or one named)
    run_id = os.environ.get("TRAIN8B_RUN")
    if not run_id:
        raise RuntimeError("train8b: set TRAIN8B_RUN to a run whose store was kept (speed8b removes its own)")
    steps = os.environ.get("TRAIN8B_STEPS", "30")
    argv = [
        sys.executable,
        "-m",
        "bench.gpu.train_probe",
        "--run",
        run_id,
        "--max-steps",
        steps,
        "--ttt-steps",
        "7",
        "--max-len",
        "2048",
        "--tokens-per-batch",
        os.environ.get("TRAIN8B_TOKENS", "16384"),
        "--loader-workers",
        "2",
        "--checkpoint-every",
        "100000",
        "--heldout-fraction",
        "0.02",
    ]
    R["cmd"] = " ".join(argv[1:])
    start(
        "train8b",
        argv,
        PY_EAGLET,
        {**eaglet_env(MODELS / "l8b", SGL_PORT), "PROBE_OUT": str(OUT / "train8b-probe.json")},
    )
    PROCS["train8b"].wait(timeout=float(os.environ.get("TRAIN8B_TIMEOUT", "300")))
    R["rc"] = PROCS["train8b"].returncode
    R["log_tail"] = tail("train8b", 30)
    try:
        R["probe"] = json.loads((OUT / "train8b-probe.json").read_text())
    except OSError:
        pass
    stop("train8b")
    save("train8b")


def phase_drafter() -> None:
    R = RESULTS.setdefault("drafter", {})
    src = "real" if "run_id" in RESULTS.get("real", {}) else "smol"
    run_id = RESULTS[src]["run_id"]
    model = MODELS / ("smollm2" if src == "real" else "smol")
    R["trained_on"] = {"phase": src, "run": run_id, "model": str(model)}
    argv = [
        sys.executable,
        "-m",
        "bench.gpu.train_probe",
        "--run",
        run_id,
        "--epochs",
        os.environ.get("DRAFT_EPOCHS", "20"),
        "--ttt-steps",
        "7",
        "--max-len",
        "2048",
        "--tokens-per-batch",
        "16384",
        "--draft-vocab-size",
        "8192",
        "--lr",
        "3e-4",
        "--loader-workers",
        "2",
        "--checkpoint-every",
        "100000",
        "--heldout-fraction",
        "0.05",
    ]
    R["train_cmd"] = " ".join(argv[1:])
    ddir = DATA / "runs" / run_id / "drafter"
    if os.environ.get("DRAFT_REUSE") and (ddir / "config.json").exists():
        argv = ["true"]
    start("draft-train", argv, PY_EAGLET, {**eaglet_env(model, SGL_PORT), "PROBE_OUT": str(OUT / "drafter-probe.json")})
    PROCS["draft-train"].wait(timeout=float(os.environ.get("DRAFT_TRAIN_TIMEOUT", "200")))
    R["train_rc"] = PROCS["draft-train"].returncode
    R["train_log_tail"] = tail("draft-train", 12)
    stop("draft-train")
    save("drafter")
    ddir = DATA / "runs" / run_id / "drafter"
    R["drafter_config"] = json.loads((ddir / "config.json").read_text())
    extra = [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(ddir),
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        "--mem-fraction-static",
        "0.5",
        "--disable-cuda-graph",
    ]
    R["server_flags"] = " ".join(extra + SGL_BASE)
    R["startup_s"] = sglang("draft-sgl", model, plugin=False, extra=extra, timeout=400)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [json.loads(line) for line in open(REPO / "data/demo/eval.jsonl")][:32]
    client = httpx.Client(base_url=f"http://127.0.0.1:{SGL_PORT}", timeout=300)
    native = []
    t = time.time()
    for p in prompts:
        msgs = [m for m in p["messages"] if m["role"] == "user"][:1]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        r = client.post(
            "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 128, "temperature": 0}}
        )
        if r.status_code == 200:
            m = r.json()["meta_info"]
            native.append(
                {k: v for k, v in m.items() if k.startswith("spec") or k in ("completion_tokens", "prompt_tokens")}
            )
        else:
            native.append({"error": r.text[:300]})
    R["decode_wall_s"] = round(time.time() - t, 2)
    R["native"] = native
    ok = [n for n in native if n.get("spec_verify_ct")]
    acc = [n["completion_tokens"] / n["spec_verify_ct"] for n in ok]
    R["acceptance_length_mean"] = round(sum(acc) / len(acc), 4) if acc else None
    R["acceptance_length_tokens_over_verifies"] = (
        round(sum(n["completion_tokens"] for n in ok) / sum(n["spec_verify_ct"] for n in ok), 4) if ok else None
    )
    try:
        info = client.get("/get_server_info").json()
        R["server_info_accept"] = {k: v for k, v in info.get("internal_states", [{}])[0].items() if "accept" in k}
    except Exception as e:
        R["server_info_accept"] = repr(e)
    R["server_log_accept_lines"] = [ln for ln in tail("draft-sgl", 400).splitlines() if "accept len" in ln][-8:]
    stop("draft-sgl")
    save("drafter")


ESTIMATE_S = {
    "smol": 200,
    "real": 180,
    # measured 2026-12-04: the first SGLang start on a fresh machine 148 s, 79 s once a smaller model's kernels were
    # compiled, later ones 50-70 s; a pipeline repetition ~100 s with its dataset, workers and probe (bf16speed8b
    # x3: 393 s with a 79 s start; plain8b: 246 s with a 70 s start)
    "speed8b": 650,
    "plain8b": 300,
    "fp8speed8b": 400,
    "bf16speed8b": 400,
    "layoutspeed8b": 480,
    "fp4speed8b": 480,  # as layoutspeed8b; two repetitions after a 176 s first start were cut at 550 s with a third
    "diskpatterns": 90,
    "ref8b": 150,
    "train8b": 120,
    "drafter": 200,
    "models": 60,
}


def phase_models() -> None:
    """Builds the random-weight models ahead (the 8B one is 16 GB), while the rest is still being sent."""
    R = RESULTS.setdefault("models", {})
    wanted = os.environ.get("GPUBENCH_MODELS", "smol,8b").split(",")
    for kind, name in [(k, n) for k, n in (("smol", "smol"), ("8b", "l8b")) if k in wanted]:
        t = time.time()
        subprocess.run([sys.executable, "-m", "bench.gpu.mkmodel", kind, str(MODELS / name), f"{S}/tokenizer"], check=True)
        R[name] = round(time.time() - t, 1)


PHASES = {
    "models": phase_models,
    "smol": phase_smol,
    "real": phase_real,
    "speed8b": phase_speed8b,
    "plain8b": phase_plain8b,
    "fp8speed8b": phase_fp8speed8b,
    "bf16speed8b": phase_bf16speed8b,
    "layoutspeed8b": phase_layoutspeed8b,
    "fp4speed8b": phase_fp4speed8b,
    "diskpatterns": phase_diskpatterns,
    "ref8b": phase_ref8b,
    "train8b": phase_train8b,
    "drafter": phase_drafter,
}


def fresh(phase: str) -> None:
    """A phase not done starts from a clean record; what an earlier attempt ended with stays as a note."""
    old = RESULTS.get(phase)
    if not old or old.get("done"):
        return
    earlier = old.get("earlier_attempts", [])
    note = {k: old[k] for k in ("date", "error", "skipped", "runs") if k in old}  # runs: units it finished
    RESULTS[phase] = {"earlier_attempts": earlier + [note]} if note or earlier else {}


def main() -> int:
    # A call's time limit ends it with SIGTERM: leave through the finally blocks, which save the results and stop
    # every server and worker (left running, they would serve and steal the next call's work).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    state = ROOT / "gpubench-results.json"
    if state.exists():
        RESULTS.update(json.loads(state.read_text()))
    rc = 0
    deadline = float(os.environ.get("GPUBENCH_DEADLINE_S", "1e9"))
    try:
        for phase in sys.argv[1:]:
            log(f"=== {phase}")
            fresh(phase)
            estimate = ESTIMATE_S.get(phase, 60)
            estimate = estimate() if callable(estimate) else estimate
            if phase in PHASES and time.time() - T0 + estimate > deadline:
                RESULTS.setdefault(phase, {})["skipped"] = (
                    f"not started: {time.time() - T0:.0f}s gone of {deadline:.0f}s"
                )
                log(f"{phase}: skipped, out of time")
                save(phase)
                continue
            try:
                PHASES[phase]()
            except Exception as e:
                import traceback

                rc = 1
                RESULTS.setdefault(phase, {})["error"] = f"{type(e).__name__}: {e}"
                RESULTS[phase]["traceback"] = traceback.format_exc()[-3000:]
                log(f"{phase} FAILED: {traceback.format_exc()[-3000:]}")
                stop_all()
            finally:
                RESULTS.setdefault(phase, {})["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                save(phase)
                state.write_text(json.dumps(RESULTS, default=str))
    finally:
        stop_all()
        with tarfile.open(CALL_OUT / "logs.tgz", "w:gz") as t:
            for f in LOGS.glob("*.log"):
                t.add(f, arcname=f.name)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
