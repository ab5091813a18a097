"""deploy/checks/common.py: what the structural checks of deploy/check-deploy share.

Imported by deploy/checks/*.py (each runs as `python3 deploy/checks/NAME.py ...`, so this file's
directory is on sys.path). A check collects every problem it finds in a Problems list, prints them
all, and exits 1 if there was any.
"""

import re
from pathlib import Path

import yaml

# The repository's top directory: the checks read the files the rendered configs point at from it.
ROOT = Path(__file__).resolve().parents[2]

UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


class Problems(list):
    """The problems a check found, in the order it found them."""

    def need(self, ok, message):
        """Records `message` unless `ok` holds."""
        if not ok:
            self.append(message)

    def report(self):
        """Prints the problems, one a line; the check's exit code."""
        for problem in self:
            print(problem)
        return 1 if self else 0


def read(path):
    """The text of `path`, relative to the repository's top unless absolute."""
    return (ROOT / path).read_text(encoding="utf-8")


def load_yaml(path):
    return yaml.safe_load(read(path))


def env_file(path):
    """The KEY=VALUE lines of an env file (deploy/defaults.env), comments and blank lines left out."""
    lines = read(path).splitlines()
    return dict(line.strip().split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def seconds(text):
    """A duration as compose, Kubernetes and walletlock write it (`500ms`, `10s`, `1m30s`), in seconds."""
    return sum(float(n) * UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text)))
