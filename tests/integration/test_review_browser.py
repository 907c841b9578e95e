"""The review page in a real browser: headless Chromium (the distribution's `chromium` and
`chromium-driver` packages) driven by Selenium, against the whole path.

Tickets of two tenants go in through a real gateway to a real worker (tiny stand-in, a schema whose
every answer is flagged for review); the worker copies them to the review stream. A reviewer of
`acme` logs in with the login form, corrects three items, and the labelled stream holds exactly
those three decisions; a second acme reviewer, whose page was loaded before, submits one of the
same items and is told it was decided already (no second decision); a reviewer of `beta` sees
none of acme's items. `ticketq reviews export` then writes those three as a labelled file that
`ticketq eval --schema` scores.

Skips (fails under CI, where .ci/run installs it) only when no chromium binary exists.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from gateways import running_gateway
from schemas import write_review_all
from servers import require_redis_server
from workers import ROOT, RedisServer, running_worker, skip_or_fail, wait_for, worker_env

from gateway.auth import token_digest
from ticketq.names import LABELLED_STREAM, REVIEW_STREAM

pytestmark = pytest.mark.integration

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
ALICE, CAROL, BOB = (f"{who}-{uuid.uuid4().hex}" for who in ("alice", "carol", "bob"))
TOKENS = f"alice@acme:{token_digest(ALICE)},carol@acme:{token_digest(CAROL)},bob@beta:{token_digest(BOB)}"
ACME = {f"A{n}": f"acme ticket {n}: my invoice {n} was charged twice" for n in range(5)}
BETA = {f"B{n}": f"beta ticket {n}: the app crashes on start" for n in range(2)}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[dict]:
    """A private Redis, a worker serving REVIEW_ALL, a gateway with acme's and beta's tokens, and
    every ticket in the review stream."""
    if CHROMIUM is None:
        skip_or_fail("no chromium binary: apt-get install -y chromium chromium-driver (make test-deps does)")
    require_redis_server()
    workdir = tmp_path_factory.mktemp("review-browser")
    schema = write_review_all(workdir)
    server = RedisServer(workdir, aof=False).start()
    queue = f"review-{uuid.uuid4().hex[:8]}"
    env = worker_env(tiny_model_dir, server.url, queue, TICKETQ_SCHEMAS=str(schema))
    gateway_env = {
        "TICKETQ_GATEWAY_TOKENS": TOKENS,
        "TICKETQ_GATEWAY_SCHEMAS": "review-all",
        "TICKETQ_GATEWAY_REVIEW_SECRET": uuid.uuid4().hex * 2,
        "TICKETQ_GATEWAY_REVIEW_INSECURE_COOKIE": "1",
    }
    try:
        with running_worker(env, workdir / "worker.log"), running_gateway(workdir, server.url, queue,
                                                                          **gateway_env) as gateway:  # fmt: skip
            for token, tickets in ((ALICE, ACME), (BOB, BETA)):
                body = [{"id": i, "text": text, "schema": "review-all"} for i, text in tickets.items()]
                auth = {"Authorization": f"Bearer {token}"}
                answer = httpx.post(f"{gateway.url}/v1/tickets", json=body, headers=auth)
                assert answer.status_code == 202, answer.text
            client = server.client()
            wait_for(lambda: client.xlen(REVIEW_STREAM) == len(ACME) + len(BETA), 120, "the review stream")
            yield {
                "url": gateway.url,
                "redis": client,
                "workdir": workdir,
                "broker": server.url,
                "model": tiny_model_dir,
            }
    finally:
        server.stop()


def browser(tmp: Path):
    """A fresh headless Chromium (its own profile: no cookies shared with another session)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--user-data-dir={tmp}"):  # fmt: skip
        options.add_argument(flag)
    driver_path = shutil.which("chromedriver")
    assert driver_path, "chromium without chromedriver: apt-get install -y chromium-driver"
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def logged_in(stack: dict, token: str, name: str):
    from selenium.webdriver.common.by import By

    driver = browser(stack["workdir"] / f"profile-{name}")
    driver.get(stack["url"] + "/review")
    driver.find_element(By.ID, "token").send_keys(token)
    submit(driver, driver.find_element(By.ID, "login"))
    headings = [h.text for h in driver.find_elements(By.TAG_NAME, "h1")]
    assert headings and headings[0].endswith(token_tenant(name)), driver.page_source[:2000]
    return driver


def token_tenant(name: str) -> str:
    return {"alice": "acme", "carol": "acme", "bob": "beta"}[name]


def shown(driver) -> list[str]:
    from selenium.webdriver.common.by import By

    return [form.get_attribute("data-ticket") for form in driver.find_elements(By.CSS_SELECTOR, "form.item")]


def correct(driver, ticket: str) -> str:
    """Choose a label other than the model's for `ticket`'s field and save; the label chosen."""
    from selenium.webdriver.common.by import By

    form = driver.find_element(By.CSS_SELECTOR, f'form.item[data-ticket="{ticket}"]')
    other = next(r for r in form.find_elements(By.CSS_SELECTOR, 'input[type="radio"]') if not r.is_selected())
    label = other.get_attribute("value")
    other.click()
    submit(driver, form.find_element(By.CSS_SELECTOR, 'button[type="submit"]'))
    return label


def submit(driver, button) -> None:
    """Click a form's button and wait until the browser shows another document (the answer). The old
    page's element is never touched after the click: mid-navigation Chromium answers for it with
    errors other than "stale" ("Node ... does not belong to the document"); each poll finds the
    current document's root afresh, and a new document's root has a new reference."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    before = driver.find_element(By.TAG_NAME, "html").id
    button.click()
    WebDriverWait(driver, 60, ignored_exceptions=(WebDriverException,)).until(
        lambda d: (
            d.find_element(By.TAG_NAME, "html").id != before
            and d.execute_script("return document.readyState") == "complete"
        )
    )


def in_stream(client: redis.Redis, tenant: str) -> list[str]:
    """`tenant`'s ticket ids in the review stream, oldest first."""
    wire = [json.loads(fields[b"data"])["id"] for _, fields in client.xrange(REVIEW_STREAM)]
    return [i.partition(":")[2] for i in wire if i.startswith(f"{tenant}:")]


def decisions(client: redis.Redis) -> list[dict]:
    return [json.loads(fields[b"data"]) for _, fields in client.xrange(LABELLED_STREAM)]


def test_a_reviewer_corrects_three_items_in_a_browser_and_each_is_written_once(stack):
    from selenium.webdriver.common.by import By

    alice, carol = logged_in(stack, ALICE, "alice"), logged_in(stack, CAROL, "carol")
    try:
        oldest_first = in_stream(stack["redis"], "acme")  # the worker's publication order (batches sort by length)
        assert sorted(oldest_first) == sorted(ACME)
        assert shown(alice) == shown(carol) == oldest_first, "acme's items, oldest first, and nothing of beta's"
        assert "beta ticket" not in alice.page_source
        chosen = {}
        for ticket in ("A0", "A2", "A4"):
            chosen[ticket] = correct(alice, ticket)
            assert f"Saved your decision on ticket {ticket}" in alice.find_element(By.ID, "message").text
        assert shown(alice) == [t for t in oldest_first if t in ("A1", "A3")]
        # carol's page was loaded before: she decides A2 too, and is told alice was first
        correct(carol, "A2")
        assert "already decided by alice@acme" in carol.find_element(By.ID, "message").text
        written = decisions(stack["redis"])
        assert [(d["id"], d["tenant"], d["expected"]["team"], d["reviewer"]) for d in written] == [
            (t, "acme", chosen[t], "alice@acme") for t in ("A0", "A2", "A4")]  # fmt: skip
        assert all(d["corrected"] == ["team"] and d["text"] == ACME[d["id"]] for d in written)
    finally:
        alice.quit()
        carol.quit()
    bob = logged_in(stack, BOB, "bob")
    try:
        assert shown(bob) == in_stream(stack["redis"], "beta"), "beta's own items"
        assert "acme ticket" not in bob.page_source, "beta sees none of acme's"
    finally:
        bob.quit()
    check_export(stack, {t: chosen[t] for t in ("A0", "A2", "A4")})


def check_export(stack: dict, chosen: dict[str, str]) -> None:
    """`ticketq reviews export` writes the three decisions; `ticketq eval --schema` scores them."""
    out = stack["workdir"] / "reviews.jsonl"
    env = {"TICKETQ_BROKER_URL": stack["broker"], "PATH": str(Path(sys.executable).parent)}
    run = subprocess.run([sys.executable, "-m", "ticketq_cli", "reviews", "export", "--out", str(out), "--tenant",
                          "acme"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["text"], r["expected"]) for r in rows] == [(t, ACME[t], {"team": c}) for t, c in chosen.items()]
    schema = stack["workdir"] / "review-all.toml"
    scored = subprocess.run([sys.executable, "-m", "ticketq_cli", "eval", str(out), "--schema", str(schema)], cwd=ROOT,
                            env={**env, "TICKETQ_MODEL": str(stack["model"]), "TICKETQ_DEVICE": "cpu",
                                 "TICKETQ_DTYPE": "float32"}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert scored.returncode == 0, scored.stderr
    assert "schema review-all: 3 of 3 rows scored" in scored.stdout, scored.stdout
