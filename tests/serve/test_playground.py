"""The playground at ``/`` in a real headless browser against a real clm-serve.

Debian's chromium through its chromedriver (``make setup`` installs both): Selenium is handed their
paths, so Selenium Manager never looks for or downloads a browser. One clm-serve process (the tiny
Qwen3 encoder in process, heads v0001) and one browser serve the whole module; every test loads
the page afresh with empty storage. Waits are DOM conditions (WebDriverWait), never sleeps.

The server allows two origins (``CLM_SERVE_CORS_ORIGINS``): a made-up one for the preflight checks
and a plain static server on another port that serves the same page files, which then calls
clm-serve across origins (the "playground served elsewhere" case the setting is for).

The page speaks three dialects (vLLM's /v1/systemone, upstream contrastive-lm's client, OpenAI's
/v1/decisions) from one form: the tests switch between them, run each dialect's code as shown (the
Python in subprocesses: httpx, upstream's CLMClient from its unpacked wheel, the openai SDK) and check
that the same form gets the same probabilities in all three.
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

import sys

import httpx
import pytest

from clm.texts import join_state, render_state
from clm_serve.http.app import create_app
from clm_serve.http.playground_routes import PLAYGROUND_DIR
from support.browser import chromium_driver
from support.serve import serve_settings, start_serve_with_heads
from support.upstream import upstream_env, upstream_guard

from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

ALLOWED_ORIGIN = "http://playground.example"
DIALECTS = ("systemone", "upstream", "decisions")  # the page's API picker, in its order
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


def served_models(serve) -> list[str]:
    """The model names clm-serve lists (its OpenAI cards): the default heads first, then their aliases, the
    published names and clm-raw; the page must list the same, in the same order."""
    names = [card["id"] for card in httpx.get(serve.url + "/v1/models", timeout=10).json()["data"]]
    assert names[0] == "clm-latest" and {"clm", "triage", "clm-raw"} <= set(names), names
    return names


def replace_text(element, text: str) -> None:
    """Select all and type: fires the input events a user's typing fires (clear() does not)."""
    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(Keys.DELETE)
    element.send_keys(text)


def pick_dialect(driver, dialect: str) -> None:
    """Click the API picker's label (its radio is visually hidden, as a segmented control's is) and wait
    for the page to follow: the route shown and the request view."""
    tid(driver, f"dialect-{dialect}").find_element(By.XPATH, "..").click()
    route = "POST /v1/decisions" if dialect == "decisions" else "POST /v1/systemone"
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.dialect") == dialect
          and tid(d, "route").text == route, f"the page to switch to {dialect}")


def notes(driver) -> list[str]:
    return [note.get_attribute("textContent") for note in tids(driver, "dialect-note")]


def run_python(code: str, env: dict | None = None) -> str:
    """Run a code view's Python as a user would paste it; its stdout."""
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env or dict(os.environ))
    assert ran.returncode == 0, f"{ran.stderr[-3000:]}\n--- the code:\n{code}"
    return ran.stdout


# ───────────────────────────── the page ─────────────────────────────

def test_page_loads_without_console_errors_and_lists_the_served_model(serve, browser):
    loaded = open_page(browser, serve.url + "/")
    _wait(browser, lambda d: tid(d, "status").get_attribute("data-state") == "ok", "the status pill to say ready")
    assert browser.title == "clm-serve playground"
    assert "v0001" in tid(browser, "status").text
    picker = Select(tid(browser, "model"))
    # what the server lists (its aliases are its settings' to change), in its order
    assert [option.get_attribute("value") for option in picker.options][1:] == served_models(serve)
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
    served = served_models(serve)  # clm-serve's names (OpenAI cards, aliases included)
    _wait(browser, lambda d: len(Select(tid(d, "model")).options) == 1 + len(served), "the model list across origins")
    assert [o.get_attribute("value") for o in Select(tid(browser, "model")).options] == ["", *served]
    assert Select(tid(browser, "model")).first_selected_option.get_attribute("value") == "clm-latest"
    assert text_of(browser, "view-curl").startswith(f"curl -sS '{serve.url}/v1/systemone'")
    send_and_wait(browser)
    assert len(tids(browser, "answer")) == 3, tid(browser, "error").text
    assert "heads v0001" in tid(browser, "meta").text  # an exposed header (Access-Control-Expose-Headers)
    assert [entry for entry in severe(browser) if "CORS" in entry["message"]] == []


# ───────────────────────────── the three dialects ─────────────────────────────

def _python_call(python: str, callee: str) -> ast.Call:
    return next(node for node in ast.walk(ast.parse(python)) if isinstance(node, ast.Call)
                and ast.unparse(node.func) == callee)


def test_picking_a_dialect_changes_the_request_and_the_code(serve, browser):
    open_page(browser, serve.url + "/")
    state = json.loads(tid(browser, "state").get_attribute("value"))  # the example: a JSON state
    instructions = tid(browser, "instructions").get_attribute("value")
    # the text the model reads of state + instructions: what the dialects without either are sent
    read = join_state(render_state(state), instructions)
    temperature = browser.find_element(By.ID, "temperature-field")

    # vLLM's /v1/systemone, the default: the form as it is
    assert browser.execute_script("return document.body.dataset.dialect") == "systemone"
    assert tid(browser, "route").text == "POST /v1/systemone"
    assert "is-current" in tid(browser, "differences-systemone").get_attribute("class")
    assert not temperature.is_displayed() and not tid(browser, "dialect-notes").is_displayed()
    systemone = json.loads(text_of(browser, "view-json"))
    assert systemone["state"] == state and systemone["instructions"] == instructions
    assert "httpx.post(" in text_of(browser, "view-python")

    # upstream contrastive-lm: the same route, CLMClient's body (no instructions: they end the state)
    pick_dialect(browser, "upstream")
    body = json.loads(text_of(browser, "view-json"))
    assert list(body) == ["state", "model", "questions"] and body["state"] == read
    assert body["model"] == "clm-latest" and body["questions"] == systemone["questions"]
    assert text_of(browser, "view-curl").startswith(f"curl -sS '{serve.url}/v1/systemone'")
    python = text_of(browser, "view-python")
    assert python.startswith("from clm import CLMClient, Choice, Noul, Score\n")
    assert f'CLMClient(base_url="{serve.url}")' in python and "client.system_one(" in python
    call = _python_call(python, "client.system_one")
    assert ast.literal_eval(next(k.value for k in call.keywords if k.arg == "state")) == read
    # each question is upstream's class with the body's fields as its arguments
    questions = next(k.value for k in call.keywords if k.arg == "questions")
    assert [ast.literal_eval(key) for key in questions.keys] == list(body["questions"])
    assert [ast.unparse(q.func) for q in questions.values] == ["Choice", "Noul", "Score"]
    assert [{"type": spec["type"], **{k.arg: ast.literal_eval(k.value) for k in q.keywords}}
            for q, spec in zip(questions.values, body["questions"].values())] == list(body["questions"].values())
    assert any("appended to the state" in note for note in notes(browser))
    assert "is-current" in tid(browser, "differences-upstream").get_attribute("class")
    assert "is-current" not in tid(browser, "differences-systemone").get_attribute("class")
    # upstream's temperature: a field of this dialect only, sent when given
    assert temperature.is_displayed()
    tid(browser, "temperature").send_keys("0.5")
    _wait(browser, lambda d: json.loads(text_of(d, "view-json")).get("temperature") == 0.5, "the temperature")
    assert "    temperature=0.5,\n" in text_of(browser, "view-python")

    # OpenAI's decisions: another route, questions a list, predicate for noul, the input text
    pick_dialect(browser, "decisions")
    body = json.loads(text_of(browser, "view-json"))
    assert list(body) == ["model", "input", "questions"] and body["input"] == read
    assert [(q["type"], q["name"]) for q in body["questions"]] == [
        ("choice", "disposition"), ("predicate", "escalate"), ("score", "severity")]
    assert body["questions"][0]["choices"] == [
        {"value": name, "description": description}
        for name, description in systemone["questions"]["disposition"]["criteria"].items()]
    assert body["questions"][1] == {"type": "predicate", "name": "escalate", "instructions": "Escalate to tier 2?"}
    assert body["questions"][2]["levels"] == [{"label": level} for level in ("none", "low", "medium", "high", "critical")]
    assert text_of(browser, "view-curl").startswith(f"curl -sS '{serve.url}/v1/decisions'")
    python = text_of(browser, "view-python")
    assert "from openai import OpenAI" in python and f'OpenAI(base_url="{serve.url}/v1"' in python
    call = _python_call(python, "client.decisions.create")
    assert {k.arg: ast.literal_eval(k.value) for k in call.keywords} == body  # copy-paste: the same request
    shown = notes(browser)
    assert any("predicate has no true/false descriptions" in note and "escalate" in note for note in shown), shown
    assert any("Temperature is contrastive-lm's" in note for note in shown), shown  # kept, not sent
    assert not temperature.is_displayed()
    assert "is-current" in tid(browser, "differences-decisions").get_attribute("class")
    differences = text_of(browser, "differences")
    for words in ("questions a list", "predicate", "typed values", "no temperature", "diagnostics", "clm-raw"):
        assert words in differences, words

    # the choice is kept with the form: a reload opens in the same dialect
    browser.refresh()
    _wait(browser, lambda d: d.execute_script("return document.body.dataset.ready === 'true'"), "the page again")
    assert tid(browser, "dialect-decisions").is_selected() and tid(browser, "route").text == "POST /v1/decisions"
    assert severe(browser) == []


def test_each_dialects_code_runs_as_shown(serve, browser):
    """The curl command and the Python of every dialect, pasted into a shell and a Python process, get
    their answers: httpx for vLLM's, upstream's own CLMClient (its wheel, never our clm), the openai SDK."""
    open_page(browser, serve.url + "/")
    for dialect in DIALECTS:
        pick_dialect(browser, dialect)
        if shutil.which("curl"):
            ran = subprocess.run(["bash", "-c", text_of(browser, "view-curl")], capture_output=True, text=True,
                                 timeout=60)
            assert ran.returncode == 0, ran.stderr
            answered = json.loads(ran.stdout)["answers"]
            names = [a["name"] for a in answered] if dialect == "decisions" else list(answered)
            assert names == ["disposition", "escalate", "severity"], ran.stdout
        python = text_of(browser, "view-python")
        if dialect == "upstream":  # its import name is clm, like ours: the guard checks which one ran
            out = run_python(upstream_guard() + python, upstream_env())
            assert "ChoiceAnswer(choice=" in out and "NoulAnswer(noul=" in out and "ScoreAnswer(score=" in out
        else:
            out = run_python(python)
        printed = [line.split(" ", 1)[0] for line in out.splitlines()]
        assert printed == ["disposition", "escalate", "severity"], out


def test_each_dialect_answers_the_same_form_with_the_same_probabilities(serve, browser, tmp_path):
    open_page(browser, serve.url + "/")
    # a JSON state whose prose rendering (the decisions' input text) has numbers Python spells otherwise
    # (9.8e3 is 9800.0, 0.750 is 0.75), nesting and an integer-like key to get right, else the model
    # reads another text in that dialect
    state = '{"rule": "impossible travel", "risk": 0.750, "geo": {"km": 9.8e3, "countries": ["DE", "BR"]}, "2": true}'
    replace_text(tid(browser, "state"), state)
    # the one part of the example a predicate cannot carry: the noul's true/false descriptions
    for field in ("truth-true", "truth-false"):
        replace_text(tid(browser, field), "")
    _wait(browser, lambda d: "criteria" not in json.loads(text_of(d, "view-json"))["questions"]["escalate"],
          "a noul without descriptions")

    shown = {}
    for dialect in DIALECTS:
        pick_dialect(browser, dialect)
        assert not any("predicate" in note for note in notes(browser))  # nothing is left out
        if dialect == "decisions":  # the input is the text clm-serve renders from the state, byte for byte
            assert json.loads(text_of(browser, "view-json"))["input"] == join_state(
                render_state(json.loads(state)), tid(browser, "instructions").get_attribute("value"))
        send_and_wait(browser)
        assert not tid(browser, "error").is_displayed(), tid(browser, "error").text
        shown[dialect] = answers(browser)
        assert list(shown[dialect]) == ["disposition", "escalate", "severity"]
        assert tid(browser, "meta").text.startswith("200 OK · " + {"systemone": "vLLM", "upstream": "contrastive-lm",
                                                                   "decisions": "OpenAI"}[dialect])
        response = json.loads(text_of(browser, "view-response"))
        if dialect == "decisions":  # OpenAI's shape: a list of answers in question order, named
            assert [(a["type"], a["name"]) for a in response["answers"]] == [
                ("choice", "disposition"), ("predicate", "escalate"), ("score", "severity")]
            assert "diagnostics" not in response
        else:  # vLLM's shape, which upstream's client reads too
            assert response["object"] == "structured_decision" and list(response["diagnostics"]) == list(shown[dialect])
        browser.save_screenshot(str(tmp_path / f"playground-{dialect}.png"))
        assert (tmp_path / f"playground-{dialect}.png").stat().st_size > 10_000

    assert [a["type"] for a in shown["decisions"].values()] == ["choice", "predicate", "score"]
    assert [a["type"] for a in shown["upstream"].values()] == ["choice", "noul", "score"]
    reference = shown["systemone"]
    for dialect in ("upstream", "decisions"):
        for qid, answer in shown[dialect].items():
            assert [bar["label"] for bar in answer["bars"]] == [bar["label"] for bar in reference[qid]["bars"]]
            assert [bar["prob"] for bar in answer["bars"]] == pytest.approx(
                [bar["prob"] for bar in reference[qid]["bars"]], abs=1e-6), (dialect, qid)
            assert answer["top"] == reference[qid]["top"]

    # upstream's temperature reaches the server: 4 flattens every distribution
    pick_dialect(browser, "upstream")
    tid(browser, "temperature").send_keys("4")
    _wait(browser, lambda d: json.loads(text_of(d, "view-json")).get("temperature") == 4, "the temperature")
    send_and_wait(browser)
    flat = answers(browser)
    for qid, answer in flat.items():
        assert max(bar["prob"] for bar in answer["bars"]) < max(bar["prob"] for bar in reference[qid]["bars"]), qid
    assert severe(browser) == []


def test_decisions_without_a_model_is_not_sent(serve, browser):
    """OpenAI's decisions require a model (the others fall back to the server's or CLMClient's default)."""
    open_page(browser, serve.url + "/")
    pick_dialect(browser, "decisions")
    Select(tid(browser, "model")).select_by_value("")
    _wait(browser, lambda d: text_of(d, "view-json").startswith("// Not sendable: OpenAI’s decisions need a model"),
          "the missing model flagged")
    tid(browser, "send").click()
    _wait(browser, lambda d: tid(d, "error").is_displayed(), "the client-side error")
    assert tid(browser, "error-title").text == "Not sent"
    pick_dialect(browser, "upstream")  # CLMClient sends its default model: the JSON says which
    assert json.loads(text_of(browser, "view-json"))["model"] == "clm-latest"
    assert any("CLMClient sends clm-latest" in note for note in notes(browser))
    assert "model=" not in text_of(browser, "view-python")


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
