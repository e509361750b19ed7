#!/usr/bin/env bash
# Makes sure a Redis answers on 127.0.0.1:6379 (or $EAGLET_REDIS_PORT): installs Debian's redis-server if
# missing and starts one (files in var/redis) if none answers. The tests start their own, on other ports.
# A thin wrapper: the starting is eaglet.shared.redisserver's, run with the venv's Python (PYTHON), which
# `make redis` creates first.
set -euo pipefail
bash "$(dirname "$0")/install-system.sh" redis-server
"${PYTHON:-.venv/bin/python}" -m eaglet.shared.redisserver --port "${EAGLET_REDIS_PORT:-6379}" --dir var/redis
