# shellcheck shell=bash
# The Citus extension, for `deploy/local up --postgres citus` and the tests' Citus topology
# (docs/operating/citus.md): built from the vendored source (deploy/vendor, see its README) once per machine
# into ~/.cache/walletlock/citus, and installed into the Postgres on this machine from that cache.
# Sourced after deploy/lib.sh.

wl_citus_version=13.2.2

# wl_citus_cache: where the build of this Citus for this Postgres is kept: stage/ holds what
# `make install` writes (DESTDIR), so installing again (a fresh Postgres package, a container) is a
# copy, not a build.
wl_citus_cache() {
  local server; server=$(dpkg-query -W -f '${Version}' postgresql-15 2>/dev/null)
  echo "${XDG_CACHE_HOME:-$HOME/.cache}/walletlock/citus/$wl_citus_version-pg$server"
}

# wl_citus_installed: the installed Postgres loads the cached build's citus.so.
wl_citus_installed() {
  local lib; lib=$(wl_pg_bindir)/../lib/citus.so
  [ -f "$lib" ] && cmp -s "$lib" "$(wl_citus_cache)/stage/usr/lib/postgresql/15/lib/citus.so"
}

# wl_citus_install: Citus in the installed Postgres 15, built first if the cache has no build.
# Debian's server and its headers must be the same release (the vendored patch is for 15.20's
# exported have_createdb_privilege), so both are installed together.
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

# wl_citus_settings: the settings every node of a Citus cluster runs with (for wl_start_postgres):
# the extension preloaded, prepared transactions for the two-phase commit of a transaction that
# writes on two workers (a transfer between wallets placed apart), and logical WAL so shards can
# move to a new worker while they take writes (citus_rebalance_start). The nodes reach each other
# over their Unix sockets (wl_citus_join), where libpq uses no TLS: without `sslmode=disable`,
# Citus would turn TLS on with a self-signed certificate that no client verifies.
# A worker that crashed between a transfer's PREPARE and its COMMIT PREPARED comes back holding
# the transfer's wallet rows in the prepared transaction, until the coordinator's recovery
# finishes it; by default that runs once a minute, a minute in which every payment of those
# wallets times out. Every second, it costs the coordinator one query per worker.
wl_citus_settings() {
  printf '%s\n' shared_preload_libraries=citus max_prepared_transactions=200 wal_level=logical \
    citus.node_conninfo=sslmode=disable citus.recover_2pc_interval=1s
}

# wl_citus_join DATABASE COORDINATOR WORKER...: makes DATABASE a Citus cluster, each node given as
# DIR:PORT (its wl_start_postgres directory, whose socket lets the superuser in, and its port): the
# extension in DATABASE on every node (the database made where missing), the coordinator
# registered as itself, the coordinator's login roles made on each worker, and each worker added,
# which copies the distributed objects to it. Safe to run again.
wl_citus_join() {
  local database=$1 coordinator=$2; shift 2
  local node
  for node in "$coordinator" "$@"; do
    wl_psql "$node" postgres -tAc "select 1 from pg_database where datname = '$database'" | grep -q 1 ||
      wl_psql "$node" postgres -qc "create database \"$database\""
    wl_psql "$node" "$database" -qc "create extension if not exists citus"
  done
  # Citus copies to a worker only the roles its distributed objects depend on (a table's owner),
  # not the others, such as an app role that only gets grants later, which then fail on the
  # workers: every login role of the coordinator is made on each worker too, without a password
  # (only the coordinator connects to a worker, over its socket).
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
  # Each node by its socket directory: the nodes connect to each other as the user of the session
  # at hand, which the socket lets in without a password (TCP clients must give one).
  wl_psql "$coordinator" "$database" -qAtc "select citus_set_coordinator_host('${coordinator%:*}', ${coordinator##*:})" >/dev/null
  for node in "$@"; do
    wl_psql "$coordinator" "$database" -qAtc "select citus_add_node('${node%:*}', ${node##*:})" >/dev/null
  done
}
