#!/bin/sh
# deploy/compose.d/sentinel.sh: one Sentinel of docker-compose.yml's `sentinel` profile, by DNS
# names throughout (SENTINEL_ANNOUNCE), logging in to the data nodes as `admin`. Its config is
# written once into /data, which Sentinel rewrites as it learns the topology; to start over:
#   docker compose --profile sentinel up -d --force-recreate --renew-anon-volumes redis-sentinel-1 ...
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
exec docker-entrypoint.sh redis-server "$conf" --sentinel
