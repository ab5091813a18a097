"""Parses Prometheus text exposition format from stdin with the reference parser
(prometheus_client) and prints the samples as JSON: [{"name", "labels", "value"}, ...]."""
import json
import sys

from prometheus_client.parser import text_string_to_metric_families

samples = [
    {"name": sample.name, "labels": sample.labels, "value": sample.value}
    for family in text_string_to_metric_families(sys.stdin.read())
    for sample in family.samples
]
json.dump(samples, sys.stdout)
