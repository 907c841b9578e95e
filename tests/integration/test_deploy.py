"""Deployment files: docker-compose.yml and deploy/ (Dockerfile, Prometheus, Grafana, Kubernetes).

Three layers:
- static: every YAML/JSON file parses and has the keys the stack relies on; every metric name a
  dashboard panel or alert rule uses is one the worker exports (names from worker/constants.py);
- promtool: `promtool check config` / `promtool check rules` accept the Prometheus files;
- live (`integration`): a real Prometheus (1 s scrapes, our alert rules loaded) evaluates every
  dashboard expression against a real `ticketq worker` (tiny stand-in, Redis at 127.0.0.1:6379 db 4)
  beside a real `ticketq exporter` watching its queue and a second one (per-queue panels), and
  every alert expression against fixture exporters in deliberately degraded/healthy states.

Prometheus/promtool come from the Debian package: `apt-get install -y --no-install-recommends
prometheus`. Without them those tests skip, except on CI (`CI` set, as CI systems do) or with
TICKETQ_TEST_REQUIRE_PROMETHEUS=1, where a missing Prometheus (or Redis) fails them instead.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
PROM_DIR = DEPLOY / "prometheus"
PROM_CONFIGS = (PROM_DIR / "prometheus.yml", PROM_DIR / "prometheus.local.yml")
ALERTS = PROM_DIR / "alerts.yml"
DELIVER_ALERTS = PROM_DIR / "deliver-alerts.yml"
ALERT_TESTS = PROM_DIR / "alerts.test.yml"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "ticketq.json"
K8S = DEPLOY / "k8s"
CONSTANTS = ROOT / "worker" / "constants.py"
GATEWAY_KEYS = ROOT / "gateway" / "keys.py"  # the gateway's metric names (the review page's panels)
NAMES = ROOT / "ticketq" / "names.py"  # the names clients share: task, queue, streams

DEFAULT_METRICS_PORT = 9808

# The metrics the worker exports, by Prometheus type (the brief of the metrics work). Names are
# cross-checked against worker/constants.py below; ticketq_queue_depth (a gauge the worker fills
# with LLEN of its queue) may not have a constant yet.
EXPECTED_KINDS: dict[str, str] = {
    "ticketq_tickets": "counter",
    "ticketq_tokens_real": "counter",
    "ticketq_tokens_computed": "counter",
    "ticketq_tokens_padded": "counter",
    "ticketq_batch_padding_ratio": "gauge",
    "ticketq_batch_size": "histogram",
    "ticketq_batch_tokens": "histogram",
    "ticketq_queue_wait_seconds": "histogram",
    "ticketq_forward_seconds": "histogram",
    "ticketq_latency_seconds": "histogram",
    "ticketq_prefix_cache_reuses": "counter",
    "ticketq_dead_letters": "counter",
    "ticketq_shadow_checked": "counter",
    "ticketq_shadow_agreed": "counter",
    "ticketq_model": "info",
    "ticketq_flushes": "counter",
    "ticketq_queue_depth": "gauge",
}
NOT_YET_IN_CONSTANTS = {"ticketq_queue_depth"}
# The gateway's series the dashboard shows (the review page's), by kind; names from gateway/keys.py.
# Not a worker's: no `instance=~"$instance"` (a worker variable), and the live check below, which
# scrapes a worker and an exporter only, leaves them out (tests/integration/test_deploy_gateway.py
# evaluates them on a Prometheus scraping a real gateway).
GATEWAY_KINDS = {"ticketq_gateway_review_decisions": "counter", "ticketq_gateway_review_conflicts": "counter"}
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "info": ("_info",),
}
KINDS = tuple(SERIES_SUFFIXES)
METRIC_RE = re.compile(r"\bticketq_[A-Za-z0-9_]+\b")


# --------------------------------------------------------------------------------------------
# helpers


def _load_yaml(path: Path):
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _load_yaml_all(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def _constants(path: Path = CONSTANTS) -> dict[str, str]:
    """Module-level string constants of worker/constants.py (or `path`), read without importing the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out[node.targets[0].id] = node.value.value
    return out


def _metric_kinds() -> dict[str, str]:
    """Base metric name -> kind, from worker/constants.py (type from the `# kind` comment where
    present, else from EXPECTED_KINDS), plus the expected metrics not in constants yet."""
    kinds: dict[str, str] = {}
    comment_re = re.compile(r'^(M_\w+)\s*=\s*"([^"]+)"\s*#\s*(\w+)', re.MULTILINE)
    commented = {m.group(2): m.group(3) for m in comment_re.finditer(CONSTANTS.read_text(encoding="utf-8"))}
    for const, value in _constants().items():
        if not const.startswith("M_") or const == "M_PREFIX":
            continue
        kind = commented.get(value)
        kinds[value] = kind if kind in KINDS else EXPECTED_KINDS.get(value, "any")
    for name in NOT_YET_IN_CONSTANTS:
        kinds.setdefault(name, EXPECTED_KINDS[name])
    return kinds


def _exported_series(kinds: dict[str, str]) -> set[str]:
    out: set[str] = set()
    for name, kind in kinds.items():
        suffixes = SERIES_SUFFIXES.get(kind) or tuple(s for group in SERIES_SUFFIXES.values() for s in group)
        out.update(name + suffix for suffix in suffixes)
    return out


def _walk_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _walk_panels(panel.get("panels", []))


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


# What Grafana substitutes before it sends a query (every worker chosen, a 1-minute rate window):
# the expressions are evaluated by a real Prometheus the way Grafana would send them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*", "$queue": ".*", "$job": "ticketq"}
AGGREGATION_RE = re.compile(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(")


def _raw_dashboard_exprs() -> list[str]:
    return [
        target["expr"]
        for panel in _walk_panels(_dashboard()["panels"])
        if panel.get("type") != "row"
        for target in panel.get("targets", [])
    ]


def _dashboard_exprs() -> list[str]:
    exprs = []
    for expr in _raw_dashboard_exprs():
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        exprs.append(expr)
    return exprs


def _alert_rules() -> list[dict]:
    return [rule for group in _load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def _alert_exprs() -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for rule in _alert_rules() if "alert" in rule}


def _k8s_docs() -> list[dict]:
    docs: list[dict] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":  # a kustomize input, not a cluster object
            continue
        docs.extend(_load_yaml_all(path))
    return docs


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected exactly one {kind} {name or ''} in deploy/k8s, found {len(found)}"
    return found[0]


def _container_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _as_command(value) -> str:
    return value if isinstance(value, str) else " ".join(str(v) for v in value)


# --------------------------------------------------------------------------------------------
# static: every file parses


_DEPLOY_YAML = [*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")]
ALL_YAML = sorted([COMPOSE, *_DEPLOY_YAML], key=lambda p: str(p.relative_to(ROOT)))


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path: Path):
    docs = _load_yaml_all(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs), f"{path}: every document must be a mapping"


def test_expected_files_exist():
    for path in (
        COMPOSE,
        DOCKERFILE,
        *PROM_CONFIGS,
        ALERTS,
        DASHBOARD,
        GRAFANA / "provisioning" / "datasources" / "prometheus.yml",
        GRAFANA / "provisioning" / "dashboards" / "ticketq.yml",
    ):
        assert path.is_file(), f"missing {path.relative_to(ROOT)}"
    assert not (DEPLOY / "README-ops.md").exists()


# --------------------------------------------------------------------------------------------
# static: metric names


def test_expected_metrics_match_constants():
    """A rename in worker/constants.py must not leave dashboards and alerts behind."""
    names = {v for k, v in _constants().items() if k.startswith("M_") and k != "M_PREFIX"}
    missing = set(EXPECTED_KINDS) - NOT_YET_IN_CONSTANTS - names
    assert not missing, f"metrics used by deploy/ but gone from worker/constants.py: {sorted(missing)}"
    kinds = _metric_kinds()
    wrong = {n: (kinds[n], k) for n, k in EXPECTED_KINDS.items() if kinds.get(n) not in (k, "any")}
    assert not wrong, f"metric kinds (constants comment, expected): {wrong}"


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_referenced_metrics_exist(source: str):
    exprs = _dashboard_exprs() if source == "dashboard" else list(_alert_exprs().values())
    allowed = _exported_series(_metric_kinds()) | (_exported_series(GATEWAY_KINDS) if source == "dashboard" else set())
    unknown = sorted({name for expr in exprs for name in METRIC_RE.findall(expr)} - allowed)
    assert not unknown, f"{source} uses metrics the worker does not export: {unknown}"
    for expr in exprs:
        assert "$" not in expr, f"an unknown Grafana variable makes an expression untestable: {expr}"


def test_dashboard_uses_its_variables():
    """A datasource variable (import into any Grafana), a queue variable, an instance variable (the
    workers of the chosen queues), and Grafana's rate window."""
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["instance"]["includeAll"]
    assert variables["queue"]["includeAll"] and variables["queue"]["multi"]
    assert "ticketq_queue_depth" in variables["queue"]["definition"], "the exporter's queues too, served or not"
    assert 'queue=~"$queue"' in variables["instance"]["definition"]
    assert 'job=~"$job"' in variables["instance"]["definition"], "the workers of the chosen scrape jobs"
    assert variables["job"]["current"]["value"] == ["ticketq"], "the job_name of deploy/prometheus/*.yml"
    raw = _raw_dashboard_exprs()
    assert not [e for e in raw if re.search(r'job\s*=\s*"', e)], "the job is $job, never written out"
    assert not [e for e in raw if re.search(r"\[\d+[smh]\]", e) and "increase(" not in e], "use $__rate_interval"
    assert all('instance=~"$instance"' in e for e in raw if "ticketq_" in e and "queue_depth" not in e
               and "ticketq_gateway_" not in e), "every worker series is the chosen workers'"
    assert all('queue=~"$queue"' in e for e in raw), "every panel shows the chosen queues"


def test_every_dashboard_panel_is_per_queue():
    """Queue depth is max by (queue), never one max over the workers' and the exporter's series of
    different queues; every other aggregation keeps `queue` apart too."""
    raw = _raw_dashboard_exprs()
    depths = [e for e in raw if "ticketq_queue_depth" in e]
    assert depths and all(e == 'max by (queue) (ticketq_queue_depth{queue=~"$queue"})' for e in depths), depths
    for expr in raw:
        for op, by in AGGREGATION_RE.findall(expr):
            assert "queue" in [label.strip() for label in by.split(",")], f"{op} without `by (queue, ...)`: {expr}"


def test_gateway_series_on_the_dashboard_are_the_gateways():
    """The gateway metric names the dashboard uses are gateway/keys.py's (a rename there breaks this)."""
    names = {v for k, v in _constants(GATEWAY_KEYS).items() if k.startswith("REVIEW_")}
    assert set(GATEWAY_KINDS) <= names, f"gone from gateway/keys.py: {sorted(set(GATEWAY_KINDS) - names)}"
    used = {name for expr in _dashboard_exprs() for name in METRIC_RE.findall(expr) if "_gateway_" in name}
    assert used == {name + "_total" for name in GATEWAY_KINDS}, used


def test_dashboard_covers_every_metric():
    used = {name for expr in _dashboard_exprs() for name in METRIC_RE.findall(expr)}
    for name, kind in EXPECTED_KINDS.items():
        series = {name + suffix for suffix in SERIES_SUFFIXES[kind]}
        assert used & series, f"no dashboard panel shows {name}"


# --------------------------------------------------------------------------------------------
# static: docker-compose.yml and the Dockerfile


def test_compose_services():
    services = _load_yaml(COMPOSE)["services"]
    assert {"redis", "worker", "producer", "prometheus", "grafana"} <= set(services)


def test_compose_redis_persistent_and_protected():
    redis = _load_yaml(COMPOSE)["services"]["redis"]
    cmd = _as_command(redis["command"])
    assert "--appendonly yes" in cmd
    assert "--appendfsync everysec" in cmd
    assert "--requirepass ${REDIS_PASSWORD" in cmd
    assert any(str(v).endswith(":/data") for v in redis["volumes"]), "AOF needs a volume on /data"
    assert "healthcheck" in redis


def test_compose_worker_scalable():
    compose = _load_yaml(COMPOSE)
    worker = compose["services"]["worker"]
    assert "container_name" not in worker, "a fixed container_name breaks --scale worker=N"
    assert "ports" not in worker, "a host port breaks --scale worker=N (Prometheus scrapes via DNS)"
    assert worker["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (ROOT / worker["build"]["context"] / worker["build"]["dockerfile"]).is_file()
    env = worker["environment"]
    assert env["TICKETQ_BROKER_URL"].startswith("redis://:${REDIS_PASSWORD")
    assert "@redis:6379" in env["TICKETQ_BROKER_URL"]
    assert env["TICKETQ_METRICS_HOST"] == "0.0.0.0"
    assert int(env.get("TICKETQ_METRICS_PORT", DEFAULT_METRICS_PORT)) == DEFAULT_METRICS_PORT
    assert "HF_HOME" in env
    assert any(str(v).split(":")[1] == "/models" for v in worker["volumes"]), "model cache volume"
    health = _as_command(worker["healthcheck"]["test"])
    assert str(DEFAULT_METRICS_PORT) in health and "/readyz" in health
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    named = set(compose.get("volumes", {}))
    for service in compose["services"].values():
        for vol in service.get("volumes", []):
            src = str(vol).split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"bind mount source {src} does not exist"
            else:
                assert src in named, f"named volume {src} is not declared"


def test_compose_producer_one_shot():
    producer = _load_yaml(COMPOSE)["services"]["producer"]
    assert producer.get("restart") == "no" or producer.get("profiles")
    assert "ticketq-produce" in _as_command(producer["entrypoint"])
    assert producer["environment"]["TICKETQ_BROKER_URL"].startswith("redis://:${REDIS_PASSWORD")


def test_compose_prometheus_and_grafana_mounts():
    services = _load_yaml(COMPOSE)["services"]
    prom_mounts = {str(v).split(":")[0]: str(v).split(":")[1] for v in services["prometheus"]["volumes"]}
    assert prom_mounts.get("./deploy/prometheus") == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    graf = services["grafana"]
    graf_mounts = {str(v).split(":")[0]: str(v).split(":")[1] for v in graf["volumes"]}
    assert graf_mounts.get("./deploy/grafana/provisioning") == "/etc/grafana/provisioning"
    provider = _load_yaml(GRAFANA / "provisioning" / "dashboards" / "ticketq.yml")["providers"][0]
    assert graf_mounts.get("./deploy/grafana/dashboards") == provider["options"]["path"]
    assert graf["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert graf["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_dockerfile():
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.MULTILINE)
    assert re.search(r"^ARG TORCH_INDEX=", text, re.MULTILINE)
    assert re.search(r"^ARG TORCH_SPEC=torch", text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert re.search(r'^ENTRYPOINT \["ticketq", "worker"\]$', text, re.MULTILINE)
    copied = [src for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE) for src in line.split()[:-1]]
    for src in ("pyproject.toml", "ticketq", "worker", "producer", "ticketq_cli", "ticketq_bench"):
        assert src in copied and (ROOT / src).exists(), src
    # `pip install .` needs the readme pyproject names.
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    if readme:
        assert readme.group(1) in copied


def test_pyproject_license_is_an_spdx_expression():
    """`license` as an SPDX string (PEP 639): the table form makes every build print setuptools'
    deprecation (an error from 2027), and the string needs setuptools 77."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in pyproject["build-system"]["requires"]


# --------------------------------------------------------------------------------------------
# static: Prometheus and Grafana files


def test_prometheus_compose_config_discovers_every_replica():
    config = _load_yaml(PROM_DIR / "prometheus.yml")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "ticketq")
    sd = job["dns_sd_configs"]
    assert any({"worker", "tasks.worker"} & set(entry["names"]) for entry in sd)
    assert all(entry["port"] == DEFAULT_METRICS_PORT for entry in sd)


def test_prometheus_local_config():
    """By hand, one worker, and the gateway and its dispatcher where they run: each on its default port."""
    from gateway.settings import GatewaySettings

    config = _load_yaml(PROM_DIR / "prometheus.local.yml")
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["ticketq"]["static_configs"][0]["targets"] == [f"127.0.0.1:{DEFAULT_METRICS_PORT}"]
    defaults = GatewaySettings.model_fields
    gateway, deliver = jobs["ticketq-gateway"], jobs["ticketq-deliver"]
    assert gateway["static_configs"][0]["targets"] == [f"127.0.0.1:{defaults['gateway_port'].default}"]
    assert (PROM_DIR / gateway["authorization"]["credentials_file"]).is_file()  # the token, as compose's
    assert deliver["static_configs"][0]["targets"] == [f"127.0.0.1:{defaults['deliver_metrics_port'].default}"]


@pytest.mark.parametrize("path", PROM_CONFIGS, ids=lambda p: p.name)
def test_prometheus_rule_files_resolve(path: Path):
    config = _load_yaml(path)
    loaded = {(path.parent / rule_file).resolve() for rule_file in config["rule_files"]}
    assert ALERTS.resolve() in loaded, "alert rules are not loaded"
    assert loaded <= {ALERTS.resolve(), DELIVER_ALERTS.resolve()}
    assert DELIVER_ALERTS.resolve() in loaded  # both scrape the dispatcher: its alerts are loaded


def test_alert_rules_present():
    rules = _alert_rules()
    exprs = _alert_exprs()
    assert set(exprs) >= {
        "TicketqBacklogGrowing",
        "TicketqPaddingRatioHigh",
        "TicketqFailureRateHigh",
        "TicketqShadowDisagreement",
        "TicketqWorkerDown",
        "TicketqDeadLettersGrowing",
    }
    assert "ticketq_tokens_padded_total" in exprs["TicketqPaddingRatioHigh"]
    assert "ticketq_batch_size_count" in exprs["TicketqPaddingRatioHigh"], "pages only while batches are large"
    assert "ticketq_dead_letter_entries" in exprs["TicketqDeadLettersGrowing"]
    assert "0.15" in exprs["TicketqPaddingRatioHigh"]
    assert "ticketq_queue_depth" in exprs["TicketqBacklogGrowing"]
    assert "deriv(" in exprs["TicketqBacklogGrowing"]
    assert "0.05" in exprs["TicketqFailureRateHigh"]
    assert exprs["TicketqWorkerDown"].replace(" ", "") == 'up{job="ticketq"}==0'
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


PER_TARGET_ALERTS = {"TicketqWorkerDown", "TicketqNoWorkerUp"}  # about scrape targets, not a queue
SHARED_ALERTS = {"TicketqDeadLettersGrowing"}  # the dead-letter stream is one for every queue
JOB_SELECTOR = 'job="ticketq"'  # the job_name of deploy/prometheus/*.yml, as the rules write it
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"


def test_alerts_are_per_queue():
    """Every alert on tickets or the backlog is per queue and names it; the model's and batcher's
    series, which carry no queue, take it from target_info."""
    for rule in _alert_rules():
        if rule["alert"] in PER_TARGET_ALERTS | SHARED_ALERTS:
            continue
        aggregations = AGGREGATION_RE.findall(rule["expr"])
        assert aggregations and all(by.strip() == "queue" for _, by in aggregations), rule["expr"]
        assert "{{ $labels.queue }}" in rule["annotations"]["summary"], rule["alert"]
        unlabelled = {"ticketq_tokens_", "ticketq_shadow_"}
        if any(prefix in rule["expr"] for prefix in unlabelled):
            assert "group_left (queue) target_info" in rule["expr"], rule["expr"]


def test_every_alert_has_a_runbook_section():
    """`runbook_url` of each alert is its own section of docs/troubleshooting.md (`### <alert>`)."""
    headings = set(re.findall(r"^### (\S+)$", TROUBLESHOOTING.read_text(encoding="utf-8"), re.MULTILINE))
    for rule in _alert_rules():
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == f"docs/troubleshooting.md#{name.lower()}", name
        assert name in headings, f"docs/troubleshooting.md has no `### {name}` section"


def test_alerts_select_the_scrape_job_in_one_form():
    """The workers' job appears only as JOB_SELECTOR, so that the substitution docs/deployment.md
    shows (`sed 's/job="ticketq"/job="…"/'`) changes every rule that reads it."""
    text = ALERTS.read_text(encoding="utf-8")
    exprs = " ".join(_alert_exprs().values())
    assert set(re.findall(r'job\s*=~?\s*"[^"]*"', exprs)) == {JOB_SELECTOR}
    assert f"sed -e 's/{JOB_SELECTOR}/" in (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    assert text.count(JOB_SELECTOR) == exprs.count(JOB_SELECTOR) + 1  # + the header comment naming it


def test_grafana_datasource_matches_dashboard():
    ds = _load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    assert ds[0]["url"] == "http://prometheus:9090"
    assert ds[0]["uid"], "the provisioned data source needs a uid"
    uid = "${datasource}"  # every panel reads the dashboard's data source variable (type prometheus)
    for panel in _walk_panels(_dashboard()["panels"]):
        if panel.get("type") == "row":
            continue
        assert panel["datasource"]["uid"] == uid, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", {"uid": uid})["uid"] == uid, panel["title"]


def test_dashboard_panels():
    dash = _dashboard()
    assert dash["uid"] == "ticketq" and dash["title"]
    panels = [p for p in _walk_panels(dash["panels"]) if p.get("type") != "row"]
    assert len(panels) >= 10
    ids = [p["id"] for p in _walk_panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel.get("targets"), f"panel {panel['title']!r} has no targets"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r} has an empty query"
            assert target.get("refId")
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
    exprs = " ".join(_dashboard_exprs())
    for needle in ('sum by (queue) (rate(ticketq_tickets_total{queue=~".*",instance=~".*"}[1m]))',
                   "histogram_quantile(0.99", "by (queue, instance)"):  # fmt: skip
        assert needle in exprs, needle


# --------------------------------------------------------------------------------------------
# static: Kubernetes


def test_k8s_kinds():
    kinds = {d["kind"] for d in _k8s_docs()}
    wanted = {"Namespace", "Service", "StatefulSet", "Deployment", "ScaledObject", "TriggerAuthentication"}
    assert wanted <= kinds, f"missing kinds: {sorted(wanted - kinds)}"
    kustomization = _load_yaml(K8S / "kustomization.yaml")
    for res in kustomization["resources"]:
        assert (K8S / res).is_file(), res
    for doc in _k8s_docs():
        assert doc.get("apiVersion") and doc["metadata"].get("name"), doc


def test_k8s_redis():
    docs = _k8s_docs()
    sts = _one(docs, "StatefulSet", "redis")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    args = _as_command(container["args"])
    assert "--appendonly yes" in args and "--appendfsync everysec" in args
    assert "--requirepass $(REDIS_PASSWORD)" in args
    assert "secretKeyRef" in _container_env(container)["REDIS_PASSWORD"]["valueFrom"]
    assert any(m["mountPath"] == "/data" for m in container["volumeMounts"])
    assert sts["spec"]["volumeClaimTemplates"]
    svc = _one(docs, "Service", "redis")
    assert svc["spec"]["ports"][0]["port"] == 6379


def test_k8s_worker():
    deploy = _one(_k8s_docs(), "Deployment", "ticketq-worker")
    pod = deploy["spec"]["template"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(DEFAULT_METRICS_PORT)
    container = pod["spec"]["containers"][0]
    env = _container_env(container)
    assert env["TICKETQ_BROKER_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@redis:6379")
    names = list(_container_env(container))
    assert names.index("REDIS_PASSWORD") < names.index("TICKETQ_BROKER_URL"), "$(VAR) needs it defined first"
    assert env["TICKETQ_METRICS_HOST"]["value"] == "0.0.0.0"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    probes = {name: container[name]["httpGet"]["path"] for name in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes == {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 30


def test_k8s_gateway_and_dispatcher():
    """The gateway behind a Service, ready only while Redis takes writes; the dispatcher beside it;
    both on the broker of the workers, their secrets from a secret, never inline."""
    docs = _k8s_docs()
    gateway = _one(docs, "Deployment", "ticketq-gateway")["spec"]["template"]
    container = gateway["spec"]["containers"][0]
    assert container["command"][0] == "ticketq-gateway" and gateway["spec"]["securityContext"]["runAsNonRoot"]
    assert {p: container[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")} == {
        "readinessProbe": "/readyz", "livenessProbe": "/healthz"}  # fmt: skip
    env = _container_env(container)
    assert env["TICKETQ_BROKER_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@redis:6379")
    assert "secretKeyRef" in env["TICKETQ_GATEWAY_TOKENS"]["valueFrom"]
    service = _one(docs, "Service", "ticketq-gateway")
    assert service["spec"]["selector"].items() <= gateway["metadata"]["labels"].items()
    deliver = _one(docs, "Deployment", "ticketq-deliver")["spec"]["template"]["spec"]["containers"][0]
    denv = _container_env(deliver)
    assert deliver["command"] == ["ticketq-deliver"]
    assert all("secretKeyRef" in denv[name]["valueFrom"] for name in ("TICKETQ_DELIVER_URL", "TICKETQ_DELIVER_SECRET"))
    from gateway.settings import GatewaySettings

    fields = {f"TICKETQ_{name.upper()}" for name in GatewaySettings.model_fields}
    assert {name for name in {**env, **denv} if name.startswith("TICKETQ_")} <= fields, "every variable a setting"


def test_k8s_keda_scales_on_the_celery_queue():
    docs = _k8s_docs()
    scaled = _one(docs, "ScaledObject")
    deploy = _one(docs, "Deployment", "ticketq-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    triggers = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis"]
    assert len(triggers) == 1
    meta = triggers[0]["metadata"]
    assert meta["listName"] == _constants(NAMES)["QUEUE"]
    assert int(meta["listLength"]) > 0
    assert meta["address"].startswith("redis.")
    auth = _one(docs, "TriggerAuthentication", triggers[0]["authenticationRef"]["name"])
    ref = auth["spec"]["secretTargetRef"][0]
    assert ref["parameter"] == "password"
    redis_pod = _one(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]
    redis_env = _container_env(redis_pod["containers"][0])
    assert ref["name"] == redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"]


# --------------------------------------------------------------------------------------------
# promtool / prometheus binaries


def _skip_or_fail(reason: str) -> None:
    """`workers.skip_or_fail`, which also fails with TICKETQ_TEST_REQUIRE_PROMETHEUS=1."""
    from workers import skip_or_fail

    if os.environ.get("TICKETQ_TEST_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(reason)
    skip_or_fail(reason)


@pytest.fixture(scope="session")
def prometheus_bins() -> dict[str, str]:
    """Paths of `promtool` and `prometheus` (Debian package `prometheus`)."""
    found = {name: shutil.which(name) for name in ("promtool", "prometheus")}
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        reason = (
            f"{', '.join(missing)} not on PATH; install with "
            "`apt-get update && apt-get install -y --no-install-recommends prometheus`"
        )
        _skip_or_fail(reason)
    return {name: str(path) for name, path in found.items()}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("path", PROM_CONFIGS, ids=lambda p: p.name)
def test_promtool_check_config(prometheus_bins, path: Path):
    res = _run([prometheus_bins["promtool"], "check", "config", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_check_rules(prometheus_bins):
    res = _run([prometheus_bins["promtool"], "check", "rules", str(ALERTS)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_unit_tests_of_every_alert(prometheus_bins):
    """deploy/prometheus/alerts.test.yml: each alert fires with the text a person reads (and the
    value it names is the right one), `for:` included, and stays quiet where it should."""
    res = _run([prometheus_bins["promtool"], "test", "rules", str(ALERT_TESTS)])
    assert res.returncode == 0, res.stdout + res.stderr
    tests = _load_yaml(ALERT_TESTS)["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for test in tests for case in test["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == set(_alert_exprs()), f"alerts without a firing unit test: {set(_alert_exprs()) - fired}"
    assert {"TicketqBacklogGrowing", "TicketqShadowDisagreement"} <= quiet


def test_promtool_unit_tests_pass_with_another_job(prometheus_bins, tmp_path):
    """The rules and their unit tests rewritten for another scrape job, as docs/deployment.md shows
    it, still pass: the job selector is configurable."""
    for path in (ALERTS, ALERT_TESTS):
        text = path.read_text(encoding="utf-8").replace(JOB_SELECTOR, 'job="my-workers"')
        text = text.replace("job: ticketq\n", "job: my-workers\n")  # the expected label of TicketqWorkerDown
        (tmp_path / path.name).write_text(text, encoding="utf-8")
    assert "my-workers" in (tmp_path / ALERTS.name).read_text(encoding="utf-8")
    res = _run([prometheus_bins["promtool"], "test", "rules", str(tmp_path / ALERT_TESTS.name)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_alertmanager_config():
    """Prometheus sends alerts to the Alertmanager that compose runs, and its config is valid."""
    config = _load_yaml(PROM_DIR / "prometheus.yml")
    targets = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    services = _load_yaml(COMPOSE)["services"]
    assert targets == ["alertmanager:9093"] and "alertmanager" in services
    mounts = " ".join(services["alertmanager"]["volumes"])
    assert "./deploy/alertmanager:/etc/alertmanager" in mounts
    amtool = shutil.which("amtool")
    if amtool is None:
        _skip_or_fail("amtool not on PATH; install with `apt-get install -y prometheus-alertmanager`")
    res = _run([amtool, "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml")])
    assert res.returncode == 0, res.stdout + res.stderr


def test_backlog_exporter_is_scraped():
    """`ticketq exporter` reports the queue's depth with every worker down: compose runs it and
    Prometheus scrapes it."""
    services = _load_yaml(COMPOSE)["services"]
    assert services["exporter"]["entrypoint"] == ["ticketq", "exporter"]
    jobs = {job["job_name"]: job for job in _load_yaml(PROM_DIR / "prometheus.yml")["scrape_configs"]}
    assert jobs["ticketq-exporter"]["static_configs"][0]["targets"] == ["exporter:9809"]


# --------------------------------------------------------------------------------------------
# live: a real Prometheus evaluates every expression


# FIXTURE-ONLY exporter: NOT the ticketq worker. It serves every ticketq metric with synthetic,
# steadily advancing values so that a real Prometheus can evaluate the alert expressions in
# states a real worker cannot be put in on demand (the dashboard test uses a real worker). Run as `python -c SRC MODE`:
#   degraded: every alert condition holds (queue growing, 20% padding, 18% failures, shadow 50%,
#             a stalled classifying loop, Redis losing its data, and a second queue with messages
#             and no worker);
#   healthy:  no alert condition holds (flat queue, 5% padding, no failures, shadow 100%).
# It serves queue `fixture` (target_info, as a worker names its queue).
# Prints its port, then runs until killed or orphaned.
_FIXTURE_EXPORTER_SRC = r'''
import os, sys, threading, time
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

degraded = sys.argv[1] == "degraded"
parent = os.getppid()
lock = threading.Lock()


class SnapshotRegistry(CollectorRegistry):
    """Updates and scrapes take one lock: a scrape never sees half a tick."""

    def collect(self):
        with lock:
            families = list(super().collect())
        yield from families


reg = SnapshotRegistry(target_info={"queue": "fixture"})
tickets = Counter("ticketq_tickets", "fixture", ["queue", "label", "outcome"], registry=reg)
tokens_real = Counter("ticketq_tokens_real", "fixture", registry=reg)
tokens_computed = Counter("ticketq_tokens_computed", "fixture", registry=reg)
tokens_padded = Counter("ticketq_tokens_padded", "fixture", registry=reg)
padding_last = Gauge("ticketq_batch_padding_ratio", "fixture", registry=reg)
batch_size = Histogram("ticketq_batch_size", "fixture", buckets=(1, 2, 4, 8, 16, 32, 64), registry=reg)
batch_tokens = Histogram("ticketq_batch_tokens", "fixture", buckets=(128, 256, 512, 1024, 2048), registry=reg)
queue_wait = Histogram("ticketq_queue_wait_seconds", "fixture", ["queue"], registry=reg).labels("fixture")
forward = Histogram("ticketq_forward_seconds", "fixture", registry=reg)
latency = Histogram("ticketq_latency_seconds", "fixture", ["queue"], registry=reg).labels("fixture")
prefix_reuses = Counter("ticketq_prefix_cache_reuses", "fixture", registry=reg)
dead_letters = Counter("ticketq_dead_letters", "fixture", ["queue", "reason"], registry=reg)
shadow_checked = Counter("ticketq_shadow_checked", "fixture", registry=reg)
shadow_agreed = Counter("ticketq_shadow_agreed", "fixture", registry=reg)
shadow_disagreed = Counter("ticketq_shadow_disagreed", "fixture", ["near_tie"], registry=reg)
flushes = Counter("ticketq_flushes", "fixture", registry=reg)
queue_depth = Gauge("ticketq_queue_depth", "fixture", ["queue"], registry=reg)
stalled = Gauge("ticketq_classifying_stalled_seconds", "fixture", registry=reg)
data_lost = Counter("ticketq_redis_data_lost", "fixture", registry=reg)
dead_entries = Gauge("ticketq_dead_letter_entries", "fixture", registry=reg)  # as `ticketq exporter` exports it
Info("ticketq_model", "fixture", registry=reg).info(
    {"model": "fixture-exporter", "standin": "true", "dtype": "float32", "device": "cpu"}
)
labels = ("billing", "technical", "account")
failed = tickets.labels("fixture", "billing", "failed")
rejected = tickets.labels("fixture", "none", "rejected")
invalid = dead_letters.labels("fixture", "invalid")
if degraded:
    queue_depth.labels("unserved").set(5)  # a queue nobody consumes, as `ticketq exporter` reports it

server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
print(server.server_port, flush=True)
start = time.monotonic()
step = 0
while os.getppid() == parent:
    with lock:
        step += 1
        for label in labels:
            tickets.labels("fixture", label, "ok").inc(3)
        padded = 200 if degraded else 50
        tokens_computed.inc(1000)
        tokens_padded.inc(padded)
        tokens_real.inc(1000 - padded)
        padding_last.set(padded / 1000)
        batch_size.observe(8 + step % 9)
        batch_tokens.observe(900 + 10 * (step % 11))
        queue_wait.observe(0.01 * (1 + step % 7))
        forward.observe(0.05 * (1 + step % 5))
        latency.observe(0.1 * (1 + step % 13))
        prefix_reuses.inc()
        flushes.inc()
        shadow_checked.inc(2)
        shadow_agreed.inc(1 if degraded else 2)
        shadow_disagreed.labels("false" if degraded else "true").inc(1 if degraded else 0)
        if degraded:
            failed.inc()
            rejected.inc()
            invalid.inc()
            stalled.set(30)
            data_lost.inc()
            queue_depth.labels("fixture").set(2000 + 100 * (time.monotonic() - start))
            dead_entries.set(step)
        else:
            queue_depth.labels("fixture").set(10)
            dead_entries.set(3)
    time.sleep(0.05)
'''


@contextlib.contextmanager
def _fixture_exporter(mode: str) -> Iterator[str]:
    """Start the FIXTURE-ONLY exporter; yields "127.0.0.1:PORT"."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FIXTURE_EXPORTER_SRC, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().strip() if ready else ""
        if not line.isdigit():
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"fixture exporter did not start: {line!r} {err[-2000:]}")
        yield f"127.0.0.1:{line}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


DEPLOY_REDIS_URL = "redis://127.0.0.1:6379/4"  # the live worker's broker; the queue name is unique per run


@pytest.fixture(scope="module")
def deploy_queue() -> str:
    """The live worker's queue: unique per run."""
    return f"deploy-{os.urandom(4).hex()}"


@pytest.fixture(scope="module")
def metrics_target(tiny_model_dir, tmp_path_factory, deploy_queue) -> Iterator[str]:
    """host:port of a real `ticketq worker` (tiny stand-in, TICKETQ_SHADOW_RATE=1) that has classified
    tickets, rejected a malformed one (dead letter) and shadow-checked its answers, so that the
    failure, dead-letter and shadow panels have series. The alert tests keep the fixture exporters:
    they need deliberately degraded and healthy states."""
    import redis
    from workers import running_worker, worker_env

    client = redis.Redis.from_url(DEPLOY_REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        _skip_or_fail(f"no Redis at {DEPLOY_REDIS_URL} for the live worker ({exc})")
    finally:
        client.close()
    queue = deploy_queue
    schema = ROOT / "examples" / "schema.toml"  # for the triage panels; the other tickets name `default`
    env = worker_env(tiny_model_dir, DEPLOY_REDIS_URL, queue, TICKETQ_SHADOW_RATE="1", TICKETQ_SCHEMAS=str(schema))
    log = tmp_path_factory.mktemp("deploy-worker") / "worker.log"
    with running_worker(env, log, ready_timeout=180) as worker:
        _feed_worker(worker, queue)
        yield f"127.0.0.1:{worker.metrics_port}"


UNSERVED_BACKLOG = 7  # messages waiting in the exporter's second queue, which no worker serves


@pytest.fixture(scope="module")
def exporter_target(metrics_target, deploy_queue, tmp_path_factory) -> Iterator[tuple[str, dict[str, float]]]:
    """A real `ticketq exporter --queue <the worker's> --queue <another>`, the other queue holding
    UNSERVED_BACKLOG messages: ("127.0.0.1:PORT", the depth each queue must show)."""
    import redis
    from workers import free_port, wait_for

    other = f"{deploy_queue}-unserved"
    client = redis.Redis.from_url(DEPLOY_REDIS_URL)
    client.rpush(other, *["not a message, only counted"] * UNSERVED_BACKLOG)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env["TICKETQ_BROKER_URL"] = DEPLOY_REDIS_URL
    argv = ["exporter", "--port", str(port), "--queue", deploy_queue, "--queue", other]
    log_path = tmp_path_factory.mktemp("deploy-exporter") / "exporter.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ticketq_cli.cli", *argv], env=env, stdout=log, stderr=log)

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"ticketq exporter exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    try:
        wait_for(ready, 60, "ticketq exporter ready")
        yield f"127.0.0.1:{port}", {deploy_queue: 0.0, other: float(UNSERVED_BACKLOG)}
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        client.delete(other)
        client.close()


def _feed_worker(worker, queue: str) -> None:
    """Valid tickets one per message (the `default` field), a few answered with the `support`
    schema, and two malformed ones (a message, and a ticket in a pack); returns once every ticket
    is counted and the shadow checker has caught up."""
    from workers import wait_for

    from producer.api import Producer
    from producer.synthetic import generate_tickets
    from ticketq.names import TASK_CLASSIFY
    from worker.settings import Settings

    tickets = [{"id": t["id"], "text": t["text"], "schema": "default"} for t in generate_tickets(30, seed=5)]
    triaged = [{"id": f"triage-{t['id']}", "text": t["text"]} for t in generate_tickets(4, seed=6)]
    # Malformed tickets go raw, past the producer's validation: one alone, one inside a pack.
    pack = [tickets[0], {"id": "malformed-in-pack", "text": 12345}, tickets[1]]
    with Producer(Settings(broker_url=DEPLOY_REDIS_URL, queue=queue)) as producer:
        sent = producer.submit_many(tickets[2:]) + producer.submit_many(triaged, schema="support")
        for args in ([{"id": "malformed", "text": "   "}], [pack]):
            sent.append(producer.app.send_task(TASK_CLASSIFY, args=args, queue=queue))
        results = producer.wait(sent, timeout=120)
    assert len(results) == len(tickets) + len(triaged) + 2
    assert [r["status"] for r in results].count("failed") == 2, results
    assert [r.get("schema") for r in results].count("support") == len(triaged)

    def settled() -> bool:
        metrics = worker.metrics()

        def total(name: str, label: str = "") -> float:
            return sum(v for k, v in metrics.items() if k.startswith(name + "{") and label in k)

        shadow = total("ticketq_shadow_checked_total") + total("ticketq_shadow_dropped_total")
        return (
            total("ticketq_tickets_total") == len(tickets) + len(triaged) + 2
            and total("ticketq_tickets_total", "outcome=rejected") == 2
            and total("ticketq_dead_letters_total") == 2
            and total("ticketq_field_answers_total", "field=category") == len(triaged)
            and total("ticketq_shadow_checked_total") > 0
            and shadow == total("ticketq_tickets_total", "outcome=ok")
        )

    wait_for(settled, 60, f"worker metrics settled (log {worker.log_path})")


@pytest.fixture(scope="module")
def degraded_target() -> Iterator[str]:
    with _fixture_exporter("degraded") as target:
        yield target


@pytest.fixture(scope="module")
def healthy_target() -> Iterator[str]:
    with _fixture_exporter("healthy") as target:
        yield target


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rfc3339(stamp: str) -> float:
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, stamp
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float(m.group(2) or 0)


class _Prometheus:
    """A throwaway Prometheus on a free port: job `ticketq` scrapes `targets` every second (or
    `jobs`, scrape configs of its own) and the rule groups of deploy/prometheus/alerts.yml are
    evaluated every second."""

    def __init__(self, binary: str, workdir: Path, targets: list[str], jobs: list[dict] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": jobs or [
                {"job_name": "ticketq", "scrape_interval": "1s", "static_configs": [{"targets": targets}]}
            ],
        }
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait_for(self._ready, 30, "Prometheus did not become ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:  # 400/422: the body says what is wrong with the query
            body = json.load(err)
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait_for(self, condition, timeout_s: float, message: str):
        """Poll `condition()` until it returns something truthy (bounded); returns that value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"{message} within {timeout_s}s\n{self.log_tail()}")
            time.sleep(0.25)

    def wait_for_scrapes(self, n_targets: int, scrapes: int = 3):
        """Every target scraped at least `scrapes` times (enough samples for rate/deriv)."""
        expr = f'count(count_over_time(up{{job="ticketq"}}[5m]) >= {scrapes})'
        self.wait_for(
            lambda: (r := self.query(expr)) and int(float(r[0]["value"][1])) == n_targets,
            30,
            f"Prometheus did not scrape {n_targets} targets {scrapes} times",
        )

    def wait_for_rule_evaluation(self) -> list[dict]:
        """Rules evaluated (healthy) after this call began; returns the rule groups."""
        since = time.time()

        def evaluated():
            groups = self.api("rules")["groups"]
            done = groups and all(_rfc3339(g["lastEvaluation"]) > since for g in groups)
            return groups if done else None

        return self.wait_for(evaluated, 30, "alert rules were not evaluated")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def prometheus(prometheus_bins, tmp_path_factory) -> Iterator:
    """Factory: `prometheus([targets])` starts a Prometheus scraping them; all stopped at teardown."""
    started: list[_Prometheus] = []

    def start(targets: list[str]) -> _Prometheus:
        workdir = tmp_path_factory.mktemp("prometheus")
        started.append(_Prometheus(prometheus_bins["prometheus"], workdir, targets))
        return started[-1]

    yield start
    for prom in started:
        prom.close()


def _scraped(target: str) -> str:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_promtool_check_metrics_on_a_live_worker_and_exporter(prometheus_bins, metrics_target, exporter_target):
    """`promtool check metrics` on a real worker's /metrics (it has classified, dead-lettered and
    shadow-checked) and on `ticketq exporter`'s: nothing reported (names, units, suffixes, help)."""
    for target in (metrics_target, exporter_target[0]):
        res = subprocess.run([prometheus_bins["promtool"], "check", "metrics"], input=_scraped(target),
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert (res.returncode, res.stdout + res.stderr) == (0, ""), f"{target}: {res.stdout}{res.stderr}"


def test_docs_list_the_labels_a_live_worker_exports(metrics_target):
    """docs/metrics.md lists, for each series, every label a real worker exports it with."""
    from prometheus_client.parser import text_string_to_metric_families

    documented = {}
    for line in (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            name, _, labels = (cell.strip() for cell in line.strip("|").split("|")[:3])
            documented[name.strip("`")] = set(re.findall(r"`(\w+)`", labels))
    for family in text_string_to_metric_families(_scraped(metrics_target)):
        name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
        labels = {key for sample in family.samples for key in sample.labels} - {"le"}
        assert name in documented, f"{name} is not in docs/metrics.md"
        assert labels <= documented[name], f"{name}: docs/metrics.md lists {documented[name]}, it has {labels}"


def test_live_dashboard_expressions(prometheus, metrics_target, exporter_target, deploy_queue):
    exporter, depths = exporter_target
    prom = prometheus([metrics_target, exporter])
    prom.wait_for_scrapes(2)
    models = {r["metric"]["model"] for r in prom.query("ticketq_model_info")}
    assert models and "fixture-exporter" not in models, f"the dashboard must be checked on a real worker: {models}"
    # The gateway's panels: tests/integration/test_deploy_gateway.py, against a real gateway.
    exprs = sorted(e for e in set(_dashboard_exprs()) if "ticketq_gateway_" not in e)

    def all_non_empty():
        return not [e for e in exprs if not prom.query(e)]

    deadline = time.monotonic() + 30
    while not all_non_empty() and time.monotonic() < deadline:
        time.sleep(0.25)
    empty = [e for e in exprs if not prom.query(e)]
    assert not empty, "dashboard expressions with no result:\n" + "\n".join(empty)

    # The worker's and the exporter's depth series of one queue are one line; the other queue's, another.
    for expr in (e for e in exprs if "ticketq_queue_depth" in e):
        shown = {r["metric"].get("queue"): float(r["value"][1]) for r in prom.query(expr)}
        assert shown == depths, f"{expr}: {shown}"
    queues = {r["metric"].get("queue") for e in exprs if "ticketq_queue_depth" not in e for r in prom.query(e)}
    assert queues == {deploy_queue}, f"every other panel shows the worker's queue, by name: {queues}"


# Which alerts must fire in each scenario (the `for:` duration aside: the expression is non-empty
# and the rule is pending or firing). Every alert in alerts.yml must appear in at least one.
ALWAYS_QUIET_WITH_A_WORKER_UP = {"TicketqNoWorkerUp"}


def _scenario_expectations() -> dict[str, tuple[list[str], set[str]]]:
    names = set(_alert_exprs())
    return {
        # degraded worker + a target nobody listens on (up == 0)
        "degraded": (["degraded", "dead"], names - ALWAYS_QUIET_WITH_A_WORKER_UP),
        "healthy": (["healthy"], set()),
        "no-worker": (["dead"], {"TicketqWorkerDown", "TicketqNoWorkerUp"} & names),
    }


@pytest.fixture(scope="module")
def alert_scenarios(prometheus, request) -> dict[str, tuple[_Prometheus, int]]:
    """One Prometheus per scenario, all started at once: Prometheus 2.x applies new scrape targets
    only every 5 s, so starting them together saves that wait for all but the first."""
    out = {}
    for scenario, (target_kinds, _) in _scenario_expectations().items():
        targets = [
            f"127.0.0.1:{_free_port()}" if kind == "dead" else request.getfixturevalue(f"{kind}_target")
            for kind in target_kinds
        ]
        out[scenario] = (prometheus(targets), len(targets))
    return out


@pytest.mark.parametrize("scenario", ["degraded", "healthy", "no-worker"])
def test_live_alert_expressions(alert_scenarios, scenario):
    _, expected = _scenario_expectations()[scenario]
    prom, n_targets = alert_scenarios[scenario]
    prom.wait_for_scrapes(n_targets)
    exprs = _alert_exprs()

    def fired() -> set[str]:
        return {name for name, expr in exprs.items() if prom.query(expr)}

    # Expected alerts appear within the bound; then the others must stay quiet (the data for
    # them is already there: every target has been scraped at least 3 times).
    deadline = time.monotonic() + 30
    while not expected <= fired() and time.monotonic() < deadline:
        time.sleep(0.25)
    got = fired()
    assert got == expected, f"{scenario}: non-empty expressions {sorted(got)}, expected {sorted(expected)}"

    groups = prom.wait_for_rule_evaluation()
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["name"] for r in rules} == set(exprs), "Prometheus did not load every rule"
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad, f"rules failing to evaluate: {bad}"
    active = {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"]}
    assert active == expected, f"{scenario}: active alerts {sorted(active)}, expected {sorted(expected)}"


def test_every_alert_is_exercised():
    exercised = set().union(*(expected for _, expected in _scenario_expectations().values()))
    assert exercised == set(_alert_exprs())
