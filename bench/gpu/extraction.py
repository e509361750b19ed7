"""The extraction checks: SGLang with eaglet's plugin and the real extractor workers against the reference
server, per tensor (``smol``: SmolLM2-135M shape, random weights; ``real``: the bundled SmolLM2-135M-Instruct).
"""

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.gpu import harness as H


def compare_with_reference(run_id: str, model: Path, limit: int | None = None) -> dict:
    """Each stored sample (from SGLang's dumps) against the reference server's dump of the same prompt."""
    import torch
    from safetensors.torch import load_file

    from eaglet.shared.dumpfile import read_dump
    from eaglet.shared.samples import SampleSet
    from eaglet.shared.store import sample_path, samples_dir

    samples = SampleSet(samples_dir(H.DATA, run_id))
    client = httpx.Client(base_url=f"http://127.0.0.1:{H.REF_PORT}", timeout=600)
    names = ["hidden_states", "aux_hidden_states[0]", "aux_hidden_states[1]", "aux_hidden_states[2]"]
    agg = {n: {"max_abs": 0.0, "sum_abs": 0.0, "n": 0, "max_ref": 0.0, "cos_min": 1.0} for n in names}
    per_sample, mismatched, missing = [], [], []
    n_cmp = len(samples) if limit is None else min(limit, len(samples))
    for i in range(n_cmp):
        s = samples[i]
        stored_path = sample_path(H.DATA, run_id, s.sample_id)
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
        p = H.DUMPS / f"{rid}.safetensors"
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


PREFILL = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+),.*?#queue-req: (\d+)")


def log_size(name: str) -> int:
    """Where the server's log ends now: a later ``prefill_batches`` reads what it wrote since."""
    try:
        return (H.LOGS / f"{name}.log").stat().st_size
    except OSError:
        return 0


def prefill_batches(name: str, since: int) -> dict:
    """SGLang's prefill batches logged since byte ``since`` of its log (one line a batch at --log-level info): how many,
    and the requests, tokens and queued requests of a batch on average. Few requests a batch and none queued: the
    clients keep too few in flight; full batches and a queue: the server is the bound."""
    try:
        with open(H.LOGS / f"{name}.log", "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return {"batches": 0}
    found = [tuple(map(int, m.groups())) for m in PREFILL.finditer(text)]
    if not found:
        return {"batches": 0}
    seqs, tokens, queued = zip(*found, strict=True)
    n = len(found)
    return {"batches": n, "mean_seqs": round(sum(seqs) / n, 2), "mean_tokens": round(sum(tokens) / n, 1),
            "mean_queued": round(sum(queued) / n, 2)}  # fmt: skip


def plugin_lines(name: str) -> list[str]:
    try:
        lines = (H.LOGS / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    keys = ("eaglet", "EAGLE-3", "dump", "Traceback", "Error", "chunk")
    clock = [ln[:300] for ln in lines if "capture: " in ln]  # one a minute: what the capture cost the forwards
    return [ln[:300] for ln in lines if any(k in ln for k in keys) and "capture: " not in ln][:40] + clock[-40:]


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
    R = H.RESULTS.setdefault(phase, {})
    H.redis_up()
    H.DUMPS.mkdir(parents=True, exist_ok=True)
    extra = ["--chunked-prefill-size", str(chunk), "--mem-fraction-static", "0.5", "--disable-cuda-graph"]
    R["server"] = {
        "cmd": "python -m eaglet.services.inference.sglang_launch --model-path M --dump-dir D "
        + " ".join(extra + H.SGL_BASE),
        "startup_s": H.sglang(f"{phase}-sgl", model, plugin=True, extra=extra),
    }
    H.save(phase)
    run_id = f"{phase}-{int(time.time())}"
    R["pipeline"] = H.pipeline(run_id, model, dataset, H.SGL_PORT, n_workers, max_tokens, timeout=300)
    R["run_id"] = run_id
    H.save(phase)
    if bench_prompts:
        R["server_alone_plugin_loaded_no_dump"] = H.bench(
            H.SGL_PORT, bench_prompts, n_workers, f"bench-{phase}-", False
        )
        R["server_with_dumps_client"] = H.bench(H.SGL_PORT, bench_prompts, n_workers, f"eaglet:bench-{phase}:s:", True)
        H.log(f"{phase}: bench {R['server_alone_plugin_loaded_no_dump']} / {R['server_with_dumps_client']}")
    R["plugin_log"] = plugin_lines(f"{phase}-sgl")
    H.stop(f"{phase}-sgl")
    H.save(phase)
    if compare:
        R["reference_startup_s"] = H.reference(f"{phase}-ref", model, dump=True)
        R["comparison"] = compare_with_reference(run_id, model)
        H.log(f"{phase}: comparison {json.dumps(R['comparison']['per_tensor'])}")
        H.stop(f"{phase}-ref")
        H.save(phase)


def phase_smol() -> None:
    model = H.MODELS / "smol"
    subprocess.run(
        [sys.executable, "-m", "bench.gpu.mkmodel", "smol", str(model), f"{H.S}/tokenizer"],
        check=True,
        env={**os.environ, "PYTHONPATH": H.PY_EAGLET},
    )
    rng = random.Random(1)
    lengths = [int(16 * (3000 / 16) ** rng.random()) for _ in range(96)] + [256, 257, 512, 3000]
    ds = H.ROOT / "smol.jsonl"
    tokens = H.pretokenized(ds, lengths, 49152, seed=2)
    H.RESULTS["smol"] = {
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
    model = H.MODELS / "smollm2"
    gg = H.S / "gguf" / "model.gguf"
    subprocess.run(
        [sys.executable, "-m", "bench.gpu.mkmodel", "gguf", str(model), str(gg)],
        check=True,
        env={**os.environ, "PYTHONPATH": H.PY_EAGLET},
    )
    src = H.REPO / "data/demo/train.jsonl"
    if not src.exists():
        src = H.REPO / "data/demo/train.tmp"  # being regenerated: its complete lines
    ds = H.ROOT / "real.jsonl"
    lines = [ln for ln in src.read_text().splitlines() if ln.strip().endswith("}")]
    ds.write_text("\n".join(lines) + "\n")
    H.RESULTS["real"] = {
        "model": "SmolLM2-135M-Instruct (the bundled GGUF, dequantized, bf16)",
        "dataset": f"{src.relative_to(H.REPO)} ({len(lines)} conversations)",
        "chunked_prefill_size": 128,
    }
    phase_extract("real", model, ds, n_workers=4, chunk=128, compare=True, bench_prompts=None, max_tokens=2048)
