#!/bin/sh
# deploy/compose.d/sentinel.sh: starts one Redis Sentinel of docker-compose.yml's `sentinel` profile
# (redis image, as root until the image's entrypoint drops to the `redis` user).
#
# Sentinel rewrites its config file as it learns the topology (replicas, the other Sentinels, the
# current primary after a failover), so the config lives in the container's writable /data, written
# here on the first start only; a restarted Sentinel resumes from what it had learned. To start
# over (e.g. after changing WALLETLOCK_REDIS_ADMIN_PASSWORD):
#   docker compose --profile sentinel up -d --force-recreate --renew-anon-volumes redis-sentinel-1 ...
#
# Compose names every container by DNS, so the Sentinels monitor `redis` by name, announce
# themselves by name (SENTINEL_ANNOUNCE, e.g. redis-sentinel-1), and give clients names, not
# container addresses that change when a container is recreated. They log in to the data nodes as
# `admin` (deploy/compose.d/secrets.sh writes the ACL); clients reach the Sentinels themselves without
# a password, which is why no Sentinel port is published.
set -eu
conf=/data/sentinel.conf
: "${SENTINEL_ANNOUNCE:?SENTINEL_ANNOUNCE is empty}"
: "${WALLETLOCK_REDIS_ADMIN_PASSWORD:?WALLETLOCK_REDIS_ADMIN_PASSWORD is empty}"
master=${SENTINEL_MASTER:-walletlock}

if [ ! -s "$conf" ]; then
  umask 077
  # resolve-hostnames must come before `monitor`, which names the primary by host name.
  cat >"$conf.new" <<EOF
port 26379
dir /data
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $SENTINEL_ANNOUNCE
sentinel monitor $master redis 6379 2
sentinel auth-user $master admin
sentinel auth-pass $master $WALLETLOCK_REDIS_ADMIN_PASSWORD
sentinel down-after-milliseconds $master 5000
sentinel failover-timeout $master 10000
sentinel parallel-syncs $master 1
EOF
  mv "$conf.new" "$conf"
fi
# The image's entrypoint hands /data to the redis user and drops root before it runs redis-server.
exec docker-entrypoint.sh redis-server "$conf" --sentinel
