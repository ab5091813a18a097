#!/usr/bin/env python3
"""deploy/checks/prometheus.py: what Prometheus's scrape jobs must find, for deploy/check-deploy.

    python3 deploy/checks/prometheus.py deploy/prometheus/prometheus.yml

(a python3 with PyYAML). The replicas are found both by compose's DNS (app:8080) and by the
targets/*.json files deploy/local writes; nginx's exporter is scraped on :9113; and nothing
overwrites the `instance` and `replica` labels the dashboard joins on. Prints one line per
problem and exits 1 if there is any.
"""

import sys

from common import Problems, load_yaml


def check(config):
    problems = Problems()
    need = problems.need
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    need(set(jobs) == {"walletlock", "nginx"}, f"jobs are {sorted(jobs)}")
    app = jobs.get("walletlock", {})
    need(app.get("metrics_path", "/metrics") == "/metrics", "walletlock: metrics_path")
    need(any(d.get("names") == ["app"] and d.get("type") == "A" and d.get("port") == 8080
             for d in app.get("dns_sd_configs", [])),
         "walletlock: no dns_sd_configs for app, type A, port 8080")
    need(any("targets/*.json" in f.get("files", []) for f in app.get("file_sd_configs", [])),
         "walletlock: no file_sd_configs reading targets/*.json")
    # The dashboard names a replica by joining on `instance` with walletlock_replica_info's own
    # `replica` label: neither may be overwritten.
    need(not app.get("honor_labels"), "walletlock: honor_labels")
    need(not any(r.get("target_label") in ("instance", "replica") for r in app.get("relabel_configs", [])),
         "walletlock: relabeling instance or replica breaks the dashboard's join")
    nginx = jobs.get("nginx", {})
    need(any(d.get("names") == ["nginx"] and d.get("port") == 9113 for d in nginx.get("dns_sd_configs", []))
         or any("nginx:9113" in s.get("targets", []) for s in nginx.get("static_configs", [])),
         "nginx: the exporter at nginx:9113 is not scraped")
    return problems


def main(argv):
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    return check(load_yaml(argv[1])).report()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
