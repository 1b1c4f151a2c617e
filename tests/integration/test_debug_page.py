"""The debug page at ``/`` in a real headless Chromium (Debian's ``chromium``, driven by playwright).

Uploads a real PNG file, picks a scorer, clicks Score and reads the score the page displays. Skipped
where playwright or /usr/bin/chromium is missing (``apt-get install -y chromium``; never
``playwright install``, which downloads a browser).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

sync_api = pytest.importorskip("playwright.sync_api")

from servers import serve  # noqa: E402

from reward_server.app import create_app  # noqa: E402
from reward_server.scorers import build_scorers  # noqa: E402
from reward_server.settings import ServerSettings  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

if shutil.which(CHROMIUM) is None and os.environ.get("RF_REQUIRE_SYSTEM_DEPS"):
    raise RuntimeError(f"{CHROMIUM} is required here (RF_REQUIRE_SYSTEM_DEPS is set): apt-get install -y chromium")
pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is not installed")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    app = create_app(
        build_scorers(["brightness", "jpeg_compressibility", "digit"]),
        ServerSettings(instance_id="debug-page"),
    )
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def page(server_url: str) -> Iterator[sync_api.Page]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context()
        external: list[str] = []
        context.route(  # the page must not load anything from anywhere but the server itself
            re.compile(r"^(?!" + re.escape(server_url) + r"|blob:|data:).*"),
            lambda route: (external.append(route.request.url), route.abort()),
        )
        page = context.new_page()
        yield page
        browser.close()
        assert not external, f"the page tried to load {external}"


def test_page_is_self_contained(server_url: str) -> None:
    html = httpx.get(server_url + "/", trust_env=False).text
    assert "<script>" in html and "<style>" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "external asset in the debug page"


def test_upload_png_and_see_the_brightness_score(page: sync_api.Page, server_url: str, tmp_path: Path) -> None:
    pixels = np.random.default_rng(7).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    png = tmp_path / "upload.png"
    Image.fromarray(pixels).save(png)
    expected = float(pixels.mean()) / 255.0

    page.goto(server_url + "/")
    sync_api.expect(page.locator("#server")).to_contain_text("instance debug-page, ready")
    page.set_input_files("#image", str(png))
    page.fill("#prompt", "a handwritten digit 3")
    page.uncheck("input[name=scorer][value=digit]")  # 24x32 is not a multiple of 8 in both sides: skip
    page.uncheck("input[name=scorer][value=jpeg_compressibility]")
    page.click("#score")
    sync_api.expect(page.locator("#status")).to_have_text("done")

    shown = page.locator("#score-brightness").inner_text()
    assert float(shown) == pytest.approx(expected, abs=1e-12)
    assert page.locator("#results tbody tr").count() == 1  # only the picked scorer
    assert "answered by debug-page" in page.locator("#meta").inner_text()


def test_upload_video_frames_see_them_cycle_and_scored(page: sync_api.Page, tmp_path: Path, server_url: str) -> None:
    frames = [np.full((16, 24, 3), value, np.uint8) for value in (30, 90, 150)]
    paths = []
    for index, frame in enumerate(frames):
        paths.append(str(tmp_path / f"frame{index + 1}.png"))
        Image.fromarray(frame).save(paths[-1])
    page.goto(server_url + "/")
    sync_api.expect(page.locator("#server")).to_contain_text("ready")
    page.set_input_files("#video", paths[::-1])  # put back in file-name order
    page.fill("#fps", "20")
    page.locator("#fps").dispatch_event("change")
    sync_api.expect(page.locator("#video-preview")).to_have_attribute("data-frame", "2")  # the clip is animated
    page.uncheck("input[name=scorer][value=digit]")
    page.click("#score")
    sync_api.expect(page.locator("#status")).to_have_text("done")
    assert float(page.locator("#score-brightness").inner_text()) == pytest.approx(90 / 255, abs=1e-12)
    assert '"frame_scores"' in page.locator("tr[data-scorer=brightness]").inner_text()


def test_errors_are_shown(page: sync_api.Page, server_url: str, tmp_path: Path) -> None:
    png = tmp_path / "small.png"
    Image.fromarray(np.zeros((12, 12), np.uint8)).save(png)
    page.goto(server_url + "/")
    sync_api.expect(page.locator("#server")).to_contain_text("ready")
    page.set_input_files("#image", str(png))
    page.fill("#prompt", "no digit here")
    page.fill("#metadata", '{"note": "x"}')
    page.click("#score")
    sync_api.expect(page.locator("#status")).to_have_text("done")
    assert page.locator("#score-digit").inner_text() == "failed"
    assert "PARSE" in page.locator("tr[data-scorer=digit]").inner_text()
    assert float(page.locator("#score-brightness").inner_text()) == 0.0

    page.fill("#metadata", "{not json")
    page.click("#score")
    sync_api.expect(page.locator("#status")).to_contain_text("metadata is not valid JSON")
