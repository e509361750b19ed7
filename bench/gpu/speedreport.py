"""The pipeline's speed at the 8B shape against its two ceilings: from the phases speed8b (plain SGLang, the bf16
pipeline), fp8speed8b, layoutspeed8b, topkrows8b, stream8b and fp4speed8b (phases.py), each repetition's tokens/s over
min(plain SGLang's median, the disk's fsync bandwidth probed just before it ÷ the bytes a token that repetition
stored). Plain SGLang's median is that of the repetitions in the pipeline's own call where there are any
(``plain_same_call``: true), else of all of them (another call, maybe another machine: false).

    python -m bench.gpu.speedreport GPU_OUT_DIR results      (writes gpu-speedrows.md and .json)
"""

import json
import statistics
import sys
from pathlib import Path

PHASES = {
    "speed8b": "bf16",
    "fp8speed8b": "fp8",
    "layoutspeed8b": "default layout",
    "topkrows8b": "default layout",
    "stream8b": "default layout",
    "fp4speed8b": "fp4 aux alone",
}


def row_name(name: str, rep: dict) -> str:
    """The pipeline a repetition ran: its phase's, with what the A/B phases varied (each repetition says)."""
    if rep.get("topk_rows") == "all":  # topkrows8b: the default (the top-k at the loss rows) against every row
        return f"{name}, top-k at every row"
    if rep.get("capture_stream"):  # stream8b: two servers side by side, each with 0.4 of the GPU's memory
        return f"{name}, capture on the {rep['capture_stream']} stream (two servers)"
    return name


GOAL = 0.95


def rows(results: dict) -> tuple[float | None, list[dict]]:
    """Plain SGLang's median tokens/s, and one row per pipeline repetition of each phase. A repetition recorded
    before the probe moved beside it takes the phase's probes (speed8b's) in order."""
    plain = [r for r in results.get("speed8b", {}).get("plain", []) if r.get("tokens_per_s")]
    every = statistics.median(r["tokens_per_s"] for r in plain) if plain else None
    out = []
    for phase, name in PHASES.items():
        R = results.get(phase, {})
        probes = R.get("disk", [])
        for i, rep in enumerate(R.get("pipeline", [])):
            disk = (rep.get("disk") or (probes[i] if i < len(probes) else {})).get("fsync_write_GBps")
            same = [r["tokens_per_s"] for r in plain if rep.get("call") is not None and r.get("call") == rep["call"]]
            server = statistics.median(same) if same else every
            per_token = rep.get("bytes_per_token")
            disk_bound = disk * 1e9 / per_token if disk and per_token else None
            ceiling = min(x for x in (server, disk_bound) if x) if server or disk_bound else None
            tps = rep.get("tokens_per_s")
            out.append({
                "pipeline": row_name(name, rep),
                "repetition": i, "tokens_per_s": tps, "bytes_per_token": per_token,
                "plain_tokens_per_s": server, "plain_same_call": bool(same),
                "disk_GBps": disk, "disk_bound_tokens_per_s": round(disk_bound, 1) if disk_bound else None,
                "ratio": round(tps / ceiling, 3) if tps and ceiling else None,
                "written_GBps": round(rep["bytes_per_s"] / 1e9, 3) if rep.get("bytes_per_s") else None,
            })  # fmt: skip
    return every, out


def write(out_dir: Path, results_dir: Path) -> dict:
    results = {p: json.loads((out_dir / f"{p}.json").read_text()) for p in PHASES if (out_dir / f"{p}.json").exists()}
    server, table = rows(results)
    summary = {"plain_sglang_median_tokens_per_s": server, "goal": GOAL, "rows": table}
    lines = [
        "# The pipeline at the Llama-3-8B shape against min(plain SGLang, the disk) (one H200)",
        "",
        f"Written by `bench/gpu/speedreport.py` from phases.py's speed phases. Plain SGLang's median: "
        f"{server:,.0f} tokens/s."
        if server
        else "Plain SGLang: not measured in these results.",
        "",
        "| pipeline | repetition | tokens/s | bytes a token | disk GB/s (probe) | disk bound tokens/s | written GB/s "
        f"| plain SGLang tokens/s (same call?) | ÷ min(SGLang, disk) (goal ≥ {GOAL}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        shown = ("tokens_per_s", "bytes_per_token", "disk_GBps", "disk_bound_tokens_per_s", "written_GBps")
        cells = ["—" if r[k] is None else f"{r[k]:,}" for k in shown]
        plain = "—" if r["plain_tokens_per_s"] is None else f"{r['plain_tokens_per_s']:,.0f}"
        cells += [
            f"{plain} ({'yes' if r['plain_same_call'] else 'no'})",
            "—" if r["ratio"] is None else str(r["ratio"]),
        ]
        lines.append(" | ".join(["", r["pipeline"], str(r["repetition"]), *cells]).strip() + " |")
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "gpu-speedrows.md").write_text("\n".join(lines) + "\n")
    (results_dir / "gpu-speedrows.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(json.dumps(write(Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
