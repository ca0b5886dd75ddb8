"""`fastremover serve` under the attacks of issue 42, each against a live server on 127.0.0.1 (a server process, or
uvicorn in a thread of this process where a test watches what the server calls): the answer's status and one-line
message, no traceback, and every user file and the data dir unchanged unless the request was accepted.

1. traversal ids on DELETE/GET /v1/files and /v1/videos; 2. decoded-size bombs refused from their headers;
3. the queue cap under 30 concurrent creates; 4. URL downloads: a total deadline, and /health answers while they
stall; 5. Host and Origin checks; 6. box count, deep JSON, security headers, favicon, the --insecure-public warning
and a /sync request in flight at SIGTERM.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import select
import signal
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import GATED_SERVER, gated_worker, live_server, thread_server, write_clip

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed; the dev extra installs it")
from fastremover.serve.app import ServeConfig, create_app  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------------
# Helpers


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under `folder` with its content hash ("dir" for folders). The SQLite files are listed by name only
    (a read updates the WAL index); what they hold is checked through the API."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_dir():
            out[rel] = "dir"
        elif path.name.startswith("jobs.sqlite3"):
            out[rel] = "sqlite"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def one_line_error(response: httpx.Response, status: int, code: str | None = None) -> str:
    """The JSON error's message, after checking the status, one line, and no traceback."""
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["message"] and "\n" not in error["message"], error
    assert "Traceback" not in response.text
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One request with `path` sent exactly as given (httpx would normalize "..")."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def png_header(width: int, height: int) -> bytes:
    """A small PNG whose IHDR says width x height, with a token IDAT (decoding it would allocate the whole frame)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 256)) + \
        chunk(b"IEND", b"")


def jpeg_header(width: int, height: int) -> bytes:
    """A JPEG start (SOI, an APP0 segment, a baseline SOF0 saying width x height) and no picture data."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + app0 + sof0 + b"\xff\xd9"


def upload(url: str, path: Path) -> str:
    with open(path, "rb") as f:
        r = httpx.post(url + "/v1/files", files={"file": (path.name, f)}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def wait_for(predicate, what: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


# ----------------------------------------------------------------------------------------------------------------------
# One keyless server with defaults (items 1, 5, 6), started with --insecure-public to show its warning


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    video, mask = write_clip(root / "media")
    with live_server(root / "data", "--insecure-public") as (proc, url):
        ids = [upload(url, video), upload(url, mask)]
        done = httpx.post(url + "/v1/videos", json={"input_reference": ids[0], "mask": ids[1]}, timeout=30)
        assert done.status_code == 200, done.text
        video_id = done.json()["id"]
        wait_for(lambda: httpx.get(f"{url}/v1/videos/{video_id}").json()["status"] == "completed", "job finished")
        yield {"proc": proc, "url": url, "data": root / "data", "media": root / "media", "files": ids,
               "video_id": video_id}


def test_traversal_ids_delete_nothing(plain):
    """1: DELETE /v1/files/.. (and %2e%2e, ., other non-ids) answered 404 and deleted the whole data dir on ecf8a4b."""
    url, data = plain["url"], plain["data"]
    before, user_before = snapshot(data), snapshot(plain["media"])
    assert any(k.startswith("files/file-") for k in before) and any(k.startswith("jobs/video_") for k in before)
    for method in ("DELETE", "GET"):
        for path in ("/v1/files/..", "/v1/files/%2e%2e", "/v1/files/%2E%2E", "/v1/files/.", "/v1/files/%2e",
                     "/v1/files/file-" + "0" * 32, "/v1/files/jobs.sqlite3", "/v1/files/file-..",
                     "/v1/files/" + plain["files"][0].upper(), "/v1/videos/..", "/v1/videos/%2e%2e",
                     "/v1/videos/.", "/v1/videos/video_" + "0" * 32):
            status, headers, body = raw(url, method, path)
            assert status == 404, (method, path, status, body)
            message = json.loads(body)["error"]["message"]
            assert "\n" not in message and b"Traceback" not in body, (path, body)
            assert snapshot(data) == before, (method, path)
    assert snapshot(plain["media"]) == user_before
    for file_id in plain["files"]:
        assert httpx.get(f"{url}/v1/files/{file_id}").status_code == 200
    assert httpx.get(f"{url}/v1/videos/{plain['video_id']}/content").status_code == 200


def test_host_and_origin_checks(plain):
    """5: a foreign Host (DNS rebinding) got 200 and a cross-origin no-cors multipart POST ran a job on ecf8a4b."""
    url, data = plain["url"], plain["data"]
    port = url.rsplit(":", 1)[1]
    before, user_before = snapshot(data), snapshot(plain["media"])
    for host in ("attacker.example", f"attacker.example:{port}", f"127.0.0.1.attacker.example:{port}"):
        for path in ("/health", "/v1/videos", f"/v1/videos/{plain['video_id']}", "/"):
            r = httpx.get(url + path, headers={"Host": host})
            assert r.status_code == 400 and r.text == "Invalid host header", (host, path, r.status_code, r.text)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200, host
    # What a page elsewhere can send without a preflight: a multipart form post (Origin set by the browser).
    clip = (plain["media"] / "clip.mp4").read_bytes()
    mask = (plain["media"] / "mask.mp4").read_bytes()
    form = {"input_reference": ("clip.mp4", clip, "video/mp4"), "mask": ("mask.mp4", mask, "video/mp4")}
    for origin in ("http://attacker.example", f"http://attacker.example:{port}", "null",
                   f"http://localhost.attacker.example:{port}", f"https://127.0.0.1:{int(port) + 1}"):
        r = httpx.post(url + "/v1/videos", files=form, headers={"Origin": origin}, timeout=30)
        assert "another origin" in one_line_error(r, 403, "cross_origin"), origin
        r = httpx.delete(f"{url}/v1/files/{plain['files'][0]}", headers={"Origin": origin})
        one_line_error(r, 403, "cross_origin")
        r = httpx.post(url + "/v1/files", files={"file": ("x.mp4", clip)}, headers={"Origin": origin})
        one_line_error(r, 403, "cross_origin")
    assert snapshot(data) == before and snapshot(plain["media"]) == user_before
    assert httpx.get(url + "/health").json()["queued"] == 0
    # The server's own page posts with its own origin; API clients send none.
    r = httpx.post(url + "/v1/videos", files=form, headers={"Origin": url}, timeout=30)
    assert r.status_code == 200, r.text
    video_id = r.json()["id"]
    wait_for(lambda: httpx.get(f"{url}/v1/videos/{video_id}").json()["status"] == "completed", "job finished")
    assert httpx.delete(f"{url}/v1/videos/{video_id}", headers={"Origin": url}).json()["deleted"]


def test_box_count_deep_json_headers_favicon_and_warning(plain):
    """6: 2000 boxes were queued, 100k-deep JSON was a 500, no route had security headers, /favicon.ico was a 404 and
    --insecure-public without a key started silently on ecf8a4b."""
    url, data = plain["url"], plain["data"]
    before = snapshot(data)
    boxes = ";".join(["2,2,8,8"] * 2000)
    r = httpx.post(url + "/v1/videos", json={"input_reference": plain["files"][0], "box": boxes}, timeout=30)
    assert "at most 16 per job" in one_line_error(r, 400)
    r = httpx.post(url + "/v1/videos", json={"input_reference": plain["files"][0], "box": ["2,2,8,8"] * 2000})
    assert "at most 16 per job" in one_line_error(r, 400)
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        r = httpx.post(url + "/v1/videos", content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert "nested too deeply" in one_line_error(r, 400, "invalid_body")
    assert snapshot(data) == before

    favicon = httpx.get(url + "/favicon.ico")
    assert favicon.status_code == 204 and favicon.content == b""
    port = url.rsplit(":", 1)[1]
    answers = [httpx.get(url + p) for p in ("/", "/static/app.js", "/health", "/v1/models", "/v1/videos",
                                            "/favicon.ico", "/v1/nothing", "/v1/videos/video_x")]
    answers += [httpx.get(url + "/health", headers={"Host": f"evil.example:{port}"}),
                httpx.post(url + "/v1/videos", json={"box": "1,2"}),
                httpx.post(url + "/v1/videos", json={}, headers={"Origin": "http://evil.example"}),
                httpx.get(f"{url}/v1/videos/{plain['video_id']}/content")]
    assert sorted({a.status_code for a in answers}) == [200, 204, 400, 403, 404]
    for a in answers:
        csp = a.headers.get("content-security-policy", "")
        assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp, (a.url, a.headers)
        assert a.headers.get("x-content-type-options") == "nosniff", a.url
        assert a.headers.get("referrer-policy") == "no-referrer", a.url
        assert a.headers.get("x-request-id", "").startswith("req_"), a.url

    # The warning was printed before the server said it listens.
    proc = plain["proc"]
    assert select.select([proc.stderr], [], [], 10)[0], "nothing on stderr"
    stderr = os.read(proc.stderr.fileno(), 1 << 16).decode()
    warnings = [line for line in stderr.splitlines() if "warning: --insecure-public without --api-key" in line]
    assert len(warnings) == 1 and "Traceback" not in stderr, stderr


# ----------------------------------------------------------------------------------------------------------------------
# 2. Decoded-size bombs


def test_decoded_size_bombs_refused_from_headers(tmp_path, monkeypatch):
    """A 20000x20000 PNG as the mask of a 96x64 clip was accepted (+8.8 GB when run) and as the video refused only
    after the probe decoded it on ecf8a4b; now both are refused from the header, before anything decodes."""
    import cv2

    from fastremover import media

    decoded = []
    real_imdecode, real_read_image = cv2.imdecode, media._read_image_rgb
    monkeypatch.setattr(cv2, "imdecode", lambda *a, **k: decoded.append("cv2.imdecode") or real_imdecode(*a, **k))
    monkeypatch.setattr(media, "_read_image_rgb", lambda p: decoded.append(str(p)) or real_read_image(p))

    video, mask = write_clip(tmp_path / "media", frames=9, height=64, width=96)
    (tmp_path / "media" / "bomb.png").write_bytes(png_header(20000, 20000))
    (tmp_path / "media" / "bomb.jpg").write_bytes(jpeg_header(20000, 20000))
    (tmp_path / "media" / "bomb_named.mp4").write_bytes(png_header(20000, 20000))  # the name does not matter
    cv2.imwrite(str(tmp_path / "media" / "big_mask.png"), cv2.resize(  # a real mask of another size: accepted
        media.read_video(mask).frames[0], (192, 128), interpolation=cv2.INTER_NEAREST))
    user_before = snapshot(tmp_path / "media")
    data = tmp_path / "data"
    worker, _ = gated_worker()
    decoded.clear()
    with thread_server(create_app(ServeConfig(data_dir=str(data)), workers=[worker])) as url:
        before = snapshot(data)

        def post(video_name: str, mask_name: str) -> httpx.Response:
            with open(tmp_path / "media" / video_name, "rb") as v, open(tmp_path / "media" / mask_name, "rb") as m:
                return httpx.post(url + "/v1/videos", files={"input_reference": (video_name, v),
                                                              "mask": (mask_name, m)}, timeout=60)

        for video_name, mask_name, what in [("clip.mp4", "bomb.png", "the mask 20000x20000"),
                                            ("clip.mp4", "bomb.jpg", "the mask 20000x20000"),
                                            ("clip.mp4", "bomb_named.mp4", "the mask 20000x20000"),
                                            ("bomb.png", "mask.mp4", "the video is 20000x20000"),
                                            ("bomb.jpg", "mask.mp4", "the video is 20000x20000")]:
            message = one_line_error(post(video_name, mask_name), 400)
            assert what in message and "--max-decoded-gib" in message, (video_name, mask_name, message)
            assert decoded == [], (video_name, mask_name, decoded)
            assert snapshot(data) == before
        r = post("clip.mp4", "big_mask.png")
        assert r.status_code == 200, r.text
        video_id = r.json()["id"]
        wait_for(lambda: httpx.get(f"{url}/v1/videos/{video_id}").json()["status"] == "completed", "job finished")
    assert snapshot(tmp_path / "media") == user_before


def test_header_size_reads_sizes_without_decoding_over_the_cap(tmp_path):
    """PNG and JPEG sizes from their headers; other formats from PyAV's stream parameters, where FFmpeg's max_pixels
    keeps a format that must decode a frame to know its size from decoding one over the cap."""
    import cv2
    import numpy as np

    from fastremover.errors import FastRemoverError
    from fastremover.serve.limits import HeaderSize, header_size

    picture = np.zeros((1200, 1600, 3), np.uint8)
    for ending in (".png", ".jpg", ".webp", ".bmp", ".tif"):
        cv2.imwrite(str(tmp_path / f"p{ending}"), picture)
        assert header_size(tmp_path / f"p{ending}", 2_000_000, "mask") == HeaderSize(1, 1200, 1600), ending
    clip, _ = write_clip(tmp_path / "media", frames=9, height=48, width=64)
    assert header_size(clip, 10_000, "video") == HeaderSize(9, 48, 64)
    for ending in (".webp", ".bmp", ".tif"):  # FFmpeg decodes these to learn their size: refused, not decoded
        with pytest.raises(FastRemoverError, match="more than 1000000 pixels"):
            header_size(tmp_path / f"p{ending}", 1_000_000, "mask")
    (tmp_path / "bad.png").write_bytes(png_header(64, 48)[:20])
    (tmp_path / "junk.mp4").write_bytes(b"\x00" * 1000)
    with pytest.raises(FastRemoverError, match="image header is corrupt"):
        header_size(tmp_path / "bad.png", 1_000_000, "mask")
    with pytest.raises(FastRemoverError, match="corrupt or not a video"):
        header_size(tmp_path / "junk.mp4", 1_000_000, "video")


# ----------------------------------------------------------------------------------------------------------------------
# 3 and 6 (sync at SIGTERM): a server whose one worker holds every job at its first progress report


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    root = tmp_path_factory.mktemp("gated")
    video, mask = write_clip(root / "media")
    with live_server(root / "data", "--max-queue", "5", "--shutdown-grace", "1", script=GATED_SERVER,
                     env={"GATE": str(root / "never")}) as (proc, url):
        yield {"proc": proc, "url": url, "data": root / "data", "files": [upload(url, video), upload(url, mask)]}


def test_queue_cap_holds_under_concurrent_creates(gated):
    """3: with --max-queue 5, 30 concurrent creates were all accepted (29 queued) on ecf8a4b."""
    url, data = gated["url"], gated["data"]
    body = {"input_reference": gated["files"][0], "mask": gated["files"][1]}
    barrier = threading.Barrier(30)

    def create(_):
        with httpx.Client(timeout=60) as client:
            barrier.wait()
            return client.post(url + "/v1/videos", json=body)

    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(create, range(30)))
    accepted = [a.json()["id"] for a in answers if a.status_code == 200]
    for a in answers:
        if a.status_code != 200:
            assert "5 jobs are queued already" in one_line_error(a, 429, "queue_full")
            assert a.headers["retry-after"] == "5"
    health = httpx.get(url + "/health").json()
    assert health["queued"] <= 5 and health["queued"] + health["in_progress"] == len(accepted) <= 6, (
        health, len(accepted))
    assert sorted(p.name for p in (data / "jobs").iterdir()) == sorted(accepted)  # no leftover of a refused one
    assert list((data / "tmp").iterdir()) == []


def test_sync_request_in_flight_at_sigterm_gets_json_503(gated):
    """6: a /v1/videos/sync request in flight at SIGTERM got a plain-text 500 on ecf8a4b; now the documented JSON 503
    naming its job. (Last in this module: it stops the server.)"""
    url, proc = gated["url"], gated["proc"]
    for video in httpx.get(url + "/v1/videos", params={"limit": 100}).json()["data"]:
        if video["status"] == "queued":
            httpx.delete(f"{url}/v1/videos/{video['id']}")
    known = {v["id"] for v in httpx.get(url + "/v1/videos", params={"limit": 100}).json()["data"]}
    body = {"input_reference": gated["files"][0], "mask": gated["files"][1]}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, url + "/v1/videos/sync", json=body, timeout=120)
        new = wait_for(lambda: [v for v in httpx.get(url + "/v1/videos").json()["data"] if v["id"] not in known],
                       "the sync job was created")
        proc.send_signal(signal.SIGTERM)
        r = answer.result()
    message = one_line_error(r, 503, "stopping")
    assert new[0]["id"] in message and r.headers["retry-after"] == "5"
    assert proc.wait(60) == 0


# ----------------------------------------------------------------------------------------------------------------------
# 4. URL downloads


class _Drip(http.server.BaseHTTPRequestHandler):
    """Answers 200 with a 1 MB Content-Length, then sends one byte a second until `stop` is set or the client
    goes away."""

    stop: threading.Event
    active: list

    def do_GET(self):  # noqa: N802
        self.active.append(self)
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            while not self.stop.wait(1.0):
                self.wfile.write(b"\x00")
                self.wfile.flush()
        except OSError:
            pass
        finally:
            self.active.remove(self)

    def log_message(self, *args):
        pass


@pytest.fixture
def drip():
    stop, active = threading.Event(), []
    handler = type("Drip", (_Drip,), {"stop": stop, "active": active})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}/clip.mp4", "active": active, "stop": stop}
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def url_server(tmp_path: Path, timeout_s: float):
    config = ServeConfig(data_dir=str(tmp_path / "data"), allow_urls=True, allow_private_urls=True,
                         url_timeout_s=timeout_s)
    return thread_server(create_app(config, workers=[gated_worker()[0]]))


def test_url_download_is_cut_at_its_deadline(tmp_path, drip):
    """4: a sender dripping 1 byte/s held the request as long as it liked on ecf8a4b (the cap was checked after each
    64 KiB read); now the download ends at the deadline (1.5 s here, --url-timeout)."""
    video, mask = write_clip(tmp_path / "media")
    user_before = snapshot(tmp_path / "media")
    with url_server(tmp_path, 1.5) as url:
        mask_id = upload(url, mask)
        before = snapshot(tmp_path / "data")
        started = time.monotonic()
        try:
            r = httpx.post(url + "/v1/videos", json={"input_reference": drip["url"], "mask": mask_id}, timeout=30)
        finally:
            drip["stop"].set()  # the old code's download ran until the sender stopped
        took = time.monotonic() - started
        assert "the download took longer than 1.5 s" in one_line_error(r, 400)
        print(f"a 1 byte/s download was cut after {took:.2f} s (deadline 1.5 s)")
        assert snapshot(tmp_path / "data") == before
    assert snapshot(tmp_path / "media") == user_before


def test_health_answers_while_downloads_stall(tmp_path, drip):
    """4: 42 creates whose URL never finished exhausted the request thread pool on ecf8a4b (/health took 55 s); now
    downloads run in their own pool (4 at once, 429 above) and /health answers while they stall."""
    with url_server(tmp_path, 8) as url:
        mask_id = upload(url, write_clip(tmp_path / "media")[1])
        before = snapshot(tmp_path / "data")
        body = {"input_reference": drip["url"], "mask": mask_id}
        with ThreadPoolExecutor(45) as pool:
            answers = [pool.submit(httpx.post, url + "/v1/videos", json=body, timeout=120) for _ in range(45)]
            try:
                wait_for(lambda: len(drip["active"]) >= 4, "4 downloads in flight")
                started = time.monotonic()
                health = httpx.get(url + "/health", timeout=10)
                took = time.monotonic() - started
                stalled = len(drip["active"])
            finally:
                drip["stop"].set()  # on the old code the downloads would hold their threads until this
            results = [a.result() for a in answers]
        assert health.status_code == 200 and health.json()["status"] == "ok"
        print(f"/health answered in {took * 1000:.0f} ms with {stalled} downloads stalled")
        codes = {}
        for r in results:
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            message = one_line_error(r, r.status_code)
            assert r.status_code in (400, 429), (r.status_code, message)
            assert ("URL downloads are running already" if r.status_code == 429 else "download") in message
        assert codes.get(429, 0) >= 45 - 4, codes
        assert snapshot(tmp_path / "data") == before


def test_stopping_ends_downloads_in_flight(tmp_path, drip):
    """At SIGTERM (`UrlFetcher.abort`) a stalled download ends at once with its own message instead of holding the
    shutdown until its deadline (60 s by default)."""
    from fastremover.errors import FastRemoverError
    from fastremover.serve.security import UrlFetcher

    fetcher = UrlFetcher(max_bytes=1 << 20, timeout_s=600, allow_private=True)
    errors = []

    def fetch():
        try:
            fetcher.fetch(drip["url"], tmp_path / "x.mp4", "input_reference")
        except FastRemoverError as e:
            errors.append(str(e))

    thread = threading.Thread(target=fetch)
    thread.start()
    wait_for(lambda: drip["active"], "the download started")
    fetcher.abort()
    thread.join(30)
    assert not thread.is_alive() and errors == ["input_reference: the download was stopped: the server is stopping"]
    assert not (tmp_path / "x.mp4").exists()
