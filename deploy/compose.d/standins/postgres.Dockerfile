# The stand-in for postgres:16-alpine: Debian's PostgreSQL 15, with an entrypoint of the official
# image's interface (postgres-entrypoint.sh; docs/operating/compose-and-kubernetes.md).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

# The package makes a cluster of its own (15/main) at install; the entrypoint makes the one in
# $PGDATA, so that one is dropped.
# The stand-ins take what Debian 12 ships: its point releases move the versions.
# hadolint ignore=DL3008
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql-15 >/dev/null \
    && pg_dropcluster 15 main \
    && rm -rf /var/lib/apt/lists/* \
    # As the official image: listen on every interface of the container (initdb copies the sample).
    && sed -ri "s!^#?(listen_addresses)\s*=\s*\S+.*!\1 = '*'!" /usr/share/postgresql/15/postgresql.conf.sample \
    && mkdir -p /docker-entrypoint-initdb.d /var/lib/postgresql/data /var/run/postgresql \
    && chown postgres:postgres /var/lib/postgresql/data /var/run/postgresql \
    && chmod 3777 /var/run/postgresql

ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
ENTRYPOINT ["docker-entrypoint.sh"]
# Postgres's fast shutdown, as the official image.
STOPSIGNAL SIGINT
EXPOSE 5432
CMD ["postgres"]
