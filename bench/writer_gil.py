"""Does the server's dump writer take the scheduler's time? A Python loop (the scheduler thread's stand-in: pure
interpreter work) timed alone and beside ``--threads`` writer threads writing dumps as the plugin's writer does
(``write_dump_parts`` into shared memory), alternating, ``--rounds`` times: its rate beside the writers over its rate
alone (1.0: the writers release the GIL while they write); and the other way, the writers' dumps a second beside the
loop over theirs alone (the GIL handed back to a writer only at the interpreter's switch interval).

    python -m bench.writer_gil                                   # the 8B shape's fp4-alone dump (31 MB)
    python -m bench.writer_gil --tokens 356 --hidden 576 --threads 4
    python -m bench.writer_gil --tokens 356 --hidden 576 --threads 4 --switch-interval 0.0005

``--switch-interval`` sets the interpreter's (``sys.setswitchinterval``, 5 ms by default): how long a writer that
finished a write waits for a busy thread to hand the GIL back.
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import load, save_result
from eaglet.shared.dumpfile import encode_forms, write_dump_parts


def loop_rate(seconds: float) -> float:
    """Iterations a second of a loop of interpreter work, for ``seconds``."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sum(range(100))
        n += 1
    return n / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="writer threads (the plugin's default is 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0, help="each timing of the loop")
    p.add_argument("--switch-interval", type=float, default=sys.getswitchinterval(), help="seconds")
    p.add_argument("--result", default="writer-gil")
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval)
    load_before = load()
    final, aux = torch.randn(args.tokens, args.hidden).bfloat16(), torch.randn(args.tokens, 3 * args.hidden).bfloat16()
    forms = encode_forms(final, aux, [{"aux_e2m1": "aux_e2m1", "aux_block_scale": "aux_block_scale"}])
    parts = {"hidden_states": final, "aux_hidden_states_e2m1": forms["aux_e2m1"],
             "aux_hidden_states_block_scale": forms["aux_block_scale"]}  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="writer-gil-", dir="/dev/shm"))
    stop, written = threading.Event(), [0]

    def writer(i: int) -> None:
        k = 0
        while not stop.is_set():
            path = write_dump_parts(folder, f"eaglet:gil:w{i}-{k}:0", parts, aux_layer_ids=[2, 15, 27], model="m")
            path.unlink()
            k, written[0] = k + 1, written[0] + 1

    def writers_for(seconds: float, during=time.sleep):
        """Runs the writer threads while ``during(seconds)`` runs here; returns (its result, dumps a second)."""
        stop.clear()
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(args.threads)]
        for t in threads:
            t.start()
        before = written[0]
        result = during(seconds)
        dumps = written[0] - before
        stop.set()
        for t in threads:
            t.join()
        return result, dumps / seconds

    rounds = []
    for _ in range(args.rounds):
        alone = loop_rate(args.seconds)
        beside, dumps = writers_for(args.seconds, loop_rate)
        _, dumps_alone = writers_for(args.seconds)
        rounds.append({"alone": round(alone), "beside_writers": round(beside), "ratio": round(beside / alone, 3),
                       "dumps_per_s": round(dumps, 1), "dumps_per_s_alone": round(dumps_alone, 1),
                       "writers_ratio": round(dumps / dumps_alone, 3),
                       # the loop's time lost a dump written beside it: what a dump costs the scheduler thread
                       "loop_ms_lost_per_dump": round(1e3 * (1 - beside / alone) / max(dumps, 1e-9), 3)})  # fmt: skip
    folder.rmdir()
    ratios = [r["ratio"] for r in rounds]
    figures = {"tokens": args.tokens, "hidden": args.hidden, "threads": args.threads,
               "switch_interval_s": args.switch_interval, "dump_bytes": sum(t.nbytes for t in parts.values()),
               "rounds": rounds,
               "ratio_median": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
               "writers_ratio_median": statistics.median(r["writers_ratio"] for r in rounds),
               "loop_ms_lost_per_dump_median": statistics.median(r["loop_ms_lost_per_dump"] for r in rounds),
               }  # fmt: skip
    print(figures)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "result")
    print(save_result(args.result, f"python -m bench.writer_gil {flags}", figures, load_before))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
