"""The web app in a real headless Chromium (Debian's chromium + chromedriver, driven by
selenium), against a real `mlx-dspark serve` on the bundled reference model over a real
socket, with --api-key (the page asks for it once).

Checks: a chat message streams a reply with its statistics and per-token colouring, stop
and regenerate work, the conversation survives a reload; the telemetry page shows a request
the `anthropic` SDK started, while it runs; the roofline and cache pages draw their plots,
re-running tune reports progress, evict/clear work; the integrations page writes a config;
no console errors. Screenshots of each page go to the test's tmp folder and are checked for
content (pixel variance); with MLX_DSPARK_SCREENSHOTS=DIR small copies go there too (the
README's, in docs/screenshots/).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
    from PIL import Image, ImageStat
except ImportError as e:  # pragma: no cover - setup.sh installs both
    pytest.skip(f"web app browser tests need selenium and pillow ({e}); run scripts/setup.sh", allow_module_level=True)
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("web app browser tests need Debian's chromium and chromium-driver (scripts/setup.sh installs them)",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

API_KEY = "test-key-webapp"
RENAME = ("Rename `total` to `amount` everywhere in add.py. Reply with the whole updated file.\n\n"
          "```python\ndef add_all(values):\n    total = 0\n    for v in values:\n        total += v\n"
          "    return total\n```\n")
SHOTS: dict[str, Path] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlx-dspark serve` in its own process, in an empty project folder, with a private cache dir."""
    root = tmp_path_factory.mktemp("webapp")
    project = root / "project"
    project.mkdir()
    port = _free_port()
    env = {**os.environ, "MLX_DSPARK_CACHE_DIR": str(root / "cache"), "PYTHONUNBUFFERED": "1"}
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "agent_bridge", "serve", "--port", str(port), "--api-key", API_KEY],
                            cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("serve did not start:\n" + (root / "serve.log").read_text()[-3000:])
        time.sleep(0.3)
    yield {"url": url, "project": project, "root": root}
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,800",
                "--hide-scrollbars", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium look for drivers online
    env_preload = os.environ.pop("LD_PRELOAD", None)  # the test's OpenBLAS preload is not chromium's business
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    finally:
        if env_preload:
            os.environ["LD_PRELOAD"] = env_preload
    driver.set_script_timeout(30)
    driver.console = []  # every console message seen, checked at the end
    driver.shots = tmp_path_factory.mktemp("screenshots")
    driver.get(server["url"] + "/")
    dialog_input = wait(driver, lambda: _visible(driver, "#key-input"))
    dialog_input.send_keys(API_KEY, Keys.ENTER)
    wait(driver, lambda: driver.execute_script("return document.body.dataset.ready === '1'"))
    yield driver
    driver.quit()


# -- helpers ------------------------------------------------------------------------------


def wait(driver, condition, timeout: float = 60, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            _collect_console(driver)
            raise AssertionError(f"timed out after {timeout}s; console: {driver.console[-10:]}")
        time.sleep(every)


def _visible(driver, css):
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[0] if found and found[0].is_displayed() else None


def _collect_console(driver) -> None:
    driver.console.extend(driver.get_log("browser"))


def go(driver, page: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f"nav a[data-page={page}]").click()
    wait(driver, lambda: "active" in driver.find_element(By.ID, f"page-{page}").get_attribute("class"))


def not_blank(png: bytes, min_stddev: float = 8.0) -> Image.Image:
    image = Image.open(io.BytesIO(png)).convert("RGB")
    spread = max(ImageStat.Stat(image).stddev)
    assert spread > min_stddev, f"image looks blank (pixel stddev {spread:.1f})"
    return image


def screenshot(driver, name: str) -> None:
    """Whole window to the tmp folder (checked non-blank); a small copy for the README if asked."""
    png = driver.get_screenshot_as_png()
    path = driver.shots / f"{name}.png"
    path.write_bytes(png)
    image = not_blank(png)
    SHOTS[name] = path
    out = os.environ.get("MLX_DSPARK_SCREENSHOTS")
    if out:
        small = image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.LANCZOS)
        small = small.quantize(colors=256, method=Image.Quantize.FASTOCTREE)  # keeps the plots' thin coloured lines
        Path(out).mkdir(parents=True, exist_ok=True)
        small.save(Path(out) / f"{name}.png", optimize=True)


def plot_drawn(driver, css: str) -> None:
    """The uPlot canvas inside `css` exists and has something drawn on it."""
    canvas = wait(driver, lambda: _visible(driver, f"{css} canvas"))
    not_blank(canvas.screenshot_as_png, min_stddev=4.0)


def api(server, path: str, method: str = "GET", **kw):
    r = httpx.request(method, server["url"] + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **kw)
    r.raise_for_status()
    return r.json()


def set_field(driver, css: str, value: str) -> None:
    """Set an input's value and fire `change` (typing newlines into the composer would send)."""
    driver.execute_script("const e = document.querySelector(arguments[0]); e.value = arguments[1];"
                          "e.dispatchEvent(new Event('change'))", css, value)


def stored_chat(driver) -> dict:
    state = json.loads(driver.execute_script("return localStorage.getItem('mlx-dspark.chats')"))
    return next(c for c in state["chats"] if c["id"] == state["current"])


# -- the pages ----------------------------------------------------------------------------


def test_chat_streams_a_reply_with_statistics(browser, server):
    d = browser
    go(d, "chat")
    set_field(d, "#set-max_tokens", "70")
    set_field(d, "#chat-input", RENAME)
    d.find_element(By.ID, "chat-send").click()
    stats = wait(d, lambda: _visible(d, ".msg.assistant [data-role=stats]"), timeout=120)
    text = stats.text
    for label in ("tokens/forward", "acceptance", "decode", "TTFT", "cached", "prefilled", "mode"):
        assert label in text, text
    reply = stored_chat(d)["messages"][-1]
    # the small reference model copies the function (drafting pays); whether it renames is its own business
    assert reply["role"] == "assistant" and "def add_all" in reply["content"], reply["content"][:300]
    s = reply["stats"]
    assert s["generated_tokens"] > 1 and s["rounds"] >= 1 and s["prompt_tokens"] > 0
    # streamed: the reply came as many token chunks, which join to its text
    assert len(reply["tokens"]) == s["generated_tokens"] > 1
    assert "".join(t for t, _ in reply["tokens"]).startswith(reply["content"][:20])
    rendered = d.find_element(By.CSS_SELECTOR, ".msg.assistant .body")
    assert rendered.find_elements(By.CSS_SELECTOR, "pre code"), "the code block is rendered as code"

    # colour by provenance: spans per token; drafting paid on a rename (some accepted drafts)
    d.find_element(By.ID, "chat-colour").click()
    spans = wait(d, lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .body.tokens span"))
    classes = {span.get_attribute("class") for span in spans}
    assert "tok-target" in classes and classes - {"tok-target"}, classes
    assert s["accepted_tokens"] > 0
    screenshot(d, "chat")
    d.find_element(By.ID, "chat-colour").click()

    # kept in localStorage: a reload shows the conversation again (the key is kept for the tab)
    d.refresh()
    wait(d, lambda: d.execute_script("return document.body.dataset.ready === '1'"))
    wait(d, lambda: "def add_all" in d.find_element(By.CSS_SELECTOR, ".msg.assistant").text)


def test_chat_regenerate_and_stop(browser, server):
    d = browser
    go(d, "chat")
    n_before = len(stored_chat(d)["messages"])
    first = stored_chat(d)["messages"][-1]["content"]
    d.find_element(By.ID, "chat-regenerate").click()
    wait(d, lambda: d.find_element(By.ID, "chat-send").is_enabled() and len(stored_chat(d)["messages"]) == n_before
         and stored_chat(d)["messages"][-1].get("stats"), timeout=120)
    assert stored_chat(d)["messages"][-1]["content"] == first  # greedy: the same reply again

    # a long reply, stopped with Esc once it streams; the server cancels the job
    set_field(d, "#set-max_tokens", "4000")
    set_field(d, "#set-mode", "baseline")  # one token per forward: long enough to stop mid-way
    set_field(d, "#chat-input", "Write a very long story about a robot.")
    d.find_element(By.ID, "chat-send").click()
    wait(d, lambda: d.find_element(By.ID, "chat-stop").is_enabled()
         and d.execute_script("return document.querySelector('.msg.assistant:last-child .body').textContent.length") > 5,
         timeout=120, every=0.05)
    d.find_element(By.ID, "chat-input").send_keys(Keys.ESCAPE)
    wait(d, lambda: stored_chat(d)["messages"][-1].get("finish") == "stopped")
    reply = stored_chat(d)["messages"][-1]
    assert 0 < len(reply["tokens"]) < 4000 and not reply.get("stats")
    wait(d, lambda: not api(server, "/v1/telemetry/snapshot")["in_flight"], timeout=30)
    set_field(d, "#set-max_tokens", "120")
    set_field(d, "#set-mode", "")


def test_telemetry_shows_an_anthropic_sdk_request(browser, server):
    import anthropic

    d = browser
    go(d, "telemetry")
    stop, errors = threading.Event(), []

    def run():  # sampled at temperature 1, up to 3000 tokens: it runs until we have seen it
        try:
            client = anthropic.Anthropic(base_url=server["url"], api_key=API_KEY, max_retries=0)
            with client.messages.stream(model="local", max_tokens=3000, extra_body={"temperature": 1.0},
                                        messages=[{"role": "user", "content": "Tell me a long story. " * 40}]) as s:
                for _ in s.text_stream:
                    if stop.is_set():
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        row = "return document.querySelector('#tel-inflight tr[data-client=\"anthropic-sdk\"]')?.textContent || ''"
        wait(d, lambda: "prefill" in d.execute_script(row) or "decode" in d.execute_script(row), timeout=120, every=0.05)
        wait(d, lambda: "decode" in d.execute_script(row), timeout=60, every=0.05)  # the rows are re-drawn live
        time.sleep(2)  # a few snapshots more, for the charts
        screenshot(d, "telemetry")
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    wait(d, lambda: _visible(d, "#tel-recent tr[data-client=anthropic-sdk]"), timeout=60)
    for chart in ("#tel-throughput", "#tel-position", "#tel-tpf"):
        plot_drawn(d, chart)
    snap = api(server, "/v1/telemetry/snapshot")
    assert "anthropic-sdk" in snap["clients"] and "web app" in snap["clients"]
    assert any(j["client"] == "anthropic-sdk" and j["generated"] > 0 for j in snap["recent"])


def test_roofline_plots_and_tune(browser, server):
    d = browser
    go(d, "roofline")
    wait(d, lambda: d.execute_script("return document.body.dataset.rooflineReady === '1'"), timeout=180)
    plot_drawn(d, "#roof-plot")
    plot_drawn(d, "#roof-curve")
    assert "GB/s" in d.find_element(By.ID, "roof-cards").text
    set_field(d, "#tune-depths", "64,256")
    set_field(d, "#tune-repeats", "1")
    d.execute_script("delete document.body.dataset.rooflineReady")
    d.find_element(By.ID, "tune-run").click()
    wait(d, lambda: "measuring" in d.find_element(By.ID, "tune-status").text, timeout=60, every=0.05)
    wait(d, lambda: d.execute_script("return document.body.dataset.rooflineReady === '1'"), timeout=240)
    assert "tuned" in d.find_element(By.ID, "roof-cards").text
    curve = api(server, "/v1/cost-curve")
    assert curve["measured"] and curve["depths"] == [64, 256]
    plot_drawn(d, "#roof-curve")
    screenshot(d, "roofline")


def test_cache_page_plots_and_clears(browser, server):
    d = browser
    go(d, "cache")
    wait(d, lambda: d.execute_script("return document.body.dataset.cacheReady === '1'"))
    rows = wait(d, lambda: d.find_elements(By.CSS_SELECTOR, "#cache-tree .row"))
    assert any("Rename" in r.text for r in rows), [r.text for r in rows]
    plot_drawn(d, "#cache-plot")
    cards = d.find_element(By.ID, "cache-cards").text
    assert "hit rate" in cards and "cached tokens" in cards
    screenshot(d, "cache")
    d.find_element(By.ID, "cache-evict").click()
    wait(d, lambda: "evict: done" in d.find_element(By.ID, "cache-status").text)
    view = api(server, "/v1/cache")
    assert view["stats"]["ram_bytes"] == 0 and view["stats"]["disk_files"] > 0
    d.find_element(By.ID, "cache-clear").click()  # asks again first
    assert "Really" in d.find_element(By.ID, "cache-clear").text
    d.find_element(By.ID, "cache-clear").click()
    wait(d, lambda: "clear: done" in d.find_element(By.ID, "cache-status").text)
    assert api(server, "/v1/cache")["stats"]["disk_files"] == 0
    wait(d, lambda: "Nothing cached" in d.find_element(By.ID, "cache-tree").text)


def test_integrations_page_writes_a_config(browser, server):
    d = browser
    go(d, "integrations")
    wait(d, lambda: d.execute_script("return document.body.dataset.integrationsReady === '1'"))
    cards = d.find_elements(By.CSS_SELECTOR, "#int-clients .client")
    assert [c.get_attribute("data-client") for c in cards] == [
        "claude-code", "codex", "opencode", "cursor", "continue", "zed", "vscode", "aider"]
    assert "anthropic-sdk" in d.find_element(By.ID, "int-seen").text
    aider = d.find_element(By.CSS_SELECTOR, "#int-clients .client[data-client=aider]")
    assert API_KEY in aider.find_element(By.TAG_NAME, "pre").text  # the server's key, for the client
    d.execute_script("window.scrollTo(0, 0)")
    screenshot(d, "integrations")
    copy = aider.find_element(By.XPATH, ".//button[text()='Copy']")
    copy.click()
    wait(d, lambda: copy.text == "Copied", timeout=10)
    write = aider.find_element(By.CSS_SELECTOR, "button.primary")
    write.click()
    write.click()
    wait(d, lambda: "wrote" in aider.text)
    written = server["project"] / ".aider.conf.yml"
    assert written.exists() and API_KEY in written.read_text()


def test_narrow_window_and_no_console_errors(browser, server):
    d = browser
    d.set_window_size(420, 800)
    try:
        go(d, "chat")
        composer = d.find_element(By.ID, "chat-send")
        assert composer.is_displayed() and composer.location["x"] + composer.size["width"] <= 420
        assert d.execute_script("return document.documentElement.scrollWidth") <= 420
    finally:
        d.set_window_size(1200, 800)
    _collect_console(d)
    errors = [m for m in d.console if m["level"] == "SEVERE"]
    assert not errors, errors
