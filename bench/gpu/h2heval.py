"""The head-to-head's scoring (``h2h-score``: both drafters by eaglet's scorer) and evaluation (``h2h-eval``: every
server in one call, accept length, acceptance per position, tokens/s, outputs equal to the target alone's).
"""

import gzip
import json
import sys
import time
from functools import partial
from pathlib import Path

import httpx

from bench.gpu import h2h, h2hreport
from bench.gpu import harness as P


def eval_prompts(tok) -> dict[str, list[list[int]]]:
    """Chat-formatted prompt ids: the 164 HumanEval prompts and the held-out Magpie prompts."""

    def ids(text: str) -> list[int]:
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    with gzip.open(P.S / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        humaneval = [ids(json.loads(line)["prompt"]) for line in f]
    heldout = [ids(json.loads(line)["prompt"]) for line in open(h2h.H2H / "heldout.jsonl")]
    return {"humaneval": humaneval, "heldout": heldout}


def decode(
    prompts: list[list[int]],
    concurrency: int = h2h.EVAL_CONCURRENCY,
    port: int = 0,
    max_new_tokens: int = h2h.EVAL_TOKENS,
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

    from eaglet.shared.acceptance import position_acceptance

    h2h.fan_out(one, prompts[:4], 4)  # warm-up
    t = time.time()
    outs = h2h.fan_out(one, prompts, concurrency)
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
        **position_acceptance([o["hist"] for o in ok]),
        "texts": [o.get("text") for o in outs],
        **{k: [o.get(k) for o in outs] for k, on in (("ids", ids), ("gaps", gaps)) if on},
    }


def eagle3_flags(drafter_dir: str, chain: tuple) -> list[str]:
    """SGLang's flags to serve ``drafter_dir`` as EAGLE-3 at ``chain`` (steps, topk, draft tokens)."""
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter_dir,
            "--speculative-num-steps", str(chain[0]), "--speculative-eagle-topk", str(chain[1]),
            "--speculative-num-draft-tokens", str(chain[2])]  # fmt: skip


DFLASH = "dflash"
"""``evaluate``'s chain for a DFlash drafter: a block a round, its size from the drafter's config."""


def dflash_flags(drafter_dir: str) -> list[str]:
    """SGLang's flags to serve ``drafter_dir`` as DFlash (the block size and mask token come from its config)."""
    return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter_dir]


def start_sharing(name: str, model: Path, extra: list[str], port: int) -> float:
    """Plain SGLang on ``port`` beside other servers starting on the same GPU (``harness.once_more_if_refused``).
    Returns its startup s."""
    start = partial(P.sglang, name, model, plugin=False, extra=extra, timeout=300, port=port)
    return P.once_more_if_refused(name, start, h2h.time_left() >= 130)


def evaluate(
    key: str,
    ddir: str | None,
    chain: tuple | str | None,
    prompts: dict,
    base_texts: dict,
    port: int = 0,
    mem: float = 0,
) -> dict:
    """One server on ``port`` (the target alone when ``chain`` is None, else with the drafter at that chain, or as
    DFlash for ``DFLASH``) over
    every prompt set; a failure is recorded in place of the figures. The target alone decodes HumanEval a second
    time at another concurrency: the same greedy decoding in other batches, the yardstick for the drafters'
    agreement. ``mem``: the server's --mem-fraction-static when several share the GPU (0: EVAL_EXTRA's)."""
    extra = list(h2h.EVAL_EXTRA)
    if mem:
        extra[extra.index("--mem-fraction-static") + 1] = str(mem)
    if chain == DFLASH:
        extra += dflash_flags(str(ddir))
    elif chain is not None:
        extra += eagle3_flags(str(ddir), chain)
    name = f"h2h-eval-{key.replace(' ', '').replace(',', '-')}"
    try:
        startup = start_sharing(name, h2h.SMOL, extra, port)
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
            again = decode(prompts["humaneval"], h2h.REPEAT_CONCURRENCY, port)
            texts = again.pop("texts")
            again["same_text_as_target_alone"] = h2hreport.agreement(texts, base_texts["humaneval"])
            res["humaneval_repeat"] = again
            P.log(f"h2h-eval {key} humaneval again at concurrency {h2h.REPEAT_CONCURRENCY}: {again}")
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
    if h2h.done("h2h-score"):
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
            "--model", str(h2h.SMOL), "--out", str(out)]  # fmt: skip
    argv += [a for d, p in drafters.items() for a in ("--drafter", f"{d}={p}")]
    t = time.time()
    P.start(name, argv, P.PY_EAGLET, P.eaglet_env(h2h.SMOL, P.SGL_PORT))
    rc = P.PROCS[name].wait(timeout=max(30, h2h.time_left()))
    R = {"cmd": " ".join(argv[1:]), "rc": rc, "wall_s": round(time.time() - t, 1), "log_tail": P.tail(name, 20)}
    P.stop(name)
    R["drafters"] = json.loads(out.read_text()) if out.exists() else {}
    return R


def phase_eval() -> None:
    """Every server in this one call (the target alone included): figures compared across calls would mix
    machines and warm-ups."""
    if h2h.done("h2h-eval"):
        return
    R = P.RESULTS.setdefault("h2h-eval", {})
    h2h.ensure_model()
    prompts = eval_prompts(h2h.tokenizer())
    R.update(chains=[str(c) for c in h2h.CHAINS], prompt_sets=list(prompts), max_new_tokens=h2h.EVAL_TOKENS,
             concurrency=h2h.EVAL_CONCURRENCY, repeat_concurrency=h2h.REPEAT_CONCURRENCY,
             server_flags=" ".join(h2h.EVAL_EXTRA + P.SGL_BASE))  # fmt: skip
    drafters = {d: p for d, p in drafter_dirs().items() if d in h2h.EVAL_DRAFTERS}
    P.stop_all()  # the GPU to the evaluation servers alone
    runs = [("baseline", None, None)] + [(d, drafters[d], c) for d in drafters for c in h2h.CHAINS]
    base_texts = {}
    for name, ddir, chain in runs:
        key = name if chain is None else f"{name} {chain}"
        if chain is not None and not (ddir and Path(ddir, "config.json").exists()):
            res = {s: {"error": "no drafter"} for s in prompts}
        elif h2h.time_left() < 100:  # a server start and two prompt sets
            res = {s: {"error": "not run: out of this call's time"} for s in prompts}
        else:
            res = evaluate(key, ddir, chain, prompts, base_texts)
        if chain is None:
            R["baseline"] = res
        else:
            R.setdefault(name, {})[str(chain)] = res
        P.save("h2h-eval")
    R["done"] = not h2hreport.eval_errors(R)
