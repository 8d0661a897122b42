"""The playground at ``/`` in a real headless browser against a real clm-serve.

Debian's chromium through its chromedriver (``make setup`` installs both): Selenium is handed their
paths, so Selenium Manager never looks for or downloads a browser. One clm-serve process (the tiny
Qwen3 encoder in process, heads v0001) and one browser serve the whole module; every test loads
the page afresh with empty storage. Waits are DOM conditions (WebDriverWait), never sleeps.

The server allows two origins (``CLM_SERVE_CORS_ORIGINS``): a made-up one for the preflight checks
and a plain static server on another port that serves the same page files, which then calls
clm-serve across origins (the "playground served elsewhere" case the setting is for).
"""

from __future__ import annotations

import ast
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from clm_serve.http.app import create_app
from clm_serve.http.playground_routes import PLAYGROUND_DIR
from support.browser import chromium_driver
from support.serve import serve_settings, start_serve_with_heads

from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

ALLOWED_ORIGIN = "http://playground.example"
# Rewritten by `CLM_UPDATE_SCREENSHOTS=1 pytest tests/serve/test_playground.py`.
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"
WAIT_S = 30

# ───────────────────────────── fixtures ─────────────────────────────

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass


UPSTREAM_MODELS = {"models": [{"name": "clm-latest", "description": "the reference head",
                               "release_date": "2025-01-01"}]}


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """The page's files on a plain static server on another port: another origin than clm-serve's. Beside
    them, upstream clm-serve's answers to /health and /v1/models (its own model-list shape)."""
    root = tmp_path_factory.mktemp("elsewhere")
    shutil.copy(PLAYGROUND_DIR / "index.html", root / "index.html")
    shutil.copytree(PLAYGROUND_DIR, root / "playground", ignore=shutil.ignore_patterns("index.html"))
    (root / "health").write_text(json.dumps({"ok": True, "models": ["clm-latest"]}))
    (root / "v1").mkdir()
    (root / "v1" / "models").write_text(json.dumps(UPSTREAM_MODELS))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def serve(tmp_path_factory, tiny_qwen3_dir, elsewhere):
    root = tmp_path_factory.mktemp("playground-serve")
    service, _ = start_serve_with_heads(root / "logs", root / "checkpoints", tiny_qwen3_dir,
                                        extra_env={"CLM_SERVE_CORS_ORIGINS": f"{ALLOWED_ORIGIN}, {elsewhere}/"})
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium_driver(tmp_path_factory.mktemp("chromium-profile"), 1280, 800) as driver:
        yield driver


def _wait(driver, condition, what: str, timeout: float = WAIT_S):
    try:
        return WebDriverWait(driver, timeout).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"timed out waiting for {what}; page: {_page_state(driver)}") from None


def _page_state(driver) -> str:
    return driver.execute_script(
        "return JSON.stringify({status: document.querySelector('#status-text')?.textContent,"
        " error: document.querySelector('#error')?.textContent, meta: document.querySelector('#meta')?.textContent,"
        " answers: document.querySelectorAll('[data-testid=answer]').length})")


def open_page(driver, url: str) -> list[dict]:
    """The page with empty storage (the form starts from the example), ready (models listed). Returns the
    console's entries so far and so drains it: each test then reads only what it caused."""
    driver.get(url)
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url)
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.ready === 'true'"), "the page to be ready")
    return driver.get_log("browser")


def severe(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def tid(driver_or_element, testid: str):
    return driver_or_element.find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def tids(driver_or_element, testid: str):
    return driver_or_element.find_elements(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def text_of(driver, testid: str) -> str:
    """Text of an element, shown or not (a hidden tab's code is still kept up to date)."""
    return tid(driver, testid).get_attribute("textContent")


def send_and_wait(driver, keyboard_from=None) -> None:
    """Click Send (or press Ctrl+Enter in ``keyboard_from``) and wait for what comes back."""
    driver.execute_script("document.getElementById('answers').replaceChildren();"
                          "document.getElementById('error').hidden = true;")
    if keyboard_from is None:
        tid(driver, "send").click()
    else:
        keyboard_from.send_keys(Keys.CONTROL, Keys.ENTER)
    _wait(driver, lambda d: tids(d, "answer") or d.find_element(By.ID, "error").is_displayed(), "an answer or an error")


def answers(driver) -> dict[str, dict]:
    """What the page shows per question: type, top answer, sub line, bars (label, probability, percent)."""
    out = {}
    for card in tids(driver, "answer"):
        bars = [{"label": bar.get_attribute("data-label"), "prob": float(bar.get_attribute("data-prob")),
                 "pct": float(tid(bar, "bar-pct").text.rstrip("%")), "top": "is-top" in bar.get_attribute("class")}
                for bar in tids(card, "bar")]
        out[card.get_attribute("data-qid")] = {"type": card.get_attribute("data-type"),
                                               "top": tid(card, "answer-top").text,
                                               "sub": tid(card, "answer-confidence").text, "bars": bars}
    return out


def replace_text(element, text: str) -> None:
    """Select all and type: fires the input events a user's typing fires (clear() does not)."""
    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(Keys.DELETE)
    element.send_keys(text)


# ───────────────────────────── the page ─────────────────────────────

def test_page_loads_without_console_errors_and_lists_the_served_model(serve, browser):
    loaded = open_page(browser, serve.url + "/")
    _wait(browser, lambda d: tid(d, "status").get_attribute("data-state") == "ok", "the status pill to say ready")
    assert browser.title == "clm-serve playground"
    assert "v0001" in tid(browser, "status").text
    picker = Select(tid(browser, "model"))
    assert [option.get_attribute("value") for option in picker.options][1:] == ["clm-latest", "clm", "triage", "clm-raw"]
    assert picker.first_selected_option.get_attribute("value") == "clm-latest"
    # the example is preloaded: a state and one question of each type
    assert "impossible travel" in tid(browser, "state").get_attribute("value")
    assert [q.get_attribute("data-type") for q in tids(browser, "question")] == ["choice", "noul", "score"]
    assert browser.execute_script("return [window.innerWidth, window.innerHeight]") == [1280, 800]
    # no page-level scrollbar at 1280x800: the panes scroll inside
    assert browser.execute_script("return document.documentElement.scrollHeight") <= 800
    assert [entry for entry in loaded if entry["level"] == "SEVERE"] + severe(browser) == []


def test_send_renders_an_answer_for_each_question_type(serve, browser, tmp_path):
    open_page(browser, serve.url + "/")
    send_and_wait(browser)
    shown = answers(browser)
    assert list(shown) == ["disposition", "escalate", "severity"]

    choice = shown["disposition"]
    assert choice["type"] == "choice"
    assert [bar["label"] for bar in choice["bars"]] == ["benign", "suspicious", "malicious"]  # request order
    best = max(choice["bars"], key=lambda bar: bar["prob"])
    assert choice["top"] == best["label"] and best["top"]
    # the answer's confidence: upstream's (TypeSafe's), the top probability minus the mean of the others
    rest = [bar["prob"] for bar in choice["bars"] if bar is not best]
    assert f"confidence {(best['prob'] - sum(rest) / len(rest)) * 100:.1f}%" in choice["sub"]

    noul = shown["escalate"]
    assert noul["type"] == "noul" and [bar["label"] for bar in noul["bars"]] == ["yes", "no"]
    p_yes = noul["bars"][0]["prob"]
    assert noul["top"] == ("yes" if p_yes >= 0.5 else "no")
    assert f"p(yes) {p_yes * 100:.1f}%" in noul["sub"]

    score = shown["severity"]
    assert score["type"] == "score" and [bar["label"] for bar in score["bars"]] == ["0", "1", "2", "3", "4"]
    expected = sum(i * bar["prob"] for i, bar in enumerate(score["bars"]))
    assert score["top"].startswith(f"{expected:.2f}")
    assert re.search(r"≈ (none|low|medium|high|critical)$", score["top"]), score["top"]

    for answer in shown.values():
        assert sum(bar["pct"] for bar in answer["bars"]) == pytest.approx(100, abs=0.5)
        assert sum(bar["prob"] for bar in answer["bars"]) == pytest.approx(1, abs=1e-5)
        assert sum(bar["top"] for bar in answer["bars"]) == 1
    meta = tid(browser, "meta").text
    assert "200 OK" in meta and "heads v0001" in meta and "model clm" in meta
    response = json.loads(text_of(browser, "view-response"))
    assert response["object"] == "structured_decision" and list(response["answers"]) == list(shown)

    # the same request, sent by hand, gets the same probabilities
    direct = httpx.post(serve.url + "/v1/systemone", json=json.loads(text_of(browser, "view-json")), timeout=30).json()
    assert [bar["prob"] for bar in choice["bars"]] == pytest.approx(
        [direct["answers"]["disposition"]["probabilities"][k] for k in ("benign", "suspicious", "malicious")], abs=1e-6)
    assert severe(browser) == []

    send_and_wait(browser)  # again: the picture shows a warm encoder's latency, and a second answer replaces the first
    assert list(answers(browser)) == list(shown)
    browser.save_screenshot(str(tmp_path / "playground.png"))
    assert (tmp_path / "playground.png").stat().st_size > 10_000
    if os.environ.get("CLM_UPDATE_SCREENSHOTS") == "1":  # the README's picture; a plain run leaves the tree clean
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SCREENSHOT))


def test_request_views_follow_the_form(serve, browser):
    open_page(browser, serve.url + "/")
    body = json.loads(text_of(browser, "view-json"))
    assert body["model"] == "clm-latest" and body["state"]["rule"] == "impossible travel"
    assert list(body["questions"]) == ["disposition", "escalate", "severity"]
    assert body["questions"]["severity"]["criteria"] == ["none", "low", "medium", "high", "critical"]
    curl = text_of(browser, "view-curl")
    assert curl.startswith(f"curl -sS '{serve.url}/v1/systemone'") and "impossible travel" in curl
    assert "Authorization" not in curl
    python = text_of(browser, "view-python")
    assert "httpx.post(" in python and '"impossible travel"' in python
    # copy-paste works: the Python is Python whose json= is the JSON view, and the curl command runs
    call = next(node for node in ast.walk(ast.parse(python)) if isinstance(node, ast.Call)
                and ast.unparse(node.func) == "httpx.post")
    assert ast.literal_eval(next(k.value for k in call.keywords if k.arg == "json")) == body
    if shutil.which("curl"):
        ran = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        assert list(json.loads(ran.stdout)["answers"]) == ["disposition", "escalate", "severity"]

    # an edit to the state: every view follows at once
    tid(browser, "state-format-text").find_element(By.XPATH, "..").click()
    replace_text(tid(browser, "state"), "Printer on floor 3 reports it's out of toner.")
    _wait(browser, lambda d: "out of toner" in text_of(d, "view-json"), "the JSON view to follow the state")
    assert json.loads(text_of(browser, "view-json"))["state"] == "Printer on floor 3 reports it's out of toner."
    assert "out of toner" in text_of(browser, "view-python")
    tid(browser, "tab-curl").click()
    curl = tid(browser, "view-curl").text  # the shown tab
    assert "it'\\''s out of toner" in curl  # shell-quoted

    # a JSON state keeps its key order and number spelling; broken JSON is flagged, not sent
    tid(browser, "state-format-json").find_element(By.XPATH, "..").click()
    replace_text(tid(browser, "state"), '{"b": 1.0, "2": "x", "a": [1, 2]}')
    _wait(browser, lambda d: '"b": 1.0' in text_of(d, "view-json"), "the JSON state in the view")
    assert re.search(r'"state": \{"b": 1\.0, "2": "x", "a": \[1, 2\]\}', text_of(browser, "view-json"))
    assert '"state": {"b": 1.0, "2": "x", "a": [1, 2]}' in text_of(browser, "view-python")
    tid(browser, "state").send_keys("}")
    _wait(browser, lambda d: tid(d, "state-error").is_displayed(), "the state's JSON error")
    assert text_of(browser, "view-json").startswith("// Not sendable: State is not valid JSON")
    tid(browser, "send").click()
    _wait(browser, lambda d: tid(d, "error").is_displayed(), "the client-side error")
    assert tid(browser, "error-title").text == "Not sent"

    # a JSON array is a state too; a question id edit shows up in the request
    replace_text(tid(browser, "state"), '["login from DE", "login from BR"]')
    first_id = tids(browser, "question-id")[0]
    replace_text(first_id, "verdict")
    _wait(browser, lambda d: '"verdict"' in text_of(d, "view-json"), "the new question id")
    body = json.loads(text_of(browser, "view-json"))
    assert body["state"] == ["login from DE", "login from BR"] and list(body["questions"])[0] == "verdict"
    send_and_wait(browser, keyboard_from=tid(browser, "state"))  # Ctrl+Enter sends too
    assert list(answers(browser)) == ["verdict", "escalate", "severity"]
    assert severe(browser) == []


def test_a_bad_request_shows_the_servers_error(serve, browser, tmp_path):
    open_page(browser, serve.url + "/")
    choice = tids(browser, "question")[0]
    assert choice.get_attribute("data-type") == "choice"
    while tids(choice, "remove-option"):
        tids(choice, "remove-option")[0].click()
        choice = tids(browser, "question")[0]
    _wait(browser, lambda d: json.loads(text_of(d, "view-json"))["questions"]["disposition"]["criteria"] == {},
          "a choice without options in the request")
    send_and_wait(browser)
    assert tid(browser, "error").is_displayed() and not tids(browser, "answer")
    expected = httpx.post(serve.url + "/v1/systemone", json=json.loads(text_of(browser, "view-json")), timeout=30)
    assert expected.status_code == 400
    error = expected.json()["error"]
    assert tid(browser, "error-title").text == "400 BadRequestError"
    assert tid(browser, "error-message").text == error["message"]
    assert "choice criteria must map option names" in error["message"]
    assert tid(browser, "error-param").text == f"param: {error['param']}"
    browser.save_screenshot(str(tmp_path / "playground-error.png"))
    # the only console entry is the browser's own note of the 400 response
    logged = severe(browser)
    assert all(entry["source"] == "network" and "400" in entry["message"] for entry in logged), logged


def test_the_api_key_travels_as_a_bearer_token(serve, browser):
    open_page(browser, serve.url + "/")
    browser.execute_script("""
        window.__calls = [];
        const original = window.fetch;
        window.fetch = (url, options) => { window.__calls.push([String(url), (options || {}).headers || {}]);
                                           return original(url, options); };""")
    key = tid(browser, "api-key")
    key.send_keys("s3cret-key")
    key.send_keys(Keys.TAB)  # change: reconnect (health, models) with the key
    _wait(browser, lambda d: "Authorization: Bearer $CLM_API_KEY" in text_of(d, "view-curl"),
          "the key in the curl view")
    assert "s3cret-key" not in text_of(browser, "view-curl") + text_of(browser, "view-python")  # never printed
    assert 'os.environ[\'CLM_API_KEY\']' in text_of(browser, "view-python")
    send_and_wait(browser)
    assert len(tids(browser, "answer")) == 3
    calls = browser.execute_script("return window.__calls")
    assert {url.removeprefix(serve.url) for url, _ in calls} >= {"/health", "/v1/models", "/v1/systemone"}
    assert all(headers.get("Authorization") == "Bearer s3cret-key" for _, headers in calls), calls
    assert severe(browser) == []


def test_a_playground_served_elsewhere_calls_across_origins(serve, browser, elsewhere):
    """The same page from another origin, pointed at clm-serve: allowed by CLM_SERVE_CORS_ORIGINS
    (the Authorization header makes each call a preflighted one)."""
    open_page(browser, elsewhere + "/")
    # first it talks to its own origin, whose /v1/models has upstream's shape: {"models": [{"name"}]}
    _wait(browser, lambda d: tid(d, "status").get_attribute("data-state") == "ok", "the static origin's health")
    assert [o.get_attribute("value") for o in Select(tid(browser, "model")).options] == ["", "clm-latest"]
    assert json.loads(text_of(browser, "view-json"))["model"] == "clm-latest"
    browser.get_log("browser")
    tid(browser, "base-url").send_keys(serve.url)
    tid(browser, "api-key").send_keys("cross-origin-key")
    tid(browser, "api-key").send_keys(Keys.TAB)
    _wait(browser, lambda d: tid(d, "status").get_attribute("data-state") == "ok", "clm-serve's status across origins")
    _wait(browser, lambda d: len(Select(tid(d, "model")).options) == 5, "the model list across origins")
    assert [o.get_attribute("value") for o in Select(tid(browser, "model")).options] == [
        "", "clm-latest", "clm", "triage", "clm-raw"]  # clm-serve's names (OpenAI cards, aliases included)
    assert Select(tid(browser, "model")).first_selected_option.get_attribute("value") == "clm-latest"
    assert text_of(browser, "view-curl").startswith(f"curl -sS '{serve.url}/v1/systemone'")
    send_and_wait(browser)
    assert len(tids(browser, "answer")) == 3, tid(browser, "error").text
    assert "heads v0001" in tid(browser, "meta").text  # an exposed header (Access-Control-Expose-Headers)
    assert [entry for entry in severe(browser) if "CORS" in entry["message"]] == []


# ───────────────────────────── HTTP ─────────────────────────────

def test_page_and_assets_have_content_types_and_cache_control(serve):
    with httpx.Client(base_url=serve.url, timeout=10) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["cache-control"] == "no-cache"
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert client.get("/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
        for name, media_type in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
            asset = client.get(f"/playground/{name}")
            assert asset.status_code == 200 and asset.headers["content-type"] == f"{media_type}; charset=utf-8"
            assert asset.headers["cache-control"] == "no-cache" and asset.headers["etag"]
            assert f'src="playground/{name}"' in page.text or f'href="playground/{name}"' in page.text
        missing = client.get("/playground/secrets.txt")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        # nothing external: no http(s) URL is loaded by the page
        assert not re.search(r'(src|href)="https?:', page.text)
        assert "/" not in client.get("/openapi.json").json()["paths"]  # no part of the API


def test_cors_preflight_answers_with_the_allowed_origin(serve):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with httpx.Client(base_url=serve.url, timeout=10) as client:
        decisions_before = _decisions_counted(client)
        allowed = client.options("/v1/systemone", headers={"Origin": ALLOWED_ORIGIN, **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        refused = client.options("/v1/systemone", headers={"Origin": "http://evil.example", **preflight})
        assert "access-control-allow-origin" not in refused.headers
        simple = client.get("/v1/models", headers={"Origin": ALLOWED_ORIGIN})
        assert simple.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert "x-clm-heads-version" in simple.headers["access-control-expose-headers"].lower()
        assert _decisions_counted(client) == decisions_before  # a preflight is no decision: not in the metrics


def _decisions_counted(client: httpx.Client) -> float:
    samples = re.findall(r"^clm_serve_request_latency_seconds_count (\S+)$", client.get("/metrics").text, re.M)
    return float(samples[0]) if samples else 0.0


@pytest.mark.anyio
async def test_playground_off_is_404_and_cors_off_sends_no_headers(tmp_path, tiny_qwen3_dir):
    app = create_app(serve_settings(tmp_path, tiny_qwen3_dir, playground=False))  # its routes need no heads
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://clm-serve") as client:
        page = await client.get("/")
        assert page.status_code == 404 and page.json()["error"]["type"] == "NotFoundError"
        assert (await client.get("/playground/playground.js")).status_code == 404
        preflight = await client.options("/v1/systemone", headers={
            "Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers
    on = create_app(serve_settings(tmp_path, tiny_qwen3_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=on), base_url="http://clm-serve") as client:
        assert (await client.get("/")).status_code == 200  # the default: on
