"""`fastremover serve`: every route and error case through FastAPI's TestClient (the real app, store, runner and classic
pipeline; a gate in the progress callback holds a job running where a test needs that), plus the URL fetcher against a
local HTTP server on 127.0.0.1 with an injected resolver.

The helpers these and test_serve_client.py, test_serve_browser.py and test_serve_faults.py share are in helpers.py.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed; the dev extra installs it")
from fastapi.testclient import TestClient  # noqa: E402

from fastremover import media
from fastremover.errors import FastRemoverError
from fastremover.serve import security
from fastremover.serve.app import ServeConfig, create_app
from fastremover.serve.jobs import JobStore, new_id
from fastremover.serve.runner import Cleaner
from helpers import REPO, gated_worker, write_clip


# ----------------------------------------------------------------------------------------------------------------------
# Helpers


def wait_status(client, video_id: str, statuses=("completed", "failed", "cancelled"), timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        video = client.get(f"/v1/videos/{video_id}").json()
        if video["status"] in statuses:
            return video
        assert time.monotonic() < deadline, f"{video_id} still {video['status']}"
        time.sleep(0.02)


def files_outside(data_dir: Path, before: set[Path], roots: list[Path]) -> list[Path]:
    """Files under `roots` that are new since `before` and not under `data_dir`."""
    now = {p for root in roots for p in root.rglob("*") if p.is_file()}
    return sorted(p for p in now - before if not p.is_relative_to(data_dir))


# ----------------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    video, mask = write_clip(root)
    (root / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(2000))
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.mp4").write_bytes(video.read_bytes())
    (root / "escape.mp4").symlink_to(outside / "secret.mp4")
    return {"root": root, "video": video, "mask": mask, "outside": outside}


class _Files(http.server.BaseHTTPRequestHandler):
    """/clip.mp4 and /mask.mp4 from the media folder; /redirect?to=URL; /big (4 MiB); /slow (answers after 1.5 s);
    /short (10 of the 1000 bytes its Content-Length says); /empty (no bytes)."""

    folder: Path

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.end_headers()
        elif self.path == "/slow":
            time.sleep(1.5)
            self.send_response(200)
            self.end_headers()
        elif self.path in ("/short", "/empty"):
            self.send_response(200)
            if self.path == "/short":
                self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"\x00" * 10 if self.path == "/short" else b"")
        elif self.path == "/big":
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\x00" * 65536)
        elif self.path in ("/clip.mp4", "/mask.mp4"):
            data = (self.folder / self.path[1:]).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_server(clips):
    handler = type("Files", (_Files,), {"folder": clips["root"]})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


PUBLIC_IP = "93.184.216.34"  # stands for a public host; the dialer below connects it to the local server


def fake_fetcher(port: int, max_bytes: int = 1 << 20) -> security.UrlFetcher:
    """A fetcher whose resolver maps `media.test` to a public address and `internal.test` to a private one, and
    whose dialer connects the public address to the local test server (so no packet leaves 127.0.0.1)."""
    names = {"media.test": [PUBLIC_IP], "internal.test": ["10.0.0.7"], "mixed.test": [PUBLIC_IP, "127.0.0.1"]}

    def resolver(host: str, p: int) -> list[str]:
        if host in names:
            return names[host]
        return security.system_resolver(host, p) if host in ("127.0.0.1", "localhost") else []

    def dialer(ip: str, p: int, timeout: float):
        assert ip == PUBLIC_IP, f"dialed a refused address {ip}"
        import socket

        return socket.create_connection(("127.0.0.1", port), timeout=timeout)

    return security.UrlFetcher(max_bytes=max_bytes, timeout_s=10, resolver=resolver, dialer=dialer)


@pytest.fixture(scope="module")
def service(clips, http_server, tmp_path_factory):
    """One app for most tests: a gated classic worker, a media root, URLs on through the fake resolver."""
    data = tmp_path_factory.mktemp("data")
    worker, gate = gated_worker()
    config = ServeConfig(data_dir=str(data), media_roots=[str(clips["root"])], max_upload_bytes=512 * 1024,
                         max_queue=2, allow_urls=True, poll_after_ms=20, sync_timeout_s=30)
    app = create_app(config, workers=[worker], fetcher=fake_fetcher(http_server))
    with TestClient(app, raise_server_exceptions=False, base_url="http://localhost") as client:
        yield {"client": client, "gate": gate, "data": data, "app": app}
    gate.release.set()


def upload_job(client, clips, **fields):
    with open(clips["video"], "rb") as v, open(clips["mask"], "rb") as m:
        return client.post("/v1/videos", files={"input_reference": ("clip.mp4", v, "video/mp4"),
                                                "mask": ("mask.mp4", m, "video/mp4")},
                           data={k: str(x) for k, x in fields.items()})


def error_of(response, status: int) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body["error"]) >= {"code", "message"} and body["error"]["message"]
    assert "Traceback" not in response.text
    return body["error"]["message"]


# ----------------------------------------------------------------------------------------------------------------------
# Routes


def test_health_models_and_request_ids(service):
    c = service["client"]
    health = c.get("/health")
    assert health.json()["status"] == "ok" and health.json()["workers"] == 1
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "classic"
    ids = {c.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(i.startswith("req_") for i in ids)
    assert "not_found" in c.get("/v1/nothing").text


def test_files_upload_get_delete(service, clips):
    c = service["client"]
    data = clips["video"].read_bytes()
    r = c.post("/v1/files", files={"file": ("my clip.mp4", data, "video/mp4")}, data={"purpose": "user_data"})
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["object"] == "file" and f["bytes"] == len(data) and f["filename"] == "my clip.mp4"
    assert f["id"].startswith("file-") and len(f["id"]) == 5 + 32 and isinstance(f["created_at"], int)
    stored = next((service["data"] / "files" / f["id"]).iterdir())
    assert stored.read_bytes() == data
    assert c.get(f"/v1/files/{f['id']}").json() == f
    assert c.delete(f"/v1/files/{f['id']}").json() == {"id": f["id"], "object": "file", "deleted": True}
    assert not (service["data"] / "files" / f["id"]).exists()
    error_of(c.get(f"/v1/files/{f['id']}"), 404)
    error_of(c.delete(f"/v1/files/{f['id']}"), 404)
    assert "empty" in error_of(c.post("/v1/files", files={"file": ("e.mp4", b"")}), 400)
    assert "'file'" in error_of(c.post("/v1/files", files={"other": ("e.mp4", b"x")}), 400)
    assert "unknown" in error_of(c.post("/v1/files", files={"file": ("a.mp4", b"x")}, data={"colour": "red"}), 400)


def test_video_job_lifecycle_outputs_and_determinism(service, clips):
    c = service["client"]
    r = upload_job(c, clips, steps=3, seed=7, prompt="remove the ball", model="sora-2", seconds="4")
    assert r.status_code == 200, r.text
    video = r.json()
    assert video["object"] == "video" and video["status"] in ("queued", "in_progress", "completed")
    assert video["id"].startswith("video_") and video["prompt"] == "remove the ball"
    assert video["requested_model"] == "sora-2" and video["options"]["steps"] == 3 and video["options"]["seed"] == 7
    done = wait_status(c, video["id"])
    assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None
    assert done["size"] == "64x48" and float(done["seconds"]) == pytest.approx(9 / 24, abs=1e-3)
    assert done["completed_at"] >= done["created_at"]

    content = c.get(f"/v1/videos/{video['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert float(content.headers["x-inference-time-s"]) > 0
    stages = dict(kv.split("=") for kv in content.headers["x-stage-durations"].split(","))
    assert {"read", "write"} <= set(stages)
    assert hashlib.sha256(content.content).hexdigest() == done["sha256"]
    out_path = service["data"] / "jobs" / video["id"] / "output.mp4"
    assert media.read_video(out_path).frames.shape == (9, 48, 64, 3)

    thumb = c.get(f"/v1/videos/{video['id']}/content", params={"variant": "thumbnail"})
    assert thumb.headers["content-type"] == "image/png" and thumb.content[:8] == b"\x89PNG\r\n\x1a\n"
    preview = c.get(f"/v1/videos/{video['id']}/content", params={"variant": "preview"})
    assert preview.status_code == 200
    (service["data"] / "p.mp4").write_bytes(preview.content)
    assert media.read_video(service["data"] / "p.mp4").frames.shape == (9, 48, 128, 3)  # input | output
    error_of(c.get(f"/v1/videos/{video['id']}/content", params={"variant": "spritesheet"}), 400)

    # Same inputs and seed -> the same bytes; the same job through file ids and JSON.
    up = {n: c.post("/v1/files", files={"file": (f"{n}.mp4", clips[n].read_bytes())}).json()["id"]
          for n in ("video", "mask")}
    again = c.post("/v1/videos", json={"input_reference": up["video"], "mask": up["mask"], "steps": 3, "seed": 7})
    assert again.status_code == 200, again.text
    assert wait_status(c, again.json()["id"])["sha256"] == done["sha256"]

    # Deleting a finished job removes its row and files.
    assert c.delete(f"/v1/videos/{video['id']}").json() == {"id": video["id"], "object": "video.deleted",
                                                            "deleted": True}
    assert not out_path.parent.exists()
    error_of(c.get(f"/v1/videos/{video['id']}"), 404)
    error_of(c.delete(f"/v1/videos/{video['id']}"), 404)


def test_inputs_by_media_root_path_form_fields_and_url(service, clips, http_server):
    c = service["client"]
    by_path = c.post("/v1/videos", data={"input_reference": "clip.mp4", "mask": str(clips["mask"])})
    assert by_path.status_code == 200, by_path.text
    by_url = c.post("/v1/videos", json={"input_reference": "http://media.test/clip.mp4",
                                        "mask": "http://media.test/redirect?to=http://media.test/mask.mp4"})
    assert by_url.status_code == 200, by_url.text
    a, b = wait_status(c, by_path.json()["id"]), wait_status(c, by_url.json()["id"])
    assert a["status"] == b["status"] == "completed" and a["sha256"] == b["sha256"]
    # The path input is used in place (not copied); the URL one was downloaded into the job folder.
    assert not list((service["data"] / "jobs" / a["id"]).glob("video*"))
    assert (service["data"] / "jobs" / b["id"] / "video.mp4").read_bytes() == clips["video"].read_bytes()


def test_list_pagination(service, clips):
    c = service["client"]
    ids = [upload_job(c, clips).json()["id"] for _ in range(2)]
    for i in ids:
        wait_status(c, i)
    newest = c.get("/v1/videos", params={"limit": 1}).json()
    assert newest["object"] == "list" and newest["data"][0]["id"] == ids[-1] and newest["has_more"]
    page = c.get("/v1/videos", params={"limit": 1, "after": ids[-1]}).json()
    assert page["data"][0]["id"] == ids[0] and page["first_id"] == ids[0]
    asc = c.get("/v1/videos", params={"order": "asc", "limit": 100}).json()["data"]
    assert [v["id"] for v in asc][-2:] == ids and not c.get("/v1/videos", params={"limit": 100}).json()["has_more"]
    assert "limit" in error_of(c.get("/v1/videos", params={"limit": 0}), 400)
    assert "order" in error_of(c.get("/v1/videos", params={"order": "sideways"}), 400)


def test_cancel_queued_and_running_and_queue_limit(service, clips):
    c, gate = service["client"], service["gate"]
    gate.release.clear()
    gate.entered.clear()
    try:
        running = upload_job(c, clips).json()["id"]
        assert gate.entered.wait(30)
        assert wait_status(c, running, ("in_progress",))["status"] == "in_progress"
        error_of(c.get(f"/v1/videos/{running}/content"), 409)
        queued = [upload_job(c, clips).json()["id"] for _ in range(2)]  # max_queue = 2
        full = upload_job(c, clips)
        assert "queued" in error_of(full, 429) and full.headers["retry-after"] == "5"
        cancelled = c.delete(f"/v1/videos/{queued[0]}").json()
        assert cancelled["status"] == "cancelled" and cancelled["error"]["code"] == "cancelled"
        stopped = c.delete(f"/v1/videos/{running}").json()
        assert stopped["status"] == "cancelled", stopped
        folder = service["data"] / "jobs" / running
        assert not [p for p in folder.iterdir() if not p.name.startswith(("video", "mask"))]  # nothing half-written
    finally:
        gate.release.set()
    assert wait_status(c, queued[1])["status"] == "completed"


def test_progress_while_running_and_the_decoded_size_budget(service, clips):
    c, gate = service["client"], service["gate"]
    gate.hold_at, gate.entered = ("window", 1), threading.Event()
    gate.release.clear()
    try:
        # 9 frames in windows of 5 sharing 1: two windows; held after the first one -> 50 %.
        r = c.post("/v1/videos", json={"input_reference": "clip.mp4", "mask": "mask.mp4", "window": 5,
                                       "overlap": 1})
        assert gate.entered.wait(30)
        held = c.get(f"/v1/videos/{r.json()['id']}").json()
        assert held["status"] == "in_progress" and held["progress"] == 50
    finally:
        gate.hold_at = ("window", 0)
        gate.release.set()
    assert wait_status(c, r.json()["id"])["progress"] == 100
    config = service["app"].state.service.config
    config.max_decoded_gib = 1e-5  # 10 KiB: less than 9 frames of 64x48 RGB + mask
    try:
        message = error_of(c.post("/v1/videos", json={"input_reference": "clip.mp4", "mask": "mask.mp4"}), 400)
        assert "--max-decoded-gib" in message
    finally:
        config.max_decoded_gib = 4.0


def test_sync_route(service, clips):
    c, gate = service["client"], service["gate"]
    with open(clips["video"], "rb") as v, open(clips["mask"], "rb") as m:
        r = c.post("/v1/videos/sync", files={"input_reference": v, "mask": m}, data={"seed": "7", "steps": "3"})
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert hashlib.sha256(r.content).hexdigest() == r.headers["x-output-sha256"]
    assert r.headers["x-request-id"] and float(r.headers["x-inference-time-s"]) > 0
    assert c.get(f"/v1/videos/{r.headers['x-video-id']}").json()["status"] == "completed"
    # A job that outlives the server-side timeout: 504, and it is cancelled.
    service["app"].state.service.config.sync_timeout_s = 0.3
    gate.release.clear()
    try:
        with open(clips["video"], "rb") as v, open(clips["mask"], "rb") as m:
            late = c.post("/v1/videos/sync", files={"input_reference": v, "mask": m})
        assert "did not finish" in error_of(late, 504)
    finally:
        service["app"].state.service.config.sync_timeout_s = 30
        gate.release.set()
    latest = c.get("/v1/videos", params={"limit": 1}).json()["data"][0]
    assert wait_status(c, latest["id"])["status"] == "cancelled"


# ----------------------------------------------------------------------------------------------------------------------
# Errors and hostile input


def test_bad_requests_are_4xx_with_a_message_and_nothing_leaks(service, clips):
    c = service["client"]
    data = service["data"]
    before = {p for root in (clips["root"], clips["outside"]) for p in root.rglob("*") if p.is_file()}
    jobs_before = set((data / "jobs").iterdir())
    cases = [
        ({"json": {"input_reference": "clip.mp4", "mask": "mask.mp4", "colour": "red"}}, "unknown field 'colour'"),
        ({"json": {"input_reference": "clip.mp4", "mask": "mask.mp4", "steps": 0}}, "--steps 0"),
        ({"json": {"input_reference": "clip.mp4", "mask": "mask.mp4", "steps": "many"}}, "whole number"),
        ({"json": {"input_reference": "clip.mp4", "mask": "mask.mp4", "size": "1080x720"}}, "multiples of 16"),
        ({"json": {"input_reference": "clip.mp4"}}, "mask is required"),
        ({"json": {"input_reference": "../outside/secret.mp4", "mask": "mask.mp4"}}, "media roots"),
        ({"json": {"input_reference": str(clips["outside"] / "secret.mp4"), "mask": "mask.mp4"}}, "outside the media"),
        ({"json": {"input_reference": "escape.mp4", "mask": "mask.mp4"}}, "outside the media roots"),
        ({"json": {"input_reference": "/etc/passwd", "mask": "mask.mp4"}}, "outside the media roots"),
        ({"json": {"input_reference": "data:video/mp4;base64,AAAA", "mask": "mask.mp4"}}, "data: URLs are refused"),
        ({"json": {"input_reference": "file:///etc/passwd", "mask": "mask.mp4"}}, "only http(s)"),
        ({"json": {"input_reference": "http://internal.test/clip.mp4", "mask": "mask.mp4"}}, "non-public"),
        ({"json": {"input_reference": "http://127.0.0.1:1/clip.mp4", "mask": "mask.mp4"}}, "non-public"),
        ({"json": {"input_reference": "http://media.test/redirect?to=http://127.0.0.1:9/x.mp4", "mask": "mask.mp4"}},
         "non-public"),
        ({"json": {"input_reference": "http://mixed.test/clip.mp4", "mask": "mask.mp4"}}, "non-public"),
        ({"json": {"input_reference": "file-doesnotexist", "mask": "mask.mp4"}}, "no uploaded file"),
        ({"json": {"input_reference": "corrupt.mp4", "mask": "mask.mp4"}}, "corrupt"),
        ({"json": {"input_reference": 5, "mask": "mask.mp4"}}, "as a string"),
        ({"json": ["not", "an", "object"]}, "must be an object"),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, "does not parse"),
        ({"content": b"x", "headers": {"content-type": "text/plain"}}, "send multipart/form-data"),
        ({"content": b"--b\r\nContent-Disposition: form-data; name=\"mask\"\r\n\r\nab",
          "headers": {"content-type": "multipart/form-data; boundary=b"}}, "ends before"),
        ({"content": b"garbage without boundary", "headers": {"content-type": "multipart/form-data; boundary=zz"}},
         "multipart"),
        ({"content": b"", "headers": {"content-type": "multipart/form-data"}}, "boundary"),
    ]
    for i, (kwargs, words) in enumerate(cases):
        message = error_of(c.post("/v1/videos", **kwargs), 400)
        assert words in message, f"case {i}: {message}"
        assert str(data) not in message and str(clips["root"]) not in message, f"case {i}: {message}"
    # An oversize upload: 413, and the partial file is gone from tmp/.
    big = c.post("/v1/files", files={"file": ("big.mp4", b"\x00" * (600 * 1024))})
    assert "at most 524288" in error_of(big, 413)  # refused from Content-Length, before the body is read
    assert list((data / "tmp").iterdir()) == []

    def chunked():  # no Content-Length: the cap is enforced while streaming
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.mp4\"\r\n\r\n"
        for _ in range(20):
            yield b"\x00" * 65536

    streamed = c.post("/v1/files", content=chunked(), headers={"content-type": "multipart/form-data; boundary=b"})
    assert "limit" in error_of(streamed, 413)
    assert list((data / "tmp").iterdir()) == []
    # A corrupt upload is refused and the server keeps serving.
    with open(clips["root"] / "corrupt.mp4", "rb") as v, open(clips["mask"], "rb") as m:
        error_of(c.post("/v1/videos", files={"input_reference": v, "mask": m}), 400)
    assert upload_job(c, clips).status_code == 200
    assert files_outside(data, before, [clips["root"], clips["outside"]]) == []
    leftover = set((data / "jobs").iterdir()) - jobs_before
    assert len(leftover) == 1  # only the accepted job made a folder
    wait_status(c, leftover.pop().name)


def test_internal_error_is_500_with_request_id_and_no_traceback(service, clips, monkeypatch, caplog):
    c = service["client"]

    def broken(job):
        raise RuntimeError("internal detail that must stay in the log")

    monkeypatch.setattr(service["app"].state.service.checker, "check", broken)
    r = upload_job(c, clips)
    message = error_of(r, 500)
    assert r.headers["x-request-id"] in message and "internal detail" not in r.text
    assert any("internal detail" in rec.getMessage() for rec in caplog.records)


def test_internal_error_inside_a_job_fails_it_and_the_worker_goes_on(service, clips, caplog):
    c = service["client"]
    service["gate"].fail = RuntimeError("xyzzy-for-the-log-only")
    failed = wait_status(c, upload_job(c, clips).json()["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "internal_error"
    assert failed["id"] in failed["error"]["message"] and "xyzzy" not in failed["error"]["message"]
    assert any("xyzzy-for-the-log-only" in rec.getMessage() for rec in caplog.records)
    assert not (service["data"] / "jobs" / failed["id"] / "output.mp4").exists()
    assert wait_status(c, upload_job(c, clips).json()["id"])["status"] == "completed"


def test_job_that_fails_while_running_reports_the_reason(service, clips, tmp_path):
    c = service["client"]
    # A 3-frame mask for a 9-frame clip: the probes pass, the run refuses the count mismatch.
    video, mask = media.synthetic_clip(3, 48, 64, seed=0)
    media.write_video(clips["root"] / "short_mask.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, -1), 24)
    r = c.post("/v1/videos", json={"input_reference": "clip.mp4", "mask": "short_mask.mp4"})
    assert r.status_code == 200, r.text
    failed = wait_status(c, r.json()["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_input"
    assert "the mask has 3 frames but the video has 9" in failed["error"]["message"]
    assert str(service["data"]) not in failed["error"]["message"]
    error_of(c.get(f"/v1/videos/{failed['id']}/content"), 409)


def test_api_key(tmp_path, clips):
    config = ServeConfig(data_dir=str(tmp_path / "data"), api_key="s3cret-key")
    with TestClient(create_app(config, workers=[gated_worker()[0]]), base_url="http://localhost") as c:
        assert c.get("/health").status_code == 200
        assert c.get("/").status_code == 200 and c.get("/static/app.js").status_code == 200  # the page: no data
        for method, path in [("GET", "/v1/models"), ("GET", "/v1/videos"), ("POST", "/v1/videos"),
                             ("POST", "/v1/files"), ("GET", "/v1/videos/video_x/content"), ("DELETE", "/v1/files/x")]:
            for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"},
                           {"Authorization": "Bearer s3cret-key-and-more"}):
                r = c.request(method, path, headers=header)
                assert "API key" in error_of(r, 401) and "s3cret" not in r.text
                assert r.headers["www-authenticate"] == "Bearer"
        auth = {"Authorization": "Bearer s3cret-key"}
        assert c.get("/v1/models", headers=auth).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "bearer s3cret-key"}).status_code == 200
        # The defaults of this server: no media roots (paths refused), URL inputs off.
        for value, words in [(str(clips["video"]), "local paths are off"), ("http://media.test/clip.mp4",
                                                                            "URL inputs are off")]:
            r = c.post("/v1/videos", json={"input_reference": value, "mask": "file-x"}, headers=auth)
            assert words in error_of(r, 400)


def test_cli_bind_rules_and_flags(tmp_path):
    import argparse

    from fastremover.serve.cli import add_serve_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))

    def config(*argv):
        return config_from_args(parser.parse_args(["serve", "--data-dir", str(tmp_path), *argv]))

    with pytest.raises(FastRemoverError, match="loopback only"):
        config("--host", "0.0.0.0")
    assert config("--host", "0.0.0.0", "--api-key", "k").api_key == "k"
    assert config("--host", "0.0.0.0", "--insecure-public").api_key is None
    assert config("--host", "::1").api_key is None
    c = config("--media-root", "a", "--media-root", "b", "--max-upload-mb", "1", "--allow-urls")
    assert c.media_roots == ["a", "b"] and c.max_upload_bytes == 2**20 and c.allow_urls
    with pytest.raises(FastRemoverError, match="--model"):
        config("--model", str(tmp_path / "missing"))
    with pytest.raises(FastRemoverError, match="--keep-hours"):
        config("--keep-hours", "0")
    assert config("--allowed-host", "media.example", "--allowed-host", "*.lan").allowed_hosts == ["media.example",
                                                                                                 "*.lan"]
    for bad in ("foo*", "*foo.lan", "a/b", ""):
        with pytest.raises(FastRemoverError, match="--allowed-host"):
            config("--allowed-host", bad)
    assert config("--url-timeout", "5").url_timeout_s == 5
    with pytest.raises(FastRemoverError, match="--url-timeout"):
        config("--url-timeout", "0")


# ----------------------------------------------------------------------------------------------------------------------
# Store, recovery, retention


def test_store_recovery_and_retention(tmp_path):
    store = JobStore(tmp_path)
    ids = []
    for _ in range(4):
        vid = f"video_{len(ids)}"
        store.add_video(vid, model="m", prompt=None, requested_size=None, requested_seconds=None, options={},
                        video_path="v", mask_path="m")
        ids.append(vid)
    first = store.claim_next()
    second = store.claim_next()
    assert (first.id, second.id) == (ids[0], ids[1]) and first.attempts == 1
    # A crash: both in_progress. The first has had one attempt (re-queued), the second is on its second (failed).
    store._exec("UPDATE videos SET attempts = 2 WHERE id = ?", (ids[1],))
    store.close()
    store = JobStore(tmp_path)
    requeued, failed = store.recover()
    assert requeued == [ids[0]] and failed == [ids[1]]
    assert store.get_video(ids[1]).status == "failed" and "2 times" in store.get_video(ids[1]).error_message
    assert [store.claim_next().id for _ in range(3)] == [ids[0], ids[2], ids[3]]  # the re-queued job keeps its place
    assert store.get_video(ids[0]).attempts == 2
    # Retention: finished jobs older than the TTL go with their folders; newer ones stay.
    for vid in ids:
        store.job_dir(vid).mkdir(parents=True, exist_ok=True)
    store.finish(ids[0], "failed", "x", "y")
    store._exec("UPDATE videos SET completed_at = completed_at - 7200 WHERE id = ?", (ids[0],))
    old_file = new_id("file-")
    store.file_dir(old_file).mkdir()
    store.add_file(old_file, "a.mp4", 1, "user_data", store.file_dir(old_file) / "upload.mp4")
    store._exec("UPDATE files SET created_at = created_at - 7200")
    assert Cleaner(store, keep_hours=1).sweep() == (1, 1)  # ids[1] failed just now: kept
    assert store.get_video(ids[0]) is None and not store.job_dir(ids[0]).exists()
    assert store.get_video(ids[1]).status == "failed" and store.job_dir(ids[1]).exists()
    assert store.get_video(ids[2]).status == "in_progress" and store.job_dir(ids[2]).exists()
    assert store.get_file(old_file) is None and not store.file_dir(old_file).exists()


# ----------------------------------------------------------------------------------------------------------------------
# URL fetching


def test_url_fetcher_rules(http_server, tmp_path):
    fetcher = fake_fetcher(http_server, max_bytes=1 << 20)
    dest = tmp_path / "x.mp4"
    assert fetcher.fetch("http://media.test/clip.mp4", dest, "video") > 0
    for url, words in [
        ("http://media.test/big", "larger than"),
        ("http://internal.test/clip.mp4", "non-public"),
        ("http://media.test/redirect?to=http://internal.test/clip.mp4", "non-public"),
        ("http://media.test/redirect?to=http://127.0.0.1:%d/clip.mp4" % http_server, "non-public"),
        ("http://media.test/redirect?to=http://[::1]:80/", "non-public"),
        ("http://media.test/redirect?to=file:///etc/passwd", "only http(s)"),
        ("http://media.test/missing.mp4", "HTTP 404"),
        ("http://media.test/short", "ended after 10 of 1000 bytes"),
        ("http://media.test/empty", "file is empty"),
        ("http://user:pw@media.test/clip.mp4", "credentials"),
        ("data:video/mp4;base64,AAAA", "data: URLs"),
        ("ftp://media.test/clip.mp4", "only http(s)"),
        ("http://nowhere.test/clip.mp4", "does not resolve"),
    ]:
        with pytest.raises(FastRemoverError, match=words.replace("(", r"\(").replace(")", r"\)")):
            fetcher.fetch(url, dest, "video")
        assert not dest.exists(), url
    # The time cap: a host that does not answer within timeout_s.
    slow = fake_fetcher(http_server)
    slow.timeout_s = 0.3
    with pytest.raises(FastRemoverError, match="took longer than 0.3 s"):
        slow.fetch("http://media.test/slow", dest, "video")
    assert not dest.exists()
    # With private addresses allowed (tests only) the system resolver's loopback answer is fetched for real;
    # with it off (the default) the same URL is refused.
    url = f"http://127.0.0.1:{http_server}/clip.mp4"
    private = security.UrlFetcher(max_bytes=1 << 20, timeout_s=10, allow_private=True)
    assert private.fetch(url, dest, "video") == (tmp_path / "x.mp4").stat().st_size > 0
    with pytest.raises(FastRemoverError, match="non-public"):
        security.UrlFetcher(max_bytes=1 << 20).fetch(url, tmp_path / "y.mp4", "video")


def test_address_and_key_checks():
    assert security.is_public_address("93.184.216.34") and security.is_public_address("2606:4700::1111")
    for ip in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "224.0.0.1", "0.0.0.0",
               "::1", "fe80::1", "fc00::1", "ff02::1", "::ffff:127.0.0.1", "100.64.0.1", "240.0.0.1"):
        assert not security.is_public_address(ip), ip
    assert security.check_bearer("Bearer k", "k") and not security.check_bearer("Bearer k2", "k")
    assert not security.check_bearer(None, "k") and not security.check_bearer("k", "k")
    assert security.looks_like_url("http://x") and security.looks_like_url("data:abc")
    assert not security.looks_like_url("a/b.mp4") and not security.looks_like_url("/abs/c.mp4")


def test_load_tool_20_concurrent_requests(capsys):
    """tools/serve_load.py against its own in-process server: 20 concurrent sync requests all answer 200 with the
    same bytes; it prints p50 / p95."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_load", REPO / "tools" / "serve_load.py")
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    assert serve_load.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and serve_load.percentile([1.0, 2.0], 95) == 2.0
    assert serve_load.main(["--requests", "20", "--concurrency", "20", "--json"]) == 0
    summary = __import__("json").loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] == 20 and summary["distinct_hashes"] == 1 and summary["statuses"] == [200]
    assert 0 < summary["p50_s"] <= summary["p95_s"] <= summary["max_s"]
    print(f"serve load: p50 {summary['p50_s']:.2f} s, p95 {summary['p95_s']:.2f} s, wall {summary['wall_s']:.2f} s")


def test_box_instead_of_a_mask(service, clips):
    """A box on one frame instead of a mask: the worker thread builds the mask (fastremover.masktools) and removes."""
    c = service["client"]
    video, mask = media.synthetic_clip(9, 48, 64, seed=0)
    ys, xs = np.nonzero(mask[4])
    box = f"{xs.min() - 2},{ys.min() - 2},{xs.max() - xs.min() + 5},{ys.max() - ys.min() + 5}"
    r = c.post("/v1/videos", json={"input_reference": "clip.mp4", "box": box, "box_frame": 4})
    assert r.status_code == 200, r.text
    done = wait_status(c, r.json()["id"])
    assert done["status"] == "completed", done["error"]
    built = media.read_mask(service["data"] / "jobs" / done["id"] / "box_mask")
    overlap = (built & mask).sum() / mask.sum()
    assert built.shape == mask.shape and overlap > 0.8, overlap
    for fields, words in [({"box": "1,2,3"}, "X,Y,W,H"), ({"box": "60,40,20,20"}, "outside the 64x48 frame"),
                          ({"box": box, "box_frame": 9}, "out of range"),
                          ({"box": box, "mask": "mask.mp4"}, "not both"),
                          ({"box_frame": 2, "mask": "mask.mp4"}, "needs a box")]:
        assert words in error_of(c.post("/v1/videos", json={"input_reference": "clip.mp4", **fields}), 400)


def test_host_rules_with_a_key_and_allowed_hosts(tmp_path):
    """Without a key only loopback names, --host and --allowed-host are answered; with a key any Host is (a page
    elsewhere has no key), unless --allowed-host names them; an Origin of an allowed host may post."""
    from fastremover.serve.app import allowed_hosts, same_origin

    assert allowed_hosts(ServeConfig(data_dir="d")) == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts(ServeConfig(data_dir="d", bind_host="192.168.1.5"))[-1] == "192.168.1.5"
    assert allowed_hosts(ServeConfig(data_dir="d", bind_host="0.0.0.0")) == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts(ServeConfig(data_dir="d", bind_host="fd00::5"))[-1] == "[fd00::5]"
    assert allowed_hosts(ServeConfig(data_dir="d", api_key="k")) == ["*"]
    assert "media.lan" in allowed_hosts(ServeConfig(data_dir="d", api_key="k", allowed_hosts=["media.lan"]))
    assert same_origin("http://127.0.0.1:8000", "127.0.0.1:8000", []) and not same_origin("null", "x", [])
    assert not same_origin("http://127.0.0.1:8001", "127.0.0.1:8000", ["*"])
    assert same_origin("https://media.lan", "127.0.0.1:8000", ["media.lan"])
    assert same_origin("https://a.media.lan", "127.0.0.1:8000", ["*.media.lan"])
    assert not same_origin("https://amedia.lan", "127.0.0.1:8000", ["*.media.lan"])
    for hosts, expected in ((None, 200), (["media.lan"], 400)):
        config = ServeConfig(data_dir=str(tmp_path / "data"), api_key="k", allowed_hosts=hosts)
        with TestClient(create_app(config, workers=[gated_worker()[0]]), base_url="http://elsewhere.example") as c:
            assert c.get("/health").status_code == expected
            assert c.get("/health", headers={"Host": "media.lan"}).status_code == 200
