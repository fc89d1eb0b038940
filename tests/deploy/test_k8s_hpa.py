"""deploy/k8s/batchd-hpa.yaml and prometheus-adapter-rules.yaml: the HorizontalPodAutoscaler scales
the batchd Deployment on metrics a real batchd server exports, through prometheus-adapter rules
that produce exactly those metric names from series Prometheus scrapes off the pods.

The HPA validates against the vendored Kubernetes schema (tests/deploy/test_k8s.py, which
covers every manifest); here: what the schema cannot say. prometheus-adapter has no published
schema for its config; its rules are checked field by field against the adapter's documented
format (docs/config.md: seriesQuery, resources, name.matches/as, metricsQuery with the
<<.Series>> and <<.LabelMatchers>> placeholders).
"""

from __future__ import annotations

import copy
import re
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from test_k8s import container, one, validator  # noqa: F401  (validator: the schema fixture)

pytestmark = pytest.mark.timeout(120)


def hpa() -> dict:
    return one("HorizontalPodAutoscaler", "batchd")


def adapter_rules() -> list[dict]:
    return yaml.safe_load(one("ConfigMap", "batchd-prometheus-adapter")["data"]["config.yaml"])["rules"]


def test_the_hpa_scales_the_deployment_between_sane_bounds(validator):  # noqa: F811
    h, deployment = hpa(), one("Deployment", "batchd")
    ref = h["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", deployment["metadata"]["name"])
    assert 1 <= h["spec"]["minReplicas"] <= h["spec"]["maxReplicas"]
    assert "replicas" not in deployment["spec"]  # an apply would otherwise reset what the HPA chose
    # ratios in [0, 1]: the targets are quantities below 1
    for m in h["spec"]["metrics"]:
        assert m["type"] == "Pods"
        target = m["pods"]["target"]
        assert target["type"] == "AverageValue" and re.fullmatch(r"\d+m", target["averageValue"])
        assert 0 < int(target["averageValue"][:-1]) < 1000
    # the schema catches a wrong field in the HPA too
    bad = copy.deepcopy(h)
    bad["spec"]["metrics"][0]["pods"]["target"]["averageValu"] = bad["spec"]["metrics"][0]["pods"]["target"].pop(
        "averageValue")
    assert validator(bad)


def test_the_adapter_rules_give_the_hpa_its_metrics():
    rules = adapter_rules()
    served = {}
    for r in rules:
        assert set(r) == {"seriesQuery", "resources", "name", "metricsQuery"}, r
        series = re.fullmatch(r"(\w+)\{namespace!=\"\",pod!=\"\"\}", r["seriesQuery"])
        assert series, r["seriesQuery"]
        assert r["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert re.fullmatch(r["name"]["matches"], series.group(1)), "the rule must match the series it queries"
        assert "<<.Series>>" in r["metricsQuery"] and "<<.LabelMatchers>>" in r["metricsQuery"]
        served[r["name"]["as"]] = series.group(1)
    wanted = [m["pods"]["metric"]["name"] for m in hpa()["spec"]["metrics"]]
    assert set(wanted) <= set(served), f"the HPA asks for {wanted}; the adapter serves {sorted(served)}"
    assert {"batchd_trainer_data_wait_ratio", "batchd_workers_busy_ratio"} <= set(wanted)


def test_the_pods_are_scraped_where_batchd_serves_its_metrics():
    template = one("Deployment", "batchd")["spec"]["template"]
    notes = template["metadata"]["annotations"]
    c = container(template["spec"], "batchd")
    metrics_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == metrics_port
    args = c["args"]
    assert args[args.index("--metrics-port") + 1] == str(metrics_port)


def test_a_real_server_exports_every_series_the_rules_query(make_server, fmnist_root):
    server = make_server(metrics_port=0, workers={"min": 1, "max": 2},
                         datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    text = urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for r in adapter_rules():
        name = re.match(r"\w+", r["seriesQuery"]).group(0)
        assert name in families, f"{name} is not among batchd's metrics"
        assert families[name].type == "gauge"
        (sample,) = families[name].samples
        assert 0.0 <= sample.value <= 1.0


def test_the_config_map_sizes_workers_to_demand():
    config = yaml.safe_load(one("ConfigMap", "batchd-config")["data"]["config.yaml"])
    workers = config["workers"]
    limits = container(one("Deployment", "batchd")["spec"]["template"]["spec"], "batchd")["resources"]["limits"]
    assert workers["min"] >= 1 and workers["max"] <= int(limits["cpu"])  # never more workers than CPUs
