"""The dashboard in a real browser: `attnres-lens dashboard` in a subprocess, headless Chromium via playwright.

Screenshots go to test-output/ (gitignored). Skipped only outside CI when Chromium is absent; `make setup`
installs Debian's chromium and the dev extra installs playwright.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
OUTPUT = REPO_ROOT / "test-output"
DEMO_RUNS = REPO_ROOT / "data" / "demo_runs"

pytestmark = pytest.mark.slow
if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
    pytest.skip(f"{CHROMIUM} is missing (install Debian's chromium, e.g. `make setup`); required in CI",
                allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api") if not os.environ.get("CI") else __import__(
    "playwright.sync_api").sync_api


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


@pytest.fixture()
def dashboard_url():
    port = free_port()
    command = [str(Path(sys.executable).parent / "attnres-lens"), "dashboard", "--runs", str(DEMO_RUNS),
               "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
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
    page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length > 0 && "
                           f"document.querySelectorAll('.js-plotly-plot').length >= {count}", timeout=timeout_ms)
    page.locator('[data-testid="stStatusWidget"]').wait_for(state="hidden", timeout=timeout_ms)
    assert page.locator('[data-testid="stException"]').count() == 0


def test_dashboard_in_chromium(dashboard_url):
    OUTPUT.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(dashboard_url, wait_until="domcontentloaded")
            page.get_by_role("heading", name="Runs").wait_for(timeout=90_000)
            page.wait_for_selector('[data-testid="stDataFrame"]', timeout=60_000)
            page.screenshot(path=str(OUTPUT / "dashboard-runs.png"), full_page=True)

            page.get_by_role("link", name="Depth attention").click()
            wait_for_charts(page, count=6)  # two runs × pre-attention, pre-MLP and final-readout heatmaps
            assert page.locator(".js-plotly-plot .heatmaplayer image").count() >= 6
            page.screenshot(path=str(OUTPUT / "dashboard-depth-attention.png"), full_page=True)

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
