"""The cluster's page that ``mlxpipe serve`` serves at ``/``, in a real browser.

Debian's headless Chromium, driven by Selenium through the system's chromedriver, loads the page from the
session's shared 2-rank server (``server``: it has an API key, which the test types in as a user would),
checks each rank's host and layers against ``/health``, and chats through the page's box; a second, small
server (a tiny model, no key) has a rank killed, and the page must say ``restarting``, then ``ready``.
Outside CI a missing browser skips these tests, saying what to install; under CI (``CI`` set) it fails them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fixtures.browser import open_page as _open
from fixtures.browser import page_status as _status
from fixtures.browser import page_text as _text
from fixtures.browser import until as _until
from fixtures.processes import local_rank_processes
from fixtures.serve_process import KEY, ServeProcess, ready_server

RELAUNCH_SECONDS = 180.0  # the ranks' relaunch, longer than the page's WAIT_SECONDS


@pytest.mark.ranks
def test_the_page_shows_every_rank_as_health_reports_it_and_chats(server: ServeProcess, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, server.base, KEY)
    health = server.health()
    for rank in health["ranks"]:
        card = browser.find_element(By.CSS_SELECTOR, f'#ranks .rank[data-rank="{rank["rank"]}"]')
        start, end = rank["layers"]
        assert card.find_element(By.CLASS_NAME, "host").text == rank["host"]
        assert card.find_element(By.CLASS_NAME, "layers").text.startswith(f"layers {start}–{end - 1}")
        assert card.find_element(By.CLASS_NAME, "state").text == "ready"
        # A tensor-parallel group only where /health names one.
        assert bool(card.find_elements(By.CLASS_NAME, "group")) == any(k in rank for k in ("tp", "stage"))
    # In layer order: the first card holds layer 0.
    first = browser.find_element(By.CSS_SELECTOR, "#ranks .rank").get_attribute("data-rank")
    assert next(r for r in health["ranks"] if r["layers"][0] == 0)["rank"] == int(first)
    assert _status(browser) == "ready"

    browser.find_element(By.TAG_NAME, "summary").click()  # the options
    for field, value in (("temperature", "0"), ("max-tokens", "6"), ("system", "Answer in one word.")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.ID, "chat-input").send_keys("What is the capital of France?")
    browser.find_element(By.ID, "send").click()
    reply = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, '.msg.assistant[data-done="true"]'), "a reply")
    assert not reply.find_elements(By.CLASS_NAME, "error"), reply.text
    request_id = reply.get_attribute("data-request-id")
    streamed = browser.execute_script("return arguments[0].textContent", reply.find_element(By.CLASS_NAME, "text"))
    # The same request through the API, greedy: the page showed the model's reply, whole.
    body = {"messages": [{"role": "system", "content": "Answer in one word."},
                         {"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 6, "temperature": 0}
    answer = httpx.post(f"{server.url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=120).json()
    assert streamed == answer["choices"][0]["message"]["content"] and streamed
    row = _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f'#requests tr[data-id="{request_id}"]'),
                 f"{request_id} in the recent requests")[0]
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == request_id and cells[1] in ("stop", "length") and 0 < int(cells[4]) <= 6, cells


@pytest.mark.ranks
def test_a_refused_request_is_listed_with_its_door_field_and_reason(server: ServeProcess, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    refused = httpx.post(f"{server.base}/v1/messages", headers={"x-api-key": KEY}, timeout=30,
                         json={"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]})
    assert refused.status_code == 400
    _open(browser, server.base, KEY)
    row = _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#requests tr[data-status="400"]'),
                 "the refused request in the recent requests")[0]
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[:2] == ["anthropic", "refused 400"], cells
    why = row.find_element(By.XPATH, "following-sibling::tr[1]").text
    assert why.startswith("POST /v1/messages · messages[0]: 'messages[0]' must be an object"), why


@pytest.mark.ranks
def test_the_page_is_open_and_its_data_behind_the_key(server: ServeProcess) -> None:
    page = httpx.get(f"{server.base}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "page/page.js" in page.text and "http" not in page.text.split("<body>", 1)[1]  # nothing from elsewhere
    assert httpx.get(f"{server.base}/page/page.js", timeout=30).status_code == 200
    refused = httpx.get(f"{server.url}/cluster", timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    data = httpx.get(f"{server.url}/cluster", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    served = [(r["host"], r["layers"]) for r in server.health()["ranks"]]
    assert [(r["host"], r["layers"]) for r in data["ranks"]] == served
    samples = data["history"]["samples"]
    assert samples and all(s["tps"] >= 0 and s["in_flight"] >= 0 for s in samples)
    assert len(samples) < 2 or samples[-1]["t"] > samples[0]["t"]


@pytest.fixture(scope="module")
def breakable(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A server of a tiny model with no key, whose ranks the test kills."""
    with ready_server(["--model", str(tiny_models["llama"]), "--hostfile", "hostfiles/local-2.json",
                       "--max-restarts", "2"], tmp_path_factory.mktemp("page-home")) as proc:
        yield proc


@pytest.mark.ranks
def test_a_killed_rank_shows_restarting_then_ready(breakable: ServeProcess, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, breakable.base, key=None)
    assert not browser.find_element(By.ID, "key-form").is_displayed()  # no key on this server: no question
    _until(browser, lambda d: _status(d) == "ready", "ready")
    worker = next(pid for pid, (rank, cmd) in local_rank_processes(breakable.proc.pid).items()
                  if rank == 1 and "mlxpipe.launch.supervisor" not in cmd)
    os.kill(worker, signal.SIGKILL)
    _until(browser, lambda d: _status(d) == "restarting", "restarting")
    assert "rank 1" in _text(browser, "#detail"), _text(browser, "#detail")  # the root cause, named
    _until(browser, lambda d: _status(d) == "ready", "ready again", timeout=RELAUNCH_SECONDS)
    assert _text(browser, "#restarts") == "1 restart"
    states = {e.get_attribute("data-rank"): e.get_attribute("data-state")
              for e in browser.find_elements(By.CSS_SELECTOR, "#ranks .rank")}
    assert states == {"0": "ready", "1": "ready"}
