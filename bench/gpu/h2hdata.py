"""The head-to-head's conversations (``h2h-data``: the kept ones, or written by the target itself through
Magpie and eaglet's regeneration stage) and their extraction through eaglet (``h2h-extract``, ``h2h-extract-fp8``).
"""

import gzip
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from bench.gpu import h2h, magpie
from bench.gpu import harness as P


def sample_turns(client: httpx.Client, prefixes: list[list[int]], stop_id: int) -> list[str]:
    """One user turn sampled from each prefix (temperature 1: Magpie's diversity comes from sampling)."""

    def one(ids: list[int]) -> str:
        sp = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": h2h.PROMPT_TOKENS, "stop_token_ids": [stop_id]}
        r = client.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        return "" if h2h.refused(r) else r.json().get("text", "")

    return h2h.fan_out(one, prefixes, h2h.GEN_CONCURRENCY)


def answer(client: httpx.Client, model: str, conversations: list[list[dict]]) -> list[str]:
    """Greedy answers to each conversation's last user turn, through SGLang's OpenAI-compatible endpoint."""

    def one(messages: list[dict]) -> str:
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": h2h.ANSWER_TOKENS}
        r = client.post("/v1/chat/completions", json=body)
        return "" if h2h.refused(r) else (r.json()["choices"][0]["message"].get("content") or "").strip()

    return h2h.fan_out(one, conversations, h2h.GEN_CONCURRENCY)


def gzip_copy(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, gzip.GzipFile(dst, "wb", mtime=0) as g:  # mtime 0: the same data, the same bytes
        g.write(f.read())


def kept_data() -> bool:
    """The committed conversations and held-out prompts unpacked where the phases read them, with the figures of
    the run that wrote them; False when none are committed (or H2H_NEW_DATA is set)."""
    if os.environ.get("H2H_NEW_DATA") or not (h2h.KEPT / "train.jsonl.gz").exists():
        return False
    h2h.H2H.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "heldout.jsonl"):
        with gzip.open(h2h.KEPT / f"{name}.gz", "rb") as g:
            (h2h.H2H / name).write_bytes(g.read())
    R = P.RESULTS.setdefault("h2h-data", {})
    R.update(json.loads((h2h.KEPT / "data.json").read_text()), source=str(h2h.KEPT.relative_to(P.REPO)), done=True)
    P.log(f"h2h-data: {R.get('conversations')} conversations from {R['source']}")
    return True


def phase_data() -> None:
    if h2h.done("h2h-data") or kept_data():
        return
    t0 = time.time()
    h2h.ensure_model()
    h2h.plugin_server()
    R = P.RESULTS.setdefault("h2h-data", {})
    tok = h2h.tokenizer()
    stop_id = tok.convert_tokens_to_ids("<|im_end|>")
    client = httpx.Client(base_url=f"http://127.0.0.1:{P.SGL_PORT}", timeout=600,
                          limits=httpx.Limits(max_connections=h2h.GEN_CONCURRENCY + 8))  # fmt: skip
    model = client.get("/v1/models").json()["data"][0]["id"]
    dedupe = magpie.Deduper()
    first = tok.encode(magpie.user_prefix(tok, []), add_special_tokens=False)
    want = h2h.N_CONV + h2h.HELDOUT
    prompts, rounds = [], []
    while len(prompts) < want and len(rounds) < 4:
        kept, stats = magpie.filter_prompts(sample_turns(client, [first] * int((want - len(prompts)) * 1.3 + 64),
                                                         stop_id), dedupe)  # fmt: skip
        prompts += kept
        rounds.append(stats)
    R["magpie"] = {"rounds": rounds, "prefix": magpie.user_prefix(tok, [])}
    P.log(f"h2h-data: {len(prompts)} prompts after {rounds}")
    convs = [{"id": f"mp-{i:06d}", "messages": [{"role": "user", "content": p}]} for i, p in enumerate(prompts[:want])]
    frac = h2h.HELDOUT / want
    held = [c for c in convs if magpie.is_heldout(c["id"], frac)]
    train = [c for c in convs if not magpie.is_heldout(c["id"], frac)]
    # a second user turn is sampled after the target's first answer: those first answers are needed here
    second = [c for c in train if random.Random(c["id"]).random() < h2h.MULTI_TURN]
    for c, a in zip(second, answer(client, model, [c["messages"] for c in second]), strict=True):
        c["messages"].append({"role": "assistant", "content": a})
    second = [c for c in second if c["messages"][-1]["content"]]
    prefixes = [tok.encode(magpie.user_prefix(tok, c["messages"]), add_special_tokens=False) for c in second]
    dedupe2 = magpie.Deduper()
    for c, raw in zip(second, sample_turns(client, prefixes, stop_id), strict=True):
        turn = magpie.clean_turn(raw)
        if turn is not None and dedupe2.keep(turn):
            c["messages"].append({"role": "user", "content": turn})
    h2h.H2H.mkdir(parents=True, exist_ok=True)
    with open(h2h.H2H / "prompts.jsonl", "w") as f:
        for c in train:  # every user turn is answered again by the regeneration stage, earlier answers dropped
            f.write(json.dumps({"id": c["id"], "messages": [m for m in c["messages"] if m["role"] == "user"]}) + "\n")
    with open(h2h.H2H / "heldout.jsonl", "w") as f:
        for c in held:
            f.write(json.dumps({"id": c["id"], "prompt": c["messages"][0]["content"]}) + "\n")
    R["regenerate"] = regenerate(h2h.H2H / "prompts.jsonl", h2h.H2H / "train.jsonl")
    convs = [json.loads(line) for line in open(h2h.H2H / "train.jsonl")]
    R.update(conversations=len(convs), multi_turn=sum(1 for c in convs if len(c["messages"]) > 2),
             heldout_prompts=len(held), second_turn_repeats=dedupe2.repeats, wall_s=round(time.time() - t0, 1),
             example=convs[0] if convs else None,
             http_errors=len(h2h.HTTP_ERRORS), first_http_errors=h2h.HTTP_ERRORS[:3],
             done=len(convs) > 0)  # fmt: skip
    P.log(f"h2h-data: {len(convs)} conversations, {R['multi_turn']} multi-turn, {len(held)} held out")
    # kept for later runs (commit them under data/h2h/ with data.json: bench/gpu/README.md)
    gzip_copy(h2h.H2H / "train.jsonl", P.OUT / "h2h-train.jsonl.gz")
    gzip_copy(h2h.H2H / "heldout.jsonl", P.OUT / "h2h-heldout.jsonl.gz")


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

    os.environ.update(P.eaglet_env(h2h.SMOL, P.SGL_PORT))
    redis, rq_redis = Redis.from_url(P.REDIS_URL, decode_responses=True), Redis.from_url(P.REDIS_URL)
    run_id = f"h2h-regen-{int(time.time())}"
    options = RegenerateOptions(max_tokens=h2h.ANSWER_TOKENS, concurrency=max(1, h2h.GEN_CONCURRENCY // h2h.WORKERS),
                                stop_after=True)  # fmt: skip
    names = P.start_workers(run_id, h2h.SMOL, P.SGL_PORT, h2h.WORKERS)
    t = time.time()
    state = create_run(redis, run_id, source, RunOptions(regenerate=options))
    plan_run(redis, rq_redis, run_id)
    timeout = min(float(os.environ.get("H2H_REGENERATE_TIMEOUT", "420")), h2h.time_left(30))
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
    if h2h.done("h2h-extract"):
        return
    h2h.ensure_model()
    h2h.plugin_server(graphs=False)
    R = P.RESULTS.setdefault("h2h-extract", {})
    run_id = f"h2h-{int(time.time())}"
    R["run_id"] = run_id
    timeout = min(float(os.environ.get("H2H_EXTRACT_TIMEOUT", "420")), h2h.time_left(40))
    with StatusCapture(P.OUT / "h2h-status.txt"):
        R.update(P.pipeline(run_id, h2h.SMOL, h2h.H2H / "train.jsonl", P.SGL_PORT, h2h.WORKERS, 2048, timeout=timeout))
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

        env = {**os.environ, **P.eaglet_env(h2h.SMOL, P.SGL_PORT), "PYTHONPATH": P.PY_EAGLET}
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


def phase_extract_fp8() -> None:
    """The same conversations extracted again, stored fp8 (encoded by the plugin on the GPU): the cost of fp8
    storage in acceptance, measured by the `fp8` recipe."""
    if h2h.done("h2h-extract-fp8"):
        return
    h2h.ensure_model()
    h2h.plugin_server(graphs=False)
    R = P.RESULTS.setdefault("h2h-extract-fp8", {})
    R["run_id"] = f"h2h-fp8-{int(time.time())}"
    R.update(P.pipeline(R["run_id"], h2h.SMOL, h2h.H2H / "train.jsonl", P.SGL_PORT, h2h.WORKERS, 2048,
                        timeout=h2h.time_left(40), store="fp8"))  # fmt: skip
    R["done"] = bool(R.get("complete"))
