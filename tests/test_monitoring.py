"""The monitoring profile agrees with the code: every series the Grafana dashboard plots is one the gateway or the
trainer exports, and Prometheus scrapes the ports the compose file gives them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from gateway.metrics import Metrics
from trainer.telemetry import PrometheusSink

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "monitoring"


def exported() -> set[str]:
    """Every sample name a scrape of the gateway or the trainer can show."""
    names: set[str] = set()
    registries: list[CollectorRegistry] = [Metrics().registry, PrometheusSink(None).registry]
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            if family.type == "counter":  # a labelled counter shows its samples only once a label is used
                names.add(family.name + "_total")
            names.update(s.name for s in family.samples)
    return names


def test_every_dashboard_series_is_exported():
    dashboard = json.loads((MONITORING / "grafana" / "dashboards" / "clawgate.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used.update(w for w in re.findall(r"[a-z_][a-z0-9_]*", target["expr"]) if w.startswith("clawgate_"))
            assert target["datasource"]["uid"] == "clawgate-prometheus", panel["title"]
    assert len(used) >= 15
    missing = sorted(used - exported())
    assert not missing, f"the dashboard plots series nobody exports: {missing}"


def test_prometheus_scrapes_the_ports_compose_gives(monkeypatch):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gateway_port = compose["gateway"]["environment"]["CLAWGATE_PORT"]
    trainer_port = compose["trainer"]["environment"]["CLAWGATE_TRAIN_METRICS_PORT"]
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {"clawgate-gateway": [f"gateway:{gateway_port}"], "clawgate-trainer": [f"trainer:{trainer_port}"]}
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["uid"] == "clawgate-prometheus"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/clawgate.yml").read_text())
    mounts = compose["grafana"]["volumes"]
    assert f"./monitoring/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in mounts
