"""Architecture families through eaglet's SGLang dump plugin, on the GPU machine after bench/gpu/install.sh.

    python3 -m bench.gpu.families [--dry-run] [CASE...]   (from the repo root; results in $OUT, default ./gpu-out)

For each case: a tiny random-weight model of the family (bench/gpu/familymodels.py, built before the cases start),
or a bundled model's real weights converted from its staged GGUF (``smollm2real-tp1``, ``gemma3real-tp1``), SGLang
0.5.17 started through eaglet's launcher (chunked prefill 64 so prompts split, CUDA graphs and the overlap
scheduler on, triton attention, pytorch sampling), then 4 of eaglet's extractor workers extract N_SAMPLES (100)
pre-tokenized samples (``prompt_set``: 6 prompts of random ids the tiny models predict, at lengths around the
prefill chunk, and 94 demo prompts in the chat template), each followed by the target's own greedy continuation of
64 tokens from the same server (``continued``), the loss on those. Checked per case:
  - every request's dump written exactly once (the dump dir is watched with inotify: each ``<rid>.safetensors``
    renamed into place is one dump; the workers delete them after storing);
  - every stored sample's rows equal its prompt length, widths H and 3H, all values finite;
  - TP 2 stored states against the TP 1 stored states of the same prompts (max abs diff, min cosine per tensor,
    over the tokens both share: two servers' continuations may part at a near-tie);
  - Llama, Qwen3, DeepSeek-V3, Gemma 3 and the real targets, TP 1, against transformers' own forward on the same
    GPU (one reference per model): aux = hidden_states[i]
    of transformers for SGLang's ids i (the residual entering layer i), final = last hidden state after the norm;
  - Kimi-K2.5 (the same language weights as the DeepSeek-V3 model) against DeepSeek-V3 at the same TP.
Each server is stopped before the next starts, unless FAMILIES_PARALLEL > 1: then the TP 1 cases start together,
each on a port of its own, and extract in turn (bounded by the deadline only through their waits). A case is skipped
when FAMILIES_DEADLINE_S (default 540) would be passed; TP 2 cases are skipped on a one-GPU machine. A failure is
recorded with the server log tail and the run goes on. Results: $OUT/families.json, $OUT/families.md, logs in
$OUT/families-logs.tgz.

Every process gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
"""

import ctypes
import functools
import json
import os
import random
import select
import struct
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.gpu import familymodels, h2hreport

HERE = Path(__file__).resolve().parent


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

T0 = time.time()
DEADLINE_S = float(os.environ.get("FAMILIES_DEADLINE_S", "540"))
N_SAMPLES, N_WORKERS, CHUNK = 100, 4, 64
# random ids at lengths around the 64-token prefill chunk and one long prompt; the other samples are demo prompts
BOUNDARY_LENGTHS = (20, 63, 64, 65, 128, 400)
DEMO_PROMPTS = HERE.parents[1] / "data" / "demo" / "prompts-train.jsonl"
CONTINUATION = 64  # the target's own greedy tokens after each prompt (``continued``)
BASE_FLAGS = [
    "--chunked-prefill-size",
    str(CHUNK),
    "--mem-fraction-static",
    "0.3",
    "--cuda-graph-max-bs",
    "8",
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--log-level",
    "info",
]
# FAMILIES_FLAGS: more server flags, e.g. --disable-cuda-graph when only the dumps are wanted (a prefill never
# runs in a CUDA graph: the graphs are decode's, and capturing them takes part of a server's start)
EXTRA_FLAGS = os.environ.get("FAMILIES_FLAGS", "").split()
TP2_FLAGS = ["--disable-custom-all-reduce", "--enforce-disable-flashinfer-allreduce-fusion"]

# name -> (family, tp, extra launcher flags, compare with: TP 1 case / transformers / another family's case)
CASES: dict[str, dict] = {
    "llama-tp1": {"family": "llama", "tp": 1, "transformers": True},
    "qwen3-tp1": {"family": "qwen3", "tp": 1, "transformers": True},
    "deepseek-tp1": {"family": "deepseek", "tp": 1, "transformers": True},
    "qwen3moe-tp1": {"family": "qwen3moe", "tp": 1},
    "kimi-tp1": {"family": "kimi", "tp": 1, "same_as": "deepseek-tp1"},
    "gptoss-tp1": {"family": "gptoss", "tp": 1},
    "gemma3-tp1": {"family": "gemma3", "tp": 1, "transformers": True},
    # real weights, converted from a staged GGUF ("stage": its folder there): SmolLM2-135M-Instruct, the bundled
    # model (stage.sh's m1..m3), and Gemma 3 270M, the second bundled model (stage-gemma3.sh)
    "smollm2real-tp1": {"family": "llama", "tp": 1, "transformers": True, "bundled": "smollm2", "stage": "gguf"},
    "gemma3real-tp1": {"family": "gemma3", "tp": 1, "transformers": True, "bundled": "gemma3", "stage": "gemma3"},
    "llama-tp2": {"family": "llama", "tp": 2, "vs": "llama-tp1"},
    "deepseek-tp2": {"family": "deepseek", "tp": 2, "vs": "deepseek-tp1"},
    "deepseek-tp2-dpa2": {
        "family": "deepseek",
        "tp": 2,
        "flags": ["--enable-dp-attention", "--dp-size", "2"],
        "vs": "deepseek-tp1",
    },
    "qwen3moe-tp2": {"family": "qwen3moe", "tp": 2, "vs": "qwen3moe-tp1"},
    "qwen3moe-tp2-ep2": {"family": "qwen3moe", "tp": 2, "flags": ["--ep-size", "2"], "vs": "qwen3moe-tp1"},
    "kimi-tp2": {"family": "kimi", "tp": 2, "vs": "kimi-tp1", "same_as": "deepseek-tp2"},
}
PARALLEL = int(os.environ.get("FAMILIES_PARALLEL", "1"))  # TP 1 cases at once, each on a port of its own
if PARALLEL > 1:  # their servers share the one GPU
    BASE_FLAGS[BASE_FLAGS.index("--mem-fraction-static") + 1] = str(round(0.6 / PARALLEL, 2))
EXTRACTING = threading.Lock()
ESTIMATE_S = {1: 75, 2: 95}  # server start + extraction; the first server also compiles Triton kernels
FIRST_EXTRA_S = 60
RESULTS: dict = {"cases": {}}
STATES: dict[str, dict[str, tuple]] = {}  # case -> sample id -> (final, aux) float32
REFS: dict[str, dict[str, tuple]] = {}  # model folder -> sample id -> transformers' (final, aux)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def server_argv(case: str, model: Path, dump_dir: Path, port: int) -> list[str]:
    spec = CASES[case]
    argv = [sys.executable, "-m", "eaglet.services.inference.sglang_launch", "--model-path", str(model)]
    argv += ["--dump-dir", str(dump_dir), "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(spec["tp"])]
    argv += spec.get("flags", []) + BASE_FLAGS + EXTRA_FLAGS
    if spec["tp"] > 1:
        argv += TP2_FLAGS
    if spec["family"] == "kimi":
        argv += ["--trust-remote-code"]  # the processor stand-in is remote code, as the real checkpoint's is
    return argv


def prompt_set(tokenizer: Path) -> dict[str, list[int]]:
    """The samples' prompts: BOUNDARY_LENGTHS random ids of the tokens the tiny targets predict (where chunked
    prefill splits a prompt), then demo prompts in the chat template (the prompts of the families table's CPU cells),
    N_SAMPLES in all."""
    rng, ids = random.Random(11), familymodels.PREDICTED_TOKENS
    out = {f"b{i:03d}": [rng.randrange(ids.start, ids.stop) for _ in range(n)] for i, n in enumerate(BOUNDARY_LENGTHS)}
    return out | familymodels.chat_prompts(tokenizer, DEMO_PROMPTS, N_SAMPLES - len(BOUNDARY_LENGTHS))


# --- the dump dir, watched -----------------------------------------------------------------------------


class DumpWatch:
    """Counts ``<rid>.safetensors`` renamed into the dump dir (one per written dump), via inotify."""

    IN_MOVED_TO, IN_CLOSE_WRITE = 0x80, 0x08

    def __init__(self, directory: Path):
        self.names: Counter = Counter()
        self._stop = False
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, str(directory).encode(), self.IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not select.select([self.fd], [], [], 0.2)[0]:
                continue
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            i = 0
            while i + 16 <= len(buf):
                _, _, _, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16 : i + 16 + n].rstrip(b"\0").decode(errors="replace")
                i += 16 + n
                if name.endswith(".safetensors") and not name.startswith("."):
                    self.names[name.removesuffix(".safetensors")] += 1

    def close(self) -> Counter:
        time.sleep(0.5)
        self._stop = True
        self._thread.join(2)
        os.close(self.fd)
        return self.names


# --- checks --------------------------------------------------------------------------------------------


def stored_states(H, run_id: str, hidden: int) -> tuple[dict, dict]:
    """Every stored sample of ``run_id``: rows, widths and finiteness checked; the states kept (float32)."""
    import torch
    from safetensors.torch import load_file

    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import sample_path, samples_dir

    samples = SampleSet(samples_dir(H.DATA, run_id))
    states, bad = {}, []
    for i in range(len(samples)):
        s = samples[i]
        p = sample_path(H.DATA, run_id, s.sample_id)
        if not p.exists():
            bad.append(f"{s.sample_id}: not stored")
            continue
        t = load_file(str(p))
        n = len(s.input_ids)
        final, aux = t["hidden_states"].float(), t["aux_hidden_states"].float()
        if tuple(final.shape) != (n, hidden) or tuple(aux.shape) != (n, 3 * hidden):
            bad.append(f"{s.sample_id}: shapes {tuple(final.shape)} {tuple(aux.shape)} for {n} tokens")
            continue
        if not (torch.isfinite(final).all() and torch.isfinite(aux).all()):
            bad.append(f"{s.sample_id}: non-finite values")
        states[s.sample_id] = (final, aux, list(map(int, s.input_ids)))
    return states, {"samples": len(samples), "rows_ok_finite": len(states) - len(bad), "problems": bad[:10]}


def compare(a: dict, b: dict) -> dict:
    """Per tensor over the samples both have: max abs diff, max |b|, min and 1st-percentile row cosine."""
    import torch

    common = sorted(set(a) & set(b))
    out: dict = {"samples": len(common)}
    if not common:
        return out
    hidden = a[common[0]][0].shape[-1]
    parts = {"final": lambda s: s[0]}
    for k in range(3):
        parts[f"aux{k}"] = lambda s, k=k: s[1][:, k * hidden : (k + 1) * hidden]
    # the rows of the ids both have: two servers' greedy continuations of a prompt may part at a near-tie
    rows = {sid: shared_prefix(a[sid], b[sid]) for sid in common}
    out["rows_compared"] = sum(n for n in rows.values() if n is not None)
    for name, get in parts.items():
        cos, dmax, ref = [], 0.0, 0.0
        for sid in common:
            x, y = get(a[sid])[: rows[sid]], get(b[sid])[: rows[sid]]
            if x.shape != y.shape:
                out.setdefault("shape_mismatch", []).append(sid)
                continue
            dmax = max(dmax, (x - y).abs().max().item())
            ref = max(ref, y.abs().max().item())
            cos.append(torch.nn.functional.cosine_similarity(x, y, dim=-1))
        if cos:
            c = torch.cat(cos)
            out[name] = {
                "max_abs_diff": round(dmax, 5),
                "max_abs_ref": round(ref, 4),
                "min_cos": round(c.min().item(), 6),
                "p01_cos": round(torch.quantile(c, 0.01).item(), 6),
                "rows_cos_below_0.99": int((c < 0.99).sum()),
                "rows": int(c.numel()),
            }
    return out


def shared_prefix(a: tuple, b: tuple) -> int | None:
    """How many leading ids two stored samples share (None, i.e. all rows: a reference without ids)."""
    return None if len(a) < 3 or len(b) < 3 else h2hreport.first_difference(a[2], b[2])


def worst(cmp: dict) -> str:
    rows = [v for k, v in cmp.items() if isinstance(v, dict) and "min_cos" in v]
    if not rows:
        return "-"
    return f"cos {min(r['min_cos'] for r in rows):.4f}, diff {max(r['max_abs_diff'] for r in rows):.3g}"


def plugin_lines(H, name: str) -> list[str]:
    try:
        lines = (H.LOGS / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    keys = ("eaglet", "EAGLE-3", "no dumps", "dump", "Traceback", "Error", "refused")
    return [ln[:300] for ln in lines if any(k in ln for k in keys)][:30]


def earlier_states(H, case: str) -> dict | None:
    """``case``'s stored states: from this process, else from its store on this machine (an earlier call)."""
    if case not in STATES:
        R = RESULTS["cases"].get(case, {})
        if R.get("status") != "ok" or not R.get("run_id"):
            return None
        STATES[case] = stored_states(H, R["run_id"], R["model"]["hidden_size"])[0]
    return STATES[case]


# --- one case ------------------------------------------------------------------------------------------


def ensure_model(H, case: str) -> Path:
    """The case's target: a bundled model's real weights (converted from its staged GGUF), else its family's tiny
    random model, built with SmolLM2's tokenizer."""
    spec = CASES[case]
    if "bundled" in spec:
        d = H.ROOT / "models" / spec["bundled"]
        familymodels.bundled_model(spec["bundled"], spec["family"], H.S / spec["stage"] / "model.gguf", d)
        return d
    d = H.ROOT / "models" / f"fam-{spec['family']}"
    familymodels.make_model(spec["family"], d, H.S / "tokenizer")
    return d


def case_tokenizer(H, case: str) -> Path:
    """The tiny models share SmolLM2's tokenizer; a real target has its own."""
    return ensure_model(H, case) if "bundled" in CASES[case] else H.S / "tokenizer"


def case_prompts(H, case: str) -> dict[str, list[int]]:
    """``prompt_set`` in the case's tokenizer."""
    return _prompts_with(str(case_tokenizer(H, case)))


@functools.cache
def _prompts_with(tokenizer: str) -> dict[str, list[int]]:
    return prompt_set(Path(tokenizer))


def continued(port: int, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt followed by the target's own greedy continuation (CONTINUATION tokens) from the case's server,
    as the regeneration stage gives a drafter its data: the target's next token after random ids is no function a
    drafter can learn from a few thousand tokens (trained on those alone it reached 0.005 held-out accuracy and
    SGLang accepted 1 draft in 100, 2026-12-03), while on its own continuations it is."""

    def one(item: tuple[str, list[int]]) -> tuple[str, list[int]]:
        sid, ids = item
        sp = {"max_new_tokens": CONTINUATION, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=300)
        r.raise_for_status()
        return sid, ids + r.json()["output_ids"]

    with ThreadPoolExecutor(8) as ex:
        return dict(ex.map(one, prompts.items()))


def run_case(H, case: str, prompts: dict[str, list[int]], port: int = 0) -> None:
    """One case on ``port`` (0: the bench's SGLang port). Cases may run at once (FAMILIES_PARALLEL): their
    servers start together, their extractions take turns (EXTRACTING: the workers, the environment they are
    started from and the watched dump dir are the bench's one set). Its samples: the prompts and the target's
    continuations (``continued``)."""
    spec = CASES[case]
    port = port or H.SGL_PORT
    R = RESULTS["cases"].setdefault(case, {})
    R.update({"family": spec["family"], "architecture": familymodels.ARCHITECTURES[spec["family"]], "tp": spec["tp"]})
    t_case = time.time()
    model = ensure_model(H, case)
    info = json.loads((model / "family.json").read_text())
    R["model"] = info
    name = f"fam-{case}"
    argv = server_argv(case, model, H.DUMPS, port)
    R["server_cmd"] = " ".join(["python"] + argv[1:])
    H.DUMPS.mkdir(parents=True, exist_ok=True)
    dumps: Counter = Counter()

    def start() -> float:
        H.start(name, argv, H.PY_SGL_PLUGIN, {"EAGLET_DUMP_DIR": str(H.DUMPS)})
        return H.wait_health(name, port, max(60.0, min(400.0, DEADLINE_S - (time.time() - T0))))

    try:
        log(f"{case}: {R['server_cmd']}")
        R["startup_s"] = round(H.once_more_if_refused(name, start, DEADLINE_S - (time.time() - T0) > 150), 1)
        log(f"{case}: healthy after {R['startup_s']}s")
        given, prompts = prompts, continued(port, prompts)
        dataset = H.ROOT / f"families-{case}.jsonl"
        with open(dataset, "w") as f:
            for sid, ids in prompts.items():
                n = len(given[sid])
                mask = [0] * n + [1] * (len(ids) - n)  # the loss on the target's own tokens
                f.write(json.dumps({"id": sid, "input_ids": ids, "loss_mask": mask}) + "\n")
        with EXTRACTING:
            run_id = f"fam-{case}-{int(time.time())}"
            watch = DumpWatch(H.DUMPS)
            try:
                left = DEADLINE_S - (time.time() - T0)
                p = H.pipeline(run_id, model, dataset, port, N_WORKERS, 8192, timeout=max(60.0, min(240.0, left)))
            finally:
                dumps = watch.close()
        R["pipeline"] = {k: p.get(k) for k in ("samples", "tokens", "counts", "failures", "complete", "wall_s")}
        counts = p.get("counts") or {}
        R["done"], R["failed"] = int(counts.get("done", 0)), int(counts.get("failed", 0))
        R["run_id"] = run_id
    finally:
        R["plugin_log"] = plugin_lines(H, name)
        H.stop(name)
        time.sleep(2)  # the GPUs' memory back before the next server
    mine = {rid: n for rid, n in dumps.items() if rid.startswith(f"eaglet:{run_id}:")}
    per_sample = Counter(rid.split(":")[2] for rid in mine)
    R["dumps"] = {
        "written": sum(mine.values()),
        "rids": len(mine),
        "rids_written_twice_or_more": sorted(r for r, n in mine.items() if n > 1)[:10],
        "samples_with_dump": len(per_sample),
        "samples_with_several_attempts": sorted(s for s, n in per_sample.items() if n > 1)[:10],
        "samples_without_dump": sorted(set(prompts) - set(per_sample))[:10],
        "other_rids_seen": sum(1 for rid in dumps if not rid.startswith("eaglet:fam-")),
    }
    states, check = stored_states(H, run_id, info["hidden_size"])
    R["stored"] = check
    STATES[case] = states
    ok = (
        R["done"] == N_SAMPLES
        and R["failed"] == 0
        and R["dumps"]["written"] == R["dumps"]["rids"] == N_SAMPLES
        and check["rows_ok_finite"] == N_SAMPLES
    )
    if spec.get("vs"):
        other = earlier_states(H, spec["vs"])
        R["vs_tp1"] = compare(states, other) if other else {"missing": f"no {spec['vs']} run on this machine yet"}
    if spec.get("same_as") and earlier_states(H, spec["same_as"]):
        R["vs_" + spec["same_as"].replace("-", "_")] = compare(states, earlier_states(H, spec["same_as"]))
    if spec.get("transformers"):
        try:
            # per model, not per family: a bundled model and its family's tiny one are different targets
            key = str(model)
            if key not in REFS:
                ids = sorted(states)
                got = familymodels.transformers_states(model, [states[s][2] for s in ids], info["aux_layer_ids"])
                REFS[key] = {s: (f, a) for s, (f, a) in zip(ids, got, strict=True)}
            R["vs_transformers"] = compare(states, REFS[key])
        except Exception as e:
            R["vs_transformers"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-1500:]}
    R["status"] = "ok" if ok else "check failed"
    R["wall_s"] = round(time.time() - t_case, 1)


# --- output --------------------------------------------------------------------------------------------


def write_outputs(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    RESULTS["elapsed_s"] = round(time.time() - T0, 1)
    (out / "families.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    head = (
        "| case | architecture | TP | status | s | start s | done/failed | dumps written/rids/dup | rows ok "
        "| vs TP1 | vs transformers | vs DeepSeek (same weights) |\n"
    )
    lines = [head + "|" + " --- |" * 12]
    for case, R in RESULTS["cases"].items():
        d = R.get("dumps", {})
        same = next((v for k, v in R.items() if k.startswith("vs_deepseek")), {})
        vt = R.get("vs_transformers", {})
        cells = [
            case,
            R.get("architecture", ""),
            str(R.get("tp", "")),
            R.get("status", R.get("skipped", "")),
            str(R.get("wall_s", "")),
            str(R.get("startup_s", "")),
            f"{R.get('done', '')}/{R.get('failed', '')}",
            f"{d.get('written', '')}/{d.get('rids', '')}/{len(d.get('rids_written_twice_or_more', []))}" if d else "",
            str(R.get("stored", {}).get("rows_ok_finite", "")),
            worst(R.get("vs_tp1", {})),
            vt.get("error", "")[:60] if "error" in vt else worst(vt),
            worst(same),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {c}: {R['error'][:300]}" for c, R in RESULTS["cases"].items() if R.get("error")]
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    (out / "families.md").write_text(text)


def run_one(H, case: str, prompts: dict[str, list[int]], port: int = 0) -> int:
    """``run_case`` with its failure recorded (server log tail included) in place of its figures; 1 if it failed."""
    R = RESULTS["cases"][case]
    log(f"=== {case}")
    try:
        run_case(H, case, prompts, port)
        log(f"{case}: {R['status']} in {R['wall_s']}s")
        return 0
    except Exception as e:
        R["status"] = "error"
        R["error"] = f"{type(e).__name__}: {e}"[:4000]
        R["traceback"] = traceback.format_exc()[-2500:]
        R["server_log_tail"] = H.tail(f"fam-{case}", 60)
        H.stop(f"fam-{case}")
        log(f"{case} FAILED: {R['error'][:1500]}")
        return 1


def run_together(H, cases: list[str], out: Path, state: Path) -> int:
    """TP 1 cases PARALLEL at once, each on a port of its own."""
    for case in cases:
        RESULTS["cases"].setdefault(case, {"tp": 1})["architecture"] = familymodels.ARCHITECTURES[CASES[case]["family"]]
    # the models built and what the threads import, here: a tiny model's weights come from torch's one global RNG
    # (seeded per build), so two built at once draw each other's numbers; transformers' lazy imports are not safe
    # to race either
    for case in cases:
        ensure_model(H, case)
        case_prompts(H, case)
    import safetensors.torch  # noqa: F401  (stored_states)
    from transformers import AutoModelForCausalLM  # noqa: F401  (familymodels.transformers_states)

    import eaglet.shared.samples  # noqa: F401
    import eaglet.shared.store  # noqa: F401

    ports = {case: H.SGL_PORT + 40 + i for i, case in enumerate(cases)}
    with ThreadPoolExecutor(PARALLEL) as ex:
        failed = sum(ex.map(lambda c: run_one(H, c, case_prompts(H, c), ports[c]), cases))
    write_outputs(out)
    state.write_text(json.dumps(RESULTS, default=str))
    return int(failed > 0)


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    wanted = [a for a in argv if not a.startswith("--")] or list(CASES)
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        print(f"unknown cases {unknown}: choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if dry:
        root = Path("/root")  # the helper module's default root on the GPU machine
        for case in wanted:
            spec = CASES[case]
            model = root / "models" / (spec["bundled"] if "bundled" in spec else f"fam-{spec['family']}")
            env = " ".join(f"{k}={v}" for k, v in NO_MULTICAST.items())
            print(
                f"# {case}\n{env} EAGLET_DUMP_DIR=/dev/shm/eaglet-dumps python "
                + " ".join(server_argv(case, model, Path("/dev/shm/eaglet-dumps"), 30000)[1:])
            )
            print(f"{env} python -m eaglet.services.extractor.worker --name fam-{case}-RUN-wN   (x{N_WORKERS})")
        return 0
    from bench.gpu import (
        phases as H,  # the GPU bench's process, Redis and pipeline helpers; importing it creates its folders
    )

    out = Path(os.environ.get("OUT") or H.OUT)
    state = H.ROOT / "families-results.json"  # earlier calls on this machine: their runs serve as baselines
    if state.exists():
        RESULTS["cases"].update(json.loads(state.read_text()).get("cases", {}))
        for case in wanted:
            RESULTS["cases"].pop(case, None)
    gpus = gpu_count()
    RESULTS.update({"gpus": gpus, "samples": N_SAMPLES, "workers": N_WORKERS, "chunked_prefill_size": CHUNK})
    RESULTS["flags"] = " ".join(BASE_FLAGS) + " (TP 2: " + " ".join(TP2_FLAGS) + ")"
    RESULTS["env"] = NO_MULTICAST
    lens = [len(ids) for ids in _prompts_with(str(H.S / "tokenizer")).values()]  # the tiny models' set
    RESULTS["lengths"] = {"min": min(lens), "max": max(lens), "split_by_chunking": sum(n > CHUNK for n in lens)}
    rc = 0
    H.redis_up()
    try:
        together = [c for c in wanted if CASES[c]["tp"] == 1] if PARALLEL > 1 else []
        if together:
            rc |= run_together(H, together, out, state)
        for i, case in enumerate(c for c in wanted if c not in together):
            R = RESULTS["cases"].setdefault(case, {"tp": CASES[case]["tp"]})
            R["architecture"] = familymodels.ARCHITECTURES[CASES[case]["family"]]
            need = ESTIMATE_S[CASES[case]["tp"]] + (FIRST_EXTRA_S if i == 0 else 0)
            if CASES[case]["tp"] > max(gpus, 1):
                R["skipped"] = f"skipped: {gpus} GPU(s)"
            elif time.time() - T0 + need > DEADLINE_S:
                R["skipped"] = f"skipped: {time.time() - T0:.0f}s gone of {DEADLINE_S:.0f}s"
            if "skipped" in R:
                log(f"{case}: {R['skipped']}")
                continue
            rc |= run_one(H, case, case_prompts(H, case))
            write_outputs(out)
            state.write_text(json.dumps(RESULTS, default=str))
    finally:
        H.stop_all()
        write_outputs(out)
        state.write_text(json.dumps(RESULTS, default=str))
        with tarfile.open(out / "families-logs.tgz", "w:gz") as t:
            for f in H.LOGS.glob("fam-*.log"):
                t.add(f, arcname=f.name)
    print((out / "families.md").read_text())
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
