# The stand-in for redis:7-alpine: Debian's Redis 7.0 (Functions, ACLs), `redis` as uid 999 (the
# secrets step hands it the ACL), /data its directory, root dropped by the entrypoint.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

# The stand-ins take what Debian 12 ships: its point releases move the versions.
# hadolint ignore=DL3008
RUN groupadd -r -g 999 redis && useradd -r -g redis -u 999 -d /data -s /usr/sbin/nologin redis \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
ENTRYPOINT ["docker-entrypoint.sh"]
EXPOSE 6379
CMD ["redis-server"]
