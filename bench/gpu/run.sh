#!/usr/bin/env bash
# run.sh "PARTS" [PHASE...]: on the GPU machine, from the repo root. Installs the staged parts named in PARTS
# (bench/gpu/install.sh), prints the machine's facts the first time, then runs bench/gpu/phases.py's phases.
# Results: $OUT/<phase>.json, $OUT/machine.txt, $OUT/machine-packages.txt (the image's full pip list); each call's
# logs in a folder of their own, $OUT/logs/<call>/: install.log, phases.log, logs.tgz (server, worker and trainer logs).
set -u
OUT=${OUT:-$PWD/gpu-out}; export OUT
export GPUBENCH_CALL=${GPUBENCH_CALL:-$(date -u +%Y%m%d-%H%M%S)}
LOGS=$OUT/logs/$GPUBENCH_CALL; mkdir -p "$LOGS"
bash bench/gpu/install.sh $1 2>&1 | tee -a "$LOGS/install.log"
shift
if [ ! -f /root/stage/info.done ]; then
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; uname -r
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
    df -h /dev/shm /root | tail -2; nproc; free -g | head -2
    LD_LIBRARY_PATH=/root/stage/redis/lib /root/stage/redis/bin/redis-server --version
    PYTHONPATH= python3 -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|tokenizers|safetensors|numpy|httpx|aiohttp|requests|rich|pydantic|fastapi|uvicorn|accelerate|gguf|click|python-dateutil|prometheus.client|psutil|uvloop) '
  } 2>&1 | tee "$OUT/machine.txt"
  PYTHONPATH= python3 -m pip list --format=freeze > "$OUT/machine-packages.txt"
  touch /root/stage/info.done
fi
[ $# -gt 0 ] || exit 0
export PYTHONPATH=$PWD:/root/stage/esite:/root/stage/site PYTHONUNBUFFERED=1
# GPUBENCH_SCRIPT: the phases script (headtohead.py for the drafter head-to-head)
timeout ${GPUBENCH_TIMEOUT:-570} python3 -m "bench.gpu.$(basename "${GPUBENCH_SCRIPT:-phases}" .py)" "$@" 2>&1 | tee "$LOGS/phases.log"
