# The stand-in for nginx:1.28-alpine: Debian's nginx 1.22, whose entrypoint (nginx-follow-dns.sh)
# follows `--scale` as upstream `resolve` would (docs/operating/compose-and-kubernetes.md).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

# The stand-ins take what Debian 12 ships: its point releases move the versions.
# hadolint ignore=DL3008
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx >/dev/null \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled/* /etc/nginx/conf.d/*
COPY nginx-follow-dns.sh /usr/local/bin/docker-entrypoint.sh
COPY nginx-upstream.awk /usr/local/lib/nginx-upstream.awk
ENTRYPOINT ["docker-entrypoint.sh"]
EXPOSE 8080
# As the official image: SIGQUIT, nginx's graceful stop (the entrypoint passes it on).
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
