"""Every family's drafter decodes in SGLang: on the GPU machine, after families.py extracted the TP 1 cases there.

    python3 -m bench.gpu.familydrafters [CASE...]   (from the repo root; default: every TP 1 case of families.py)
    python3 -m bench.gpu.familydrafters --report A.json B.json ...   (one table from several calls' records, in $OUT)

For each case with a stored run on this machine (families.py's state, ``families-results.json``):
  1. eaglet's trainer on the case's stored samples (families.N_SAMPLES: demo prompts and a few random ones, each
     followed by the target's own continuation; bench/gpu/ablate.py: the default recipe, FAMDRAFT_STEPS (300)
     optimizer steps), every case's trainer at once on the one GPU, each drafter into
     ``<root>/fam-drafters/<case>/drafter``;
  2. SGLang 0.5.17 (launch_server, no plugin) with the target alone: FAMDRAFT_PROMPTS (32) held-out demo prompts
     (``data/demo/eval.jsonl`` in the chat template), greedy, FAMDRAFT_TOKENS (64) tokens each;
  3. SGLang with the drafter (``--speculative-algorithm EAGLE3``, chain (3, 1, 4)) on the same prompts;
  4. where an output with the drafter parts from the target alone's beyond a near-tie, the target alone once more,
     on each such prompt with the output's ids up to the parting point (``rescore``);
     FAMDRAFT_PARALLEL (3) cases at once, each on a port of its own (tiny targets: the GPU has room for them).
A case passes when the server with the drafter comes up (SGLang loads it), every greedy output equals the target
alone's, or first parts from it at a near-tie of the target's top two tokens, or at a token the target alone picks
itself when it reads that prefix anew (SGLang 0.5.17 serves these models in
bf16 only: its CUDA RMSNorm refuses float32, and bf16 in other batch shapes may pick either of two tied tokens). A
near-tie is a gap within TIE_NATS, or within the widest gap at which the target alone, decoded again at
REPEAT_CONCURRENCY, parts from itself (``case_tie``: a drafter is not held to more than the engine's own numerics; the
tiny MLA targets part from themselves at gaps up to 0.63 nats, 2026-12-03), and the accept
length is at least ACCEPT_FLOOR: a drafter that loads and accepts nothing (accept length 1.0, no error: what a wrong
layer, vocabulary map or norm gives) is a failure. The tiny random targets predict 256 ids with a peaked LM head and
the drafters learn them from the targets' own continuations of demo prompts (bench/gpu/familymodels.py says why), as
the families table's CPU cells did. Both
servers run without CUDA graphs (SGLang 0.5.17 captures EAGLE-3's graphs through deep_gemm, which the image lacks)
and with the same flags otherwise, so greedy outputs compare. Results: $OUT/familydrafters.json and
$OUT/familydrafters.md; a failure is recorded with the server's log tail and the run goes on. A case is skipped when
FAMDRAFT_DEADLINE_S (default 540) would be passed.
"""

import json
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.gpu import families, h2hreport

HERE = Path(__file__).resolve().parent


T0 = time.time()
DEADLINE_S = float(os.environ.get("FAMDRAFT_DEADLINE_S", "540"))
STEPS = int(os.environ.get("FAMDRAFT_STEPS", "300"))
N_PROMPTS = int(os.environ.get("FAMDRAFT_PROMPTS", "32"))
N_TOKENS = int(os.environ.get("FAMDRAFT_TOKENS", "64"))
CHAIN = (3, 1, 4)
EVAL_PROMPTS = HERE.parents[1] / "data" / "demo" / "eval.jsonl"
ACCEPT_FLOOR = 1.1
TIE_NATS = 0.25  # an output may differ first where the target's top two tokens lie within this (bf16 numerics)
REPEAT_CONCURRENCY = 4  # the target alone once more, in other batches: how far bf16 alone moves greedy outputs
PARALLEL = int(os.environ.get("FAMDRAFT_PARALLEL", "3"))  # cases decoded at once, each on a port of its own
SERVER_FLAGS = [
    "--mem-fraction-static",
    str(round(0.6 / PARALLEL, 2)),
    "--disable-cuda-graph",
]  # phases.sglang adds --disable-radix-cache
CASE_ESTIMATE_S = 110  # two server starts of ~40 s and two decodes


def tp1_cases() -> list[str]:
    return [c for c, spec in families.CASES.items() if spec["tp"] == 1]


def case_tie(target: dict) -> float:
    """The near-tie bound of a case: TIE_NATS, or the widest top-two gap at which the target alone's second decode
    (``same_ids_again``) first parted from its first, if wider."""
    again = target.get("same_ids_again") or {}
    return max([TIE_NATS, *(g for g in again.get("first_difference_gaps", []) if g is not None)])


def verdict(target: dict, drafted: dict) -> tuple[str, list[str]]:
    """``ok`` or ``failed`` and why, from the target alone's and the drafter's decodes (``decode``'s records)."""
    why = []
    for name, d in (("target alone", target), ("with the drafter", drafted)):
        if d.get("error") or d.get("errors"):
            why.append(f"{name}: {d.get('error') or d.get('first_error')}")
    if why:
        return "failed", why
    same = drafted.get("same_ids_as_target_alone") or {}
    # the partings beyond a near-tie at which the target alone, rescoring the prefix, picks the drafted token itself
    own = (drafted.get("rescored") or {}).get("agree", 0)
    wrong = same.get("differ_otherwise", 1) - own
    if wrong:
        why.append(f"{wrong} of {same.get('of')} greedy outputs differ from the target alone's where its top two "
                   f"tokens lie more than {same.get('tie_nats', TIE_NATS)} nats apart and the target itself, reading "
                   "the same prefix, does not pick the drafted token (or no ids to compare)")  # fmt: skip
    al = drafted.get("accept_length")
    if al is None or al < ACCEPT_FLOOR:
        why.append(f"accept length {al} < {ACCEPT_FLOOR}: the drafter is loaded but its drafts are not accepted")
    return ("failed" if why else "ok"), why


def ties(a: dict | None) -> str:
    """``tie_agreement``'s record as 'same/of (near-tie / other)'."""
    return "—" if not a else f"{a['same']}/{a['of']} ({a['differ_at_near_tie']} / {a['differ_otherwise']})"


def own(rescored: dict | None) -> str:
    """``rescore``'s record as 'agree/of', its error, or a dash where nothing parted beyond a near-tie."""
    if not rescored:
        return "—"
    return "error" if "error" in rescored else f"{rescored['agree']}/{rescored['of']}"


def markdown(results: dict) -> str:
    lines = [
        "# Every family's drafter in SGLang (one H200: tiny random targets, and real weights where a case says so)",
        "",
        f"Written by `bench/gpu/familydrafters.py`. Drafters: eaglet's trainer, {results.get('steps')} steps on each "
        f"case's {families.N_SAMPLES} stored samples. Decoding: SGLang 0.5.17, EAGLE3 at {CHAIN}, "
        f"{results.get('prompts')} held-out demo prompts, {results.get('tokens')} tokens each, greedy; pass: loads, "
        f"outputs equal the target alone's but at its near-ties (top two within {TIE_NATS} nats, or within the widest "
        "gap at which the target alone parts from itself: the tie column) or at a token the target alone picks "
        "itself on that prefix read anew (the target's own column), "
        f"accept length >= {ACCEPT_FLOOR}.",
        "",
        "| case | architecture | status | drafter acc per step (held-out) | accept length | per position | "
        "same ids (near-tie / other) | other, the target's own | tie nats | target alone vs itself | start s | why |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, R in results["cases"].items():
        d = R.get("drafted") or {}
        why = " ".join("; ".join(R.get("why", [])).split())[:200]  # one table line
        acc = ((R.get("train") or {}).get("probe") or {}).get("final", {}).get("heldout_acc")
        lines.append(
            f"| {case} | {R.get('architecture', '')} | {R.get('status', R.get('skipped', ''))} | "
            f"{h2hreport.rates(acc)} | {h2hreport.fmt(d.get('accept_length'), 3)} | "
            f"{h2hreport.rates(d.get('accept_rate_per_position'))} | {ties(d.get('same_ids_as_target_alone'))} | "
            f"{own(d.get('rescored'))} | "
            f"{h2hreport.fmt((d.get('same_ids_as_target_alone') or {}).get('tie_nats'), 3)} | "
            f"{ties((R.get('target') or {}).get('same_ids_again'))} | "
            f"{h2hreport.fmt(R.get('drafter_server_startup_s'), 1)} | {why} |"
        )
    return "\n".join(lines) + "\n"


def decode_on(H, HH, name: str, model: Path, extra: list[str], prompts: list[list[int]], port: int) -> dict:
    """One SGLang server (``extra`` flags) on ``port`` over ``prompts``: its startup time and
    ``headtohead.decode``'s figures with the output ids; without the drafter also the top-two gaps, and the prompts
    decoded once more at REPEAT_CONCURRENCY (``same_ids_again``); or the error and the server log's tail."""
    alone = "--speculative-algorithm" not in extra  # (logprobs asked of the target alone only)
    try:
        up = HH.start_sharing(name, model, SERVER_FLAGS + extra, port)
        res = {"server_startup_s": round(up, 1), **HH.decode(prompts, 16, port, N_TOKENS, ids=True, gaps=alone)}
        if alone:
            again = HH.decode(prompts, REPEAT_CONCURRENCY, port, N_TOKENS, ids=True)
            res["same_ids_again"] = h2hreport.tie_agreement(again["ids"], res["ids"], res["gaps"], TIE_NATS)
        return res
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[-1500:]}", "server_log_tail": H.tail(name, 40)}
    finally:
        H.stop(name)


def rescore(H, HH, case: str, model: Path, common: list[str], rows: list[dict], tie: float, port: int) -> dict:
    """The outputs with the drafter that part from the target alone's beyond a near-tie (``rows``), put to the
    target alone once more: each prompt with the output's ids up to the parting point, one greedy token and its
    top-two gap (``h2hreport.target_choices``). There the target reads the prefix in a prefill, another batch shape
    than either decode; an MoE router's near-tie may send a token to another expert in one shape and not the other
    (the tiny MoE targets parted at up to 1.0 nats with the drafter, 2026-12-03). A token the target itself picks
    there is the engine's numerics; one it does not is the drafter's doing (or SGLang's verification's)."""
    name = f"famdraft-{case}-rescore"
    try:
        HH.start_sharing(name, model, SERVER_FLAGS + common, port)
        got = HH.decode([r["prefix"] for r in rows], 16, port, 1, ids=True, gaps=True)
        return h2hreport.target_choices(rows, got["ids"], got["gaps"], tie)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[-500:]}", "server_log_tail": H.tail(name, 20)}
    finally:
        H.stop(name)


def decode_case(H, HH, case: str, R: dict, prompts: list[list[int]], port: int) -> None:
    """The target alone, then the target with the case's drafter, on one port; the verdict into ``R``."""
    H.log(f"=== {case} on port {port}")
    try:
        model = Path(R["model_dir"])
        # the Kimi wrapper's stand-in processor is remote code, as the real checkpoint's is
        remote = ["--trust-remote-code"] if families.CASES[case]["family"] == "kimi" else []
        # bf16: SGLang 0.5.17's CUDA RMSNorm refuses float32 ("failed to dispatch data type Float", 2026-12-03)
        common = [*remote, "--dtype", "bfloat16"]
        R["target"] = decode_on(H, HH, f"famdraft-{case}-alone", model, common, prompts, port)
        spec = HH.eagle3_flags(R["drafter_dir"], CHAIN)
        R["drafted"] = decode_on(H, HH, f"famdraft-{case}-eagle3", model, common + spec, prompts, port)
        base, mine = R["target"], R["drafted"]
        if base.get("ids") and mine.get("ids"):
            tie = case_tie(base)
            mine["same_ids_as_target_alone"] = h2hreport.tie_agreement(mine["ids"], base["ids"], base["gaps"], tie)
            rows = h2hreport.beyond_tie(mine["ids"], base["ids"], base["gaps"], tie, prompts)
            if rows:
                mine["rescored"] = rescore(H, HH, case, model, common, rows, tie, port)
        for d in (base, mine):
            for k in ("texts", "ids", "gaps"):
                d.pop(k, None)
        R["drafter_server_startup_s"] = mine.get("server_startup_s")
        R["status"], R["why"] = verdict(base, mine)
    except Exception as e:
        R["status"], R["why"] = "failed", [f"{type(e).__name__}: {e}"]
        R["traceback"] = traceback.format_exc()[-2000:]
    H.log(f"{case}: {R['status']} {R.get('why')}")


def report(paths: list[str], out: Path) -> int:
    """One table from the records of several calls (each call decodes some of the cases): a case's last record
    that has a status wins."""
    merged: dict = {"cases": {}}
    for path in paths:
        rec = json.loads(Path(path).read_text())
        merged.update({k: v for k, v in rec.items() if k != "cases"})
        for case, R in rec["cases"].items():
            if "status" in R or case not in merged["cases"]:
                merged["cases"][case] = R
    out.mkdir(parents=True, exist_ok=True)
    (out / "familydrafters.json").write_text(json.dumps(merged, indent=1, default=str))
    (out / "familydrafters.md").write_text(markdown(merged))
    print((out / "familydrafters.md").read_text())
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--report"]:
        return report(argv[1:], Path(os.environ.get("OUT") or "."))
    wanted = argv or tp1_cases()
    unknown = [c for c in wanted if c not in tp1_cases()]
    if unknown:
        print(f"unknown or not TP 1 cases {unknown}: choose from {', '.join(tp1_cases())}", file=sys.stderr)
        return 2
    from bench.gpu import h2heval as HH  # SGLang's decode figures
    from bench.gpu import h2htrain  # the trainers' runner
    from bench.gpu import harness as H

    out = Path(os.environ.get("OUT") or H.OUT)
    out.mkdir(parents=True, exist_ok=True)
    state = H.ROOT / "families-results.json"
    extracted = json.loads(state.read_text()).get("cases", {}) if state.exists() else {}
    results: dict = {"steps": STEPS, "prompts": N_PROMPTS, "tokens": N_TOKENS, "chain": str(CHAIN), "cases": {}}
    H.redis_up()
    # held-out demo prompts in the chat template of each case's tokenizer (families.py's samples are the training ones)
    prompts: dict[str, list[list[int]]] = {}

    jobs = []
    for case in wanted:
        R = results["cases"].setdefault(case, {"architecture": families.familymodels.ARCHITECTURES[
            families.CASES[case]["family"]]})  # fmt: skip
        ex = extracted.get(case, {})
        if ex.get("status") != "ok" or not ex.get("run_id"):
            R["skipped"] = f"skipped: no extraction of {case} on this machine (run families.py {case} first)"
            continue
        model = families.ensure_model(H, case)
        tokenizer = families.case_tokenizer(H, case)
        prompts[case] = list(families.familymodels.chat_prompts(tokenizer, EVAL_PROMPTS, N_PROMPTS).values())
        folder = H.ROOT / "fam-drafters" / case
        R.update(run_id=ex["run_id"], model_dir=str(model), drafter_dir=str(folder / "drafter"))
        trainer = [sys.executable, "-m", "bench.gpu.ablate", "--run", ex["run_id"], "--out", str(folder), "--model",
                   str(model), "--max-steps", str(STEPS), "--checkpoint-every", "1000000"]  # fmt: skip
        R["train"] = {}
        jobs.append((R["train"], f"famdraft-train-{case}", trainer))
    if jobs:
        H.log(f"familydrafters: training {len(jobs)} drafters together")
        (H.ROOT / "fam-drafters").mkdir(parents=True, exist_ok=True)  # their probes beside them
        env = {"EAGLET_DATA_DIR": str(H.DATA), "OMP_NUM_THREADS": "2"}  # the trainers read the store, not Redis
        h2htrain.run_trainers(jobs, H.PY_EAGLET, env, DEADLINE_S - (time.time() - T0) - 60, H.ROOT / "fam-drafters")

    trained = [c for c, R in results["cases"].items() if "skipped" not in R]
    for case in trained:
        R = results["cases"][case]
        if R["train"].get("rc") != 0:
            R["status"], R["why"] = "failed", [f"trainer: {R['train'].get('error')}"]
    ready = [c for c in trained if "status" not in results["cases"][c]]
    ports = list(range(H.SGL_PORT + 20, H.SGL_PORT + 20 + PARALLEL))
    lock = threading.Lock()

    def one(case: str) -> None:
        R = results["cases"][case]
        if DEADLINE_S - (time.time() - T0) < CASE_ESTIMATE_S:
            R["skipped"] = f"skipped: {time.time() - T0:.0f}s gone of {DEADLINE_S:.0f}s"
            return
        with lock:
            port = ports.pop()
        try:
            decode_case(H, HH, case, R, prompts[case], port)
        finally:
            with lock:
                ports.append(port)
                (out / "familydrafters.json").write_text(json.dumps(results, indent=1, default=str))

    with ThreadPoolExecutor(PARALLEL) as ex:
        list(ex.map(one, ready))
    rc = int(any(R.get("status") not in (None, "ok") for R in results["cases"].values()))
    (out / "familydrafters.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "familydrafters.md").write_text(markdown(results))
    print((out / "familydrafters.md").read_text())
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
