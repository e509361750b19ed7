"""headtohead.py's phases on a CPU machine, ahead of the GPU run: eaglet's reference server on a tiny Llama (with
SmolLM2's tokenizer) stands in for SGLang, the demo conversations' user turns for the Magpie prompts (answered
through eaglet's regeneration stage as on the GPU machine).

    GPUBENCH_ROOT=DIR OUT=DIR/out H2H_EPOCHS=1 H2H_WORKERS=2 python -m bench.gpu.headtohead_cpu PHASE...

Checks what runs without a GPU: regeneration, ingest, extraction and the store, the training split, the conversion to
SpecForge's features and its run config, the trainers' launch, deadlines and failure records, the HumanEval
prompts, the results file. Magpie sampling and the SGLang servers of `h2h-eval` need the GPU machine; SpecForge's
training needs its environment (H2H_SPECFORGE_PATH) and, past its FSDP wrapping, a GPU. Redis: the
redis-server on PATH, on GPUBENCH_REDIS_PORT.
"""

import gzip
import json
import shutil
import sys

from bench.gpu import h2h as H
from bench.gpu import h2hdata, headtohead
from bench.gpu import harness as P
from eaglet.shared.target import make_tiny_llama, resolve_model_dir


def prepare() -> None:
    """The tiny target, Redis and the HumanEval prompts where the GPU run has its own."""
    if not (H.SMOL / "config.json").exists():
        make_tiny_llama(H.SMOL, resolve_model_dir("smollm2", P.REPO / "var" / "models"))
    redis = P.S / "redis" / "bin" / "redis-server"
    if not redis.exists():
        redis.parent.mkdir(parents=True, exist_ok=True)
        redis.symlink_to(shutil.which("redis-server"))
    humaneval = P.S / "humaneval" / "HumanEval.jsonl.gz"
    if not humaneval.exists():
        humaneval.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(P.REPO / ".stage" / "p3" / "HumanEval.jsonl.gz", humaneval)
    with gzip.open(humaneval, "rt") as f:
        assert sum(1 for _ in f) == 164


def data() -> None:
    """h2h-data without SGLang: the demo's user turns (every fifth with a second one) through the regeneration
    stage; the demo's held-out prompts."""
    H.H2H.mkdir(parents=True, exist_ok=True)
    with open(H.H2H / "prompts.jsonl", "w") as f:
        for i, line in enumerate(open(P.REPO / "data" / "demo" / "train.jsonl")):
            c = json.loads(line)
            turns = [{"role": "user", "content": c["messages"][0]["content"]}]
            if i % 5 == 0:
                turns.append({"role": "user", "content": "Say that again in one sentence."})
            f.write(json.dumps({"id": c["id"], "messages": turns}) + "\n")
    with open(H.H2H / "heldout.jsonl", "w") as f:
        for line in open(P.REPO / "data" / "demo" / "eval.jsonl"):
            c = json.loads(line)
            f.write(json.dumps({"id": c["id"], "prompt": c["messages"][0]["content"]}) + "\n")
    R = P.RESULTS.setdefault("h2h-data", {})
    R["regenerate"] = h2hdata.regenerate(H.H2H / "prompts.jsonl", H.H2H / "train.jsonl")
    convs = [json.loads(line) for line in open(H.H2H / "train.jsonl")]
    R.update(conversations=len(convs), multi_turn=sum(1 for c in convs if len(c["messages"]) > 2), done=True)


def reference_server(graphs: bool = True) -> None:
    """eaglet's reference server where the plugin server would be: headtohead's extraction phases start it (and
    stop it) as they would the plugin server (``graphs``: SGLang's CUDA graphs, nothing to the CPU server)."""
    if H.SERVER in P.PROCS:
        return
    P.redis_up()
    env = {"EAGLET_MODEL": str(H.SMOL), "EAGLET_DUMP_DIR": str(P.DUMPS), "EAGLET_DEVICE": "cpu",
           "EAGLET_HOST": "127.0.0.1"}  # fmt: skip
    if H.CAPTURE:  # the layers the run names (H2H_AUX_LAYER_IDS), as the plugin server is told them
        env["EAGLET_AUX_LAYER_IDS"] = ",".join(map(str, H.CAPTURE))
    argv = [sys.executable, "-m", "eaglet.services.inference.main", "--port", str(P.SGL_PORT)]
    P.start(H.SERVER, argv, P.PY_EAGLET, env)
    P.wait_health(H.SERVER, P.SGL_PORT, 120)


if __name__ == "__main__":
    state = P.ROOT / "gpubench-results.json"
    if state.exists():
        P.RESULTS.update(json.loads(state.read_text()))
    prepare()
    H.plugin_server = reference_server
    if not P.RESULTS.get("h2h-data", {}).get("done"):
        reference_server()
        data()
    state.write_text(json.dumps(P.RESULTS, default=str))
    from bench.gpu import phases

    raise SystemExit(P.main({**phases.PHASES, **headtohead.PHASES}, {**phases.ESTIMATE_S, **headtohead.ESTIMATE_S}))
