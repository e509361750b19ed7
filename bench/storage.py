"""The durable store: bytes per token, durable write throughput against a raw sequential write of the same
bytes to the same disk, and read throughput of the trainer's loader (``load_sample``), per storage encoding.

Samples are random states of a model's shape (default: Llama-3-8B's H=4096, 2,048 tokens a sample, which is
what the DESIGN's disk figures are for; ``--hidden 576`` is SmolLM2), left as dumps in shared memory as an
inference server leaves them. "durable" is the extractor's store step from the dump (map, check, write with
the kernel copying kept states file to file); "memory" is the same with the dump loaded into memory first
(the path before the kernel copy). Phases go raw, durable, memory, raw, ... so drift shows; reads are
measured cold (the files' pages dropped from the page cache with ``posix_fadvise(DONTNEED)`` after their
fsync) and warm.

    python -m bench.storage                       # 8 samples of 2,048 tokens a phase: about 1 GiB written
    python -m bench.storage --hidden 7168 --samples 16 --writers 4
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save

from bench.common import load, save_result
from eaglet.services.trainer.data import load_sample
from eaglet.shared.dumpfile import dump_path, read_dump, validate_dump, write_dump
from eaglet.shared.fp4 import encode_fp4
from eaglet.shared.layout import Layout
from eaglet.shared.runoptions import DEFAULT_TOPK, RunOptions
from eaglet.shared.store import encode_states, sample_path, write_sample

ROOT = Path(__file__).resolve().parents[1]


ENCODINGS = {  # name: (store_dtype, layout)
    "bf16": ("bf16", Layout()),
    "fp8": ("fp8", Layout()),
    "default": ("bf16", RunOptions().layout()),  # the default layout: the dump holds what the store keeps
}
VOCAB = 128_000


def make_sample(tokens: int, hidden: int, seed: int, topk: int = DEFAULT_TOPK) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # a top-k as a server computes it: distinct ids, log-probs in descending order, 0.9 of the mass
    ids = torch.arange(topk) * (VOCAB // topk) + torch.randint(0, VOCAB // topk, (tokens, topk), generator=g)
    logp = torch.log_softmax(torch.randn(tokens, topk, generator=g), -1).sort(-1, descending=True).values
    return {
        "input_ids": torch.randint(0, VOCAB, (tokens,), dtype=torch.int32, generator=g),
        "loss_mask": torch.ones(tokens, dtype=torch.uint8),
        "hidden_states": torch.randn(tokens, hidden, generator=g).to(torch.bfloat16),  # as dumped on a GPU
        "aux_hidden_states": torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16),
        "topk_ids": ids.to(torch.int32),
        "topk_logp": (logp + torch.log(torch.tensor(0.9))).to(torch.float16),
    }


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(folder: Path, blobs: list[bytes]) -> float:
    """One file, the same bytes written in order, one fsync: the disk's sequential durable ceiling."""
    path = folder / "raw.bin"
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for blob in blobs:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t
    path.unlink()
    return seconds


def write_dumps(dump_dir: Path, samples: list[dict], tag: str, layout: Layout) -> list[str]:
    """The samples' states as an inference server leaves them for the layout's request: one dump file each, in the
    dump dir; the top-k in place of the final state, the aux states 4-bit encoded where the layout keeps them so
    (the server's work, not timed here)."""
    rids = [f"eaglet:bench:{tag}-{i:04d}:1" for i in range(len(samples))]
    for rid, s in zip(rids, samples, strict=True):
        topk = (s["topk_ids"], s["topk_logp"]) if layout.final == "topk" else None
        aux_fp4 = encode_fp4(s["aux_hidden_states"]) if layout.aux == "fp4" else None
        write_dump(dump_dir, rid, None if topk else s["hidden_states"], None if aux_fp4 else s["aux_hidden_states"],
                   aux_layer_ids=[2, 16, 29], model="m", model_dtype=s["aux_hidden_states"].dtype, topk=topk,
                   aux_fp4=aux_fp4)  # fmt: skip
    return rids


def durable_write(
    folder: Path, dump_dir: Path, rids: list[str], samples: list[dict], encoding: str, writers: int, mode: str
) -> tuple[float, list]:
    """The extractor's store step for every sample, ``writers`` at a time: map the dump, check it, then
    ``write_sample`` (encode, temp, fsync, rename, fsync of the folder). ``mode`` "kernel": kept states are
    copied file to file (the extractor's path); "memory": the dump is first loaded into memory (the old path)."""
    paths = [sample_path(folder, "bench", f"{mode}-{i:04d}") for i in range(len(samples))]
    hidden = samples[0]["hidden_states"].shape[1]
    store_dtype, layout = ENCODINGS[encoding]

    def one(i: int) -> None:
        dump = read_dump(dump_path(dump_dir, rids[i]))
        tokens = len(samples[i]["input_ids"])
        validate_dump(dump, rid=rids[i], num_tokens=tokens, hidden_size=hidden, topk=layout.topk, vocab_size=VOCAB,
                      aux_fp4=layout.aux == "fp4")  # fmt: skip
        states = dump.states
        if mode == "memory":
            states = {k: v.clone() for k, v in states.items()}
        tensors = {"input_ids": samples[i]["input_ids"], "loss_mask": samples[i]["loss_mask"], **states}
        write_sample(paths[i], tensors, dump.metadata, writer=f"w{i % writers}", store_dtype=store_dtype,
                     layout=layout, slices=dump.slices if mode == "kernel" else None)  # fmt: skip

    t = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(one, range(len(samples))))
    return time.perf_counter() - t, paths


def read_all(paths: list[Path], cold: bool) -> float:
    if cold:
        for p in paths:
            drop_cache(p)
    t = time.perf_counter()
    for p in paths:
        s = load_sample(p, torch.float32)  # the CPU trainer's dtype; bf16 on GPU
        assert s["aux_hidden_states"].shape[0] == s["input_ids"].shape[0]
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=2048, help="tokens a sample")
    p.add_argument("--samples", type=int, default=8, help="samples a phase")
    p.add_argument("--writers", type=int, default=1, help="concurrent writers (threads), as workers on one host")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtypes", default="bf16,fp8,default", help=f"storage encodings to compare: {', '.join(ENCODINGS)}")
    p.add_argument("--folder", type=Path, help="on the disk to measure (default: a temp folder under var/)")
    p.add_argument(
        "--dump-dir",
        type=Path,
        default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
        help="where the dumps lie, as the servers' shared-memory dump dir (default: /dev/shm)",
    )
    p.add_argument("--result", help="results to results/cpu-RESULT.json (default: storage-h<hidden>)")
    args = p.parse_args()
    torch.set_num_threads(1)  # as an extractor worker: one thread a process, workers scale by process
    load_before = load()
    (ROOT / "var").mkdir(exist_ok=True)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="bench-storage-", dir=ROOT / "var"))
    samples = [make_sample(args.tokens, args.hidden, i) for i in range(args.samples)]
    tokens = args.tokens * args.samples
    reference = 4 * args.hidden * 2  # four bf16 states a token
    figures: dict = {"hidden": args.hidden, "tokens_per_sample": args.tokens, "samples_per_phase": args.samples,
                     "writers": args.writers, "bf16_states_bytes_per_token": reference, "dtypes": {}}  # fmt: skip
    dump_dir = Path(tempfile.mkdtemp(prefix="bench-dumps-", dir=args.dump_dir))
    try:
        for dtype in args.dtypes.split(","):
            store_dtype, layout = ENCODINGS[dtype]
            rids = write_dumps(dump_dir, samples, dtype, layout)
            # what the durable write puts on disk, encoded outside the timing for the raw write of the same bytes
            encoded = [encode_states(s, {"rid": "x"}, store_dtype, layout)[0] for s in samples]
            blobs = [save({k: v.contiguous() for k, v in e.items()}) for e in encoded]
            nbytes = sum(map(len, blobs))
            rows, paths = [], []
            for n, kind in enumerate(["raw", "durable", "memory"] * args.rounds + ["raw"]):
                row = {"phase": n, "kind": kind, "load": load()}
                if kind == "raw":
                    seconds = raw_write(folder, blobs)
                else:
                    shutil.rmtree(folder / "runs", ignore_errors=True)
                    mode = "kernel" if kind == "durable" else "memory"
                    seconds, paths = durable_write(folder, dump_dir, rids, samples, dtype, args.writers, mode)
                row.update(seconds=round(seconds, 3), MBps=round(nbytes / seconds / 1e6, 1))
                rows.append(row)
                print(dtype, json.dumps(row), flush=True)
            stored = sum(p.stat().st_size for p in paths)
            reads = {"cold": [], "warm": []}
            for _ in range(args.rounds):
                for mode in ("cold", "warm"):
                    reads[mode].append(read_all(paths, mode == "cold"))
            raw = statistics.mean(r["MBps"] for r in rows if r["kind"] == "raw")
            durable = statistics.mean(r["MBps"] for r in rows if r["kind"] == "durable")
            memory = statistics.mean(r["MBps"] for r in rows if r["kind"] == "memory")
            figures["dtypes"][dtype] = {
                "bytes_per_token": round(stored / tokens, 1),
                "over_4H_bf16": round(stored / tokens / reference, 3),
                "raw_write_MBps": round(raw, 1),
                "durable_write_MBps": round(durable, 1),
                "durable_over_raw": round(durable / raw, 3),
                "through_memory_MBps": round(memory, 1),
                "through_memory_over_raw": round(memory / raw, 3),
                "durable_tokens_per_s": round(durable * 1e6 / (stored / tokens), 1),
                "read_cold_MBps": round(stored / statistics.median(reads["cold"]) / 1e6, 1),
                "read_warm_MBps": round(stored / statistics.median(reads["warm"]) / 1e6, 1),
                "read_cold_tokens_per_s": round(tokens / statistics.median(reads["cold"]), 1),
                "read_warm_tokens_per_s": round(tokens / statistics.median(reads["warm"]), 1),
                "phases": rows,
            }
            print(dtype, json.dumps({k: v for k, v in figures["dtypes"][dtype].items() if k != "phases"}), flush=True)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    cmd = " ".join(["python -m bench.storage", *sys.argv[1:]])
    print("wrote", save_result(args.result or f"storage-h{args.hidden}", cmd, figures, load_before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
