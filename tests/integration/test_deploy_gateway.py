"""Prometheus scraping the gateway: deploy/prometheus/prometheus.yml's `ticketq-gateway` job.

Static: the job finds every gateway replica through DNS, sends the token of
deploy/prometheus/gateway-scrape-token (committed with no token in it), and no alert reads a
gateway's `up`. Live (`integration`): a real Prometheus scrapes a real gateway (`python -m gateway`,
review page on, a private redis-server) with that job's authorization, and two jobs more without
a token (none; the placeholder file): every dashboard expression on `ticketq_gateway_` has a
result after reviewers decided, the share-corrected panel shows the share decided, the jobs
without a token are down, and no alert but "no worker up" (no worker is scraped here) is active.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateways import running_gateway
from servers import require_redis_server
from test_deploy import (  # noqa: F401 -- `prometheus_bins` is the fixture that finds (or skips on) Prometheus
    PROM_DIR,
    _dashboard_exprs,
    _load_yaml,
    _Prometheus,
    prometheus_bins,
)
from test_review import ACME, SECRET, TOKENS, seed, store
from workers import RedisServer

from gateway.auth import token_digest

pytestmark = pytest.mark.integration

COMPOSE_CONFIG = PROM_DIR / "prometheus.yml"
JOB = "ticketq-gateway"
GATEWAY_PORT = 8080  # docker-compose.yml's gateway: `--port 8080`
SCRAPE_TOKEN = "prometheus-scrape-" + uuid.uuid4().hex
QUEUE = "review"
ACTIVE_WITHOUT_A_WORKER = {"TicketqNoWorkerUp"}  # alerts.yml's: no `ticketq` job is scraped here
UP_RE = re.compile(r"\bup\s*(\{[^}]*\})?")


def _gateway_job() -> dict:
    return next(j for j in _load_yaml(COMPOSE_CONFIG)["scrape_configs"] if j["job_name"] == JOB)


def test_the_gateway_job_finds_every_replica_with_the_token_file():
    job = _gateway_job()
    assert job["metrics_path"] == "/metrics"
    assert [(sd["names"], sd["port"]) for sd in job["dns_sd_configs"]] == [(["gateway"], GATEWAY_PORT)]
    token_file = COMPOSE_CONFIG.parent / job["authorization"]["credentials_file"]
    assert token_file.is_file(), "promtool check config fails without it"
    assert not token_file.read_text(encoding="utf-8").strip(), "committed as a placeholder: no token in git"


def test_no_alert_reads_the_gateways_up():
    """`up` of a gateway with no token written (the placeholder) is 0: every `up` an alert reads is
    one job's, named exactly, and never the gateway's."""
    for path in sorted(PROM_DIR.glob("*alerts.yml")):
        for group in _load_yaml(path)["groups"]:
            for rule in group["rules"]:
                for selector in UP_RE.findall(rule["expr"]):
                    jobs = re.findall(r'job\s*=\s*"([^"]*)"', selector)
                    assert jobs and JOB not in jobs, f"{path.name} {rule['alert']}: up{selector}"


@pytest.fixture
def review_gateway(tmp_path) -> Iterator[tuple[str, RedisServer]]:
    """A gateway with the review page on and Prometheus' token among its admin tokens: its address,
    and the redis-server of its review items."""
    require_redis_server()
    server = RedisServer(tmp_path, aof=False).start()
    seed(server.client(), {f"acme:A{n}": f"acme {n}" for n in range(3)})
    env = {"TICKETQ_GATEWAY_TOKENS": TOKENS, "TICKETQ_GATEWAY_REVIEW_SECRET": SECRET,
           "TICKETQ_GATEWAY_ADMIN_TOKENS": f"prometheus:{token_digest(SCRAPE_TOKEN)}"}  # fmt: skip
    try:
        with running_gateway(tmp_path, server.url, QUEUE, **env) as gateway:
            yield gateway.url, server
    finally:
        server.stop()


def _jobs(target: str, token_file: Path) -> list[dict]:
    """The committed job on `target` (static: no DNS here) with its token file at `token_file`; the
    same without authorization; the same with the committed placeholder."""
    job = {**_gateway_job(), "scrape_interval": "1s", "static_configs": [{"targets": [target]}]}
    del job["dns_sd_configs"]
    placeholder = str(COMPOSE_CONFIG.parent / job["authorization"]["credentials_file"])
    no_token = {k: v for k, v in job.items() if k != "authorization"}
    return [
        {**job, "authorization": {"credentials_file": str(token_file)}},
        {**no_token, "job_name": "gateway-no-token"},
        {**job, "job_name": "gateway-placeholder", "authorization": {"credentials_file": placeholder}},
    ]


def _decide(url: str, server: RedisServer) -> None:
    """Two decisions confirmed, one corrected, and one refused: the item was decided before."""
    acme = {"Authorization": f"Bearer {ACME}"}
    items = store(server).pending("acme", 10)
    model = [item.result["fields"]["team"]["label"] for item in items]
    forms = [model[0], model[1], "billing" if model[2] != "billing" else "account"]
    for item, label in zip(items, forms, strict=True):
        answer = httpx.post(f"{url}/review/items/{item.review_id}", data={"field:team": label}, headers=acme)
        assert answer.status_code == 303, answer.text
    again = httpx.post(f"{url}/review/items/{items[0].review_id}", data={"field:team": "account"}, headers=acme)
    assert again.status_code == 409, again.text


def test_prometheus_scrapes_the_gateway_for_the_dashboard(prometheus_bins, review_gateway, tmp_path):  # noqa: F811
    url, server = review_gateway
    token_file = tmp_path / "gateway-scrape-token"
    token_file.write_text(SCRAPE_TOKEN + "\n", encoding="utf-8")  # as `echo TOKEN >` writes it: trimmed
    prom = _Prometheus(prometheus_bins["prometheus"], tmp_path, [], _jobs(url.removeprefix("http://"), token_file))
    try:
        # A scrape with no decision yet: the rates below see the counters grow from 0.
        prom.wait_for(lambda: prom.query(f'up{{job="{JOB}"}} == 1'), 30, "the gateway scraped with its token")
        _decide(url, server)
        exprs = sorted(e for e in set(_dashboard_exprs()) if "ticketq_gateway_" in e)
        assert len(exprs) == 3, exprs  # decisions, conflicts, the share corrected
        share = next(e for e in exprs if 'outcome="corrected"' in e)

        def shown() -> dict[str, list]:  # every panel's series grown: the conflict, last, scraped too
            results = {e: prom.query(e) for e in exprs}
            return results if all(rs and float(rs[0]["value"][1]) > 0 for rs in results.values()) else {}

        results = prom.wait_for(shown, 30, "the gateway's panels after the decisions")
        # One series per panel, the gateway's queue; rate() extrapolates both sides of the share alike
        # (one target's samples, both counters from 0 in the window).
        assert {e: [r["metric"] for r in rs] for e, rs in results.items()} == {e: [{"queue": QUEUE}] for e in exprs}
        assert float(results[share][0]["value"][1]) == pytest.approx(1 / 3)
        refused = prom.wait_for(lambda: len(r := prom.query('up{job=~"gateway-.*"}')) == 2 and r, 30, "scrapes")
        assert {r["metric"]["job"]: r["value"][1] for r in refused} == {"gateway-no-token": "0",
                                                                        "gateway-placeholder": "0"}, "no token"
        prom.wait_for_rule_evaluation()
        active = {a["labels"]["alertname"] for a in prom.api("alerts")["alerts"]}
        assert active == ACTIVE_WITHOUT_A_WORKER, f"a gateway's down target pages nobody: {sorted(active)}"
    finally:
        prom.close()
