"""The dashboard in a real browser: `attnres-lens dashboard` in a subprocess, headless Chromium via playwright.

Screenshots go to test-output/ (gitignored). Skipped only outside CI when Chromium is absent; `make setup`
installs Debian's chromium and the dev extra installs playwright.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
OUTPUT = REPO_ROOT / "test-output"
DEMO_RUNS = REPO_ROOT / "data" / "demo_runs"

pytestmark = pytest.mark.slow
if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
    pytest.skip(
        f"{CHROMIUM} is missing (install Debian's chromium, e.g. `make setup`); required in CI", allow_module_level=True
    )
playwright = (
    pytest.importorskip("playwright.sync_api")
    if not os.environ.get("CI")
    else __import__("playwright.sync_api").sync_api
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, server: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the dashboard exited with code {server.returncode}:\n{server.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the dashboard at {url} did not answer within {timeout} s")


# Markdown and HTML in a run file: shown as text, it is never an image the browser fetches (issue 41 item 3)
TRACKER = "tracker.invalid"
HOSTILE_KEY = (
    f"![pixel](http://{TRACKER}/p.png) <img src=http://{TRACKER}/q.png> www.{TRACKER} me@{TRACKER} "
    "**bold** :red[red] :material/home: :streamlit: :smile: $x^2$ a -> b"
)


@pytest.fixture()
def served_runs(tmp_path) -> Path:
    """The demo runs, and a run whose config.json has an unknown key holding a remote image (its error quotes it)."""
    served = tmp_path / "runs"
    shutil.copytree(DEMO_RUNS, served, ignore=shutil.ignore_patterns(".lock"))
    config = json.loads((DEMO_RUNS / "induction-1l-kvshift" / "config.json").read_text())
    (served / "zz-hostile").mkdir()
    (served / "zz-hostile" / "config.json").write_text(json.dumps({**config, "model": {HOSTILE_KEY: 1}}))
    return served


@pytest.fixture()
def dashboard_url(served_runs):
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "attnres-lens"),
        "dashboard",
        "--runs",
        str(served_runs),
        "--port",
        str(port),
    ]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, server)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and anything it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def wait_for_charts(page, count: int, timeout_ms: int = 90_000) -> None:
    """Plotly has drawn `count` charts, the script run has finished, and Streamlit shows no exception."""
    page.wait_for_function(
        f"document.querySelectorAll('.js-plotly-plot .main-svg').length > 0 && "
        f"document.querySelectorAll('.js-plotly-plot').length >= {count}",
        timeout=timeout_ms,
    )
    page.locator('[data-testid="stStatusWidget"]').wait_for(state="hidden", timeout=timeout_ms)
    assert page.locator('[data-testid="stException"]').count() == 0


def is_local(url: str) -> bool:
    """A request that stays on this machine: to the dashboard's own host, or data the page already holds."""
    parts = urlsplit(url)
    return parts.scheme in ("data", "blob", "about") or parts.hostname in ("127.0.0.1", "localhost")


def test_dashboard_in_chromium(dashboard_url, served_runs):
    """Every page in Chromium, each making requests to the dashboard's own host only (issue 41 item 2: offline, the
    favicon included), with a run file's Markdown image shown as text and a folder outside --runs refused."""
    OUTPUT.mkdir(exist_ok=True)
    requests: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1500, "height": 1100})
            context.on("request", lambda request: requests.append(request.url))  # every page and frame
            page = context.new_page()
            page.on("websocket", lambda socket: requests.append(socket.url))
            page.goto(dashboard_url, wait_until="domcontentloaded")
            page.get_by_role("heading", name="Runs").wait_for(timeout=90_000)
            page.wait_for_selector('[data-testid="stDataFrame"]', timeout=60_000)
            page.locator('[data-testid="stAlertContentError"]').first.wait_for(timeout=30_000)
            # the key as it reads (word joiners, which keep GFM from linking URLs, are invisible), and no element
            shown = page.locator("section.main, [data-testid='stMain']").first.inner_text().replace("\u2060", "")
            assert HOSTILE_KEY in " ".join(shown.split()), shown
            assert page.locator(f'img[src*="{TRACKER}"], a[href*="{TRACKER}"], .katex').count() == 0
            icons = page.locator('link[rel~="icon"]').evaluate_all("links => links.map(link => link.href)")
            assert icons and all(is_local(icon) for icon in icons), icons
            page.screenshot(path=str(OUTPUT / "dashboard-runs.png"), full_page=True)

            outside = served_runs.parent / "elsewhere"  # a folder the server can read, outside --runs
            outside.mkdir()
            box = page.get_by_role("textbox", name="Runs folder")
            box.fill(str(outside))
            box.press("Enter")
            page.get_by_text(f"{outside} is outside the folder this dashboard serves").wait_for(timeout=30_000)
            page.screenshot(path=str(OUTPUT / "dashboard-runs-refused.png"), full_page=True)

            page.get_by_role("link", name="Depth attention").click()
            wait_for_charts(page, count=6)  # two runs × pre-attention, pre-MLP and final-readout heatmaps
            assert page.locator(".js-plotly-plot .heatmaplayer image").count() >= 6
            page.screenshot(path=str(OUTPUT / "dashboard-depth-attention.png"), full_page=True)

            page.get_by_role("link", name="Depth-mixing matrix").click()
            page.get_by_role("heading", name="Depth-mixing matrix").wait_for(timeout=60_000)
            wait_for_charts(page, count=2)

            page.get_by_role("link", name="Induction heads").click()
            page.get_by_role("heading", name="Induction heads").wait_for(timeout=60_000)
            wait_for_charts(page, count=1)  # at least the attention pattern, drawn from the latest checkpoint

            page.get_by_role("link", name="Training dynamics").click()
            page.get_by_role("heading", name="Training dynamics").wait_for(timeout=60_000)
            wait_for_charts(page, count=4)
            page.screenshot(path=str(OUTPUT / "dashboard-training-dynamics.png"), full_page=True)

            page.get_by_role("link", name="Attribution").click()
            page.get_by_role("heading", name="Attribution").wait_for(timeout=60_000)
            page.get_by_role("button", name="Compute attribution").click(timeout=60_000)
            page.get_by_text("Direct logit attribution of the next token").first.wait_for(timeout=120_000)
            wait_for_charts(page, count=3)  # the timeline, the per-position DLA and the per-source bars
            page.screenshot(path=str(OUTPUT / "dashboard-attribution.png"), full_page=True)

            # the pruning report's frame takes the report's height: nothing cut, no second scroll bar
            page.get_by_role("link", name="Pruning").click()
            page.get_by_role("heading", name="Layer pruning").wait_for(timeout=60_000)
            samples = page.get_by_label("Held-out sequences")
            samples.fill("4")
            samples.press("Enter")
            page.get_by_role("button", name="Compute pruning report").click(timeout=60_000)
            frame = page.locator("iframe").first
            frame.wait_for(timeout=300_000)
            report = frame.content_frame
            report.locator(".plotly-graph-div").last.wait_for(timeout=60_000)
            time.sleep(1)  # the frame's height follows its content
            content = report.locator("html").evaluate("element => element.scrollHeight")
            shown = frame.bounding_box()["height"]
            assert content > 2000 and shown >= content - 5, (shown, content)
            page.screenshot(path=str(OUTPUT / "dashboard-pruning.png"), full_page=True)
        finally:
            browser.close()
    assert requests and not [url for url in requests if not is_local(url)], [
        url for url in requests if not is_local(url)
    ]
