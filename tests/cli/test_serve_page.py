"""The page at `GET /` in a real headless browser (Debian's chromium, driven by Playwright): a prompt
typed and submitted ends with a playable <video>; what the user typed is shown as text, never run
as HTML; the page loads nothing from outside the server (its CSP would refuse it, and nothing is
refused). H3_SERVE_SCREENSHOT=PATH also saves the screenshot there (docs/serve-page.png)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from commands import SERVE_KEY

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is a test extra: pip install -e '.[test]'")
CHROMIUM = next((p for p in (os.environ.get("H3_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
HOSTILE = "a lighthouse at night <img src=x onerror=\"document.title='owned'\"> & waves"


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine: `apt-get install -y chromium` (.ci/run does) or set H3_CHROMIUM")
def test_a_prompt_typed_in_the_page_ends_with_a_playable_video(served, tmp_path):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: problems.append(f"outside request {r.url}") if not r.url.startswith((served.url, "blob:", "data:")) else None)
            page.goto(f"{served.url}/")
            page.locator("#queue", has_text="needs an API key").wait_for(timeout=30_000)  # before the key: the page says so
            page.fill("#key", SERVE_KEY)
            page.dispatch_event("#key", "change")
            problems.clear()  # (the 401s before the key was given)
            page.fill("#prompt", HOSTILE)
            page.fill("#seed", "7")
            page.click("#submit")
            row = page.locator("li.job", has_text="a lighthouse at night")
            row.locator("video").wait_for(timeout=600_000)
            playable = page.wait_for_function(
                """() => { const v = document.querySelector('li.job video');
                           return v && v.readyState >= 1 && v.duration > 0 && !v.error ? [v.duration, v.videoWidth, v.videoHeight] : false; }""",
                timeout=120_000,
            ).json_value()
            played = page.evaluate("async () => { const v = document.querySelector('li.job video'); v.muted = true; await v.play(); "
                                   "await new Promise(r => setTimeout(r, 300)); return v.currentTime > 0; }")
            assert playable[1:] == [64, 64] and playable[0] > 0 and played
            assert row.locator(".prompt").inner_text() == HOSTILE  # shown as the text it is
            assert page.locator("li.job img").count() == 0 and page.title() == "h3 serve"
            assert problems == [], problems
            shot = tmp_path / "serve-page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("H3_SERVE_SCREENSHOT"):
                shutil.copyfile(shot, Path(os.environ["H3_SERVE_SCREENSHOT"]))
        finally:
            browser.close()
