"""The chat playground (GET /) and the live dashboard (GET /dashboard), in a real headless Chromium.

The browser is the distribution's Chromium (`make setup` installs Debian's `chromium` package
when it is absent), driven by Playwright for Python; Playwright's own browser download is never
used. Without Chromium these tests fail, they do not skip: CI installs it. Every request a page
makes is recorded, and none may go to a host other than the server. Screenshots of both pages
are saved to $CONTBATCH_TEST_ARTIFACTS (default: tests/artifacts/, git-ignored).

The server is the tiny random-weight Llama of test_server.py with the default model's tokenizer:
a greedy reply typed into the page must equal `model.generate`'s, decoded.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from contbatch import load_model
from conftest import reference_generate
from test_server import MODEL, _free_port, _spawn, chat_ids, start_server

CHROMIUM = os.environ.get("CONTBATCH_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium keeps calling home, which this closed
# network answers slowly; Playwright gives every launch a fresh profile (user data dir).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("CONTBATCH_TEST_ARTIFACTS") or Path(__file__).parent / "artifacts")
KEY = "sekrit"
TIMEOUT_MS = 30_000
MAX_TOKENS = 200  # the tiny model streams ~300 tok/s alone: long enough to span many reads of the stream

# Records, inside the page, the reply's length after every task that changed it (a mutation
# observer's callback runs once per task, and the browser may paint between two tasks): a
# streamed reply grows over many such states, one network read of the stream each.
RECORD_GROWTH = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const reply = document.querySelector('.msg.assistant:last-child .text');
    if (reply) window.__lengths.push(reply.textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, characterData: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: `make setup` installs Debian's chromium package "
                    "(apt-get install chromium chromium-driver)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def live(tiny_dir):
    srv = start_server(tiny_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    srv = start_server(tiny_dir, api_keys=(KEY,))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_model(tiny_dir)


class Tab:
    """One page in a fresh browser context (its own localStorage), with every request and
    script error it had recorded."""

    def __init__(self, browser: Browser, server_url: str) -> None:
        self.server = urlsplit(server_url).netloc
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page = self.open()

    def open(self) -> Page:
        page = self.context.new_page()
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("console", lambda m: self.errors.append(m.text) if "Content Security Policy" in m.text else None)
        return page

    def check(self) -> None:
        """No script error nor anything the Content-Security-Policy refused, and not one
        request to any host but the server."""
        assert not self.errors, self.errors
        assert self.requests
        others = [u for u in self.requests if not u.startswith("data:") and urlsplit(u).netloc != self.server]
        assert not others, f"requests to other hosts: {others}"

    def close(self) -> None:
        self.context.close()


def wait_text(page: Page, element_id: str, text: str) -> None:
    # A function, not an expression string: the pages' Content-Security-Policy forbids eval.
    page.wait_for_function("([id, text]) => document.getElementById(id).textContent === text", arg=[element_id, text])


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def ask(page: Page, question: str, **fields: str) -> dict:
    """Fill the settings and the question, send it, wait for the reply's figures."""
    for name, value in fields.items():
        page.fill(f"#{name}", value)
    before = page.locator(".msg.assistant .figures, .msg.error").count()
    page.fill("#prompt", question)
    page.click("#send")
    try:
        page.locator(".msg.assistant .figures, .msg.error").nth(before).wait_for()
    except Exception:
        screenshot(page, "failed-reply.png")  # what the page showed instead
        raise
    reply = page.locator(".msg.assistant, .msg.error").last
    figures = reply.locator(".figures")
    data = figures.evaluate("e => ({...e.dataset})") if figures.count() else {}
    return {"text": reply.locator(".text").text_content(), **data}


# -- the playground --------------------------------------------------------------------------
def test_playground_streams_greedy_reply_with_figures(live, browser, reference):
    model, tok = reference
    question = "What is continuous batching?"
    ids = reference_generate(model, chat_ids(tok, question), MAX_TOKENS, eos_token_id=tok.eos_token_id)
    expected = tok.decode(ids, skip_special_tokens=True)
    tab = Tab(browser, live.url)
    page = tab.page
    page.goto(live.url + "/")
    wait_text(page, "model", MODEL)
    assert page.locator("#keybar").is_hidden()  # no key on this server: not asked for one
    page.evaluate(RECORD_GROWTH)

    first = ask(page, question, temperature="0", max_tokens=str(MAX_TOKENS))
    assert first["text"] == expected  # the page's streamed text is the model's greedy reply
    lengths = page.evaluate("window.__lengths")
    assert lengths == sorted(lengths) and lengths[-1] == len(expected), lengths
    partial = {n for n in lengths if 0 < n < len(expected)}
    assert len(partial) >= 5, lengths  # shown token by token as they came, not all at once at the end
    assert float(first["ttft"]) > 0 and float(first["tokS"]) > 0
    assert first["tokens"] == str(len(ids)) and first["cached"] == "0"
    assert "time to first token" in page.locator(".figures").last.text_content()

    # The same question in a new conversation: same greedy reply, its prompt now in the prefix cache.
    page.click("#clear")
    second = ask(page, question)
    assert second["text"] == expected
    assert int(second["cached"]) >= 16  # at least one whole 16-token block
    screenshot(page, "playground.png")
    tab.check()
    tab.close()


def test_playground_shows_the_servers_error(live, browser):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": -1, "stream": True}
    r = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    tab = Tab(browser, live.url)
    page = tab.page
    page.goto(live.url + "/")
    wait_text(page, "model", MODEL)
    reply = ask(page, "Hi", temperature="-1")
    assert reply["text"] == message and "temperature" in message
    assert page.locator(".msg.error").count() == 1
    # The error cost nothing: fixing the setting gives a reply.
    assert ask(page, "Hi", temperature="0", max_tokens="4")["tokens"] == "4"
    tab.check()
    tab.close()


def test_playground_and_dashboard_ask_for_the_api_key(guarded, browser):
    url = guarded.url
    assert httpx.get(url + "/").status_code == 200  # the pages hold no data: served without the key
    assert httpx.get(url + "/static/playground.js").status_code == 200
    assert httpx.get(url + "/stats").status_code == 401  # what they show does need it
    assert httpx.get(url + "/stats", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    tab = Tab(browser, url)
    dashboard = tab.open()
    dashboard.goto(url + "/dashboard")
    dashboard.locator("#keybar").wait_for(state="visible")  # the dashboard asks too
    assert "API key" in dashboard.locator("#key-message").text_content()
    page = tab.page
    page.goto(url + "/")
    page.locator("#keybar").wait_for(state="visible")
    assert "API key" in page.locator("#key-message").text_content()
    refused = ask(page, "Hi", max_tokens="4")
    assert "API key" in refused["text"]  # the 401's message, shown as the reply

    page.fill("#api-key", "wrong")
    page.click("#key-save")
    assert "Incorrect" in ask(page, "Hi")["text"]  # a wrong key is refused, and said so
    assert page.locator("#keybar").is_visible()
    page.fill("#api-key", KEY)
    page.click("#key-save")
    wait_text(page, "model", MODEL)
    assert page.locator("#keybar").is_hidden()
    assert ask(page, "Hello", max_tokens="6")["tokens"] == "6"

    dashboard.reload()  # same context: the key typed on the playground is remembered
    wait_text(dashboard, "card-finished", "1")
    assert dashboard.locator("#keybar").is_hidden()
    tab.check()
    tab.close()


# -- the dashboard ---------------------------------------------------------------------------
def run_load(url: str, stop: threading.Event, workers: int = 3) -> list[threading.Thread]:
    """Requests sharing a long prefix, back to back until `stop`: the batch fills, KV blocks are
    taken, and the shared prefix is served from the cache."""
    prefix = "The engine batches requests continuously, token by token. " * 3

    def work(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            j = 0
            while not stop.is_set():
                r = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": f"{prefix}{i}-{j}", "n": 2,
                                                               "max_tokens": 160, "ignore_eos": True})
                assert r.status_code == 200, r.text
                j += 1

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    return threads


RUNNING = "Number(document.querySelector('#chart-requests [data-series=running]').dataset.last)"
KV_USED = "Number(document.querySelector('#chart-kv [data-series=kv_used]').dataset.last)"


def last(page: Page, chart: str, series: str) -> float:
    value = page.get_attribute(f"#chart-{chart} [data-series={series}]", "data-last")
    return float(value) if value else 0.0


@pytest.mark.slow
def test_dashboard_moves_under_load(live, browser):
    tab = Tab(browser, live.url)
    page = tab.page
    page.goto(live.url + "/dashboard")
    page.wait_for_function("() => document.getElementById('status').textContent.startsWith('live')")
    drawn = {page.get_attribute("#chart-requests [data-series=running]", "d")}

    stop = threading.Event()
    threads = run_load(live.url, stop)
    try:
        page.wait_for_function(f"() => {RUNNING} >= 2 && {KV_USED} > 0")
        drawn.add(page.get_attribute("#chart-requests [data-series=running]", "d"))
        assert int(page.locator("#card-running").text_content()) >= 1
        assert page.locator("#recent tbody tr").count() >= 2
        page.wait_for_function("() => Number(document.getElementById('card-toks').textContent) > 0")
        # A few rounds of load on the charts before the picture is taken.
        done = int(page.locator("#card-finished").text_content())
        page.wait_for_function("n => Number(document.getElementById('card-finished').textContent) >= n", arg=done + 12)
        screenshot(page, "dashboard.png")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    # Load gone: the charts come back down, and the finished requests' blocks stay cached.
    page.wait_for_function(f"() => {RUNNING} === 0 && {KV_USED} === 0")
    drawn.add(page.get_attribute("#chart-requests [data-series=running]", "d"))
    assert len(drawn) == 3  # the running chart was redrawn differently at each stage
    assert last(page, "kv", "kv_cached") > 0
    assert page.locator("#card-hit").text_content().endswith("%")  # the shared prefix was found
    states = page.locator("#recent tbody td:nth-child(2)").all_text_contents()
    assert states and set(states) <= {"length", "stop", "decoding", "queued"}
    tab.check()
    tab.close()


# -- `contbatch serve` (what `make run` starts) ----------------------------------------------
def serve_and_chat(browser: Browser, args: list[str], question: str, max_tokens: int, shot: str) -> tuple[str, str]:
    """Start `contbatch serve`, open the playground at the URL it prints, ask one greedy
    question; returns (the printed URL, the reply)."""
    port = _free_port()
    proc = _spawn(args, port, timeout=300)
    try:
        printed = ""
        while "playground" not in printed:  # printed before uvicorn starts: already in the pipe
            printed = proc.stdout.readline()
            assert printed, "the server printed no playground URL"
        url = re.search(r"chat playground at (\S+)", printed).group(1)
        assert url == f"http://127.0.0.1:{port}/" and f"http://127.0.0.1:{port}/dashboard" in printed
        tab = Tab(browser, url)
        tab.page.goto(url)
        tab.page.locator("#status").filter(has_text="ready").wait_for()
        reply = ask(tab.page, question, temperature="0", max_tokens=str(max_tokens))
        screenshot(tab.page, shot)
        tab.check()
        tab.close()
        return url, reply["text"]
    finally:
        proc.kill()
        proc.wait(30)


def test_serve_prints_the_playground_url(tiny_dir, reference, browser):
    model, tok = reference
    question = "Hello!"
    expected = tok.decode(reference_generate(model, chat_ids(tok, question), 8, tok.eos_token_id),
                          skip_special_tokens=True)
    _, text = serve_and_chat(browser, ["--model", str(tiny_dir), "--block-size", "16", "--num-blocks", "128"],
                             question, 8, "playground-cli.png")
    assert text == expected


@pytest.mark.slow
def test_make_run_playground_on_the_default_model(default_model, browser):
    """What `make run` serves: the embedded SmolLM2-135M answers in the page with real text,
    the greedy reply of `model.generate` (stopping at the model's EOS)."""
    model, tok = default_model
    question = "What is the capital of France?"
    eos = model.generation_config.eos_token_id
    expected = tok.decode(reference_generate(model, chat_ids(tok, question), 48, eos), skip_special_tokens=True)
    _, text = serve_and_chat(browser, [], question, 48, "playground-default-model.png")
    assert text == expected and "Paris" in text
