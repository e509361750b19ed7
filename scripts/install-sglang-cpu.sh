#!/usr/bin/env bash
# A light CPU install of SGLang in its own venv (.venv-sglang), for the dump plugin's tests: SGLang's
# classes import and build without a GPU; serving needs the GPU image (services/inference/Dockerfile.sglang).
# Pins: pyproject's `sglang-cpu` group. sglang itself goes in with --no-deps (its pins pull a CUDA torch
# and GPU kernels, 11 GB). Then the plugin and eaglet, both editable and --no-deps, and the released
# wheels of every supported SGLang version, which the contract test reads.
# Idempotent: does nothing when the pins, the plugin's metadata and eaglet's (its folders' mapping onto eaglet.*,
# which an editable install records) are unchanged.
# Usage: bash scripts/install-sglang-cpu.sh   (env PYTHON: the interpreter to build the venv from)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-sglang
PLUGIN=services/inference/sglang_plugin
start=$(date +%s)

pins=$("$PYTHON" scripts/pin.py sglang-cpu)
stamp="$pins $(sha256sum "$PLUGIN/pyproject.toml" pyproject.toml "$0" | cut -d' ' -f1 | tr '\n' ' ')"
if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$stamp" ]; then
  echo "$VENV is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip

sglang_pin=$(tr ' ' '\n' <<<"$pins" | grep '^sglang==')
deps=$(tr ' ' '\n' <<<"$pins" | grep -v '^sglang==')
# shellcheck disable=SC2086  # one argument per pin
"$PIP" install -q $deps
"$PIP" install -q --no-deps "$sglang_pin"
"$PIP" install -q --no-deps -e "$PLUGIN" -e .

# SGLang's config package imports torchvision.transforms at load time (a multimodal helper), and there
# is no CPU torchvision for this torch. An import-only stand-in, placed after site-packages (a .pth
# line), lets the imports resolve; anything that calls it raises. A real torchvision would win.
tv="$VENV/import-standins/torchvision"
mkdir -p "$tv/transforms/v2" "$tv/io"
cat >"$tv/_standin.py" <<'PY'
"""Import-only stand-in for torchvision: names resolve, calls raise."""
import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


class _Missing:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision.{self._name}: only an import stand-in is installed here")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


def missing(module):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{module}.{name}")

    return __getattr__
PY
printf 'from torchvision._standin import missing\n__version__ = "0.0+standin"\n__getattr__ = missing("")\nfrom torchvision import io, transforms  # noqa: E402\n' >"$tv/__init__.py"
printf 'from torchvision._standin import InterpolationMode, missing\n__getattr__ = missing("transforms")\nfrom torchvision.transforms import functional, v2  # noqa: E402\n' >"$tv/transforms/__init__.py"
printf 'from torchvision._standin import InterpolationMode, missing\n__getattr__ = missing("transforms.functional")\n' >"$tv/transforms/functional.py"
printf 'from torchvision._standin import InterpolationMode, missing\n__getattr__ = missing("transforms.v2")\nfrom torchvision.transforms.v2 import functional  # noqa: E402\n' >"$tv/transforms/v2/__init__.py"
printf 'from torchvision._standin import InterpolationMode, missing\n__getattr__ = missing("transforms.v2.functional")\n' >"$tv/transforms/v2/functional.py"
printf 'from torchvision._standin import ImageReadMode, missing\n__getattr__ = missing("io")\n' >"$tv/io/__init__.py"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
(cd "$VENV/import-standins" && pwd) >"$site/zz-eaglet-import-standins.pth"

# The released wheels of the supported versions: the contract test reads their source.
versions=$("$VENV/bin/python" -c "from eaglet_sglang.versions import SUPPORTED; print(' '.join(SUPPORTED))")
mkdir -p "$VENV/wheels"
for v in $versions; do
  ls "$VENV/wheels"/sglang-"$v"-*.whl >/dev/null 2>&1 || "$PIP" download -q --no-deps -d "$VENV/wheels" "sglang==$v"
done

# 0.5.17 importable too, for the model-family test: its own dir, put first on PYTHONPATH, with the
# transformers, tokenizers and xgrammar it pins (the venv's newer transformers clashes with it at import).
old="$VENV/sglang-0.5.17"
[ -d "$old/sglang" ] || "$PIP" install -q --no-deps --target "$old" "$VENV"/wheels/sglang-0.5.17-*.whl \
  transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1

"$VENV/bin/python" -c "import sglang.srt.managers.tp_worker, sglang.srt.plugins, eaglet_sglang, eaglet.shared.dumpfile"
echo "$stamp" >"$VENV/.installed"
echo "$VENV ready in $(($(date +%s) - start)) s"
