#!/usr/bin/env bash
# The postgres stand-in's entrypoint: the official image's interface docker-compose.yml uses
# (docs/operating/compose-and-kubernetes.md): on an empty $PGDATA, initdb and the init scripts
# under a socket-only server first, then the real server.
set -Eeo pipefail

init_cluster() {
  : "${POSTGRES_PASSWORD:?the database is uninitialised and POSTGRES_PASSWORD is empty}"
  # POSTGRES_INITDB_ARGS is split into words, as the official image does.
  # shellcheck disable=SC2086
  initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") $POSTGRES_INITDB_ARGS
  printf '\nhost all all all %s\n' "${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}" >>"$PGDATA/pg_hba.conf"

  export PGPASSWORD=$POSTGRES_PASSWORD
  local server_args=("$@")
  [ "${server_args[0]:-}" = postgres ] && server_args=("${server_args[@]:1}")
  server_args+=(-c "listen_addresses=" -p 5432)
  PGUSER=$POSTGRES_USER pg_ctl -D "$PGDATA" -o "$(printf '%q ' "${server_args[@]}")" -w start

  if [ -z "$(sql --dbname postgres -tA -v db="$POSTGRES_DB" <<<"select 1 from pg_database where datname = :'db'")" ]; then
    sql --dbname postgres -v db="$POSTGRES_DB" <<<'create database :"db"'
  fi
  local script
  for script in /docker-entrypoint-initdb.d/*; do
    case $script in
      *.sh)
        if [ -x "$script" ]; then
          echo "$0: running $script"
          "$script"
        else
          echo "$0: sourcing $script"
          # shellcheck disable=SC1090
          . "$script"
        fi
        ;;
      *.sql) echo "$0: running $script"; sql --dbname "$POSTGRES_DB" -f "$script" ;;
      *) echo "$0: ignoring $script" ;;
    esac
  done

  PGUSER=$POSTGRES_USER pg_ctl -D "$PGDATA" -m fast -w stop
  unset PGPASSWORD
  echo "PostgreSQL init process complete; ready for start up."
}

# sql ARG...: psql as the superuser over the unix socket, stopping at the first error.
sql() {
  PGHOST='' PGHOSTADDR='' psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --no-password --no-psqlrc "$@"
}

if [ "${1:0:1}" = - ]; then set -- postgres "$@"; fi
if [ "$1" = postgres ]; then
  export POSTGRES_USER=${POSTGRES_USER:-postgres}
  export POSTGRES_DB=${POSTGRES_DB:-$POSTGRES_USER}
  if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA"
    find "$PGDATA" \! -user postgres -exec chown postgres:postgres '{}' +
    chmod 0700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups -- "${BASH_SOURCE[0]}" "$@"
  fi
  if [ ! -s "$PGDATA/PG_VERSION" ]; then
    init_cluster "$@"
  else
    echo "PostgreSQL Database directory appears to contain a database; Skipping initialization"
  fi
fi
exec "$@"
