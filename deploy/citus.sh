# shellcheck shell=bash
# Citus for `deploy/local up --postgres citus` and the tests (docs/operating/citus.md): built from
# deploy/vendor once per machine into ~/.cache/walletlock/citus, installed from there. After lib.sh.

wl_citus_version=13.2.2

# wl_citus_cache: the build for this Postgres; stage/ holds what `make install` wrote, to copy again.
wl_citus_cache() {
  local server; server=$(dpkg-query -W -f '${Version}' postgresql-15 2>/dev/null)
  echo "${XDG_CACHE_HOME:-$HOME/.cache}/walletlock/citus/$wl_citus_version-pg$server"
}

# wl_citus_installed: the installed Postgres loads the cached build's citus.so.
wl_citus_installed() {
  local lib; lib=$(wl_pg_bindir)/../lib/citus.so
  [ -f "$lib" ] && cmp -s "$lib" "$(wl_citus_cache)/stage/usr/lib/postgresql/15/lib/citus.so"
}

# wl_citus_install: Citus in the installed Postgres 15, built first if the cache has none. The
# server and its headers are installed together: the vendored patch is for one release.
wl_citus_install() {
  local vendor; vendor=$(cd "$(dirname "${BASH_SOURCE[0]}")/vendor" && pwd)
  local server dev
  server=$(dpkg-query -W -f '${Version}' postgresql-15 2>/dev/null || true)
  dev=$(dpkg-query -W -f '${Version}' postgresql-server-dev-15 2>/dev/null || true)
  if [ -z "$dev" ] || [ "$server" != "$dev" ] || ! dpkg-query -W libkrb5-dev liblz4-dev libzstd-dev \
    libcurl4-openssl-dev make gcc >/dev/null 2>&1; then
    wl_apt_install postgresql-15 postgresql-server-dev-15 libkrb5-dev liblz4-dev libzstd-dev \
      libcurl4-openssl-dev make gcc
  fi
  wl_citus_installed && return 0
  local cache; cache=$(wl_citus_cache)
  if [ ! -f "$cache/stage/usr/lib/postgresql/15/lib/citus.so" ]; then
    wl_log "building Citus $wl_citus_version for PostgreSQL $(dpkg-query -W -f '${Version}' postgresql-15) (once per machine, about a minute on two cores)"
    rm -rf "$cache" && mkdir -p "$cache"
    tar -xzf "$vendor/citus-$wl_citus_version.tar.gz" -C "$cache"
    (
      cd "$cache/citus-$wl_citus_version"
      patch -p1 -s <"$vendor/citus-$wl_citus_version-pg15.20.patch"
      ./configure --quiet PG_CONFIG="$(wl_pg_bindir)/pg_config" >"$cache/build.log" 2>&1
      make -j"$(nproc)" >>"$cache/build.log" 2>&1
      make install DESTDIR="$cache/stage" >>"$cache/build.log" 2>&1
    ) || { tail -n 30 "$cache/build.log" >&2; rm -rf "$cache/stage"; wl_die "building Citus failed (log: $cache/build.log)"; }
    rm -rf "$cache/citus-$wl_citus_version"
  fi
  wl_log "installing Citus $wl_citus_version from $cache"
  wl_as_root cp -a "$cache/stage/." /
  wl_citus_installed || wl_die "Citus did not install into $(wl_pg_bindir)/../lib"
}

# wl_citus_settings: every node's settings (for wl_start_postgres): two-phase commit, logical WAL
# for rebalancing, no TLS over the sockets the nodes use (Citus would self-sign), 2PC recovery
# every second, not every minute, and two shards a worker of the two, not 32: a round writes one
# statement a shard (docs/operating/citus.md).
wl_citus_settings() {
  printf '%s\n' shared_preload_libraries=citus max_prepared_transactions=200 wal_level=logical \
    citus.node_conninfo=sslmode=disable citus.recover_2pc_interval=1s citus.shard_count=4
}

# wl_citus_join DATABASE COORDINATOR WORKER...: makes DATABASE a Citus cluster, each node DIR:PORT
# (its wl_start_postgres directory and port; the nodes reach each other by those sockets): the
# extension everywhere, the coordinator's login roles on each worker, the workers added. Safe to rerun.
wl_citus_join() {
  local database=$1 coordinator=$2; shift 2
  local node
  for node in "$coordinator" "$@"; do
    wl_psql "$node" postgres -tAc "select 1 from pg_database where datname = '$database'" | grep -q 1 ||
      wl_psql "$node" postgres -qc "create database \"$database\""
    wl_psql "$node" "$database" -qc "create extension if not exists citus"
  done
  # Citus copies only the roles its tables depend on; the app role's grants need it everywhere.
  local role
  for node in "$@"; do
    while read -r role; do
      [ -n "$role" ] || continue
      wl_psql "$node" postgres -q -v role="$role" <<'SQL'
select format('create role %I login', :'role') where not exists (select from pg_roles where rolname = :'role') \gexec
SQL
    done < <(wl_psql "$coordinator" postgres -tAc \
      "select rolname from pg_roles where rolcanlogin and not rolsuper and rolname !~ '^pg_'")
  done
  wl_psql "$coordinator" "$database" -qAtc "select citus_set_coordinator_host('${coordinator%:*}', ${coordinator##*:})" >/dev/null
  for node in "$@"; do
    wl_psql "$coordinator" "$database" -qAtc "select citus_add_node('${node%:*}', ${node##*:})" >/dev/null
  done
}
