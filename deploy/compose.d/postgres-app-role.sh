#!/bin/sh
# deploy/compose.d/postgres-app-role.sh: run (sourced: no exit) by the postgres image on an empty
# volume: the replicas' login role walletlock_app, owning nothing (`migrate --app-role` grants it
# what it needs). Run again, it sets the password:
#   docker compose exec postgres sh /docker-entrypoint-initdb.d/10-walletlock-app-role.sh
psql -v ON_ERROR_STOP=1 -X -q --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-postgres}" \
  -v app_password="${WALLETLOCK_APP_PG_PASSWORD:?WALLETLOCK_APP_PG_PASSWORD is empty}" <<'SQL'
select format('create role walletlock_app login password %L', :'app_password')
  where not exists (select from pg_roles where rolname = 'walletlock_app') \gexec
select format('alter role walletlock_app login password %L', :'app_password') \gexec
SQL
