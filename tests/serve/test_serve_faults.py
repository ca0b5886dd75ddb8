"""Faults against a live server process: kill -9 with one job running and five queued, then a restart (all six
complete, none lost); SIGTERM with a job running (re-queued, not failed, and finished by the next start); a corrupt
upload answered 400 while the server keeps serving."""

from __future__ import annotations

import signal
import time

import httpx
from helpers import GATED_SERVER, live_server, write_clip


def submit(url: str, video, mask, seed: int) -> str:
    with open(video, "rb") as v, open(mask, "rb") as m:
        r = httpx.post(url + "/v1/videos", files={"input_reference": ("clip.mp4", v), "mask": ("mask.mp4", m)},
                       data={"seed": str(seed)}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def status(url: str, video_id: str) -> dict:
    return httpx.get(f"{url}/v1/videos/{video_id}", timeout=30).json()


def wait_for(url: str, ids: list[str], statuses: tuple[str, ...], timeout_s: float = 90) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = {i: status(url, i) for i in ids}
        if all(r["status"] in statuses for r in rows.values()):
            return rows
        assert time.monotonic() < deadline, {i: r["status"] for i, r in rows.items()}
        time.sleep(0.05)


def test_kill_9_then_sigterm_then_restart(tmp_path):
    """kill -9 with one job running and five queued; a restart re-queues the running one (its retry), and a SIGTERM
    during that retry re-queues it again without failing it; the next start completes all six."""
    video, mask = write_clip(tmp_path / "media")
    data, gate = tmp_path / "data", tmp_path / "gate"
    with live_server(data, script=GATED_SERVER, env={"GATE": str(gate)}) as (proc, url):
        ids = [submit(url, video, mask, seed) for seed in range(6)]
        rows = wait_for(url, ids[:1], ("in_progress",))
        assert rows[ids[0]]["status"] == "in_progress"
        assert [status(url, i)["status"] for i in ids[1:]] == ["queued"] * 5
        # A corrupt upload: 400, and the server keeps serving.
        (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x13" * 4096)
        with open(tmp_path / "bad.mp4", "rb") as v, open(mask, "rb") as m:
            bad = httpx.post(url + "/v1/videos", files={"input_reference": v, "mask": m}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=30).json() | {"workers": 1} == {
            "status": "ok", "queued": 5, "in_progress": 1, "workers": 1}
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert not (data / "jobs" / ids[0] / "output.mp4").exists()  # nothing half-written by the killed run

    with live_server(data, "--shutdown-grace", "0.5", script=GATED_SERVER, env={"GATE": str(gate)}) as (proc, url):
        rows = wait_for(url, ids[:1], ("in_progress",))  # the interrupted job runs again first
        assert [status(url, i)["status"] for i in ids[1:]] == ["queued"] * 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "stopped" in proc.stdout.read()

    with live_server(data) as (proc, url):
        rows = wait_for(url, ids, ("completed", "failed", "cancelled"))
        outputs = [httpx.get(f"{url}/v1/videos/{i}/content", timeout=30) for i in ids]
    assert [rows[i]["status"] for i in ids] == ["completed"] * 6, {i: rows[i]["error"] for i in ids}
    # The killed run's temporary files were cleaned up by the retry; only the job's own files remain.
    left = sorted(p.name for p in (data / "jobs" / ids[0]).iterdir())
    assert left == ["mask.mp4", "output.mp4", "thumbnail.png", "video.mp4"], left
    assert all(o.status_code == 200 and o.content[4:8] == b"ftyp" for o in outputs)
    # The classic remover ignores the seed: all six inputs are the same clip, so all six outputs are the same bytes.
    assert len({rows[i]["sha256"] for i in ids}) == 1
