# The stand-in for nginx:1.28-alpine where public images cannot be pulled (deploy/compose builds it
# from Debian's packages: nginx 1.22). nginx 1.22 has no `resolver` inside `upstream` and no
# `server ... resolve`, which deploy/compose.d/upstream.conf uses to follow `--scale`; the entrypoint
# (nginx-follow-dns.sh) does that job instead: it resolves the name itself, writes the addresses
# into a copy of upstream.conf, and reloads nginx when they change. nginx.conf, listen.conf and
# status_listen.conf are used as mounted.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

# The stand-ins take what Debian 12 ships: its point releases move the versions.
# hadolint ignore=DL3008
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx >/dev/null \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/* /etc/nginx/conf.d/*
COPY nginx-follow-dns.sh /usr/local/bin/docker-entrypoint.sh
ENTRYPOINT ["docker-entrypoint.sh"]
EXPOSE 8080
# As the official image: SIGQUIT, nginx's graceful stop (the entrypoint passes it on).
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
