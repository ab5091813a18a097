#!/bin/sh
# deploy/compose.d/standins/redis-entrypoint.sh: the official redis image's entrypoint for the Debian
# stand-in (redis.Dockerfile): options or a .conf file alone mean redis-server; as root, /data is
# handed to `redis` and root is dropped. The official image builds Redis with protected mode off
# (it is reached over the container network, and the ACL guards it); Debian's is on, so it is
# turned off here unless the command says otherwise.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
  set -- redis-server "$@"
fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
  find . \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups -- "$0" "$@"
fi
if [ "$1" = redis-server ]; then
  case " $* " in
    *" --protected-mode "*) ;;
    *) set -- "$@" --protected-mode no ;;
  esac
fi
[ "$(umask)" != 0022 ] || umask 0077
exec "$@"
