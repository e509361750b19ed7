"""The head-to-head's settings (read from the environment at import) and what its phase families share: the target
model, its tokenizer, the plugin server, the fan-out of requests, the call's time left. ``headtohead`` names the phases.
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.gpu import harness as P

N_CONV = int(os.environ.get("H2H_CONVERSATIONS", "10000"))
HELDOUT = int(os.environ.get("H2H_HELDOUT", "200"))
MULTI_TURN = float(os.environ.get("H2H_MULTI_TURN", "0.25"))
PROMPT_TOKENS = int(os.environ.get("H2H_PROMPT_TOKENS", "128"))
ANSWER_TOKENS = int(os.environ.get("H2H_ANSWER_TOKENS", "256"))
GEN_CONCURRENCY = int(os.environ.get("H2H_GEN_CONCURRENCY", "256"))
WORKERS = int(os.environ.get("H2H_WORKERS", "16"))
EPOCHS = int(os.environ.get("H2H_EPOCHS", "2"))
# SpecForge's EAGLE-3 learning rate (``training.learning_rate``); unset: its own default, 1e-4. Its best of 1e-4 / 1e-3
# on the kept data was 1e-3 (2026-12-04): the fair comparison sets it.
SPECFORGE_LR = float(os.environ["H2H_SPECFORGE_LR"]) if os.environ.get("H2H_SPECFORGE_LR") else None
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
# H2H_EVAL_FLAGS, when set, replaces them (it must keep --mem-fraction-static, which shared servers lower)
EVAL_EXTRA = os.environ.get("H2H_EVAL_FLAGS", "--mem-fraction-static 0.5 --disable-cuda-graph").split()
# the layers the plugin server captures (eaglet's ids, comma-separated; unset: EAGLE-3's default three): a DFlash
# sequence needs DFlash's five, and one server captures the union for runs of both methods
CAPTURE = [int(x) for x in os.environ.get("H2H_AUX_LAYER_IDS", "").split(",") if x.strip()]


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
    capture = ["--aux-layer-ids", *map(str, CAPTURE)] if CAPTURE else []
    plain = GEN_EXTRA[:2] + ["--chunked-prefill-size", "8192", "--disable-cuda-graph"]
    if graphs:
        try:
            R["server_startup_s"] = P.sglang(SERVER, SMOL, plugin=True, extra=GEN_EXTRA + capture)
            R["server_flags"] = " ".join(GEN_EXTRA + capture + P.SGL_BASE)
            return
        except RuntimeError as e:
            P.stop(SERVER)
            R["cuda_graph_error"] = str(e)[-1500:]
    R["server_startup_s"] = P.sglang(SERVER, SMOL, plugin=True, extra=plain + capture)
    R["server_flags"] = " ".join(plain + capture + P.SGL_BASE)


HTTP_ERRORS: list[str] = []  # requests the server refused while writing the data: counted, the first kept


def refused(r: httpx.Response) -> bool:
    if r.status_code == 200:
        return False
    HTTP_ERRORS.append(f"{r.request.url.path} {r.status_code} {r.text[:200]}")
    return True


def fan_out(fn, items: list, concurrency: int) -> list:
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(fn, items))


# h2h-layouts): variants of one layout (other trainer flags, say --topk-tail uniform) share its stored run


def conversations() -> int:
    """The conversations the run extracts: the kept ones' count, else the number it writes."""
    kept = KEPT / "data.json"
    return (
        json.loads(kept.read_text())["conversations"]
        if kept.exists() and not os.environ.get("H2H_NEW_DATA")
        else N_CONV
    )
