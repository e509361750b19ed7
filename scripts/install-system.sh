#!/usr/bin/env bash
# Installs the Debian packages named as arguments, those whose command is missing: each package here
# has a command of its own name (redis-server, chromium). `make redis` asks for redis-server, which the
# demo needs; `make test` also asks for chromium, which only the gateway page's tests run.
set -euo pipefail
need=()
for package in "$@"; do
  command -v "$package" >/dev/null || need+=("$package")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  echo "installing Debian packages: ${need[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi
