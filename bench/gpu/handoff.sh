#!/usr/bin/env bash
# handoff.sh ["PARTS"]: on a machine with 2 GPUs, from the repo root, after bench/gpu/install.sh (p1 p2). Extraction
# at TP 2 on GPUs 0,1, the server released, then training on GPU 1 alone (bench/gpu/handoff.py); about 3 minutes.
# Checks and figures: $OUT/handoff.json (default ./gpu-out); exit 0 only when every check passed.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUBENCH_SCRIPT=handoff.py GPUBENCH_TIMEOUT=${GPUBENCH_TIMEOUT:-300} exec bash bench/gpu/run.sh "${1:-}" handoff
