"""The GPU runs of eaglet's SGLang dump plugin and pipeline, in phases, on an H200 machine after bench/gpu/install.sh.

    python3 -m bench.gpu.phases PHASE [PHASE...]     (from the repo root; results in $OUT, default ./gpu-out)

Each call's logs stay apart: the servers', workers' and trainer's in $OUT/logs/<call>/logs.tgz, where <call>
is GPUBENCH_CALL (bench/gpu/run.sh sets it; default: the start time).

Phases:
  smol      SGLang 0.5.17 + eaglet's plugin on a SmolLM2-135M-shape Llama (random bf16 weights), radix cache
            off, chunked prefill 256: the real extractor workers extract N samples (lengths 16..3000 tokens);
            the same prompts go through the reference server on the same GPU and the hidden states are
            compared per tensor; prefill tokens/s of the server alone (plugin on, no dump) and of the pipeline.
  real      the same on the bundled SmolLM2-135M-Instruct (real weights, from its GGUF), on the demo
            conversations; keeps the store for `drafter`.
  speed8b   Llama-3-8B shape (random bf16), 2,048-token prompts, concurrency 32, three repetitions each: plain
            SGLang's prefill tokens/s (1,000 requests), the disk's fsync bandwidth, and the bf16 pipeline's
            end-to-end tokens/s with 32 workers (1,200 samples, > 60 s), the server's memory sampled.
  plain8b   speed8b's first half (plain SGLang and the disk); bf16speed8b its second (the bf16 pipeline).
  fp8speed8b  the same pipeline storing fp8 (encoded by the plugin on the GPU), three repetitions, and the GPU
            encoder checked bit for bit against the workers' CPU encoder.
  layoutspeed8b  the same pipeline on the default storage layout (the top-24 in place of the final state and the
            4-bit aux states, both by the plugin on the GPU, checked first against the workers' encoders), three
            repetitions. Every pipeline repetition probes the disk just before it.
  fp4speed8b  the same pipeline with the 4-bit aux states alone (the final state whole, no top-k).
  smolspeed  SmolLM2-135M's shape: plain SGLang against the pipeline (default layout) at SMOL_WORKERS worker
            counts, the same chat-length samples, three repetitions each (the small target's worker-bound row).
  layoutbits  the default layout's encoders (the top-k at loss rows among them) against the workers' at SmolLM2's
            shape: a short check of the plugin inside SGLang.
  topkrows8b  the default layout with its top-k at every position against at the loss positions alone (the
            default), alternating on one server (TOPKROWS_PAIRS pairs): each pair's ratio.
  stream8b  the default layout with the capture on the forward's stream against on the plugin's side stream
            (EAGLET_CAPTURE_STREAM): two plugin servers side by side, the pipeline alternating between them
            (STREAM_PAIRS pairs), the side stream's dumps checked first: each pair's ratio.
  diskpatterns  the data disk under the store's write pattern (sample-sized files, sendfile from shared memory,
            fsync, rename, folder fsync; 8 to 64 writers; removed behind or kept) beside the plain probe.
  ref8b     the reference server at the 8B shape: server alone (--no-dump) vs the pipeline.
  train8b   eaglet's trainer on the 8B store files that speed8b wrote (hidden 4096, TTT 7, 2,048-token
            samples): tokens/s and peak GPU memory.
  drafter   trains a drafter with eaglet's trainer on the `real` (else `smol`) run, loads it in SGLang as an
            EAGLE-3 draft and decodes; reports SGLang's acceptance length.
"""

from bench.gpu import disk, extraction, harness, speed, training

ESTIMATE_S = {
    "smol": 200,
    "real": 180,
    # measured 2026-12-04: the first SGLang start on a fresh machine 148 s, 79 s once a smaller model's kernels were
    # compiled, later ones 50-70 s; a pipeline repetition ~100 s with its dataset, workers and probe (bf16speed8b
    # x3: 393 s with a 79 s start; plain8b: 246 s with a 70 s start)
    "speed8b": 650,
    "plain8b": 300,
    "fp8speed8b": 400,
    "bf16speed8b": 400,
    "layoutspeed8b": 480,
    "layoutbits": 90,
    "smolspeed": 200,  # two server starts and plain's repetitions; each pipeline repetition only where it fits
    "topkrows8b": 180,  # the server start and the check; each repetition is started only where it fits
    "stream8b": 240,  # two server starts and the check; each repetition is started only where it fits
    "fp4speed8b": 480,  # as layoutspeed8b; two repetitions after a 176 s first start were cut at 550 s with a third
    "diskpatterns": 90,
    "ref8b": 150,
    "train8b": 120,
    "drafter": 200,
    "models": 60,
}


PHASES = {
    "models": training.phase_models,
    "smol": extraction.phase_smol,
    "real": extraction.phase_real,
    "speed8b": speed.phase_speed8b,
    "plain8b": speed.phase_plain8b,
    "fp8speed8b": speed.phase_fp8speed8b,
    "bf16speed8b": speed.phase_bf16speed8b,
    "layoutspeed8b": speed.phase_layoutspeed8b,
    "smolspeed": speed.phase_smolspeed,
    "layoutbits": speed.phase_layoutbits,
    "topkrows8b": speed.phase_topkrows8b,
    "stream8b": speed.phase_stream8b,
    "fp4speed8b": speed.phase_fp4speed8b,
    "diskpatterns": disk.phase_diskpatterns,
    "ref8b": speed.phase_ref8b,
    "train8b": training.phase_train8b,
    "drafter": training.phase_drafter,
}


def main() -> int:
    return harness.main(PHASES, ESTIMATE_S)


if __name__ == "__main__":
    raise SystemExit(main())
