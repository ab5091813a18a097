#!/usr/bin/env python3
"""deploy/checks.py: what ties the deployment files together, which no schema checks (check-deploy).

    deploy/checks.py compose COMPOSE.yml COMPOSE_SENTINEL.yml   docker-compose config's output, every
                                                                profile, passwords check-<name>-secret
    deploy/checks.py k8s                                        deploy/k8s
    deploy/checks.py prometheus                                 deploy/prometheus/prometheus.yml

Each holds a file to the others it must agree with (deploy/defaults.env, the scripts it mounts,
deploy/lib.sh, deploy/local, the Dockerfile) rather than to literals of its own. Prints one line
per problem and exits 1 if there is any. Needs PyYAML.
"""

import re
import shlex
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS: list[str] = []


def need(ok, message):
    if not ok:
        PROBLEMS.append(message)


def read(path):
    return (ROOT / path).read_text(encoding="utf-8")


def load(path):
    return yaml.safe_load(read(path))


def search(pattern, path):
    """The first group of `pattern` in the file at `path` (None if it is not there)."""
    m = re.search(pattern, read(path), re.MULTILINE)
    return m.group(1) if m else None


DEFAULTS = dict(line.split("=", 1) for line in read("deploy/defaults.env").splitlines() if line and line[0] != "#")
UID = search(r"^USER (\d+):", "deploy/Dockerfile")
PORT = search(r"^ENV LISTEN_ADDR=\S+:(\d+)$", "deploy/Dockerfile")
PROBE = yaml.safe_load(search(r"^\s+CMD (\[.*\])$", "deploy/Dockerfile") or "[]")  # the image's HEALTHCHECK


def seconds(text):
    """A duration as compose, Kubernetes and walletlock write it (`500ms`, `1m30s`), in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text)))


# A replica drains in at most SHUTDOWN_GRACE twice, then its leases expire: what a stop must wait.
DRAIN = 2 * seconds(DEFAULTS["SHUTDOWN_GRACE"]) + seconds(DEFAULTS["LEASE_TTL"])


def mounts(service):
    """{target: (source, read_only)} for every volume of a rendered service (short or long syntax)."""
    found = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            found[v["target"]] = (str(v.get("source", "")), bool(v.get("read_only")))
        else:
            source, target, *mode = str(v).split(":")
            found[target] = (source, "ro" in ",".join(mode).split(","))
    return found


def mounted(service, source):
    """Where `service` mounts the repository's file `source` read-only (None if it does not)."""
    return next((t for t, (src, ro) in mounts(service).items() if src.endswith("/" + source) and ro), None)


def ports(service):
    """(host address, container port) of each port a rendered service publishes."""
    for p in service.get("ports", []):
        if isinstance(p, dict):
            yield str(p.get("host_ip", "")), str(p.get("target"))
        else:
            parts = str(p).split("/")[0].split(":")
            yield (parts[0] if len(parts) == 3 else ""), parts[-1]


def healthy(service):
    return service.get("healthcheck", {}).get("test", ["NONE"]) != ["NONE"]


def in_volume(service, path, volume):
    """`path` lies in the named `volume`, mounted read-only in `service`."""
    return any(path.startswith(t + "/") and src == volume and ro for t, (src, ro) in mounts(service).items())


def flag(command, name):
    return command[command.index(name) + 1] if name in command[:-1] else None


def depends(service, on):
    return service.get("depends_on", {}).get(on, {}).get("condition")


def compose(services, sentinel_services):
    app, pg, nginx = (services[n] for n in ("app", "postgres", "nginx"))
    env = app["environment"]
    for name, service in services.items():
        for host, port in ports(service):
            need(host == "127.0.0.1", f"{name} publishes {port} beyond the loopback")
        for dep, condition in ((d, c.get("condition")) for d, c in service.get("depends_on", {}).items()):
            if condition == "service_healthy":
                need(healthy(services[dep]), f"{name} waits for {dep}'s health, which it has no check of")
            if condition == "service_completed_successfully":
                need(services[dep].get("restart") == "no", f"{name} waits for {dep} to complete, which restarts")

    # The secrets step writes the token file and the ACL into the `secrets` volume.
    secrets = services["secrets"]
    at = mounted(secrets, "deploy/compose.d/secrets.sh")
    need(at and secrets.get("command") == ["sh", at], "secrets must run deploy/compose.d/secrets.sh, mounted read-only")
    need(at and mounted(secrets, "deploy/compose.d/redis-acl.sh") == at.rsplit("/", 1)[0] + "/redis-acl.sh",
         "secrets.sh must find deploy/compose.d/redis-acl.sh (the ACL deploy/local writes too) beside it")
    need(mounts(secrets).get(secrets["environment"].get("SECRETS_DIR")) == ("secrets", False), "secrets must write the `secrets` volume at SECRETS_DIR")
    need(secrets["environment"].get("REDIS_KEY_PREFIX") == env.get("REDIS_KEY_PREFIX"), "the ACL must cover the replicas' REDIS_KEY_PREFIX")
    need(search(r"^app_uid=(\d+)", "deploy/compose.d/secrets.sh") == UID, "secrets.sh must hand the token file to the Dockerfile's USER")
    tokens = env.get("API_TOKENS_FILE", "")
    need(in_volume(app, tokens, "secrets") and "API_TOKENS" not in env, "app must read API_TOKENS_FILE from the secrets volume")
    need(search(r"^tokens=\$dir/(\S+)", "deploy/compose.d/secrets.sh") == tokens.rsplit("/", 1)[-1], "API_TOKENS_FILE is not the file secrets.sh writes")
    k6 = services["k6"]
    need(str(k6.get("user")).split(":")[0] == UID and in_volume(k6, tokens, "secrets") and tokens in " ".join(k6["entrypoint"]),
         "k6 must read the replicas' token file as their uid")

    # Postgres: the owner migrates and grants; the replicas log in as the app role the init script makes.
    owner, db = pg["environment"]["POSTGRES_USER"], pg["environment"]["POSTGRES_DB"]
    need(pg["environment"].get("POSTGRES_PASSWORD") == "check-pg-secret", "POSTGRES_PASSWORD is not WALLETLOCK_PG_PASSWORD")
    need(pg["environment"].get("WALLETLOCK_APP_PG_PASSWORD") == "check-app-pg-secret", "the init script does not get WALLETLOCK_APP_PG_PASSWORD")
    need((mounted(pg, "deploy/compose.d/postgres-app-role.sh") or "").startswith("/docker-entrypoint-initdb.d/"),
         "postgres must run deploy/compose.d/postgres-app-role.sh from /docker-entrypoint-initdb.d")
    migrate = services["migrate"]
    need(migrate["environment"].get("DATABASE_URL") == f"postgres://{owner}:check-pg-secret@postgres:5432/{db}", "migrate must log in as the owner")
    need(migrate["command"] == ["migrate", "--app-role", "walletlock_app"] and migrate["image"] == app["image"], "migrate must grant walletlock_app, from the app's image")
    need(env.get("DATABASE_URL") == f"postgres://walletlock_app:check-app-pg-secret@postgres:5432/{db}", "app must log in as walletlock_app")

    # Redis: the nodes as deploy/local starts them, the admin loads the scripts.
    local = shlex.split(search(r"local common=\(([^)]*)\)", "deploy/local") or "")
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        node = services[name]
        command = node["command"]
        need(in_volume(node, flag(command, "--aclfile") or "", "secrets") and "--requirepass" not in command, f"{name} must take the ACL from the secrets volume")
        need(flag(command, "--masterauth") == "check-redis-admin-secret" and flag(command, "--replica-announce-ip") == name,
             f"{name} must replicate as admin and announce itself by name")
        for key in (k for k in local if k.startswith("--") and "$" not in (flag(local, k) or "$")):
            need(flag(command, key) == flag(local, key), f"{name}: {key} {flag(command, key)!r}, deploy/local has {flag(local, key)!r}")
        need(name == "redis" or flag(command, "--replicaof") == "redis", f"{name} must replicate redis")
    need(env.get("REDIS_URL") == "redis://walletlock:check-redis-secret@redis:6379", f"app's REDIS_URL {env.get('REDIS_URL')!r}")
    functions, keeper = services["redis-functions"], services["redis-functions-keeper"]
    for service in (functions, keeper):
        need(service["image"] == app["image"] and service["environment"]["REDIS_URL"] == "redis://admin:check-redis-admin-secret@redis:6379",
             "the lease scripts must be loaded by admin, from the app's image")
    need(keeper["command"][:2] == ["redis-functions", "--keep"] and keeper.get("restart") == "unless-stopped", "the keeper must stay up")
    need(all(depends(app, d) for d in ("secrets", "migrate", "redis-functions", "redis")), "app must wait for secrets, migrate, the lease scripts and redis")
    master = search(r"^master=\$\{SENTINEL_MASTER:-(\w+)\}", "deploy/compose.d/sentinel.sh")
    sentinel_port = search(r"^port (\d+)$", "deploy/compose.d/sentinel.sh")
    sentinels = sorted(n for n in services if n.startswith("redis-sentinel-"))
    for name in sentinels:
        at = mounted(services[name], "deploy/compose.d/sentinel.sh")
        need(at and services[name]["command"] == ["sh", at] and services[name]["environment"].get("SENTINEL_ANNOUNCE") == name,
             f"{name} must run deploy/compose.d/sentinel.sh and announce itself by name")
    url = sentinel_services["app"]["environment"].get("REDIS_URL", "")
    need(url == f"redis+sentinel://walletlock:check-redis-secret@{','.join(f'{s}:{sentinel_port}' for s in sentinels)}/{master}",
         f"the header's sentinel variables make REDIS_URL {url!r}")

    # The replicas: deploy/defaults.env, the image's health check, a stop that outlasts a drain.
    for key, value in DEFAULTS.items():
        need(str(env.get(key)) == value, f"app's {key} is {env.get(key)!r}, deploy/defaults.env says {value!r}")
    need("REPLICA_NAME" not in env and "container_name" not in app, "each replica names itself (no REPLICA_NAME, no container_name)")
    need(app["healthcheck"]["test"] == ["CMD", *PROBE], "app's healthcheck is not the Dockerfile's")
    need(seconds(app.get("stop_grace_period", "10s")) > DRAIN, f"app's stop_grace_period must exceed 2 x SHUTDOWN_GRACE + LEASE_TTL = {DRAIN:g}s")

    # nginx: upstream `resolve` needs 1.27.3; it runs the files deploy/local and the tests run.
    version = tuple(int(n) for n in re.findall(r"\d+", nginx["image"].split(":")[-1].split("-")[0]))
    need(nginx["image"].startswith("nginx:") and version >= (1, 27, 3), f"nginx image {nginx['image']}: needs >= 1.27.3")
    for target, source in (("nginx.conf", "nginx.conf"), *((f, f"deploy/compose.d/{f}") for f in ("upstream.conf", "listen.conf", "status_listen.conf"))):
        need(mounted(nginx, source) == f"/etc/nginx/{target}", f"nginx must mount {source} at /etc/nginx/{target}")
    listen = search(r"^listen (\d+)", "deploy/compose.d/listen.conf")
    need([port for _, port in ports(nginx)] == [listen], f"nginx must publish its listen.conf port {listen}")
    need(k6["environment"].get("BASE_URL") == f"http://nginx:{listen}", "k6 must load nginx")

    # Observability: Prometheus with its config, the exporter on nginx's stub_status, Grafana provisioned.
    prom, exporter, grafana = (services[n] for n in ("prometheus", "nginx-exporter", "grafana"))
    for name in ("prometheus", "nginx-exporter", "grafana"):
        need(services[name].get("profiles") == ["observability"], f"{name} must be in the observability profile only")
    need(prom["image"].startswith("prom/prometheus:v2."), "prometheus: a v2 image (Debian's promtool 2.42 checks the config)")
    need(f"--config.file={mounted(prom, 'deploy/prometheus/prometheus.yml')}" in prom["command"], "prometheus must run the mounted prometheus.yml")
    status = search(r"^listen (127\.0\.0\.1:\d+);", "deploy/compose.d/status_listen.conf")
    need(exporter.get("network_mode") == "service:nginx" and f"--nginx.scrape-uri=http://{status}/nginx_status" in exporter["command"],
         "nginx-exporter must scrape stub_status as status_listen.conf has it")
    dashboard = mounted(grafana, "deploy/grafana/walletlock-dashboard.json") or ""
    providers = load("deploy/grafana/provisioning/dashboards/walletlock.yml")["providers"]
    need(any(dashboard.startswith(p["options"]["path"].rstrip("/") + "/") for p in providers), "no dashboard provider holds the mounted dashboard")
    need(grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH") == dashboard, "grafana's home is not the mounted dashboard")
    for sub in ("datasources", "dashboards"):
        need(mounted(grafana, f"deploy/grafana/provisioning/{sub}") == f"/etc/grafana/provisioning/{sub}", f"grafana must mount provisioning/{sub}")
    datasources = load("deploy/grafana/provisioning/datasources/prometheus.yml")["datasources"]
    need(any(d["url"] == "http://prometheus:9090" and d.get("uid") for d in datasources), "the provisioned datasource is not the compose prometheus")
    need(grafana["environment"].get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") == "Viewer", "anonymous Grafana users must be Viewers at most")


def k8s():
    root = ROOT / "deploy/k8s"
    files = {f.name for f in root.glob("*.yaml")} - {"kustomization.yaml"}
    listed = set(load("deploy/k8s/kustomization.yaml")["resources"])
    need(listed == files - {"secret.example.yaml"}, f"kustomization lists {sorted(listed)}, not every manifest but the example Secret")
    docs = {d["kind"]: d for f in files for d in yaml.safe_load_all((root / f).read_text(encoding="utf-8"))}
    deploy, job, service, config = docs["Deployment"], docs["Job"], docs["Service"], docs["ConfigMap"]["data"]
    pod, job_pod = deploy["spec"]["template"], job["spec"]["template"]

    for key, value in DEFAULTS.items():
        need(config.get(key) == value, f"ConfigMap {key}={config.get(key)!r}, deploy/defaults.env says {value!r}")
    def matches(selector, labels):
        return all(labels.get(k) == v for k, v in selector.items())

    labels, job_labels = pod["metadata"]["labels"], job_pod["metadata"]["labels"]
    for what, selector in (("the Deployment", deploy["spec"]["selector"]["matchLabels"]), ("the Service", service["spec"]["selector"]),
                           ("the PodDisruptionBudget", docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"])):
        need(matches(selector, labels) and not matches(selector, job_labels), f"{what} must select the replicas, not the migration Job")
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    need(hpa["scaleTargetRef"]["name"] == deploy["metadata"]["name"] and hpa["minReplicas"] == deploy["spec"]["replicas"],
         "the HPA must scale the Deployment from its replicas")

    (container,), (job_container,) = pod["spec"]["containers"], job_pod["spec"]["containers"]
    secret_name = docs["Secret"]["metadata"]["name"]

    def keyed(c):
        refs = ((e["name"], e.get("valueFrom", {}).get("secretKeyRef", {})) for e in c.get("env", []))
        return {name: ref["key"] for name, ref in refs if ref.get("name") == secret_name}

    # By key, not the whole Secret: it holds the owner's MIGRATE_DATABASE_URL too.
    need(keyed(container) == {k: k for k in ("DATABASE_URL", "REDIS_URL", "API_TOKENS")}
         and [e.get("configMapRef", {}).get("name") for e in container["envFrom"]] == [docs["ConfigMap"]["metadata"]["name"]],
         "the replicas take the ConfigMap, and DATABASE_URL, REDIS_URL and API_TOKENS from the Secret by key")
    need(keyed(job_container) == {"DATABASE_URL": "MIGRATE_DATABASE_URL"} and not job_container.get("envFrom"), "the Job takes the owner's URL only")
    need(set(docs["Secret"]["stringData"]) == set(keyed(container).values()) | {"MIGRATE_DATABASE_URL"}, "the example Secret's keys")
    app_user = re.match(r"postgres://([^:@/]+)", docs["Secret"]["stringData"]["DATABASE_URL"])
    role = {e["name"]: e.get("value") for e in job_container["env"]}.get("APP_ROLE")
    need(job_container["args"] == ["migrate"] and app_user and role == app_user.group(1) == "walletlock_app",
         "the Job must grant the app role the replicas' DATABASE_URL logs in as")
    need(container["image"] == job_container["image"], "the Job and the Deployment run different images")
    port = config["LISTEN_ADDR"].rsplit(":", 1)[1]
    need([str(p["containerPort"]) for p in container["ports"]] == [port], f"the container must expose LISTEN_ADDR's port {port}")
    need(PROBE[-1].endswith(container["readinessProbe"]["httpGet"]["path"]), "the readinessProbe is not the image's HEALTHCHECK")
    for name, spec in (("Deployment", pod["spec"]), ("Job", job_pod["spec"])):
        pod_sc = spec["securityContext"]
        need(pod_sc.get("runAsNonRoot") and str(pod_sc.get("runAsUser")) == UID and pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
             f"{name}: non-root as the Dockerfile's USER, seccomp RuntimeDefault")
        for c in spec["containers"]:
            sc = c["securityContext"]
            need(sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") and sc.get("capabilities", {}).get("drop") == ["ALL"]
                 and {"limits", "requests"} <= set(c.get("resources", {})), f"{name}: no privilege escalation, a read-only root, no capabilities, resources")
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    need(pod["spec"].get("terminationGracePeriodSeconds", 30) > pre_stop + DRAIN,
         f"terminationGracePeriodSeconds must exceed preStop + 2 x SHUTDOWN_GRACE + LEASE_TTL = {pre_stop + DRAIN:g}s")


def prometheus():
    jobs = {job["job_name"]: job for job in load("deploy/prometheus/prometheus.yml")["scrape_configs"]}
    app, nginx = jobs.get("walletlock", {}), jobs.get("nginx", {})
    need(any(d.get("names") == ["app"] and str(d.get("port")) == PORT for d in app.get("dns_sd_configs", [])), f"walletlock: compose's app:{PORT} by DNS")
    # deploy/local writes its replicas into targets/local.json next to the config.
    need(any("targets/*.json" in f.get("files", []) for f in app.get("file_sd_configs", [])) and "targets/local.json" in read("deploy/local"),
         "walletlock: deploy/local's targets/*.json")
    # The dashboard joins on `instance` with walletlock_replica_info's `replica`: neither may change.
    need(not app.get("honor_labels") and not any(r.get("target_label") in ("instance", "replica") for r in app.get("relabel_configs", [])),
         "walletlock: instance and replica must stay as scraped")
    need(any(d.get("names") == ["nginx"] and d.get("port") == 9113 for d in nginx.get("dns_sd_configs", [])), "nginx: the exporter at nginx:9113")


def main(argv):
    if len(argv) == 4 and argv[1] == "compose":
        compose(yaml.safe_load(Path(argv[2]).read_text())["services"], yaml.safe_load(Path(argv[3]).read_text())["services"])
    elif len(argv) == 2 and argv[1] in ("k8s", "prometheus"):
        {"k8s": k8s, "prometheus": prometheus}[argv[1]]()
    else:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print("\n".join(PROBLEMS), end="\n" if PROBLEMS else "")
    return 1 if PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
