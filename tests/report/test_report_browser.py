"""report.html in a real browser: headless Chromium (Debian `chromium` + `chromium-driver`) via
Selenium shows the Claims section and every figure decoded, with no console errors.

Without a browser these tests skip, unless POSLENS_REQUIRE_BROWSER=1 (set in CI) makes them fail.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from poslens.report import write_report
from poslens.report.common import claims_of, verdict_label
from tests.report.synthetic import MISSING_PNG, make_study

WINDOW = (1280, 900)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
]


def _missing() -> str | None:
    """Why no browser can run here, or None when selenium, chromium and chromedriver are all present."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if _binary("chromium") is None:
        return "no chromium binary (apt-get install chromium)"
    if _binary("chromedriver") is None:
        return "no chromedriver binary (apt-get install chromium-driver)"
    return None


def _binary(name: str) -> str | None:
    """The path of chromium/chromedriver: $POSLENS_<NAME>, else PATH, else /usr/bin."""
    env = os.environ.get(f"POSLENS_{name.upper()}")
    for cand in (env, shutil.which(name), f"/usr/bin/{name}"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium for the module, using the system chromedriver (never downloaded)."""
    why = _missing()
    if why:
        if os.environ.get("POSLENS_REQUIRE_BROWSER") == "1":
            pytest.fail(f"POSLENS_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(f"real-browser test needs headless Chromium: {why}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = _binary("chromium") or ""
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(executable_path=_binary("chromedriver")), options=opts)
    d.set_page_load_timeout(30)
    try:
        yield d
    finally:
        d.quit()


def check_page(driver: Any, page: Path, screenshot: Path) -> tuple[list[str], int]:
    """Open page from disk, screenshot it, and list what is wrong: no visible Claims section, a
    figure image hidden or not decoded, a SEVERE console entry, a bad screenshot. Also returns the
    number of figure images checked."""
    from selenium.webdriver.common.by import By

    driver.get_log("browser")  # drop entries from earlier pages
    driver.get(page.resolve().as_uri())
    problems: list[str] = []
    if driver.execute_script("return document.readyState") != "complete":
        problems.append("page did not finish loading")
    claims = driver.find_elements(By.ID, "claims")
    if not claims:
        problems.append("no element with id 'claims'")
    elif not claims[0].is_displayed():
        problems.append("the Claims section is not displayed")
    imgs = driver.find_elements(By.CSS_SELECTOR, "figure img")
    for i, img in enumerate(imgs):
        alt = img.get_attribute("alt")
        if not img.is_displayed():
            problems.append(f"figure image {i} ({alt}) is not displayed")
        natural = driver.execute_script(
            "const im = arguments[0]; return im.complete ? im.naturalWidth : -1;", img
        )
        if not natural or natural <= 0:
            problems.append(f"figure image {i} ({alt}) did not decode (naturalWidth {natural})")
    for entry in driver.get_log("browser"):
        if entry.get("level") == "SEVERE":
            problems.append(f"console error: {entry.get('message')}")
    driver.save_screenshot(str(screenshot))
    png = screenshot.read_bytes() if screenshot.is_file() else b""
    if not png.startswith(b"\x89PNG\r\n\x1a\n"):
        problems.append("screenshot is not a PNG")
    else:
        w, h, dpr = driver.execute_script(
            "return [window.innerWidth, window.innerHeight, window.devicePixelRatio]"
        )
        im = Image.open(io.BytesIO(png))
        if im.size != (round(w * dpr), round(h * dpr)):
            problems.append(f"screenshot is {im.size}, the window shows {w}x{h} at {dpr}x")
        lo, hi = im.convert("L").getextrema()
        if lo == hi:
            problems.append("screenshot is blank (one colour)")
    return problems, len(imgs)


def test_report_renders_in_chromium(driver: Any, tmp_path: Path) -> None:
    results = make_study(tmp_path)
    html_path, _ = write_report(tmp_path, results)
    shot = tmp_path / "report.png"
    problems, n_imgs = check_page(driver, html_path, shot)
    assert problems == []
    assert n_imgs == sum(f["png"] != MISSING_PNG for f in results["figures"])
    with Image.open(shot) as im:
        assert im.format == "PNG" and im.size[0] >= WINDOW[0] * 0.9
    # the missing figure's note and every verdict badge are on screen as text
    from selenium.webdriver.common.by import By

    note = driver.find_element(By.CSS_SELECTOR, "p.missing")
    assert note.is_displayed() and MISSING_PNG in note.text
    badges = driver.find_elements(By.CSS_SELECTOR, "#claims table .verdict")
    assert [b.text for b in badges] == [verdict_label(c) for c in claims_of(results)]
    # each verdict has its own colour (the synthetic claims hold one of each)
    colours = {b.value_of_css_property("background-color") for b in badges}
    assert len(colours) == 3 and "rgba(0, 0, 0, 0)" not in colours


def test_checker_catches_a_broken_page(driver: Any, tmp_path: Path) -> None:
    """The check can fail: an undecodable image, a console error and no Claims section are seen."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><body><h1>broken</h1>"
        '<figure><img src="data:image/png;base64,iVBORw0KGgoAAAAA" alt="bad"></figure>'
        "<script>console.error('deliberate failure')</script></body></html>"
    )
    problems, n_imgs = check_page(driver, page, tmp_path / "broken.png")
    assert n_imgs == 1
    text = "\n".join(problems)
    assert "no element with id 'claims'" in text
    assert "figure image 0 (bad) did not decode" in text
    assert "console error" in text and "deliberate failure" in text
    # a Claims section that exists but is hidden is caught too
    page.write_text(
        '<html><body><h1>shown</h1><section id="claims" style="display:none">x</section></body></html>'
    )
    problems, _ = check_page(driver, page, tmp_path / "hidden.png")
    assert problems == ["the Claims section is not displayed"]
