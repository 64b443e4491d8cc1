"""The chat page at / in a real headless browser (Selenium + Debian's chromium and chromedriver).

Skips when chromium or chromedriver is missing - except when GENIE_RT_REQUIRE_BROWSER=1, where
a missing browser is a failure, so the check cannot pass by skipping: .ci/run installs Debian's
`chromium` and `chromium-driver` and sets it once they are in (the machines reach Debian's packages; Playwright's own browser download and
Selenium Manager's reach a CDN, which they do not), selenium comes with the test extra. The server is the fixture's
tokenizer and template with scripted replies, so the page is shown reasoning, content and a tool
call exactly as a Qwen3 model writes them, and a slow reply for the stop button.
"""
from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from genie_rt.engine.config import EngineConfig
from genie_rt.engine.engine import Engine
from genie_rt.server.app import ServerSettings, create_app

from test_server_support import ScriptedEngine, running_server

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
REQUIRED = os.environ.get("GENIE_RT_REQUIRE_BROWSER", "") == "1"
pytestmark = [pytest.mark.skipif(not (CHROMIUM and DRIVER) and not REQUIRED,
                                 reason="no chromium/chromedriver installed (apt-get install chromium chromium-driver)"),
              pytest.mark.slow]   # a browser start takes seconds

TOOLS_CALL = '<tool_call>\n{"name": "light_set", "arguments": {"room": "kitchen"}}\n</tool_call>'


@pytest.fixture(scope="module")
def page_server(fixture_gguf):
    real = Engine.load(fixture_gguf, EngineConfig(backend="cpu", n_ctx=256))
    engine = ScriptedEngine(real)
    app = create_app(engine, ServerSettings(api_key="secret"))
    with running_server(app) as (base, _, _):
        yield engine, base


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and DRIVER):
        pytest.fail("GENIE_RT_REQUIRE_BROWSER=1 and no chromium/chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # the background-networking flags: this machine's network is closed, and Chromium's own
    # connections would otherwise be refused many at a time
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _send(browser, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def _last_assistant(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def test_page_is_public_and_off_with_no_webui(page_server, fixture_gguf):
    engine, base = page_server
    r = httpx.get(base + "/")
    assert r.status_code == 200 and r.text.lower().startswith("<!doctype html>")   # no API key needed
    assert httpx.get(base + "/v1/models").status_code == 401                         # the API still does
    app = create_app(engine, ServerSettings(webui=False))
    with running_server(app) as (other, _, _):
        assert httpx.get(other + "/").status_code == 404


def test_chat_streams_reasoning_apart_tool_calls_and_speed(page_server, browser):
    engine, base = page_server
    engine.reply = lambda req: ["<think>", "the user", " wants light", "</think>", "Turning it", " on. ", TOOLS_CALL]
    browser.get(base + "/")
    browser.find_element(By.ID, "apikey").send_keys("secret")
    browser.find_element(By.CSS_SELECTOR, "details summary").click()
    browser.find_element(By.ID, "tools").send_keys(
        '[{"type": "function", "function": {"name": "light_set", "parameters": {"type": "object"}}}]')
    _send(browser, "Kitchen light on")
    wait = WebDriverWait(browser, 20)
    wait.until(lambda b: _last_assistant(b).find_elements(By.CSS_SELECTOR, ".stats")
               and not b.find_element(By.ID, "send").get_attribute("disabled"))
    msg = _last_assistant(browser)
    assert msg.find_element(By.CSS_SELECTOR, ".reasoning").text == "the user wants light"
    assert msg.find_element(By.CSS_SELECTOR, ".content").text == "Turning it on."
    assert "light_set" in msg.find_element(By.CSS_SELECTOR, ".tool-call").text
    assert "tokens/s" in msg.find_element(By.CSS_SELECTOR, ".stats").text
    # the request the page made: streamed, with the key, the user's text
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt)
    assert "Kitchen light on" in prompt and "light_set" in prompt          # the tools reached the template
    browser.find_element(By.ID, "tools").clear()


def test_stop_button_cancels_the_generation(page_server, browser):
    engine, base = page_server
    engine.reply = lambda req: ["Once"] + [0.05, " more"] * 400          # ~20 s unless stopped
    browser.get(base + "/")
    browser.find_element(By.ID, "apikey").clear()
    browser.find_element(By.ID, "apikey").send_keys("secret")
    n_before = len(engine.finished)
    _send(browser, "Tell me a long story")
    wait = WebDriverWait(browser, 20)
    wait.until(lambda b: "more" in _last_assistant(b).find_element(By.CSS_SELECTOR, ".content").text)
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda b: "stopped" in _last_assistant(b).text)
    deadline = time.monotonic() + 10
    while len(engine.finished) == n_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.finished[-1] == "cancelled"                          # the server stopped generating
