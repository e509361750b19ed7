#!/usr/bin/env bash
# Builds eaglet's images: the dependency image (eaglet-base), then the eaglet image every service runs
# (docker/Dockerfile) and, in the gpu profile, the SGLang inference image.
#
#   bash docker/build-images.sh                     # the profiles of COMPOSE_PROFILES (.env)
#   bash docker/build-images.sh --profile cpu       # arguments go to compose, before `build`
#
# Compose has no build order between images; this script is that order. It uses Compose v2 when the
# plugin is there, else docker-compose 1.29 (COMPOSE="docker-compose" forces one), and the classic
# builder unless DOCKER_BUILDKIT says otherwise: the classic builder needs no buildx plugin.
# Never passes --pull: base images may exist only locally.
set -euo pipefail
cd "$(dirname "$0")/.."
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE=docker-compose; fi
fi
# Compose interpolates the whole file, secrets included, even to build; no image holds them.
export EAGLET_REDIS_PASSWORD=${EAGLET_REDIS_PASSWORD:-unused-by-the-build}
export EAGLET_API_TOKEN=${EAGLET_API_TOKEN:-unused-by-the-build}
$COMPOSE "$@" --profile base build base
$COMPOSE "$@" build
