#!/bin/sh
# deploy/compose.d/postgres-app-role.sh: mounted into the postgres image's /docker-entrypoint-initdb.d,
# which runs it once, when it initialises an empty data volume (as POSTGRES_USER over the local
# socket; the image sources it, so it neither calls `exit` nor changes shell options).
#
# It makes the replicas' role, walletlock_app, with WALLETLOCK_APP_PG_PASSWORD: a login and nothing
# else. It owns nothing; `walletlock migrate --app-role walletlock_app` (the compose `migrate`
# service, running as the owner, POSTGRES_USER) grants it exactly what the replicas need on the
# tables. Run again, it only sets the password, so a volume made before this script existed, or a
# changed password, is brought in line with:
#
#   docker compose exec postgres sh /docker-entrypoint-initdb.d/10-walletlock-app-role.sh
psql -v ON_ERROR_STOP=1 -X -q --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:-postgres}" \
  -v app_password="${WALLETLOCK_APP_PG_PASSWORD:?WALLETLOCK_APP_PG_PASSWORD is empty}" <<'SQL'
select format('create role walletlock_app login password %L', :'app_password')
  where not exists (select from pg_roles where rolname = 'walletlock_app') \gexec
select format('alter role walletlock_app login password %L', :'app_password') \gexec
SQL
