"""The official `openai` Python client, unchanged, against a live `fastremover serve` on 127.0.0.1 (a random port),
with an API key; and a SIGTERM that stops the server cleanly."""

from __future__ import annotations

import hashlib
import signal
import warnings

import pytest
from helpers import live_server, write_clip

openai = pytest.importorskip("openai", reason="the openai client is not installed (it is in the dev extra)")

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    video, mask = write_clip(root / "media")
    with live_server(root / "data", "--api-key", KEY, "--media-root", str(root / "media")) as (proc, url):
        yield {"proc": proc, "url": url, "video": video, "mask": mask, "root": root}


def test_openai_client_files_videos_poll_download(server):
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    warnings.simplefilter("ignore", DeprecationWarning)  # the client marks its Sora methods deprecated
    with open(server["mask"], "rb") as f:
        mask = client.files.create(file=f, purpose="user_data")
    assert mask.object == "file" and mask.id.startswith("file-") and mask.bytes == server["mask"].stat().st_size

    with open(server["video"], "rb") as f:
        video = client.videos.create(model="sora-2", prompt="remove the object", input_reference=f,
                                     extra_body={"mask": mask.id, "seed": 3, "steps": 2})
    assert video.object == "video" and video.status in ("queued", "in_progress", "completed")
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert done.status == "completed" and done.progress == 100 and done.size == "64x48"
    assert client.videos.retrieve(video.id).status == "completed"

    content = client.videos.download_content(video.id)
    data = content.read()
    assert data[4:8] == b"ftyp" and hashlib.sha256(data).hexdigest() == done.model_extra["sha256"]
    thumb = client.videos.download_content(video.id, variant="thumbnail").read()
    assert thumb[:4] == b"\x89PNG"

    # create_and_poll with the same inputs by path inside the media root: same bytes.
    again = client.videos.create_and_poll(prompt="", extra_body={"input_reference": "clip.mp4", "mask": mask.id,
                                                                 "seed": 3, "steps": 2}, poll_interval_ms=50)
    assert again.status == "completed" and again.model_extra["sha256"] == done.model_extra["sha256"]

    listed = client.videos.list(limit=10)
    assert {v.id for v in listed.data} >= {video.id, again.id}
    assert client.videos.delete(again.id).deleted

    with pytest.raises(openai.BadRequestError, match="outside the media roots"):
        client.videos.create(prompt="", extra_body={"input_reference": "../data/jobs.sqlite3", "mask": mask.id})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["classic"]


def test_sigterm_stops_cleanly(server):
    """Last in this module: SIGTERM ends the server with exit code 0 (lifespan shutdown ran)."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert "Traceback" not in proc.stderr.read()
