#!/usr/bin/env bash
# stage-ref.sh: the one part the reference-server runs need on the bare GPU machine (no SGLang), in one send:
#   .stage/pr   eaglet's Python needs the image lacks (FastAPI, uvicorn, pydantic, redis, rq, ...) as py3.12
#               wheels, Debian bookworm's redis-server unpacked, SmolLM2's tokenizer (for the model builder)
# Then: bash bench/gpu/run.sh .stage/pr models ref8b       (GPUBENCH_MODELS=8b builds only the 8B shape)
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
PR=$REPO/.stage/pr; WORK=$REPO/.stage/work
rm -rf "$PR"; mkdir -p "$PR/eaglet" "$PR/redis/bin" "$PR/redis/lib" "$WORK"
PY=${PY:-$REPO/.venv/bin/python}
dl() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    -d "$1" "${@:2}"
}
# Versions: eaglet's pins (pyproject.toml) where it pins them, else those SGLang 0.5.17's stage uses.
dl "$PR/eaglet" redis==8.1.0 hiredis==3.5.0 rq==3.0.0 croniter==7.0.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
dl "$PR" fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
R=$WORK/redis; rm -rf "$R"; mkdir -p "$R/debs" "$R/root"
(cd "$R/debs" && apt-get download redis-server redis-tools libjemalloc2 liblzf1 >/dev/null 2>&1)
for f in "$R"/debs/*.deb; do dpkg -x "$f" "$R/root"; done
cp -L "$R/root/usr/bin/redis-server" "$PR/redis/bin/"
cp -L "$R"/root/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 "$R"/root/usr/lib/x86_64-linux-gnu/liblzf.so.1 "$PR/redis/lib/"
cp -L /lib/x86_64-linux-gnu/libatomic.so.1 "$PR/redis/lib/" 2>/dev/null || true
# The tokenizer the model builder copies next to the weights (SmolLM2's, from the bundled package).
(cd "$REPO" && "$PY" - "$WORK/tokenizer" <<'PY'
import sys
from pathlib import Path
from eaglet.shared.target import resolve_model_dir
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(resolve_model_dir("smollm2", Path("var/models"))).save_pretrained(sys.argv[1])
PY
)
tar -C "$WORK" -czf "$PR/tokenizer.tgz" tokenizer
du -sh "$PR"
