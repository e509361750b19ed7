"""Two loss curves (``losscurve.py`` records) compared step by step: the same trainer within a tolerance, or not.

    python -m bench.gpu.comparecurves A.json B.json [--rtol 0.02] [--atol 1e-3] [--out compare.json]

Step i's losses agree when |a - b| <= atol + rtol * |a| (the per-step losses of each TTT step as well as the
weighted total). Exit 0 when every step agrees, 1 when one does not (the first such step and the largest deviation
printed), 2 when the records do not compare (other steps, shapes or seeds).

The tolerance: in bf16 on a GPU, kernels that sum in another order (compiled against eager) differ by a few ulps
of bf16 (0.4 % each) in a step's activations, and the updates carry the differences into the later steps; the
default (``--rtol 0.02``) is an allowance for that, not yet measured: the first GPU records set it. In float32 on
the CPU (``results/cpu-losscurve-*.json``) compiled and eager agree to 1e-5.
"""

import argparse
import json
import sys
from pathlib import Path

COMPARED = ("shape", "T", "samples")  # what must be the same for two curves to compare
SEED_FIELDS = ("seed", "max_steps", "tokens_per_batch", "max_len", "ttt_steps", "lr")


def deviations(a: dict, b: dict) -> list[dict]:
    """Per step: the largest |a - b| of its losses (total and per TTT step), and the allowance at that value."""
    return [
        {"step": x["step"], "loss_a": x["loss"], "loss_b": y["loss"], **worst(x, y)}
        for x, y in zip(a["steps"], b["steps"], strict=True)
    ]


def worst(x: dict, y: dict) -> dict:
    pairs = [(x["loss"], y["loss"]), *zip(x["step_losses"], y["step_losses"], strict=True)]
    diff, ref = max(((abs(p - q), abs(p)) for p, q in pairs), key=lambda d: d[0] / max(d[1], 1e-12))
    return {"abs_diff": diff, "rel_diff": diff / max(ref, 1e-12), "ref": ref}


def mismatch(a: dict, b: dict) -> str | None:
    """Why two records do not compare at all, or None."""
    for k in COMPARED:
        if a.get(k) != b.get(k):
            return f"{k}: {a.get(k)} against {b.get(k)}"
    for k in SEED_FIELDS:
        if a["config"].get(k) != b["config"].get(k):
            return f"config {k}: {a['config'].get(k)} against {b['config'].get(k)}"
    if [s["step"] for s in a["steps"]] != [s["step"] for s in b["steps"]]:
        return f"steps: {len(a['steps'])} against {len(b['steps'])}"
    return None


def compare(a: dict, b: dict, rtol: float, atol: float) -> dict:
    """The comparison's record: each step's deviation, whether all agree, the first that does not."""
    why = mismatch(a, b)
    if why is not None:
        return {"comparable": False, "why": why}
    rows = deviations(a, b)
    bad = [r for r in rows if r["abs_diff"] > atol + rtol * r["ref"]]
    return {
        "comparable": True, "rtol": rtol, "atol": atol, "steps": len(rows), "agree": not bad,
        "first_disagreeing_step": bad[0]["step"] if bad else None,
        "max_rel_diff": max(r["rel_diff"] for r in rows), "max_abs_diff": max(r["abs_diff"] for r in rows),
        "flags": [a.get("flags"), b.get("flags")], "per_step": rows,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--rtol", type=float, default=0.02)
    p.add_argument("--atol", type=float, default=1e-3)
    p.add_argument("--out", type=Path, help="also write the comparison's record here")
    args = p.parse_args(argv)
    result = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()), args.rtol, args.atol)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if not result["comparable"]:
        print(f"not comparable: {result['why']}")
        return 2
    print(f"{result['steps']} steps, flags {result['flags'][0]!r} against {result['flags'][1]!r}: largest deviation "
          f"{result['max_rel_diff']:.2e} relative ({result['max_abs_diff']:.2e} absolute); tolerance rtol "
          f"{args.rtol:g} atol {args.atol:g}: {'agree' if result['agree'] else 'DISAGREE'}")  # fmt: skip
    if not result["agree"]:
        print(f"first step beyond the tolerance: {result['first_disagreeing_step']}")
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
