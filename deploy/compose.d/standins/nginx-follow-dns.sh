#!/usr/bin/env bash
# The nginx stand-in's entrypoint: what nginx >= 1.27.3's `server NAME:PORT resolve` does, for
# nginx 1.22: a copy of upstream.conf with a server per address of NAME, rewritten and reloaded
# (SIGHUP) when they change; an empty answer keeps the last. SIGQUIT and SIGTERM go to nginx.
set -euo pipefail
mounted=/etc/nginx
conf=/run/walletlock-nginx
interval=${NGINX_RESOLVE_INTERVAL:-1}

[ "${1:-}" = nginx ] || exec "$@"

# The name and port of the `server NAME:PORT ... resolve ...;` line.
target=$(awk '$1 == "server" && / resolve[ ;]/ { print $2; exit }' "$mounted/upstream.conf")
[ -n "$target" ] || { echo "$0: no 'server NAME:PORT resolve' line in $mounted/upstream.conf" >&2; exit 1; }
name=${target%:*}

# The addresses NAME has now, sorted, one line.
resolve() { getent ahostsv4 "$name" | awk '{ print $1 }' | sort -u | paste -sd' ' -; }

# render ADDRESSES: the mounted upstream.conf for nginx 1.22, with those addresses.
render() { awk -v servers="$1" -f /usr/local/lib/nginx-upstream.awk "$mounted/upstream.conf"; }

mkdir -p "$conf"
for file in nginx.conf listen.conf status_listen.conf; do cp "$mounted/$file" "$conf/$file"; done
current=""
until current=$(resolve) && [ -n "$current" ]; do
  echo "$0: waiting for $name to resolve" >&2
  sleep "$interval"
done
render "$current" >"$conf/upstream.conf"
echo "$0: upstream $target: $current" >&2

"$@" -c "$conf/nginx.conf" &
nginx_pid=$!
trap 'kill -QUIT "$nginx_pid"' QUIT
trap 'kill -TERM "$nginx_pid"' TERM INT

while kill -0 "$nginx_pid" 2>/dev/null; do
  sleep "$interval" &
  wait $! || true
  latest=$(resolve || true)
  if [ -n "$latest" ] && [ "$latest" != "$current" ]; then
    render "$latest" >"$conf/upstream.conf.new"
    mv "$conf/upstream.conf.new" "$conf/upstream.conf"
    if nginx -t -q -c "$conf/nginx.conf"; then
      kill -HUP "$nginx_pid"
      echo "$0: upstream $target: $latest (was: $current); reloaded" >&2
      current=$latest
    fi
  fi
done
wait "$nginx_pid"
