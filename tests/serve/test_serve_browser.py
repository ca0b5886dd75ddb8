"""The web page in a real headless Chromium (Debian's `chromium`, driven by Playwright with `executable_path`):
upload the demo clip and its mask, wait for the job, and check that the result <video> loads with a duration > 0,
under the server's Content-Security-Policy (no violation reported). A screenshot is saved to $FASTREMOVER_ARTIFACTS
(default: the test's tmp folder). And a page on another origin that posts a job with `fetch(..., {mode: "no-cors"})`
(no preflight) creates nothing."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

import numpy as np
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed; the dev extra installs it")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed; the dev extra installs it")
from helpers import gated_worker, thread_server, write_clip

from fastremover import media
from fastremover.serve.app import ServeConfig, create_app


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def require_chromium() -> str:
    executable = chromium_path()
    if executable is None:
        if os.environ.get("FASTREMOVER_REQUIRE_CHROMIUM"):  # CI sets it: there a missing browser is a failure
            pytest.fail("FASTREMOVER_REQUIRE_CHROMIUM is set but no chromium is on PATH (apt-get install chromium)")
        print("SKIPPED: no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH: apt-get install chromium (CI's .ci/run installs it)")
    return executable


def test_page_uploads_polls_and_plays_the_result(tmp_path):
    executable = require_chromium()
    # The demo clip (`fastremover demo`'s synthetic clip, seed 0) at a small size.
    video, mask = write_clip(tmp_path / "media", frames=17, height=96, width=128)
    mask_frames = media.synthetic_clip(17, 96, 128, seed=0)[1]
    artifacts = Path(os.environ.get("FASTREMOVER_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    worker, _ = gated_worker()  # the real classic pipeline; its gate stays open here
    app = create_app(ServeConfig(data_dir=str(tmp_path / "data"), poll_after_ms=100), workers=[worker])
    with thread_server(app) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True,
                                     args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"{r.url} {r.failure}") if "blob:" not in r.url else None)
            page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
            page.goto(url + "/")
            assert page.title() == "fastremover"
            page.set_input_files("#video", str(video))
            page.set_input_files("#mask", str(mask))
            page.click("details summary")  # open the options
            page.fill("input[name=steps]", "2")
            page.click("#submit")
            page.wait_for_function(
                "() => { const v = document.getElementById('result-video');"
                " return v.src && v.readyState >= 2 && v.duration > 0; }", timeout=90_000)
            duration = page.evaluate("document.getElementById('result-video').duration")
            assert duration == pytest.approx(17 / 24, abs=0.05)
            assert page.evaluate("document.getElementById('input-video').src").startswith("blob:")
            assert page.get_attribute("#download", "href").startswith("blob:")
            assert "completed" in page.inner_text("#status")
            page.click("#refresh")
            page.wait_for_function("() => document.querySelector('#jobs tbody').innerText.includes('completed')")
            shot = artifacts / "serve_page.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
            assert shot.stat().st_size > 10_000 and errors == []

            # Again without a mask: a box dragged on the first frame (the server builds the mask from it).
            first = page.get_attribute("#result-video", "data-video-id")
            page.set_input_files("#mask", [])
            page.wait_for_selector("#frame", state="visible")  # shown since the video was chosen
            ys, xs = np.nonzero(mask_frames[0])
            x0, y0, x1, y1 = max(0, xs.min() - 3), max(0, ys.min() - 3), min(128, xs.max() + 4), min(96, ys.max() + 4)
            page.locator("#frame").scroll_into_view_if_needed()
            rect = page.locator("#frame").bounding_box()
            scale = rect["width"] / 128

            def at(x, y):
                return rect["x"] + x * scale, rect["y"] + y * scale

            page.mouse.move(*at(x0 + 0.5, y0 + 0.5))
            page.mouse.down()
            page.mouse.move(*at(x1 - 0.5, y1 - 0.5), steps=4)
            page.mouse.up()
            box = [int(v) for v in page.input_value("#box").split(",")]
            assert np.allclose(box, [x0, y0, x1 - x0 - 1, y1 - y0 - 1], atol=1), (box, [x0, y0, x1, y1])
            page.click("#submit")
            page.wait_for_function(
                "(first) => { const v = document.getElementById('result-video');"
                " return v.dataset.videoId !== first && v.readyState >= 2 && v.duration > 0"
                " && document.getElementById('input-video').readyState >= 2; }", arg=first,
                timeout=90_000)
            boxed = artifacts / "serve_page_box.png"
            page.screenshot(path=str(boxed), full_page=True)
            print(f"screenshot: {boxed}")
            assert errors == []
        finally:
            browser.close()


class _Attacker(http.server.BaseHTTPRequestHandler):
    """A page on another origin: it posts a clip and its mask (served from its own origin) as a multipart job to the
    server with `no-cors` (no preflight is sent)."""

    target: str
    media: Path

    def do_GET(self):  # noqa: N802
        if self.path in ("/clip.mp4", "/mask.mp4"):
            body, kind = (self.media / self.path[1:]).read_bytes(), "video/mp4"
        else:
            body, kind = f"""<!doctype html><title>elsewhere</title><script>
            const form = new FormData();
            window.posted = Promise.all(["clip", "mask"].map((n) => fetch("/" + n + ".mp4").then((r) => r.blob())))
              .then(([clip, mask]) => {{
                form.append("input_reference", clip, "clip.mp4");
                form.append("mask", mask, "mask.mp4");
                return fetch("{self.target}/v1/videos", {{method: "POST", mode: "no-cors", body: form}});
              }}).then(() => "sent", (e) => "failed: " + e);
            </script>""".encode(), "text/html"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_page_elsewhere_cannot_post_a_job(tmp_path):
    """A no-cors multipart POST from another origin reached the keyless server and ran on ecf8a4b; now the Origin
    check refuses it (403) and the data dir is as it was."""
    executable = require_chromium()
    write_clip(tmp_path / "media")
    worker, _ = gated_worker()
    data = tmp_path / "data"
    app = create_app(ServeConfig(data_dir=str(data)), workers=[worker])
    with thread_server(app) as url, sync_api.sync_playwright() as pw:
        handler = type("Attacker", (_Attacker,), {"target": url, "media": tmp_path / "media"})
        attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=attacker.serve_forever, daemon=True).start()
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        try:
            before = sorted(str(p.relative_to(data)) for p in data.rglob("*") if "sqlite" not in p.name)
            seen: list[int] = []
            page = browser.new_page()
            page.on("response", lambda r: seen.append(r.status) if r.url.endswith("/v1/videos") else None)
            page.goto(f"http://localhost:{attacker.server_address[1]}/")  # another origin than 127.0.0.1:PORT
            assert page.evaluate("window.posted") == "sent"  # the browser sent it; the answer is opaque to the page
            assert seen == [403], seen
            after = sorted(str(p.relative_to(data)) for p in data.rglob("*") if "sqlite" not in p.name)
            assert after == before and list((data / "jobs").iterdir()) == []
        finally:
            browser.close()
            attacker.shutdown()
            attacker.server_close()
