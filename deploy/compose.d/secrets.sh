#!/bin/sh
# deploy/compose.d/secrets.sh: docker-compose.yml's `secrets` step (as root, no network), before
# Redis and the replicas on every `up`, into the `secrets` volume at $SECRETS_DIR:
#   api-tokens       `local:<64 hex>`, made on the first start only, printed on every run; 0400,
#                    owned by the replicas' and k6's uid
#   redis-users.acl  redis-acl.sh's users with the passwords' SHA-256; 0400, owned by redis
set -eu

dir=${SECRETS_DIR:-/secrets}
app_uid=65532 # distroless nonroot: walletlock (deploy/Dockerfile USER 65532:65532)
redis_uid=999 # redis in the redis:7 images, Alpine and Debian alike
prefix=${REDIS_KEY_PREFIX:-walletlock}
: "${WALLETLOCK_REDIS_PASSWORD:?WALLETLOCK_REDIS_PASSWORD is empty}"
: "${WALLETLOCK_REDIS_ADMIN_PASSWORD:?WALLETLOCK_REDIS_ADMIN_PASSWORD is empty}"

umask 077
# Others may reach the files by name (each file's own owner and mode decide), not list them.
chmod 0711 "$dir"

# install_file SRC DEST UID: SRC into place as DEST, owned by UID, mode 0400, atomically.
install_file() {
  chown "$3:$3" "$1"
  chmod 0400 "$1"
  mv -f "$1" "$2"
}

# --- the API token --------------------------------------------------------------------------------
tokens=$dir/api-tokens
if [ ! -s "$tokens" ]; then
  token=$(od -An -v -N32 -tx1 /dev/urandom | tr -d ' \n')
  [ "${#token}" -eq 64 ] || { echo "secrets: could not read 32 random bytes" >&2; exit 1; }
  printf 'local:%s\n' "$token" >"$tokens.new"
  install_file "$tokens.new" "$tokens" "$app_uid"
  echo "secrets: made a new API token for caller \"local\" ($tokens)"
else
  # Kept as it is (more callers, a rotated token); its owner and mode put right.
  chown "$app_uid:$app_uid" "$tokens"
  chmod 0400 "$tokens"
fi
token=$(sed -n 's/^local://p' "$tokens" | head -n 1)
if [ -n "$token" ]; then
  echo "walletlock API token (caller local): $token"
  echo "  curl -H \"authorization: Bearer $token\" http://localhost:8080/wallets/alice"
else
  echo "secrets: $tokens has no caller \"local\"; its callers: $(cut -d: -f1 "$tokens" | grep -v '^#' | paste -sd, -)"
fi

# --- the Redis ACL ----------------------------------------------------------------------------------
sha256() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }
# shellcheck source=deploy/compose.d/redis-acl.sh
. "$(dirname "$0")/redis-acl.sh"
wl_redis_acl_lines "$prefix" "#$(sha256 "$WALLETLOCK_REDIS_PASSWORD")" "#$(sha256 "$WALLETLOCK_REDIS_ADMIN_PASSWORD")" \
  >"$dir/redis-users.acl.new"
install_file "$dir/redis-users.acl.new" "$dir/redis-users.acl" "$redis_uid"
echo "secrets: wrote the Redis ACL (users admin and walletlock, keys {$prefix:*)"
