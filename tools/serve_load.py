"""Load check for `fastremover serve`: N concurrent POST /v1/videos/sync requests of one small clip.

Every request must answer 200 with an mp4, all outputs must have the same sha256 (same inputs + seed -> same bytes),
and the latency percentiles are printed. Without --url it starts its own server in this process (classic model,
127.0.0.1, a random port, a temporary data dir).

    python tools/serve_load.py                      # 20 requests, 20 at once, 9 frames of 64x48
    python tools/serve_load.py --url http://127.0.0.1:8000 --api-key KEY --requests 50 --concurrency 8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@contextmanager
def local_server(data_dir: Path, max_queue: int):
    """A classic-model server on 127.0.0.1 in a background thread; yields its base URL."""
    import uvicorn

    from fastremover.serve.app import ServeConfig, create_app
    from fastremover.serve.cli import bind

    app = create_app(ServeConfig(data_dir=str(data_dir), max_queue=max_queue, sync_timeout_s=300))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the local server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def make_clip(folder: Path, frames: int, height: int, width: int) -> tuple[Path, Path]:
    import numpy as np

    from fastremover import media

    video, mask = media.synthetic_clip(frames, height, width, seed=0)
    media.write_video(folder / "clip.mp4", video.frames, video.fps)
    media.write_video(folder / "mask.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), video.fps)
    return folder / "clip.mp4", folder / "mask.mp4"


def run_load(url: str, video: Path, mask: Path, *, requests: int, concurrency: int, api_key: str | None,
             timeout_s: float) -> dict:
    """Send the requests; returns the summary (ok count, latencies, distinct hashes, failures)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    video_bytes, mask_bytes = video.read_bytes(), mask.read_bytes()

    def one(index: int) -> tuple[float, int, str, str]:
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/videos/sync", headers=headers, timeout=timeout_s, data={"seed": "42"},
                       files={"input_reference": ("clip.mp4", video_bytes, "video/mp4"),
                              "mask": ("mask.mp4", mask_bytes, "video/mp4")})
        latency = time.perf_counter() - start
        digest = hashlib.sha256(r.content).hexdigest() if r.status_code == 200 else ""
        return latency, r.status_code, digest, "" if r.status_code == 200 else r.text[:200]

    wall = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - wall
    latencies = [r[0] for r in results]
    return {
        "requests": requests, "concurrency": concurrency,
        "ok": sum(r[1] == 200 for r in results),
        "statuses": sorted({r[1] for r in results}),
        "distinct_hashes": len({r[2] for r in results if r[2]}),
        "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95), "max_s": max(latencies),
        "mean_s": statistics.fmean(latencies), "wall_s": wall,
        "failures": [r[3] for r in results if r[3]][:3],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one here)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--height", type=int, default=48)
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        tmp_path = Path(tmp)
        video, mask = make_clip(tmp_path, args.frames, args.height, args.width)
        if args.url:
            summary = run_load(args.url.rstrip("/"), video, mask, requests=args.requests,
                               concurrency=args.concurrency, api_key=args.api_key, timeout_s=args.timeout)
        else:
            with local_server(tmp_path / "data", max_queue=max(64, args.requests)) as url:
                summary = run_load(url, video, mask, requests=args.requests, concurrency=args.concurrency,
                                   api_key=None, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['ok']}/{summary['requests']} ok ({summary['concurrency']} at once), "
              f"{summary['distinct_hashes']} distinct output hash(es); latency p50 {summary['p50_s']:.2f} s, "
              f"p95 {summary['p95_s']:.2f} s, max {summary['max_s']:.2f} s; wall {summary['wall_s']:.2f} s")
        for failure in summary["failures"]:
            print("  failure:", failure)
    good = summary["ok"] == summary["requests"] and summary["distinct_hashes"] == 1
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
