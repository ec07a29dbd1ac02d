"""The web page in a real browser (headless Chromium through selenium) against a real
`pagoda serve` with an API key: it loads without console errors, takes the key, streams a
chat answer at the server's default temperature (and says so next to it) and the README's
question greedily, stops a long one (and the server frees it), and its live engine view
moves while a background load runs, its charts' headlines and timeline rows labelled;
once more at phone size. Screenshots go to $PAGODA_TEST_ARTIFACTS (default
/tmp/pagoda-test-artifacts). test_web_page_static.py checks the drawing in detail."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.entrypoints.server_helpers import RemoteServer
from tests.entrypoints.web_browser import (
    ARTIFACTS,
    CANVAS_TEXT,
    DESKTOP_SIZE,
    By,
    Keys,
    by_id,
    chromium,
    console_errors,
    drawn_text,
    wait,
)

pytestmark = pytest.mark.slow

API_KEY = "page-key"


@pytest.fixture(scope="module")
def server():
    with RemoteServer(["--api-key", API_KEY, "--max-num-seqs", "8", "--no-access-log"]) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with chromium(CANVAS_TEXT) as driver:
        yield driver  # (quit before the server stops: an open stream would hold its shutdown)


def engine_stream_event(server: RemoteServer) -> str:
    """The first event of the live view's stream, read as a client of the server."""
    with httpx.stream("GET", server.url + "/v1/engine/stream", timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                return line[5:]
    raise AssertionError("no event")


def send(driver, text: str, max_tokens: int) -> None:
    field = by_id(driver, "max-tokens")
    driver.execute_script("arguments[0].value = arguments[1]", field, str(max_tokens))
    by_id(driver, "message").send_keys(text + Keys.ENTER)  # Enter sends


def test_the_page(server: RemoteServer, browser) -> None:
    # The page and its assets are public; the stream is behind the key like all of /v1.
    assert httpx.get(server.url + "/").status_code == 200
    assert httpx.get(server.url + "/v1/engine/stream").status_code == 401
    browser.get(server.url + "/")
    wait(browser, lambda d: "API key" in by_id(d, "status").text, 20,
         "the page should say that the models need the API key")
    assert console_errors(browser) == [] or all("401" in e["message"]
                                                for e in console_errors(browser))
    key = by_id(browser, "api-key")
    key.send_keys(API_KEY + Keys.ENTER)
    wait(browser, lambda d: by_id(d, "model").get_attribute("value"), 20, "no model listed")
    wait(browser, lambda d: int(by_id(d, "engine").get_attribute("data-ticks")) >= 3, 20,
         "the engine view gets no ticks")
    assert by_id(browser, "batch-text").text == "idle: no request running"
    assert browser.execute_script("return localStorage.getItem('pagoda.apiKey')") == API_KEY

    # A short answer streams; keyboard: Tab goes from the message to Send.
    send(browser, "Name three colors.", 24)
    wait(browser, lambda d: by_id(d, "chat").get_attribute("data-state") == "done", 90,
         "the answer did not finish")
    answers = browser.find_elements(By.CSS_SELECTOR, "#conversation .message.assistant .text")
    assert len(answers) == 1 and answers[0].text.strip()
    assert "tokens/s" in by_id(browser, "chat-stats").text
    by_id(browser, "message").send_keys(Keys.TAB)
    assert browser.switch_to.active_element.get_attribute("id") == "send"
    # the temperature field is empty: the server's default, named next to the answer
    assert by_id(browser, "temperature").get_attribute("value") == ""
    sampling = browser.find_element(By.CSS_SELECTOR, "#conversation .message.assistant .sampling")
    assert sampling.text.strip() == "· temperature 1 (server default)"

    # The README's first question, greedy, gets the README's answer.
    by_id(browser, "clear").click()
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
    by_id(browser, "temperature").send_keys("0")
    send(browser, "What is the capital of France?", 32)
    wait(browser, lambda d: by_id(d, "chat").get_attribute("data-state") == "done", 90,
         "the answer did not finish")
    answer = browser.find_element(By.CSS_SELECTOR, "#conversation .message.assistant")
    assert "Paris" in answer.find_element(By.CSS_SELECTOR, ".text").text, answer.text
    assert answer.find_element(By.CSS_SELECTOR, ".sampling").text.strip() == "· temperature 0"

    # Stop ends a long answer early, and the server frees its request.
    send(browser, "Write a very long story about a lighthouse keeper.", 1500)
    wait(browser, lambda d: len(d.find_elements(
        By.CSS_SELECTOR, "#conversation .message.assistant .text")) == 2
        and d.find_elements(By.CSS_SELECTOR, "#conversation .message.assistant .text")[1].text,
        60, "the long answer never started")
    time.sleep(0.5)
    by_id(browser, "stop").click()
    wait(browser, lambda d: by_id(d, "chat").get_attribute("data-state") == "stopped", 10,
         "Stop did not end the answer")
    stopped = browser.find_elements(By.CSS_SELECTOR, "#conversation .message.assistant")[1]
    assert "stopped" in stopped.get_attribute("class")
    deadline = time.time() + 10
    while '"running":0' not in (event := engine_stream_event(server)):
        assert time.time() < deadline, f"the stopped request still runs: {event[:300]}"
        time.sleep(0.3)
    assert '"abort":1' in event

    # The live view moves under a background load.
    generated = int(by_id(browser, "generated").text.replace(",", ""))
    stop_load = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            while not stop_load.is_set():
                client.post("/v1/completions", json={"prompt": "The history of tea:",
                                                     "max_tokens": 24, "n": 1})

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait(browser, lambda d: int(by_id(d, "q-running").text or 0) >= 2, 30,
             "the view never showed the load running")
        wait(browser, lambda d: int(by_id(d, "generated").text.replace(",", "")) > generated + 40,
             30, "the generated-token counter does not move")
        wait(browser, lambda d: by_id(d, "kv-used").text not in ("0", "–"), 10)
        time.sleep(1.5)  # let the charts fill a little
        # each chart's headline is the latest value; its canvas names the axis top "max"
        assert by_id(browser, "throughput-now").text.startswith("now generated ")
        assert drawn_text(browser, "throughput-chart")[0].startswith("max ")
        # every timeline row drawn keeps its label (the rest counted as "+N more")
        label = by_id(browser, "timeline").get_attribute("aria-label")
        num_rows = int(label.removeprefix("Request timeline: ").split()[0])
        texts = drawn_text(browser, "timeline")
        assert num_rows >= 3 and sum(t.startswith(("cmpl-", "chatcmpl-", "…"))
                                     for t in texts) == num_rows, (label, texts)
        browser.save_screenshot(str(ARTIFACTS / "web-page-desktop.png"))

        # Phone size: one column, nothing wider than the screen.
        browser.set_window_size(390, 844)
        time.sleep(1.0)
        width = browser.execute_script("return document.documentElement.scrollWidth")
        viewport = browser.execute_script("return window.innerWidth")
        assert width <= viewport, f"the page is wider ({width}px) than a phone ({viewport}px)"
        chat = by_id(browser, "chat").rect
        engine = by_id(browser, "engine").rect
        assert engine["y"] >= chat["y"] + chat["height"], "chat and engine view should stack"
        browser.save_screenshot(str(ARTIFACTS / "web-page-phone.png"))
    finally:
        stop_load.set()
        for thread in threads:
            thread.join(60)
    browser.set_window_size(*DESKTOP_SIZE)
    wait(browser, lambda d: by_id(d, "batch-text").text == "idle: no request running", 30,
         "the view does not say idle once the load stops")
    errors = [e for e in console_errors(browser) if "401" not in e["message"]]
    assert errors == [], errors
