"""The web page in a real browser (headless Chromium) with its server stubbed: the page's
files come from a plain static server, and `fetch` answers /v1/models, the engine stream
(events built by the real EngineView) and the chat from the test. Fast (no engine), and
what it checks is what a reader of the page sees:

- each chart's headline is the series' latest value, and the axis maximum is drawn
  labelled "max";
- the request timeline under load: every row drawn keeps its label, the rows that do not
  fit are counted as "+N more", and the time axis is a window (old finished requests scroll
  off instead of piling up at its left edge);
- the chat leaves temperature and top_p out of the request unless set (the server's
  defaults apply), and each answer names the temperature it was sampled at."""

from __future__ import annotations

import functools
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagoda.engine.stats.request_timeline import RequestTimeline
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.entrypoints.web.engine_view import NUM_TIMELINE_REQUESTS, EngineView
from pagoda.entrypoints.web.routes import STATIC_DIR
from tests.entrypoints.web_browser import (
    ARTIFACTS,
    CANVAS_TEXT,
    By,
    Keys,
    by_id,
    chromium,
    console_errors,
    drawn_text,
    wait,
)

NOW = 1003.0
NUM_OLD, NUM_RECENT = 5, NUM_TIMELINE_REQUESTS - 6
LONG_ID = "chatcmpl-0123456789abcdef0123456789abcdef"  # in flight for 100 s


def timeline_records() -> list[RequestTimeline]:
    """NUM_TIMELINE_REQUESTS records as of NOW: NUM_OLD finished 200 s ago, one long one
    still decoding since 100 s ago, and NUM_RECENT finished in the last minute."""
    old = [RequestTimeline(f"cmpl-old-{i}", NOW - 300 + i, 10, ((NOW - 299 + i, NOW - 298, 10),),
                           NOW - 298 + i, NOW - 200, "stop", 20) for i in range(NUM_OLD)]
    long = RequestTimeline(LONG_ID, NOW - 100, 30, ((NOW - 99.5, NOW - 99, 30),), NOW - 99)
    recent = [RequestTimeline(f"cmpl-recent-{i:02d}", NOW - 50 + i, 12,
                              ((NOW - 49.8 + i, NOW - 49.5 + i, 12),), NOW - 49.5 + i,
                              NOW - 40 + 1.5 * i, "length", 24) for i in range(NUM_RECENT)]
    return [*old, long, *recent]


def engine_events() -> list[str]:
    """Four ticks, one a second up to NOW: generation rates 40, 20 then 0 tokens/s (the
    first tick has none), so the charts' latest value (0) differs from their maximum (40)."""
    clock = iter([NOW - 3, NOW - 2, NOW - 1, NOW])
    view = EngineView("m", clock=lambda: next(clock))
    records = tuple(timeline_records())
    return [json.dumps(view.tick(EngineSnapshot(num_generation_tokens=n, num_kv_blocks=64,
                                                num_free_kv_blocks=60,
                                                request_timelines=records)))
            for n in (0, 40, 40, 40)]


STUB = CANVAS_TEXT + """
window.__sent = [];
const sse = (events, hold) => new Response(new ReadableStream({ start(controller) {
  for (const e of events) controller.enqueue(new TextEncoder().encode(`data: ${e}\\n\\n`));
  if (!hold) controller.close();  // (held: the engine stream stays open, as the server's)
} }), { headers: { "Content-Type": "text/event-stream" } });
const chunk = (content) => JSON.stringify({ choices: [{ index: 0, delta: { content } }] });
const pageFetch = window.fetch;
window.fetch = async (url, options = {}) => {
  const path = String(url);
  if (path === "/v1/models") return Response.json({ data: [{ id: "m" }] });
  if (path.startsWith("/v1/engine/stream")) return sse(ENGINE_EVENTS, true);
  if (path === "/v1/chat/completions") {
    window.__sent.push(JSON.parse(options.body));
    return sse([chunk("Paris"), chunk("."), "[DONE]"], false);
  }
  return pageFetch(url, options);
};
"""


class StaticHandler(SimpleHTTPRequestHandler):
    """/ is index.html, /static/NAME the file: the routes of pagoda/entrypoints/web/."""

    def translate_path(self, path: str) -> str:
        path = path.split("?", 1)[0]
        path = "/index.html" if path == "/" else path.removeprefix("/static")
        return super().translate_path(path)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def page():
    handler = functools.partial(StaticHandler, directory=str(STATIC_DIR))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stub = STUB.replace("ENGINE_EVENTS", f"[{', '.join(json.dumps(e) for e in engine_events())}]")
    try:
        with chromium(stub) as driver:
            driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
            wait(driver, lambda d: int(by_id(d, "engine").get_attribute("data-ticks")) == 4, 20,
                 "the engine view did not take the stubbed ticks")
            yield driver
    finally:
        server.shutdown()
        server.server_close()


def test_chart_headline_is_the_latest_value_and_the_axis_maximum_says_max(page) -> None:
    headline = by_id(page, "throughput-now").text
    assert headline == "now generated 0.0 · prompt 0.0", headline
    texts = drawn_text(page, "throughput-chart")
    assert texts == ["max 40.0 tok/s"], texts  # the axis top, named; no other number drawn
    label = by_id(page, "throughput-chart").get_attribute("aria-label")
    assert "now generated 0.0, prompt 0.0 tok/s" in label and "max 40.0 tok/s" in label
    # the latency charts likewise (one value per percentile of the finished requests)
    assert by_id(page, "ttft-now").text.startswith("now p50 ")
    assert drawn_text(page, "ttft-chart")[0].startswith("max ")


def test_timeline_keeps_every_row_labelled_and_windows_the_time_axis(page) -> None:
    texts = drawn_text(page, "timeline")
    label = by_id(page, "timeline").get_attribute("aria-label")
    in_window = 1 + NUM_RECENT  # the old ones finished 200 s ago: scrolled off
    more = [t for t in texts if t.startswith("+")]
    assert len(more) == 1 and more[0].endswith(" more"), texts
    num_hidden = int(more[0][1:].split()[0])
    row_labels = [t for t in texts if t.startswith(("cmpl-", "…"))]
    assert len(row_labels) + num_hidden == in_window, texts
    # rows of at least 12 px (11 px text) in the 240 px canvas, less the axis: at most 18
    assert 10 <= len(row_labels) <= 18, texts
    assert f"{len(row_labels)} requests in the last 60 s, {num_hidden} more not shown" in label
    assert not any("old" in t for t in texts), "finished before the window: should be gone"
    # the long request (oldest in flight) keeps its row, its id cut from the left to fit
    (long_label,) = [t for t in texts if t.startswith("…")]
    assert LONG_ID.endswith(long_label[1:]) and len(long_label) < len(LONG_ID)
    # kept: the in-flight one, then the most recently finished
    shown = sorted(int(t.removeprefix("cmpl-recent-")) for t in row_labels if "recent" in t)
    assert shown == list(range(NUM_RECENT - len(shown), NUM_RECENT))
    assert "-60 s" in texts and "now" in texts  # the axis: a one-minute window


def test_chat_leaves_sampling_to_the_server_unless_set_and_names_the_temperature(page) -> None:
    assert by_id(page, "temperature").get_attribute("value") == ""
    by_id(page, "message").send_keys("What is the capital of France?" + Keys.ENTER)
    wait(page, lambda d: by_id(d, "chat").get_attribute("data-state") == "done", 10)
    sent = page.execute_script("return window.__sent")
    assert len(sent) == 1 and "temperature" not in sent[0] and "top_p" not in sent[0], sent
    assert sent[0]["max_tokens"] == 256  # (a cap stays: every request has one)
    answers = page.find_elements(By.CSS_SELECTOR, "#conversation .message.assistant")
    assert answers[0].find_element(By.CSS_SELECTOR, ".text").text == "Paris."
    note = answers[0].find_element(By.CSS_SELECTOR, ".sampling").text.strip()
    assert note == "· temperature 1 (server default)", note

    page.find_element(By.CSS_SELECTOR, "#settings summary").click()  # open the settings
    for field, value in [("temperature", "0"), ("top-p", "0.9")]:
        by_id(page, field).send_keys(value)
    by_id(page, "message").send_keys("And of Italy?" + Keys.ENTER)
    wait(page, lambda d: len(d.execute_script("return window.__sent")) == 2
         and by_id(d, "chat").get_attribute("data-state") == "done", 10)
    sent = page.execute_script("return window.__sent")[1]
    assert sent["temperature"] == 0 and sent["top_p"] == 0.9, sent
    answers = page.find_elements(By.CSS_SELECTOR, "#conversation .message.assistant")
    note = answers[1].find_element(By.CSS_SELECTOR, ".sampling").text.strip()
    assert note == "· temperature 0 · top_p 0.9", note
    page.save_screenshot(str(ARTIFACTS / "web-page-stubbed.png"))
    errors = console_errors(page)
    assert errors == [], errors
