#!/bin/sh
# The redis stand-in's entrypoint, as the official image's: options or a .conf mean redis-server,
# root is dropped, and protected mode is off (the official build's default; the ACL guards it).
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
