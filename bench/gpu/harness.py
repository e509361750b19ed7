"""The GPU bench's harness: the machine's folders and ports (module state, read from the environment at import), the
processes it starts (SGLang, the reference server, Redis, eaglet's workers), the pipeline and prefill helpers, the
samplers, the disk probe, and the runner that keeps one record per phase across calls. The phases themselves are in
one module per family (``extraction``, ``speed``, ``disk``, ``training``; ``phases`` names them all); the head-to-head
and the other GPU benches run through the same runner.
"""

import json
import os
import random
import re
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
    """A process's last ``n`` log lines, the checkout's files named from its root (the results are committed)."""
    try:
        lines = (LOGS / f"{name}.log").read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ""
    return "\n".join(lines).replace(f"{REPO}/", "")


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


def sglang(
    name: str,
    model: Path,
    *,
    plugin: bool,
    extra: list[str],
    timeout: float = 420,
    port: int = 0,
    env: dict | None = None,
) -> float:
    """Starts SGLang on ``port`` (0: SGL_PORT): with the plugin through eaglet's launch command, without it as plain
    launch_server; ``env``: more of the server's environment (the plugin's settings)."""
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
        env = {"EAGLET_DUMP_DIR": str(DUMPS), **(env or {})}
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
        pp = PY_SGL_PLAIN
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


LOSS_SHARE = float(os.environ.get("GPUBENCH_LOSS_SHARE", "0.5"))
"""The share of a synthetic sample's positions under the loss (the kept chat data's: 0.69): what a top-k kept at loss
positions scores."""


def pretokenized(path: Path, lengths: list[int], vocab: int, seed: int, low: int = 3) -> int:
    """Samples of random ids in [low, vocab), the last LOSS_SHARE of each its loss positions; returns the tokens."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            ids = [rng.randrange(low, vocab) for _ in range(n)]
            prompt = int(n * (1 - LOSS_SHARE))  # 0.5: n // 2, as before
            mask = [0] * prompt + [1] * (n - prompt)
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
    cpu_before = cpu_seconds()
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
    cpu = cpu_busy(cpu_before, cpu_seconds(), wall, {PROCS[n].pid for n in names if n in PROCS})
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
        # where the host's cores went: the workers' CPU a sample, the busiest processes (SGLang's scheduler among them)
        "worker_cpu_ms_per_sample": round(1e3 * cpu.pop("workers_s") / max(int(counts.get("done", 0)), 1), 2),
        **cpu,
    }
    log(f"{run_id}: {json.dumps(out)[:600]}")
    return out


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of every process under this one, by pid, with what it runs: SGLang's
    process titles (``sglang::scheduler``...) or the command line past the interpreter."""
    import psutil

    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            with proc.oneshot():
                cmd, times = proc.cmdline(), proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        if cmd and "python" in Path(cmd[0]).name:
            cmd = cmd[1:]
        out[proc.pid] = (" ".join(cmd)[:90], times.user + times.system)
    return out


def cpu_busy(before: dict, after: dict, wall: float, workers: set[int], top: int = 8) -> dict:
    """Each process's cores busy between two ``cpu_seconds`` (1.0: one core all the time), the ``top`` busiest; all
    of them together; and the CPU seconds of the ``workers`` pids."""
    busy = {pid: (after[pid][0], after[pid][1] - before[pid][1]) for pid in after.keys() & before.keys()}
    ranked = sorted(busy.items(), key=lambda kv: -kv[1][1])
    return {
        "cpu_busiest": [{"process": what, "pid": pid, "cores": round(s / wall, 2)} for pid, (what, s) in ranked[:top]],
        "cpu_cores_busy": round(sum(s for _, s in busy.values()) / wall, 2),
        "workers_s": sum(s for pid, (_, s) in busy.items() if pid in workers),
    }


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


# --- phases --------------------------------------------------------------------------------------------


L8B_EXTRA = ["--chunked-prefill-size", "8192", "--mem-fraction-static", "0.8", "--cuda-graph-max-bs", "8"]
L8B_LENGTH, L8B_CONCURRENCY, L8B_REPS = 2048, 32, 3


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


def fresh(phase: str) -> None:
    """A phase not done starts from a clean record; what an earlier attempt ended with stays as a note."""
    old = RESULTS.get(phase)
    if not old or old.get("done"):
        return
    earlier = old.get("earlier_attempts", [])
    # runs: units it finished; drafters, specforge_convert: dfl-train's trainers (their walls so far, summed over
    # the calls a cut-off run resumes in) and the features they read, converted once
    note = {k: old[k] for k in ("date", "error", "skipped", "runs", "drafters", "specforge_convert") if k in old}
    RESULTS[phase] = {"earlier_attempts": earlier + [note]} if note or earlier else {}


def main(phases: dict, estimates: dict) -> int:
    """Runs the phases named on the command line (``phases``: name to function; ``estimates``: name to seconds, or to
    a function of none that gives them), each with a clean record, none started past the call's deadline."""
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
            estimate = estimates.get(phase, 60)
            estimate = estimate() if callable(estimate) else estimate
            if phase in phases and time.time() - T0 + estimate > deadline:
                RESULTS.setdefault(phase, {})["skipped"] = (
                    f"not started: {time.time() - T0:.0f}s gone of {deadline:.0f}s"
                )
                log(f"{phase}: skipped, out of time")
                save(phase)
                continue
            try:
                phases[phase]()
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
