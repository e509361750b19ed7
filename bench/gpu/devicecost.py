"""What the servers' device-side encoders cost a forward, on one GPU, without a server: the top-k distribution (the
product's ``encode_topk`` beside the way it was computed before and the head's product alone), the 4-bit and fp8
encoders.

    GPUBENCH_SCRIPT=devicecost.py bash bench/gpu/run.sh "" devicecost     (any machine with torch and a GPU, ~1 min)

One chunked-prefill forward's rows at the Llama-3-8B shape (8,192 tokens, H 4,096, vocabulary 128,256; Kimi-K2.5's
7,168 x 163,840 with DEVICECOST_SHAPES=l8b,kimi), random bf16 states and head. Each encoder runs DEVICECOST_REPEATS
(7) times after one warm-up, timed with CUDA events; the median, min and max milliseconds, and the share of the
plain server's time for those tokens (8,192 / 39,549 tokens/s = 207 ms at the 8B shape, gpu-speedrows-2026-12-04)
that it would add on the forward's stream. The other ways' outputs are compared with the product's: the fraction
of equal ids and the largest log-probability difference.

- ``full-select``: ``encode_topk`` until 2026-12-04 (33 ms at the 8B shape then): a float32 log-softmax over every
  column, then the selection over every column; the product now selects among the chunks of largest maximum
  (``shared/topk.py``, ``top_logits``).
- ``head-product``: the LM head's product alone, in the same blocks of rows: the floor of any top-k over the
  whole vocabulary.
"""

import os
import statistics
import time

import torch

from bench.gpu import harness as P
from eaglet.shared.fp4 import FP4_DEVICE_BLOCK_BYTES, encode_fp4
from eaglet.shared.store import FP8_DEVICE_BLOCK_BYTES, encode_fp8
from eaglet.shared.topk import encode_topk, logit_blocks

ROWS, K = int(os.environ.get("DEVICECOST_ROWS", "8192")), 24
DEVICE = os.environ.get("DEVICECOST_DEVICE", "cuda")  # cpu: a dry run of the phase (tiny shapes: DEVICECOST_SHAPES)
SHAPES = {"l8b": (4096, 128256), "kimi": (7168, 163840), "smol": (576, 49152), "tiny": (64, 40000)}
PLAIN_MS_8B = 1000 * ROWS / 39549  # the plain server's time for one forward's tokens at the 8B shape


def full_select(final: torch.Tensor, head: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.empty(final.shape[0], k, dtype=torch.int32, device=final.device)
    logp = torch.empty(final.shape[0], k, dtype=torch.float16, device=final.device)
    for rows in logit_blocks(final, head.shape[0]):
        logits = (final[rows] @ head.T).float()
        values, top = torch.log_softmax(logits, -1).topk(k, dim=-1)
        ids[rows], logp[rows] = top.to(torch.int32), values.to(torch.float16)
    return ids, logp


def head_product(final: torch.Tensor, head: torch.Tensor, k: int) -> None:
    for rows in logit_blocks(final, head.shape[0]):
        final[rows] @ head.T


def agreement(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """How a candidate's top-k matches the product's: ids in the same places, the same set of ids a row (equal
    logits may come in another order), and the largest log-probability difference."""
    same_set = (got[0].sort(-1).values == want[0].sort(-1).values).all(-1)
    return {
        "ids_equal_fraction": round(float((got[0] == want[0]).float().mean()), 5),
        "rows_same_id_set_fraction": round(float(same_set.float().mean()), 5),
        "logp_max_abs_diff": round(float((got[1].float() - want[1].float()).abs().max()), 5),
    }


def timed(fn, repeats: int) -> dict:
    """Milliseconds a call: CUDA events on the GPU (the host does not wait between launches), else the wall."""
    fn()
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            fn()
            ms.append(1000 * (time.perf_counter() - t))
    median = statistics.median(ms)
    return {"median_ms": round(median, 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}


def phase_devicecost() -> None:
    R = P.RESULTS.setdefault("devicecost", {})
    repeats = int(os.environ.get("DEVICECOST_REPEATS", "7"))
    R["device"] = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    for shape in os.environ.get("DEVICECOST_SHAPES", "l8b").split(","):
        hidden, vocab = SHAPES[shape]
        g = torch.Generator(device=DEVICE).manual_seed(0)
        final = torch.randn(ROWS, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
        head = (torch.randn(vocab, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g) / hidden**0.5) * 4
        aux = torch.randn(ROWS, 3 * hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
        rows = {}
        want = encode_topk(final, head, K)
        for name, fn in (("encode_topk", encode_topk), ("full-select", full_select), ("head-product", head_product)):
            rows[name] = timed(lambda fn=fn, x=final, h=head: fn(x, h, K), repeats)
            if name == "full-select":
                rows[name] |= agreement(fn(final, head, K), want)
        rows["encode_fp4 (aux)"] = timed(lambda a=aux: encode_fp4(a, FP4_DEVICE_BLOCK_BYTES), repeats)
        rows["encode_fp8 (aux + final)"] = timed(
            lambda a=aux, x=final: (encode_fp8(a, FP8_DEVICE_BLOCK_BYTES), encode_fp8(x, FP8_DEVICE_BLOCK_BYTES)),
            repeats,
        )
        if shape == "l8b" and ROWS == 8192:
            for row in rows.values():
                row["share_of_plain_forward"] = round(row["median_ms"] / PLAIN_MS_8B, 4)
        R[shape] = {"rows": ROWS, "hidden": hidden, "vocab": vocab, "k": K, "encoders": rows}
        P.log(f"devicecost {shape}: {rows}")
        P.save("devicecost")
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    from bench.gpu import phases

    raise SystemExit(P.main({**phases.PHASES, "devicecost": phase_devicecost}, {**phases.ESTIMATE_S, "devicecost": 60}))
