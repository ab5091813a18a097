# The stand-in for redis:7-alpine where public images cannot be pulled (deploy/compose builds it
# from Debian's packages: Redis 7.0, which has the Functions and ACLs walletlock uses). As in the
# official image: the `redis` user is uid 999 (the secrets step hands the ACL file to 999), /data is
# the working directory, and the entrypoint drops root before it runs redis-server.
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
