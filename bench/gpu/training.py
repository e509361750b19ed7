"""eaglet's trainer on the GPU: the random-weight models built ahead (``models``), the 8B store (``train8b``), and a
drafter trained on the ``real`` run, loaded in SGLang as an EAGLE-3 draft (``drafter``).
"""

import json
import os
import subprocess
import sys
import time

import httpx

from bench.gpu import harness as H


def phase_train8b() -> None:
    R = H.RESULTS.setdefault("train8b", {})
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
    H.start(
        "train8b",
        argv,
        H.PY_EAGLET,
        {**H.eaglet_env(H.MODELS / "l8b", H.SGL_PORT), "PROBE_OUT": str(H.OUT / "train8b-probe.json")},
    )
    H.PROCS["train8b"].wait(timeout=float(os.environ.get("TRAIN8B_TIMEOUT", "300")))
    R["rc"] = H.PROCS["train8b"].returncode
    R["log_tail"] = H.tail("train8b", 30)
    try:
        R["probe"] = json.loads((H.OUT / "train8b-probe.json").read_text())
    except OSError:
        pass
    H.stop("train8b")
    H.save("train8b")


def phase_drafter() -> None:
    R = H.RESULTS.setdefault("drafter", {})
    src = "real" if "run_id" in H.RESULTS.get("real", {}) else "smol"
    run_id = H.RESULTS[src]["run_id"]
    model = H.MODELS / ("smollm2" if src == "real" else "smol")
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
    ddir = H.DATA / "runs" / run_id / "drafter"
    if os.environ.get("DRAFT_REUSE") and (ddir / "config.json").exists():
        argv = ["true"]
    H.start(
        "draft-train",
        argv,
        H.PY_EAGLET,
        {**H.eaglet_env(model, H.SGL_PORT), "PROBE_OUT": str(H.OUT / "drafter-probe.json")},
    )
    H.PROCS["draft-train"].wait(timeout=float(os.environ.get("DRAFT_TRAIN_TIMEOUT", "200")))
    R["train_rc"] = H.PROCS["draft-train"].returncode
    R["train_log_tail"] = H.tail("draft-train", 12)
    H.stop("draft-train")
    H.save("drafter")
    ddir = H.DATA / "runs" / run_id / "drafter"
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
    R["server_flags"] = " ".join(extra + H.SGL_BASE)
    R["startup_s"] = H.sglang("draft-sgl", model, plugin=False, extra=extra, timeout=400)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [json.loads(line) for line in open(H.REPO / "data/demo/eval.jsonl")][:32]
    client = httpx.Client(base_url=f"http://127.0.0.1:{H.SGL_PORT}", timeout=300)
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
    R["server_log_accept_lines"] = [ln for ln in H.tail("draft-sgl", 400).splitlines() if "accept len" in ln][-8:]
    H.stop("draft-sgl")
    H.save("drafter")


def phase_models() -> None:
    """Builds the random-weight models ahead (the 8B one is 16 GB), while the rest is still being sent."""
    R = H.RESULTS.setdefault("models", {})
    wanted = os.environ.get("GPUBENCH_MODELS", "smol,8b").split(",")
    for kind, name in [(k, n) for k, n in (("smol", "smol"), ("8b", "l8b")) if k in wanted]:
        t = time.time()
        subprocess.run(
            [sys.executable, "-m", "bench.gpu.mkmodel", kind, str(H.MODELS / name), f"{H.S}/tokenizer"], check=True
        )
        R[name] = round(time.time() - t, 1)
