"""The speed phases: at the 8B shape plain SGLang's prefill, the pipeline in bf16, fp8, the default storage layout and
the 4-bit aux states, each GPU encoder checked bit for bit against the workers' first; the reference server at 8B;
at SmolLM2's shape the pipeline against plain SGLang on the same chat-length samples (``smolspeed``).
"""

import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.gpu import extraction, training
from bench.gpu import harness as H


def l8b_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(H.L8B_LENGTH)] for _ in range(n)]


def phase_speed8b() -> None:
    """Plain SGLang and the bf16 pipeline at the Llama-3-8B shape, each repeated, with the disk probed between.

    Steady: >= 1,000 requests a plain repetition, >= 1,000 samples and >= 60 s a pipeline repetition. The store
    is removed behind the pipeline as samples complete (written and fsynced first): a bf16 repetition writes
    ~70 GB, more than the machine's disk holds. On a fresh machine both halves do not fit one call (the first
    SGLang start compiles its kernels): ``plain8b`` then ``bf16speed8b`` in two calls record the same.
    """
    phase_plain8b()
    pipeline_reps("speed8b", "bf16", H.MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")))


def phase_plain8b() -> None:
    """speed8b's first half: plain SGLang's prefill tokens/s, repeated, the disk probed after each (recorded as
    speed8b's, where the speed report reads them)."""
    R = H.RESULTS.setdefault("speed8b", {})
    model = H.MODELS / "l8b"
    if not (model / "config.json").exists():
        training.phase_models()
    R["model"] = "Llama-3-8B shape (hidden 4096, 32 layers, 32/8 heads, vocab 128256), random bf16"
    R["flags"] = " ".join(H.L8B_EXTRA + H.SGL_BASE) + " (radix cache off in both)"
    n_plain = int(os.environ.get("N8B", "1000"))
    H.redis_up()
    H.DUMPS.mkdir(parents=True, exist_ok=True)
    R["plain_startup_s"] = H.sglang("s8b-plain", model, plugin=False, extra=H.L8B_EXTRA)
    H.bench(H.SGL_PORT, l8b_prompts(32, 1), H.L8B_CONCURRENCY, "warm-", False)
    R["plain"], R["disk"] = [], []
    for rep in range(H.L8B_REPS):
        plain = H.bench(H.SGL_PORT, l8b_prompts(n_plain, 10 + rep), H.L8B_CONCURRENCY, f"plain{rep}-", False)
        R["plain"].append({**plain, "call": H.T0})  # the call it ran in: a pipeline's ratio prefers its own call's
        R["disk"].append(H.disk_probe())
        H.log(f"speed8b plain {rep}: {R['plain'][-1]} disk {R['disk'][-1]}")
        H.save("speed8b")
    H.stop("s8b-plain")


def phase_bf16speed8b() -> None:
    """More repetitions of speed8b's bf16 pipeline (``BF16_REPS``), added to its list."""
    H.redis_up()
    H.RESULTS.setdefault("speed8b", {})
    pipeline_reps("speed8b", "bf16", H.MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")),
                  int(os.environ.get("BF16_REPS", str(H.L8B_REPS))))  # fmt: skip


def phase_fp8speed8b() -> None:
    """The fp8 pipeline at the 8B shape (the server encodes on the GPU), repeated; the GPU encoder checked
    bit for bit against the workers' CPU encoder on dumps of the same prompts."""
    R = H.RESULTS.setdefault("fp8speed8b", {})
    model = H.MODELS / "l8b"
    H.redis_up()
    R["gpu_encoder_vs_cpu"] = fp8_bits_check(l8b_prompts(16, 99))  # first: a fault shows even if time runs out
    H.save("fp8speed8b")
    pipeline_reps("fp8speed8b", "fp8", model, int(os.environ.get("NPIPE8B", "1200")))
    H.stop("s8b-plugin")
    H.save("fp8speed8b")


def pipeline_reps(
    phase: str,
    store: str,
    model: Path,
    n: int,
    reps: int = H.L8B_REPS,
    store_options: dict | None = None,
    server: tuple[str, int] | None = None,
) -> None:
    """``reps`` pipeline runs of ``n`` 2,048-token samples on one plugin server (``server``: the name and port of one
    already up; else ``plugin_server``'s), each after a probe of the disk (its ceiling then), with the scheduler's
    memory sampled throughout; added to the phase's list."""
    R = H.RESULTS[phase]
    if server is None:
        plugin_server(model)
    name, port = server or ("s8b-plugin", H.SGL_PORT)
    R.setdefault("pipeline", [])
    for rep in range(len(R["pipeline"]), len(R["pipeline"]) + reps):
        ds = H.ROOT / f"l8b-{rep}.jsonl"
        H.pretokenized(ds, [H.L8B_LENGTH] * n, 49152, seed=20 + rep)
        disk = H.disk_probe()
        with H.MemorySampler(H.PROCS[name].pid) as memory:
            out = H.pipeline(f"{phase}-{rep}-{int(time.time())}", model, ds, port, H.L8B_CONCURRENCY, 8192,
                           timeout=400, store=store, sink=True, store_options=store_options)  # fmt: skip
        out["server_memory"], out["disk"], out["call"] = memory.result(), disk, H.T0
        counts = out.get("counts") or {}
        # the stored bytes a token as counted by the workers (a layout's are not the dumps' fixed width)
        out["bytes_per_token"] = round(int(counts.get("bytes", 0)) / max(int(counts.get("tokens", 0)), 1), 1)
        R["pipeline"].append(out)
        H.log(f"{phase} pipeline {rep}: {out['tokens_per_s']} tok/s, memory {out['server_memory']}")
        H.save(phase)
    R["plugin_log"] = extraction.plugin_lines(name)


def phase_layoutspeed8b() -> None:
    """The default storage layout's pipeline at the 8B shape, repeated: the plugin computes the top-24 in place of the
    final state and the 4-bit aux states on the GPU; both checked first against the workers' encoders."""
    R = H.RESULTS.setdefault("layoutspeed8b", {})
    H.redis_up()
    from eaglet.shared.runoptions import DEFAULT_TOPK

    R["encoders_vs_cpu"] = layout_bits_check(l8b_prompts(8, 98), DEFAULT_TOPK)  # a fault shows first
    H.save("layoutspeed8b")
    pipeline_reps("layoutspeed8b", "bf16", H.MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")), store_options={})
    H.stop("s8b-plugin")
    H.save("layoutspeed8b")


def phase_topkrows8b() -> None:
    """The default layout with its top-k scored at every position against at the loss positions alone (the default),
    alternating on one plugin server (``TOPKROWS_PAIRS`` pairs, ``NPIPE8B`` samples each): the change's own ratio,
    same call and server; the encoders checked first. A repetition that would pass the call's deadline is not
    started."""
    from eaglet.shared.runoptions import DEFAULT_TOPK

    R = H.RESULTS.setdefault("topkrows8b", {})
    H.redis_up()
    R["encoders_vs_cpu"] = layout_bits_check(l8b_prompts(8, 98), DEFAULT_TOPK)  # a fault shows first
    H.save("topkrows8b")
    n, longest = int(os.environ.get("NPIPE8B", "1200")), 0.0
    for _ in range(int(os.environ.get("TOPKROWS_PAIRS", "3"))):
        for rows in ("all", "loss"):
            if not fits(R, longest):
                break
            t = time.time()
            pipeline_reps("topkrows8b", "bf16", H.MODELS / "l8b", n, 1, {"store_topk_rows": rows})
            R["pipeline"][-1]["topk_rows"] = rows
            longest = max(longest, time.time() - t)
    by = {
        rows: [r["tokens_per_s"] for r in R.get("pipeline", []) if r.get("topk_rows") == rows]
        for rows in ("all", "loss")
    }
    pairs = list(zip(by["all"], by["loss"], strict=False))
    R["loss_over_all"] = [round(b / a, 4) for a, b in pairs if a and b]  # each pair's: the same server, one after other
    H.stop("s8b-plugin")
    H.save("topkrows8b")


def phase_stream8b() -> None:
    """The default layout at the 8B shape with the capture's device work on the forward's stream against on the
    plugin's side stream (``EAGLET_CAPTURE_STREAM``): two plugin servers side by side on the GPU (each with half the
    memory; one idles while the other serves), the pipeline alternating between them, ``STREAM_PAIRS`` pairs of
    ``NPIPE8B`` samples; the side stream's dumps checked against the workers' encoders first. ``side_over_forward``:
    each pair's ratio, same call and servers. A repetition that would pass the call's deadline is not started."""
    from eaglet.shared.runoptions import DEFAULT_TOPK

    R = H.RESULTS.setdefault("stream8b", {})
    model = H.MODELS / "l8b"
    if not (model / "config.json").exists():
        training.phase_models()
    H.redis_up()
    H.DUMPS.mkdir(parents=True, exist_ok=True)
    extra = [*H.L8B_EXTRA[: H.L8B_EXTRA.index("--mem-fraction-static")], "--mem-fraction-static", "0.4",
             *H.L8B_EXTRA[H.L8B_EXTRA.index("--mem-fraction-static") + 2 :]]  # fmt: skip
    ports = {"forward": H.SGL_PORT + 60, "side": H.SGL_PORT + 61}
    R["flags"] = " ".join(extra + H.SGL_BASE)
    for stream, port in ports.items():
        env = {"EAGLET_CAPTURE_STREAM": stream}
        R[f"{stream}_startup_s"] = H.sglang(f"s8b-{stream}", model, plugin=True, extra=extra, port=port, env=env)
        H.bench(port, l8b_prompts(32, 1), H.L8B_CONCURRENCY, f"eaglet:warm{stream}:s:", True)
    R["side_encoders_vs_cpu"] = layout_bits_check(l8b_prompts(8, 98), DEFAULT_TOPK, model, ports["side"])
    H.save("stream8b")
    n, longest = int(os.environ.get("NPIPE8B", "1200")), 0.0
    for _ in range(int(os.environ.get("STREAM_PAIRS", "2"))):
        for stream, port in ports.items():
            if not fits(R, longest):
                break
            t = time.time()
            pipeline_reps("stream8b", "bf16", model, n, 1, {}, server=(f"s8b-{stream}", port))
            R["pipeline"][-1]["capture_stream"] = stream
            longest = max(longest, time.time() - t)
    by = {s: [r["tokens_per_s"] for r in R["pipeline"] if r["capture_stream"] == s] for s in ports}
    R["side_over_forward"] = [round(b / a, 4) for a, b in zip(by["forward"], by["side"], strict=False) if a and b]
    R["plugin_log"] = {stream: extraction.plugin_lines(f"s8b-{stream}") for stream in ports}
    for stream in ports:
        H.stop(f"s8b-{stream}")
    H.save("stream8b")


def phase_layoutbits() -> None:
    """The default layout's encoders checked against the workers' (``layout_bits_check``) at SmolLM2's shape: the
    plugin's top-k at loss rows inside SGLang in a short call (its server starts in a minute, the 8B one's in two)."""
    from eaglet.shared.runoptions import DEFAULT_TOPK

    H.redis_up()
    H.DUMPS.mkdir(parents=True, exist_ok=True)
    R = H.RESULTS.setdefault("layoutbits", {})
    R.update(layout_bits_check(l8b_prompts(8, 98), DEFAULT_TOPK, H.MODELS / "smol"), model="SmolLM2-135M shape")
    H.stop("s8b-plugin")
    R["done"] = R["prompts"] == 8
    H.save("layoutbits")


def fits(R: dict, longest_s: float) -> bool:
    """Whether one more repetition, as long as the longest so far, ends before the call's deadline; else the phase's
    record says it stopped."""
    deadline = float(os.environ.get("GPUBENCH_DEADLINE_S", "1e9"))
    if time.time() - H.T0 + longest_s * 1.2 + 10 <= deadline:
        return True
    R["stopped"] = "out of this call's time"
    return False


SMOL_EXTRA = ["--chunked-prefill-size", "8192", "--mem-fraction-static", "0.6", "--disable-cuda-graph"]


def phase_smolspeed() -> None:
    """SmolLM2-135M's shape (random bf16 weights): plain SGLang's prefill on ``SMOL_SAMPLES`` samples of chat lengths
    (64-768 tokens, ``GPUBENCH_LOSS_SHARE`` of each under the loss), ``SMOL_CONCURRENCY`` requests in flight, three
    times; then the pipeline on the same samples in the default layout at each of ``SMOL_WORKERS`` worker counts,
    three times each; one call, one machine. Each count's ratio: its median over plain's. Each repetition records
    SGLang's prefill batches (how full, how much queued) and the plugin logs its cost every 10 s: the profile that
    says whether the workers keep too few requests in flight or the server's host work is the bound."""
    R = H.RESULTS.setdefault("smolspeed", {})
    model = H.MODELS / "smol"
    if not (model / "config.json").exists():
        raise RuntimeError("no SmolLM2-shape model: run the models phase first (GPUBENCH_MODELS=smol)")
    n, conc = int(os.environ.get("SMOL_SAMPLES", "3000")), int(os.environ.get("SMOL_CONCURRENCY", "64"))
    counts = [int(x) for x in os.environ.get("SMOL_WORKERS", "16,48").split(",")]
    rng = random.Random(7)
    ds = H.ROOT / "smol-speed.jsonl"
    H.pretokenized(ds, [rng.randint(64, 768) for _ in range(n)], 49152, seed=8)
    with open(ds) as f:
        prompts = [json.loads(line)["input_ids"] for line in f]
    R.update(samples=n, tokens=sum(map(len, prompts)), flags=" ".join(SMOL_EXTRA + H.SGL_BASE), plain=[], pipeline=[])
    H.redis_up()
    H.DUMPS.mkdir(parents=True, exist_ok=True)
    R["plain_startup_s"] = H.sglang("smol-plain", model, plugin=False, extra=SMOL_EXTRA)
    H.bench(H.SGL_PORT, prompts[:64], conc, "warm-", False)
    for rep in range(H.L8B_REPS):
        since = extraction.log_size("smol-plain")
        plain = H.bench(H.SGL_PORT, prompts, conc, f"plain{rep}-", False)
        R["plain"].append({**plain, "prefill_batches": extraction.prefill_batches("smol-plain", since), "call": H.T0})
        H.save("smolspeed")
    H.stop("smol-plain")
    # the capture's cost lines every 10 s: a repetition lasts tens of seconds
    env = {"EAGLET_CAPTURE_LOG_S": "10"}
    R["plugin_startup_s"] = H.sglang("smol-plugin", model, plugin=True, extra=SMOL_EXTRA, env=env)
    H.bench(H.SGL_PORT, prompts[:64], conc, "eaglet:warm:s:", True)
    longest = 0.0
    for workers in counts:
        for rep in range(H.L8B_REPS):
            if not fits(R, longest):
                break
            t, since = time.time(), extraction.log_size("smol-plugin")
            out = H.pipeline(f"smolspeed-{workers}-{rep}-{int(t)}", model, ds, H.SGL_PORT, workers, 8192, timeout=300,
                             sink=True, store_options={})  # fmt: skip
            longest = max(longest, time.time() - t)
            batches = extraction.prefill_batches("smol-plugin", since)
            R["pipeline"].append({**out, "workers": workers, "prefill_batches": batches, "call": H.T0})
            H.log(f"smolspeed {workers} workers, repetition {rep}: {out.get('tokens_per_s')} tok/s")
            H.save("smolspeed")
    R["plugin_log"] = extraction.plugin_lines("smol-plugin")
    H.stop("smol-plugin")
    plain = statistics.median(r["tokens_per_s"] for r in R["plain"])
    R["ratio_by_workers"] = {
        w: round(statistics.median(rs) / plain, 4)
        for w in counts
        if (rs := [r["tokens_per_s"] for r in R["pipeline"] if r["workers"] == w and r.get("tokens_per_s")])
    }
    H.save("smolspeed")


def phase_fp4speed8b() -> None:
    """The 4-bit aux states alone (the final state kept whole: 0.46x bf16, no top-k) at the 8B shape, repeated
    (``FP4_REPS``): the small layout's speed without the vocabulary head's product."""
    H.RESULTS.setdefault("fp4speed8b", {})
    H.redis_up()
    fp4_alone = {"store_final": "all", "store_aux": "fp4"}
    reps = int(os.environ.get("FP4_REPS", str(H.L8B_REPS)))
    pipeline_reps("fp4speed8b", "bf16", H.MODELS / "l8b", int(os.environ.get("NPIPE8B", "1200")), reps, fp4_alone)
    H.stop("s8b-plugin")
    H.save("fp4speed8b")


def plugin_server(model: Path) -> None:
    if "s8b-plugin" not in H.PROCS:
        H.RESULTS["plugin8b_startup_s"] = H.sglang("s8b-plugin", model, plugin=True, extra=H.L8B_EXTRA)
        H.bench(H.SGL_PORT, l8b_prompts(32, 1), H.L8B_CONCURRENCY, "eaglet:warm:s:", True)


def fp8_bits_check(prompts: list[list[int]]) -> dict:
    """The GPU encoder against the workers' CPU encoder, bit for bit: on the same tensors (the full-width dumps
    moved to the GPU), and through the plugin (the same prompt dumped full width, again full width to see
    whether two forwards agree at all, and fp8-encoded on the GPU)."""
    import torch

    from eaglet.shared.dumpfile import read_dump
    from eaglet.shared.store import FP8_DEVICE_BLOCK_BYTES, encode_fp8

    plugin_server(H.MODELS / "l8b")
    client = httpx.Client(base_url=f"http://127.0.0.1:{H.SGL_PORT}", timeout=600)
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
        path = H.DUMPS / f"{rid}.safetensors"
        t = time.time()
        while not path.exists() and time.time() - t < 60:
            time.sleep(0.01)
        paths.append(path)
    return paths


def layout_bits_check(prompts: list[list[int]], k: int, model: Path | None = None, port: int = 0) -> dict:
    """The default layout's dump against the workers' CPU encoders on the full-width dump of the same prompt: the
    4-bit aux states bit for bit; the top-k against ``encode_topk`` on the GPU from the full-width final states (the
    plugin scores every asking request's rows in one product, whose kernel may round otherwise), at every position
    and at the loss positions only (the default: the request names the spans, here the prompt's second half). On the
    plugin server at ``port`` (0: ``plugin_server``'s, started if need be)."""
    import torch

    from eaglet.shared.dumpfile import read_dump
    from eaglet.shared.fp4 import encode_fp4
    from eaglet.shared.store import FP4_AUX_TENSORS
    from eaglet.shared.targettensors import load_target_tensors
    from eaglet.shared.topk import encode_topk

    model = model or H.MODELS / "l8b"
    if not port:
        plugin_server(model)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port or H.SGL_PORT}", timeout=600)
    head = load_target_tensors(model, ("lm_head",))["lm_head"].cuda()
    out = {"prompts": 0, "fp4_identical": 0, "final_state_omitted": 0, "topk_ids_equal_fraction": [],
           "topk_logp_max_abs_diff": [], "loss_rows_ids_equal_fraction": [], "loss_rows_shape_ok": 0}  # fmt: skip
    for i, ids in enumerate(prompts):
        half = len(ids) // 2
        asks = {"w": {}, "d": {"eaglet_topk": k, "eaglet_aux": "e2m1_b32"},
                "l": {"eaglet_topk": k, "eaglet_aux": "e2m1_b32", "eaglet_topk_rows": [[half, len(ids)]]}}  # fmt: skip
        paths = dumps_of(client, ids, f"l{i}", asks)
        wide, default, at_loss = (read_dump(p) for p in paths)
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
        loss_ids = at_loss.topk["topk_ids"]
        out["loss_rows_shape_ok"] += tuple(loss_ids.shape) == (len(ids) - half, k)
        if loss_ids.shape[0] == len(ids) - half:
            same = (loss_ids == top_ids.cpu()[half:]).float().mean()
            out["loss_rows_ids_equal_fraction"].append(round(float(same), 5))
        for path in paths:
            path.unlink()
    return out


def phase_ref8b() -> None:
    R = H.RESULTS.setdefault("ref8b", {})
    model = H.MODELS / "l8b"
    rng = random.Random(5)
    n = int(os.environ.get("REF8B_SAMPLES", "96"))
    prompts = [[rng.randrange(3, 49152) for _ in range(2048)] for _ in range(n)]
    H.redis_up()
    R["startup_no_dump_s"] = H.reference("r8b-nodump", model, dump=False)
    H.bench(H.REF_PORT, prompts[:16], 32, "warm-", False)
    R["server_alone"] = H.bench(H.REF_PORT, prompts, 32, "eaglet:r8b:s:", False)
    H.stop("r8b-nodump")
    H.save("ref8b")
    R["startup_dump_s"] = H.reference("r8b-dump", model, dump=True)
    ds = H.ROOT / "r8b.jsonl"
    H.pretokenized(ds, [2048] * n, 49152, seed=6)
    R["pipeline"] = H.pipeline(f"r8b-{int(time.time())}", model, ds, H.REF_PORT, 32, 8192, timeout=300)
    R["ratio_pipeline_vs_server"] = round(R["pipeline"]["tokens_per_s"] / R["server_alone"]["tokens_per_s"], 4)
    H.stop("r8b-dump")
    H.save("ref8b")
