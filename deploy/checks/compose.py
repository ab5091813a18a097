#!/usr/bin/env python3
"""deploy/checks/compose.py: what docker-compose.yml must say once rendered, for deploy/check-deploy.

    python3 deploy/checks/compose.py COMPOSE.yml COMPOSE_SENTINEL.yml deploy/defaults.env

(a python3 with PyYAML). COMPOSE.yml is `docker-compose config` with every profile and passwords of
the check's own (check-pg-secret, check-app-pg-secret, check-redis-secret,
check-redis-admin-secret), so it can see where each one ends up; COMPOSE_SENTINEL.yml the same
with WALLETLOCK_REDIS_SCHEME and WALLETLOCK_REDIS_HOSTS as the file's header documents them for
the sentinel profile. Checked: no published port but nginx's 127.0.0.1:8080 (and Prometheus/Grafana on
loopback); the secrets step and the token file; Postgres's owner and app roles; the Redis ACL as
deploy/lib.sh's wl_redis_acl writes it, the replicas and Sentinels; the app's settings against
deploy/defaults.env and its grace period; nginx, k6, and the observability profile. The scripts
and files the services mount are read from the repository. Prints one line per problem and exits
1 if there is any.
"""

import re
import sys

from common import Problems, env_file, load_yaml, read, seconds

SENTINELS = ("redis-sentinel-1", "redis-sentinel-2", "redis-sentinel-3")
REDIS_REPLICAS = ("redis-replica-1", "redis-replica-2")


def mounts(service):
    """{target: (source, read_only)} for every volume of a service, short or long syntax."""
    found = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            found[v["target"]] = (str(v.get("source", "")), bool(v.get("read_only")))
        else:
            parts = str(v).split(":")
            found[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return found


def flag(command, name):
    """The value after `name` in a command list (None if absent)."""
    return command[command.index(name) + 1] if name in command and command.index(name) + 1 < len(command) else None


def acl_lines(text, pattern):
    return [re.sub(r"^echo \"|\"$", "", line.strip()) for line in text.splitlines() if re.search(pattern, line)]


def acl_rules(line):
    """A `user NAME on <password> rules...` line without its password part."""
    return re.sub(r'\s(>\S+|#\$\(sha256 "\$\w+"\))', "", line).split()[2:]


def published(service):
    return [str(p) if not isinstance(p, dict) else f"{p.get('host_ip', '')}:{p.get('published')}:{p.get('target')}"
            for p in service.get("ports", [])]


def check_services(services, need):
    """Which services there are, which publish a port, which have a health check."""
    need(set(services) == {"secrets", "postgres", "redis", "redis-functions", "redis-functions-keeper", "migrate", "app", "nginx", "k6", "prometheus", "nginx-exporter",
                           "grafana", *REDIS_REPLICAS, *SENTINELS},
         f"services are {sorted(services)}")
    for name, service in services.items():
        if name not in ("nginx", "prometheus", "grafana"):
            need(not service.get("ports"), f"{name} publishes a port; only nginx may (and Prometheus/Grafana on loopback)")
    for name in ("postgres", "redis", "app", *REDIS_REPLICAS, *SENTINELS):
        need("healthcheck" in services[name], f"{name} has no healthcheck")


def check_secrets(services, need, secrets_script, uid):
    """The secrets step: a one-shot shell that runs deploy/compose.d/secrets.sh on the `secrets` volume."""
    secrets = services["secrets"]
    env = services["app"]["environment"]
    secrets_mounts = mounts(secrets)
    script_at = next((t for t, (src, ro) in secrets_mounts.items() if src.endswith("/deploy/compose.d/secrets.sh") and ro), None)
    need(script_at is not None and secrets.get("command") == ["sh", script_at],
         "secrets must run deploy/compose.d/secrets.sh, mounted read-only")
    secrets_dir = secrets["environment"].get("SECRETS_DIR", "/secrets")
    need(secrets_mounts.get(secrets_dir, ("", True)) == ("secrets", False), f"secrets must mount the `secrets` volume writable at {secrets_dir}")
    need(re.match(r"(alpine|busybox):", secrets.get("image", "")), f"secrets image {secrets.get('image')}: a small image with a shell")
    need(secrets.get("restart") == "no" and not secrets.get("profiles"), "secrets is a one-shot step of the default stack")
    need(secrets["environment"].get("WALLETLOCK_REDIS_PASSWORD") == "check-redis-secret"
         and secrets["environment"].get("WALLETLOCK_REDIS_ADMIN_PASSWORD") == "check-redis-admin-secret",
         "secrets must get both Redis passwords (it writes the ACL)")
    need(secrets["environment"].get("REDIS_KEY_PREFIX") == env.get("REDIS_KEY_PREFIX"),
         "secrets must write the ACL for the replicas' REDIS_KEY_PREFIX")
    need(uid and re.search(rf"^app_uid={uid.group(1)}\b", secrets_script, re.MULTILINE),
         "secrets.sh must hand the token file to the image's USER uid")


def check_tokens(services, need, secrets_script):
    """The replicas: the token file from the secrets volume, after the secrets step."""
    app = services["app"]
    env = app["environment"]
    tokens_file = env.get("API_TOKENS_FILE", "")
    app_mounts = mounts(app)
    need(tokens_file and any(tokens_file.startswith(t.rstrip("/") + "/") and src == "secrets" and ro
                             for t, (src, ro) in app_mounts.items()),
         f"app's API_TOKENS_FILE ({tokens_file!r}) must be in the `secrets` volume, mounted read-only")
    need(tokens_file.rsplit("/", 1)[-1] and f"tokens=$dir/{tokens_file.rsplit('/', 1)[-1]}" in secrets_script,
         "app's API_TOKENS_FILE is not the file secrets.sh writes")
    need("API_TOKENS" not in env, "app must take its tokens from API_TOKENS_FILE, not an inline API_TOKENS")
    need(app["depends_on"].get("secrets", {}).get("condition") == "service_completed_successfully",
         "app must wait for the secrets step")


def check_postgres(services, need):
    """Postgres: the owner migrates and grants; the replicas log in as the app role, made by the init script."""
    pg, migrate, app = (services[n] for n in ("postgres", "migrate", "app"))
    env = app["environment"]
    need(pg["environment"].get("POSTGRES_PASSWORD") == "check-pg-secret", "POSTGRES_PASSWORD does not come from WALLETLOCK_PG_PASSWORD")
    need(pg["environment"].get("WALLETLOCK_APP_PG_PASSWORD") == "check-app-pg-secret",
         "postgres's init script does not get WALLETLOCK_APP_PG_PASSWORD")
    pg_mounts = mounts(pg)
    need(any(t == "/var/lib/postgresql/data" for t in pg_mounts), "postgres has no data volume")
    need(any(t.startswith("/docker-entrypoint-initdb.d/") and t.endswith(".sh") and src.endswith("/deploy/compose.d/postgres-app-role.sh") and ro
             for t, (src, ro) in pg_mounts.items()),
         "postgres must mount deploy/compose.d/postgres-app-role.sh read-only into /docker-entrypoint-initdb.d")
    init_script = read("deploy/compose.d/postgres-app-role.sh")
    need("create role walletlock_app login password" in init_script and "not exists (select from pg_roles where rolname = 'walletlock_app')" in init_script
         and "WALLETLOCK_APP_PG_PASSWORD" in init_script,
         "postgres-app-role.sh must create walletlock_app (if missing) with WALLETLOCK_APP_PG_PASSWORD")
    need("pg_isready" in " ".join(pg["healthcheck"]["test"]), "postgres healthcheck is not pg_isready")

    owner_url = f"postgres://{pg['environment'].get('POSTGRES_USER')}:check-pg-secret@postgres:5432/{pg['environment'].get('POSTGRES_DB')}"
    need(migrate["environment"].get("DATABASE_URL") == owner_url, "migrate's DATABASE_URL must be the owner's (POSTGRES_USER)")
    app_role = flag(migrate.get("command", []), "--app-role") or migrate["environment"].get("APP_ROLE")
    need(migrate.get("command", [None])[0] == "migrate" and app_role == "walletlock_app",
         f"migrate must run `migrate --app-role walletlock_app` (or APP_ROLE), runs {migrate.get('command')} with APP_ROLE={migrate['environment'].get('APP_ROLE')}")
    need(migrate.get("restart") == "no", "migrate must not restart")
    need(migrate["depends_on"].get("postgres", {}).get("condition") == "service_healthy", "migrate must wait for a healthy postgres")
    need(migrate.get("image") == app.get("image") and migrate.get("build") == app.get("build"), "migrate and app must run the same image")
    need(str(app["build"].get("dockerfile", "")).endswith("deploy/Dockerfile"), "app is not built from deploy/Dockerfile")
    need(env.get("DATABASE_URL") == "postgres://walletlock_app:check-app-pg-secret@postgres:5432/walletlock",
         "app's DATABASE_URL must log in as walletlock_app with WALLETLOCK_APP_PG_PASSWORD")


def check_redis(services, need, secrets_script):
    """Redis: the ACL from the secrets volume (no requirepass, no default user), as deploy/local's."""
    redis, app = services["redis"], services["app"]
    env = app["environment"]
    lib = read("deploy/lib.sh")
    for user in ("default", "admin", "walletlock"):
        ours = [acl_rules(l) for l in acl_lines(secrets_script, rf"^\s*echo \"user {user} ")]
        theirs = [acl_rules(l) for l in acl_lines(lib, rf"^\s*echo \"user {user} ")]
        need(ours and ours == theirs, f"the ACL of user {user} in secrets.sh differs from wl_redis_acl in deploy/lib.sh: {ours} vs {theirs}")
    need(re.search(r"user walletlock on #\$\(sha256 \"\$WALLETLOCK_REDIS_PASSWORD\"\)", secrets_script)
         and re.search(r"user admin on #\$\(sha256 \"\$WALLETLOCK_REDIS_ADMIN_PASSWORD\"\)", secrets_script),
         "secrets.sh must give walletlock and admin the hashes of their passwords")
    acl_file = None
    for name in ("redis", *REDIS_REPLICAS):
        node = services[name]
        command = node.get("command", [])
        acl = flag(command, "--aclfile") or ""
        acl_file = acl_file or acl
        need("--requirepass" not in command, f"{name}: --requirepass; the ACL file has the users")
        need(acl.endswith("/redis-users.acl") and acl == acl_file
             and any(acl.startswith(t.rstrip("/") + "/") and src == "secrets" and ro for t, (src, ro) in mounts(node).items()),
             f"{name} must load redis-users.acl from the `secrets` volume, mounted read-only")
        need(flag(command, "--masteruser") == "admin" and flag(command, "--masterauth") == "check-redis-admin-secret",
             f"{name} must replicate as admin (WALLETLOCK_REDIS_ADMIN_PASSWORD)")
        need(flag(command, "--replica-announce-ip") == name, f"{name} must announce itself as {name}")
        need(flag(command, "--save") == "" and flag(command, "--appendonly") == "no", f"{name}: no persistence")
        need(node["environment"].get("REDISCLI_AUTH") == "check-redis-admin-secret", f"{name}: REDISCLI_AUTH is not the admin password")
        health = " ".join(node["healthcheck"]["test"])
        need("redis-cli" in health and "--user admin" in health and "PONG" in health, f"{name}: healthcheck must be redis-cli --user admin ping, PONG only")
    need(redis["depends_on"].get("secrets", {}).get("condition") == "service_completed_successfully", "redis must wait for the secrets step (the ACL)")
    need(not redis.get("profiles") and "--replicaof" not in redis["command"], "redis is the default stack's primary")
    need(env.get("REDIS_URL") == "redis://walletlock:check-redis-secret@redis:6379", f"app's REDIS_URL {env.get('REDIS_URL')!r}")
    for name in ("redis", *REDIS_REPLICAS):
        need(flag(services[name].get("command", []), "--busy-reply-threshold") == "500",
             f"{name}: --busy-reply-threshold 500 bounds how long a script holds Redis")
    functions = services["redis-functions"]
    need(functions.get("command") == ["redis-functions"] and functions.get("image") == app.get("image"),
         "redis-functions must run `walletlock redis-functions` from the app's image")
    need(functions["environment"].get("REDIS_URL") == "redis://admin:check-redis-admin-secret@redis:6379",
         f"redis-functions must load as admin: REDIS_URL {functions['environment'].get('REDIS_URL')!r}")
    need(functions.get("restart") == "no" and functions["depends_on"].get("redis", {}).get("condition") == "service_healthy",
         "redis-functions is a one shot after a healthy redis")
    need(app["depends_on"].get("redis-functions", {}).get("condition") == "service_completed_successfully",
         "app must wait for the lease scripts to be loaded")
    keeper = services["redis-functions-keeper"]
    need(keeper.get("command") == ["redis-functions", "--keep", "1s"] and keeper.get("image") == app.get("image"),
         "redis-functions-keeper must run `walletlock redis-functions --keep 1s` from the app's image")
    need(keeper["environment"].get("REDIS_URL") == functions["environment"].get("REDIS_URL"),
         "redis-functions-keeper must load as admin, as redis-functions does")
    need(keeper.get("restart") == "unless-stopped",
         "redis-functions-keeper stays up: a Redis restarted without persistence needs it")


def check_sentinel(services, need, sentinel_config):
    """The sentinel profile: two replicas of redis and three Sentinels, nothing published."""
    for name in REDIS_REPLICAS:
        node = services[name]
        need(node.get("profiles") == ["sentinel"], f"{name} must be in the sentinel profile only")
        command = node.get("command", [])
        need(flag(command, "--replicaof") == "redis" and command[command.index("--replicaof") + 2] == "6379",
             f"{name} must be --replicaof redis 6379")
        need(node["depends_on"].get("redis", {}).get("condition") == "service_healthy", f"{name} must wait for a healthy redis")
    sentinel_script = read("deploy/compose.d/sentinel.sh")
    master = re.search(r"^master=\$\{SENTINEL_MASTER:-(\w+)\}", sentinel_script, re.MULTILINE)
    master = master.group(1) if master else None
    for line in ("port 26379", "sentinel resolve-hostnames yes", "sentinel announce-hostnames yes",
                 "sentinel announce-ip $SENTINEL_ANNOUNCE", "sentinel monitor $master redis 6379 2",
                 "sentinel auth-user $master admin", "sentinel auth-pass $master $WALLETLOCK_REDIS_ADMIN_PASSWORD",
                 "sentinel down-after-milliseconds $master 5000", "sentinel failover-timeout $master 10000"):
        need(re.search(rf"^{re.escape(line)}$", sentinel_script, re.MULTILINE), f"sentinel.sh must write `{line}`")
    need(sentinel_script.find("sentinel resolve-hostnames yes") < sentinel_script.find("sentinel monitor"),
         "sentinel.sh: resolve-hostnames must come before monitor")
    need(re.search(r"^exec docker-entrypoint\.sh redis-server \"\$conf\" --sentinel$", sentinel_script, re.MULTILINE)
         and re.search(r"^conf=/data/", sentinel_script, re.MULTILINE) and 'if [ ! -s "$conf" ]' in sentinel_script,
         "sentinel.sh must write its config once into /data (writable: Sentinel rewrites it) and run redis-server ... --sentinel")
    for name in SENTINELS:
        node = services[name]
        need(node.get("profiles") == ["sentinel"], f"{name} must be in the sentinel profile only")
        need(str(node.get("image", "")).startswith("redis:"), f"{name} must run the redis image")
        at = next((t for t, (src, ro) in mounts(node).items() if src.endswith("/deploy/compose.d/sentinel.sh") and ro), None)
        need(at is not None and node.get("command") == ["sh", at], f"{name} must run deploy/compose.d/sentinel.sh, mounted read-only")
        need(node["environment"].get("SENTINEL_ANNOUNCE") == name, f"{name} must announce itself as {name}")
        need(node["environment"].get("WALLETLOCK_REDIS_ADMIN_PASSWORD") == "check-redis-admin-secret", f"{name} must log in to the data nodes as admin")
        need(node["depends_on"].get("redis", {}).get("condition") == "service_healthy", f"{name} must wait for a healthy redis")
    sentinel_url = sentinel_config["services"]["app"]["environment"].get("REDIS_URL", "")
    m = re.fullmatch(r"redis\+sentinel://walletlock:check-redis-secret@([^/]+)/(\w+)", sentinel_url)
    need(m and sorted(h.rsplit(":", 1)[0] for h in m.group(1).split(",")) == sorted(SENTINELS)
         and all(h.endswith(":26379") for h in m.group(1).split(",")) and m.group(2) == master,
         f"the documented sentinel variables make REDIS_URL {sentinel_url!r}, not redis+sentinel://walletlock:<pw>@<the 3 sentinels>:26379/{master}")


def check_app(services, need, defaults):
    """The replicas' settings, health check, dependencies and grace period."""
    app = services["app"]
    env = app["environment"]
    need(env.get("LISTEN_ADDR") == "0.0.0.0:8080", "app's LISTEN_ADDR")
    need(env.get("LOG_FORMAT") == "json", "app's LOG_FORMAT")
    need("REPLICA_NAME" not in env, "REPLICA_NAME must stay unset (each container names itself)")
    for key, value in defaults.items():
        need(str(env.get(key)) == value, f"app's {key} is {env.get(key)!r}, deploy/defaults.env says {value!r}")
    need("container_name" not in app, "app has a container_name: --scale would fail")
    need(app.get("deploy", {}).get("replicas") == 3, "app's deploy.replicas is not 3")
    need(app.get("healthcheck", {}).get("test") == ["CMD", "walletlock", "probe", "http://127.0.0.1:8080/readyz"], "app's healthcheck")
    need(app["depends_on"].get("migrate", {}).get("condition") == "service_completed_successfully", "app must wait for the migration")
    need(app["depends_on"].get("redis", {}).get("condition") == "service_healthy", "app must wait for a healthy redis")
    drain = 2 * seconds(defaults["SHUTDOWN_GRACE"]) + seconds(defaults["LEASE_TTL"])
    need(seconds(app.get("stop_grace_period", "10s")) > drain,
         f"app's stop_grace_period must exceed 2 x SHUTDOWN_GRACE + LEASE_TTL = {drain:g}s")


def check_nginx(services, need):
    """nginx: an image new enough for upstream `resolve`, the only published port, its files read-only."""
    nginx = services["nginx"]
    tag = nginx["image"].split(":", 1)[1] if ":" in nginx["image"] else "latest"
    version = tuple(int(n) for n in re.findall(r"\d+", tag.split("-")[0]))
    need(nginx["image"].startswith("nginx:") and version >= (1, 27, 3), f"nginx image {nginx['image']}: needs >= 1.27.3 for upstream `resolve`")
    ports = [str(p) for p in nginx.get("ports", [])]
    need(ports == ["127.0.0.1:8080:8080/tcp"], f"nginx must publish 127.0.0.1:8080:8080 by default, publishes {ports}")
    nginx_mounts = {v.split(":")[1]: v for v in nginx.get("volumes", [])}
    for target, source in (("/etc/nginx/nginx.conf", "/nginx.conf"),
                           ("/etc/nginx/upstream.conf", "/deploy/compose.d/upstream.conf"),
                           ("/etc/nginx/listen.conf", "/deploy/compose.d/listen.conf"),
                           ("/etc/nginx/status_listen.conf", "/deploy/compose.d/status_listen.conf")):
        volume = nginx_mounts.get(target, "")
        need(volume.split(":")[0].endswith(source) and volume.endswith(":ro"), f"nginx must mount .{source} at {target} read-only")
    need(nginx["depends_on"].get("app", {}).get("condition") == "service_healthy", "nginx must wait for healthy replicas")


def check_k6(services, need, uid):
    """k6, in the loadtest profile, with the replicas' token."""
    k6 = services["k6"]
    tokens_file = services["app"]["environment"].get("API_TOKENS_FILE", "")
    need(k6.get("command") == ["run", "/loadtest/k6/hot.js"], "k6's command must run loadtest/k6/$SCENARIO.js")
    need(k6["environment"].get("BASE_URL") == "http://nginx:8080", "k6's BASE_URL")
    need(any(v.endswith("/loadtest:/loadtest:ro") for v in k6.get("volumes", [])), "k6 must mount ./loadtest read-only")
    need(str(k6.get("user", "")).split(":")[0] == (uid.group(1) if uid else None)
         and tokens_file.rsplit("/", 1)[-1] and any(tokens_file.rsplit("/", 1)[-1] in str(a) and "API_TOKEN=" in str(a) for a in k6.get("entrypoint", []))
         and any(src == "secrets" and ro for src, ro in mounts(k6).values()),
         "k6 must read the token file (as the replicas' uid, the secrets volume read-only) into API_TOKEN")


def check_observability(services, need):
    """The observability profile: Prometheus, Grafana and the nginx exporter, none of them in the default
    stack, published on the host's loopback only."""
    prom, grafana, exporter = (services[n] for n in ("prometheus", "grafana", "nginx-exporter"))
    for name in ("prometheus", "grafana", "nginx-exporter"):
        need(services[name].get("profiles") == ["observability"], f"{name} must be in the observability profile only")
    for service, port in ((prom, 9090), (grafana, 3000)):
        ports = published(service)
        need(len(ports) == 1 and re.fullmatch(rf"127\.0\.0\.1:{port}:{port}(/tcp)?", ports[0]),
             f"{service['image']} must publish 127.0.0.1:{port}:{port} only, publishes {ports}")
    need(not exporter.get("ports"), "nginx-exporter publishes a port")
    need(prom["image"].startswith("prom/prometheus:v2."),
         f"prometheus image {prom['image']}: a pinned v2 (the config is checked with Debian's promtool 2.42)")
    config_flag = next((a.split("=", 1)[1] for a in prom.get("command", []) if a.startswith("--config.file=")), "")
    need(any(v.split(":")[0].endswith("/deploy/prometheus/prometheus.yml") and v.split(":")[1] == config_flag
             and v.endswith(":ro") for v in prom.get("volumes", [])),
         f"prometheus must mount deploy/prometheus/prometheus.yml read-only at its --config.file ({config_flag or 'none'})")
    need(exporter.get("network_mode") == "service:nginx",
         "nginx-exporter must share nginx's network namespace (network_mode: service:nginx)")
    status_listen = read("deploy/compose.d/status_listen.conf")
    scrape_uri = next((a.split("=", 1)[1] for a in exporter.get("command", []) if a.startswith("--nginx.scrape-uri=")), "")
    m = re.search(r"^listen (127\.0\.0\.1:\d+);", status_listen, re.MULTILINE)
    need(m is not None and scrape_uri == f"http://{m.group(1)}/nginx_status",
         f"nginx-exporter's --nginx.scrape-uri {scrape_uri!r} is not stub_status as deploy/compose.d/status_listen.conf has it")
    grafana_mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana.get("volumes", [])}
    for sub in ("datasources", "dashboards"):
        need(grafana_mounts.get(f"/etc/grafana/provisioning/{sub}", "").endswith(f"/deploy/grafana/provisioning/{sub}"),
             f"grafana must mount deploy/grafana/provisioning/{sub}")
    dashboard_mount = next((t for t, s in grafana_mounts.items() if s.endswith("/deploy/grafana/walletlock-dashboard.json")), None)
    need(dashboard_mount is not None, "grafana must mount deploy/grafana/walletlock-dashboard.json")
    provider = load_yaml("deploy/grafana/provisioning/dashboards/walletlock.yml")
    paths = [p.get("options", {}).get("path") for p in provider.get("providers", [])]
    need(dashboard_mount is not None and any(dashboard_mount.startswith(f"{p.rstrip('/')}/") for p in paths if p),
         f"the dashboard provider's path {paths} does not hold the mounted dashboard ({dashboard_mount})")
    need(grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH") == dashboard_mount,
         "grafana's home dashboard is not the mounted one")
    need(grafana["environment"].get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") == "Viewer", "anonymous Grafana users must be Viewers at most")
    datasources = load_yaml("deploy/grafana/provisioning/datasources/prometheus.yml")["datasources"]
    need(any(d.get("type") == "prometheus" and d.get("url") == "http://prometheus:9090" and d.get("uid") for d in datasources),
         "the provisioned datasource must be the compose prometheus (http://prometheus:9090), with a uid")


def check(config, sentinel_config, defaults):
    problems = Problems()
    need = problems.need
    services = config["services"]
    secrets_script = read("deploy/compose.d/secrets.sh")
    uid = re.search(r"^USER (\d+):", read("deploy/Dockerfile"), re.MULTILINE)
    check_services(services, need)
    check_secrets(services, need, secrets_script, uid)
    check_tokens(services, need, secrets_script)
    check_postgres(services, need)
    check_redis(services, need, secrets_script)
    check_sentinel(services, need, sentinel_config)
    check_app(services, need, defaults)
    check_nginx(services, need)
    check_k6(services, need, uid)
    check_observability(services, need)
    return problems


def main(argv):
    if len(argv) != 4:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return check(load_yaml(argv[1]), load_yaml(argv[2]), env_file(argv[3])).report()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
