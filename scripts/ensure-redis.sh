#!/usr/bin/env bash
# Makes sure a Redis answers on 127.0.0.1:6379 (or $EAGLET_REDIS_PORT): installs the system packages
# if missing and starts one if none answers. The tests start their own, on other ports.
set -euo pipefail
port=${EAGLET_REDIS_PORT:-6379}
bash "$(dirname "$0")/install-system.sh"
if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then
  exit 0
fi
mkdir -p var/redis
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --dir "$PWD/var/redis" \
  --appendonly yes --logfile "$PWD/var/redis/redis.log"
for _ in $(seq 50); do
  redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && exit 0
  sleep 0.1
done
echo "redis-server did not answer on port $port; see var/redis/redis.log" >&2
exit 1
