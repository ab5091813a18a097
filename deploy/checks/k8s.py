#!/usr/bin/env python3
"""deploy/checks/k8s.py: the links between the Kubernetes manifests, for deploy/check-deploy.

    python3 deploy/checks/k8s.py deploy/k8s deploy/defaults.env

(a python3 with PyYAML). kubernetes-validate checks each manifest against its schema; this checks
what no schema can: kustomization.yaml lists every manifest but the example Secret; the selectors
of the Service, the PodDisruptionBudget and the Deployment find the replicas and not the migration
Job; the HPA targets the Deployment; the ConfigMap says what deploy/defaults.env says; the
replicas take DATABASE_URL, REDIS_URL and API_TOKENS from the Secret by key, and the Job only the
owner's URL; both run non-root on a read-only root; the grace period outlasts a drain. Prints one
line per problem and exits 1 if there is any.
"""

import re
import sys
from pathlib import Path

import yaml

from common import ROOT, Problems, env_file, load_yaml, read, seconds


def url_user(url):
    """The user a postgres:// URL logs in as (a match; None if it names none)."""
    return re.match(r"postgres(?:ql)?://([^:@/]+)", url or "")


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def secret_env(c):
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


def check(root, defaults):
    problems = Problems()
    need = problems.need
    kustomization = load_yaml(root / "kustomization.yaml")
    listed = set(kustomization.get("resources", []))
    files = {f.name for f in root.glob("*.yaml")} - {"kustomization.yaml"}
    need(listed == files - {"secret.example.yaml"},
         f"kustomization resources {sorted(listed)} != the manifests {sorted(files - {'secret.example.yaml'})}")
    need("secret.example.yaml" not in listed, "the example Secret must not be applied by kustomize")

    docs = {}
    for name in files:
        for doc in yaml.safe_load_all(read(root / name)):
            docs[doc["kind"]] = doc
    for kind in ("Namespace", "ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget",
                 "HorizontalPodAutoscaler", "Job"):
        need(kind in docs, f"no {kind}")
    if problems:
        return problems

    config = docs["ConfigMap"]["data"]
    for key, value in defaults.items():
        need(config.get(key) == value, f"ConfigMap {key}={config.get(key)!r}, deploy/defaults.env says {value!r}")
    need(config.get("LOG_FORMAT") == "json", "ConfigMap LOG_FORMAT must be json")
    need(config.get("LISTEN_ADDR") == "0.0.0.0:8080", "ConfigMap LISTEN_ADDR must be 0.0.0.0:8080")
    secret = docs["Secret"].get("stringData", {})
    need(set(secret) == {"DATABASE_URL", "MIGRATE_DATABASE_URL", "REDIS_URL", "API_TOKENS"},
         f"the Secret's stringData must hold DATABASE_URL, MIGRATE_DATABASE_URL, REDIS_URL and API_TOKENS, holds {sorted(secret)}")
    app_user, owner_user = url_user(secret.get("DATABASE_URL")), url_user(secret.get("MIGRATE_DATABASE_URL"))
    need(app_user and app_user.group(1) == "walletlock_app", "the Secret's DATABASE_URL (the replicas') must log in as walletlock_app")
    need(owner_user and owner_user.group(1) != "walletlock_app", "the Secret's MIGRATE_DATABASE_URL must log in as the owner, not the app role")
    need(re.fullmatch(r"local:\S.*", secret.get("API_TOKENS", "")), "the Secret's API_TOKENS must be a `local:<token>` placeholder")

    deploy = docs["Deployment"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    pod = deploy["spec"]["template"]
    labels = pod["metadata"]["labels"]
    need(matches(selector, labels), "the Deployment's selector does not match its pods")
    need(matches(docs["Service"]["spec"]["selector"], labels), "the Service does not select the replicas")
    need(not matches(docs["Service"]["spec"]["selector"], docs["Job"]["spec"]["template"]["metadata"]["labels"]),
         "the Service also selects the migration Job's pod")
    need(not matches(selector, docs["Job"]["spec"]["template"]["metadata"]["labels"]), "the Deployment's selector matches the Job's pod")
    need(matches(docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], labels), "the PodDisruptionBudget does not select the replicas")
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    need(target["kind"] == "Deployment" and target["name"] == deploy["metadata"]["name"], "the HPA does not target the Deployment")
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    need(hpa["minReplicas"] >= 3 and deploy["spec"]["replicas"] == hpa["minReplicas"], "HPA minReplicas vs Deployment replicas")

    (container,) = pod["spec"]["containers"]
    need(container["image"] == docs["Job"]["spec"]["template"]["spec"]["containers"][0]["image"], "the Job and the Deployment run different images")
    refs = {("configMapRef" if "configMapRef" in e else "secretRef"): next(iter(e.values()))["name"] for e in container["envFrom"]}
    need(refs.get("configMapRef") == docs["ConfigMap"]["metadata"]["name"], "envFrom does not name the ConfigMap")
    # The replicas take their three secrets by key: the whole Secret would hand them the owner's URL.
    need("secretRef" not in refs, "the Deployment must not take the whole Secret (envFrom secretRef): it holds MIGRATE_DATABASE_URL")
    secret_name = docs["Secret"]["metadata"]["name"]
    app_secrets = secret_env(container)
    need(app_secrets == {k: (secret_name, k) for k in ("DATABASE_URL", "REDIS_URL", "API_TOKENS")},
         f"the Deployment must take DATABASE_URL, REDIS_URL and API_TOKENS (only) from the Secret's keys of those names, takes {app_secrets}")
    need(container["readinessProbe"]["httpGet"]["path"] == "/readyz", "readinessProbe must GET /readyz")
    need(container["livenessProbe"]["httpGet"]["path"] == "/healthz", "livenessProbe must GET /healthz")
    need(any(p["containerPort"] == 8080 for p in container["ports"]), "container port 8080")
    need(docs["Service"]["spec"]["ports"][0]["port"] == 80, "the Service must listen on 80")

    for name, spec in (("Deployment", pod["spec"]), ("Job", docs["Job"]["spec"]["template"]["spec"])):
        pod_sc = spec.get("securityContext", {})
        need(pod_sc.get("runAsNonRoot") is True, f"{name}: runAsNonRoot")
        need(pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccompProfile RuntimeDefault")
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            need(sc.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation must be false")
            need(sc.get("readOnlyRootFilesystem") is True, f"{name}: readOnlyRootFilesystem must be true")
            need(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: capabilities must drop ALL")
            need("limits" in c.get("resources", {}) and "requests" in c.get("resources", {}), f"{name}: resources")

    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    drain = pre_stop + 2 * seconds(config["SHUTDOWN_GRACE"]) + seconds(config["LEASE_TTL"])
    need(pod["spec"].get("terminationGracePeriodSeconds", 30) > drain,
         f"terminationGracePeriodSeconds must exceed preStop + 2 x SHUTDOWN_GRACE + LEASE_TTL = {drain:g}s")
    job = docs["Job"]["spec"]
    (job_container,) = job["template"]["spec"]["containers"]
    job_args = job_container.get("args", [])
    job_env = {e["name"]: e.get("value") for e in job_container.get("env", [])}
    job_role = job_args[job_args.index("--app-role") + 1] if "--app-role" in job_args[:-1] else job_env.get("APP_ROLE")
    need(job_args[:1] == ["migrate"] and job_role == "walletlock_app",
         f"the Job must run `walletlock migrate` with the app role walletlock_app (--app-role or APP_ROLE), runs {job_args} with APP_ROLE={job_env.get('APP_ROLE')}")
    need(secret_env(job_container) == {"DATABASE_URL": (secret_name, "MIGRATE_DATABASE_URL")} and not job_container.get("envFrom"),
         f"the Job must take DATABASE_URL from the Secret's MIGRATE_DATABASE_URL (the owner), and nothing else, takes {secret_env(job_container)}")
    need("backoffLimit" in job and "ttlSecondsAfterFinished" in job, "the Job needs backoffLimit and ttlSecondsAfterFinished")

    return problems


def main(argv):
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return check(ROOT / Path(argv[1]), env_file(argv[2])).report()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
