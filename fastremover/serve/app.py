"""The HTTP service: OpenAI-style `/v1/files` and `/v1/videos` routes over the job store and the worker threads.

Contracts:
* The event loop parses requests and answers from the store; probing inputs, copying files and fetching URLs run in
  the thread pool; the model runs only in `Runner`'s worker threads.
* Every response carries `X-Request-Id`. A user error is a 4xx JSON `{"error": {"code", "message"}}`; an internal
  error is a 500 naming the request id, with the traceback in the server log only.
* With an API key, every route except `/health` and the page's static files needs `Authorization: Bearer KEY`; the
  check happens before the body is read.
* Browsers: every request's Host must be an allowed host (`ServeConfig.allowed_hosts`, Starlette's
  TrustedHostMiddleware), so a DNS-rebound name cannot reach the API; a state-changing request (POST, DELETE ...) that
  carries an Origin must come from the server's own origin (or an allowed host), so a page elsewhere cannot create
  or delete jobs, even with a `no-cors` form post. Every answer carries SECURITY_HEADERS.
* Outputs are written only under the data dir, at server-chosen paths; a job is reachable only through its random id.
* URL inputs are downloaded in their own small thread pool (at most `max_downloads` at once, 429 above), never in the
  request thread pool, so stalled downloads cannot starve the other routes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import secrets
import shutil
import threading
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from fastremover.errors import FastRemoverError
from fastremover.options import RunOptions
from fastremover.serve import limits, security
from fastremover.serve.jobs import FILE_ID, FINISHED, VIDEO_ID, FileRow, JobStore, QueueFull, VideoRow, new_id
from fastremover.serve.runner import (BOX_MASK_NAME, OUTPUT_NAME, PREVIEW_NAME, THUMBNAIL_NAME, Cleaner, Runner,
                                      RunnerConfig, write_preview)
from fastremover.config import EngineConfig, ModelSource
from fastremover.serve.uploads import BadBody, Form, Upload, UploadTooLarge, read_body
from fastremover.worker import Job, RemovalWorker

log = logging.getLogger("fastremover.serve")

STATIC_DIR = Path(__file__).parent / "static"
OPEN_PATHS = ("/health", "/", "/favicon.ico")  # plus /static/*: the page holds no data
OPTION_FIELDS = {"steps": int, "seed": int, "dilate": int, "window": int, "overlap": int, "size": str, "crop": str,
                 "schedule": str}
COMPAT_FIELDS = ("model", "prompt", "seconds")  # accepted for client compatibility, recorded, not used
INPUT_FIELDS = ("input_reference", "mask")
BOX_FIELDS = ("box", "box_frame")  # instead of a mask: boxes around the object on one frame (fastremover.masktools)
KNOWN_FIELDS = set(OPTION_FIELDS) | set(COMPAT_FIELDS) | set(INPUT_FIELDS) | set(BOX_FIELDS)
FILE_ID_LIKE = re.compile(r"file-[A-Za-z0-9_-]+")  # a value meant as a file id (ours: jobs.FILE_ID exactly)
MAX_BOXES = 16  # boxes per job: each is tracked through the clip on the one worker
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SECURITY_HEADERS = [
    # The page loads its own script and style only; media and the box tool's frame come from blob: URLs of the
    # user's own files; nothing may frame any answer.
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                 b"img-src 'self' blob: data:; media-src 'self' blob:; form-action 'self'; "
                                 b"base-uri 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]
SECURITY_NAMES = {name for name, _ in SECURITY_HEADERS}
SAFE_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".gif", ".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif",
                 ".tiff", ".m4v"}


@dataclass
class ServeConfig:
    data_dir: str
    model: ModelSource = field(default_factory=ModelSource)
    engine: EngineConfig = field(default_factory=EngineConfig)
    media_roots: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_upload_bytes: int = 2 << 30
    max_queue: int = 64  # queued jobs; more -> 429
    max_decoded_gib: float = 4.0
    mask_threshold: int = 20
    allow_urls: bool = False
    allow_private_urls: bool = False  # tests only: URL hosts on loopback/private networks
    url_timeout_s: float = 60.0  # wall-clock deadline of one URL download, redirects included
    max_downloads: int = 4  # URL downloads at once; more answer 429
    # Host header values accepted besides the loopback names (Starlette patterns: "name", "*.domain", "*" for any).
    # None: only loopback names and the bound address without an API key, any host with one (DNS rebinding reads
    # nothing without the key).
    allowed_hosts: list[str] | None = None
    bind_host: str | None = None  # the --host address, accepted as a Host when it is a specific one
    keep_hours: float = 24.0
    cleaner_interval_s: float = 600.0
    sync_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    poll_after_ms: int = 500  # the `openai-poll-after-ms` hint for polling clients


class ApiError(Exception):
    """A 4xx answer: status, machine-readable code, one-line message."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


def error_body(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message, "type": "invalid_request_error" if code != "internal_error"
                      else "server_error"}}


class Service:
    """What the routes share: the config, the store, the runner and the input checker."""

    def __init__(self, config: ServeConfig, workers: list[RemovalWorker] | None,
                 fetcher: security.UrlFetcher | None):
        self.config = config
        self.roots = security.resolve_roots(config.media_roots)
        self.model_name = config.model.label
        self._workers = workers
        self.checker = RemovalWorker(config.model, config.engine)  # check() only: it never loads the pipeline
        self.fetcher = fetcher or security.UrlFetcher(max_bytes=config.max_upload_bytes,
                                                      timeout_s=config.url_timeout_s,
                                                      allow_private=config.allow_private_urls)
        self.store: JobStore | None = None
        self.runner: Runner | None = None
        self.cleaner: Cleaner | None = None
        self._preview_lock = threading.Lock()
        self._downloads = concurrent.futures.ThreadPoolExecutor(config.max_downloads, "url-download")
        self._downloading = 0  # touched on the event loop only
        self.stop_deadline: float | None = None  # monotonic; set when SIGTERM arrives (begin_stop)

    def start(self) -> None:
        self.store = JobStore(self.config.data_dir)
        self.cleaner = Cleaner(self.store, self.config.keep_hours, self.config.cleaner_interval_s)
        self.cleaner.clear_tmp()
        requeued, failed = self.store.recover()
        for video_id in requeued:
            log.warning("job %s was running when the server stopped; queued again", video_id)
        for video_id in failed:
            log.warning("job %s was interrupted again; failed", video_id)
        workers = self._workers
        if workers is None:
            workers = default_workers(self.config.model, self.config.engine)
        self.runner = Runner(self.store, workers, RunnerConfig(max_decoded_gib=self.config.max_decoded_gib,
                                                               mask_threshold=self.config.mask_threshold),
                             roots=self.roots)
        self.runner.start()
        self.cleaner.start()

    def begin_stop(self) -> None:
        """SIGTERM arrived (called from the server's signal handler, before it stops accepting): no new job is
        claimed, downloads in flight end, and a sync request whose job is not done by the grace deadline answers
        503 with its id."""
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.config.shutdown_grace_s
        if self.runner is not None:
            self.runner.stopping = True  # idle workers see it within RunnerConfig.idle_poll_s
        self.fetcher.abort()  # a request waiting on a download answers now instead of holding the shutdown

    def stop(self) -> None:
        self.fetcher.abort()  # downloads in flight end now, not at their deadline
        self._downloads.shutdown(wait=False, cancel_futures=True)
        if self.runner is not None:
            grace = self.config.shutdown_grace_s
            if self.stop_deadline is not None:  # the grace counts from SIGTERM
                grace = max(0.0, self.stop_deadline - time.monotonic())
            self.runner.stop(grace)
        if self.cleaner is not None:
            self.cleaner.stop()
        if self.store is not None:
            self.store.close()

    # -- objects -------------------------------------------------------------------------------------------------------

    def video_object(self, row: VideoRow) -> dict:
        error = {"code": row.error_code, "message": row.error_message} if row.error_code else None
        expires = row.completed_at + int(self.config.keep_hours * 3600) if row.completed_at else None
        return {
            "id": row.id, "object": "video", "status": row.status, "progress": row.progress,
            "created_at": row.created_at, "completed_at": row.completed_at, "expires_at": expires,
            "error": error, "model": self.model_name, "requested_model": row.model, "prompt": row.prompt,
            "size": row.size or row.requested_size or "native", "seconds": row.seconds or row.requested_seconds or "",
            "remixed_from_video_id": None, "options": row.options, "inference_time_s": row.inference_s,
            "stages": row.stages or None, "sha256": row.sha256, "notes": row.notes,
        }

    @staticmethod
    def file_object(row: FileRow) -> dict:
        return {"id": row.id, "object": "file", "bytes": row.bytes, "filename": row.filename,
                "created_at": row.created_at, "purpose": row.purpose, "status": "processed"}

    def video_row(self, video_id: str) -> VideoRow:
        row = self.store.get_video(video_id) if VIDEO_ID.fullmatch(video_id) else None
        if row is None:
            raise ApiError(404, "not_found", f"no video {video_id!r} (finished jobs are kept "
                                             f"{self.config.keep_hours:g} h)")
        return row

    # -- creating a job (runs in the thread pool) ----------------------------------------------------------------------

    def check_form(self, form: Form) -> tuple[RunOptions, dict, dict | None]:
        """The checks a job's body needs before any input is fetched or placed: fields, options, boxes, and the
        queue (answered early here; the count that holds is the one in `create_job`'s insert).
        Returns (options, compat fields, boxes or None)."""
        unknown = sorted(set(form.fields) - KNOWN_FIELDS) + sorted(set(form.files) - set(INPUT_FIELDS))
        if unknown:
            raise ApiError(400, "unknown_parameter", f"unknown field {unknown[0]!r}; known fields: "
                                                     f"{', '.join(sorted(KNOWN_FIELDS))}")
        options = parse_options(form.fields)
        compat = {}
        for name in COMPAT_FIELDS:
            value = form.fields.get(name)
            if value is not None and not isinstance(value, (str, int, float)):
                raise ApiError(400, "invalid_value", f"{name}: must be a string")
            compat[name] = None if value is None else str(value)
        boxes = parse_boxes(form.fields, has_mask=("mask" in form.files or bool(form.fields.get("mask"))))
        if self.store.count("queued") >= self.config.max_queue:
            raise self.queue_full()
        return options, compat, boxes

    def queue_full(self) -> ApiError:
        return ApiError(429, "queue_full", f"{self.config.max_queue} jobs are queued already; retry later",
                        headers={"Retry-After": "5"})

    def create_job(self, form: Form, options: RunOptions, compat: dict, boxes: dict | None) -> VideoRow:
        """Place the inputs in a new job folder, check them (sizes from their headers first, nothing decoded
        beyond what the limit allows) and queue the job; the folder is removed again on any error."""
        video_id = new_id("video_")
        folder = self.store.job_dir(video_id)
        folder.mkdir(parents=True)
        try:
            video_path = self.place_input(form, "input_reference", folder, "video")
            if boxes is None:
                mask_path = self.place_input(form, "mask", folder, "mask")
                check_mask = mask_path
            else:
                mask_path = folder / BOX_MASK_NAME  # built by the worker thread before the run
                check_mask = video_path  # the probe of a mask as large as the video
            limits.check_decoded_size(video_path, None if boxes else mask_path, options,
                                      model=self.config.model.kind != "classic",
                                      max_decoded_gib=self.config.max_decoded_gib)
            if boxes is not None:
                check_boxes(video_path, boxes)
            job = Job(video=str(video_path), mask=str(check_mask), output=str(folder / OUTPUT_NAME),
                      options=options, mask_threshold=self.config.mask_threshold,
                      max_decoded_gib=self.config.max_decoded_gib)
            self.checker.check(job)
            try:
                row = self.store.add_video(
                    video_id, model=compat["model"] or self.model_name, prompt=compat["prompt"],
                    requested_size=form.fields.get("size") and str(form.fields["size"]),
                    requested_seconds=compat["seconds"], options=options_dict(options), video_path=str(video_path),
                    mask_path=str(mask_path), mask_boxes=boxes, max_queued=self.config.max_queue,
                )
            except QueueFull:
                raise self.queue_full() from None
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.runner.notify()
        return row

    async def fetch_urls(self, form: Form) -> None:
        """Download the inputs given as URLs (in the download pool, not the request pool) to temporary files, which
        then stand in the form as uploads; the form's discard() deletes them."""
        for name in INPUT_FIELDS:
            value = form.fields.get(name)
            if not isinstance(value, str) or not security.looks_like_url(value):
                continue
            if value[:5].lower() == "data:":
                raise FastRemoverError(f"{name}: data: URLs are refused for videos; upload the file instead")
            if not self.config.allow_urls:
                raise ApiError(400, "urls_disabled", f"{name}: URL inputs are off on this server (start it with "
                                                     "--allow-urls); upload the file instead")
            if self._downloading >= self.config.max_downloads:
                raise ApiError(429, "busy", f"{self.config.max_downloads} URL downloads are running already; retry "
                                            "later or upload the file", headers={"Retry-After": "5"})
            tmp = self.store.tmp_path()
            self._downloading += 1
            future = self._downloads.submit(self.fetcher.fetch, value, tmp, name)
            try:
                size = await asyncio.wrap_future(future)
            except asyncio.CancelledError:  # the client went away: the file goes once the download ends
                future.add_done_callback(lambda _: tmp.unlink(missing_ok=True))
                raise
            finally:
                self._downloading -= 1
            form.files[name] = Upload(filename=value.split("?", 1)[0], path=tmp, bytes=size)
            del form.fields[name]

    def place_input(self, form: Form, name: str, folder: Path, stem: str) -> Path:
        """The job's input `name` as a file path: an upload (or a URL `fetch_urls` downloaded) moved into the job
        folder, an uploaded file id copied there, or a path checked against the media roots."""
        what = name
        if name in form.files:
            upload = form.files[name]
            if upload.bytes == 0:
                raise ApiError(400, "invalid_file", f"{what}: the uploaded file is empty")
            dest = folder / (stem + safe_suffix(upload.filename))
            os.replace(upload.path, dest)
            return with_suffix(dest)
        value = form.fields.get(name)
        if isinstance(value, dict) and isinstance(value.get("file_id"), str):
            value = value["file_id"]
        if value is None or value == "":
            raise ApiError(400, "missing_parameter", f"{what} is required: upload the file, or give an uploaded file "
                                                     "id, a path inside a media root or (when enabled) a URL")
        if not isinstance(value, str):
            raise ApiError(400, "invalid_value", f"{what}: give a file id, a path or a URL as a string")
        if FILE_ID_LIKE.fullmatch(value):
            row = self.store.get_file(value) if FILE_ID.fullmatch(value) else None
            if row is None:
                raise ApiError(400, "invalid_file", f"{what}: no uploaded file {value!r}")
            dest = folder / (stem + safe_suffix(row.filename))
            try:
                os.link(row.path, dest)
            except OSError:
                shutil.copyfile(row.path, dest)
            return with_suffix(dest)
        if security.looks_like_url(value):  # fetch_urls downloads them before this runs
            raise ApiError(400, "invalid_value", f"{what}: give a URL as the field's value, not as a file_id")
        return security.resolve_media_path(value, self.roots, what)

    def scrub(self, message: str) -> str:
        return security.scrub_paths(message, self.store.root if self.store else None, self.roots)

    def preview(self, row: VideoRow) -> Path:
        folder = self.store.job_dir(row.id)
        path = folder / PREVIEW_NAME
        with self._preview_lock:
            if not path.exists():
                write_preview(row.video_path, folder / OUTPUT_NAME, path, self.config.max_decoded_gib)
        return path


async def wait_finished(service: Service, video_id: str, timeout_s: float) -> VideoRow:
    """Poll the store from the event loop (no thread-pool thread is held while a sync request waits) until the job
    is finished, `timeout_s` passed, or the server is stopping and the job will not finish (it is still queued, or
    the shutdown grace is over); returns the last row."""
    deadline = time.monotonic() + timeout_s
    interval = 0.02
    while True:
        row = service.store.get_video(video_id)
        runner = service.runner
        now = time.monotonic()
        if row.status in FINISHED or now >= deadline:
            return row
        if runner.stopping and (row.status == "queued" or not runner.busy
                                or (service.stop_deadline is not None and now >= service.stop_deadline)):
            return row
        wake = deadline if service.stop_deadline is None else min(deadline, service.stop_deadline)
        await asyncio.sleep(min(interval, max(0.0, wake - now)))
        interval = min(interval * 1.5, 0.25)


def default_workers(source: ModelSource, engine: EngineConfig) -> list[RemovalWorker]:
    """One worker per CUDA GPU for a diffusion model when no device is given, else one (for the classic remover: on
    the CPU)."""
    if source.kind != "classic" and engine.device is None:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            return [RemovalWorker(source, engine.with_(device=f"cuda:{i}"))
                    for i in range(torch.cuda.device_count())]
    return [RemovalWorker(source, engine)]


def safe_suffix(name: str) -> str:
    """The name's ending when it is a known media ending, else "" (see `sniff_suffix`)."""
    suffix = Path(name.replace("\\", "/")).suffix.lower()
    return suffix if suffix in SAFE_SUFFIXES else ""


def sniff_suffix(path: Path) -> str:
    """An ending for a file named without a known one: .png / .jpg by their magic bytes, else .mp4 (FFmpeg probes
    the real container whatever the name says)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x89PNG"):
        return ".png"
    if head.startswith(b"\xff\xd8\xff"):
        return ".jpg"
    return ".mp4"


def with_suffix(path: Path) -> Path:
    """`path` renamed to carry a media ending if it has none."""
    if path.suffix:
        return path
    named = path.with_name(path.name + sniff_suffix(path))
    os.replace(path, named)
    return named


def parse_boxes(fields: dict, *, has_mask: bool) -> dict | None:
    """`box` ("X,Y,W,H", several joined by ";" or a JSON list) and `box_frame` -> {"boxes", "frame"}, or None when
    no box is given. A box and a mask together are refused."""
    value, frame = fields.get("box"), fields.get("box_frame", 0)
    if value in (None, "", []):
        if fields.get("box_frame") not in (None, ""):
            raise FastRemoverError("box_frame needs a box: give box=X,Y,W,H too")
        return None
    if has_mask:
        raise FastRemoverError("give either a mask or a box, not both")
    texts = value.split(";") if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise FastRemoverError('box: give "X,Y,W,H" (several joined by ";") or a list of such strings')
    if len(texts) > MAX_BOXES:
        raise FastRemoverError(f"box: {len(texts)} boxes; this server takes at most {MAX_BOXES} per job")
    try:
        from fastremover.masktools import parse_box
    except ImportError:
        raise FastRemoverError("box masks need fastremover.masktools, which this installation lacks; upload a mask") \
            from None
    boxes = [str(parse_box(t)) for t in texts]
    try:
        frame = int(frame)
    except (TypeError, ValueError):
        raise FastRemoverError(f"box_frame {frame!r}: must be a whole number") from None
    return {"boxes": boxes, "frame": frame}


def check_boxes(video: Path, boxes: dict) -> None:
    """Every box inside the frame and the key frame inside the clip (probed, not decoded)."""
    from fastremover import media
    from fastremover.masktools import check_box, parse_box

    info = media.probe(video)
    for i, text in enumerate(boxes["boxes"]):
        check_box(parse_box(text), int(info["height"]), int(info["width"]), label=f"box {i + 1}")
    count = int(info["num_frames"])
    if count and not -count <= boxes["frame"] < count:
        raise FastRemoverError(f"box_frame {boxes['frame']} is out of range: the clip has {count} frames")


def parse_options(fields: dict) -> RunOptions:
    """RunOptions from form strings or JSON values; FastRemoverError (-> 400) naming a bad one."""
    values: dict = {}
    for name, kind in OPTION_FIELDS.items():
        value = fields.get(name)
        if value is None or value == "":
            continue
        if kind is int:
            if isinstance(value, str):
                try:
                    value = int(value.strip())
                except ValueError:
                    raise FastRemoverError(f"{name} {value!r}: must be a whole number") from None
            elif isinstance(value, bool) or not isinstance(value, int):
                raise FastRemoverError(f"{name} {value!r}: must be a whole number")
        elif not isinstance(value, str):
            raise FastRemoverError(f"{name} {value!r}: must be a string")
        values[name] = value
    options = RunOptions(**values)
    options.validate()
    return options


def options_dict(options: RunOptions) -> dict:
    return {"steps": options.steps, "seed": options.seed, "dilate": options.dilate, "size": options.size,
            "composite": options.composite, "window": options.window, "overlap": options.overlap,
            "crop": options.crop, "schedule": options.schedule}


def result_headers(row: VideoRow) -> dict[str, str]:
    headers = {"X-Video-Id": row.id}
    if row.inference_s is not None:
        headers["X-Inference-Time-S"] = f"{row.inference_s:.4f}"
    if row.stages:
        headers["X-Stage-Durations"] = ",".join(f"{k}={v:.4f}" for k, v in row.stages.items())
    if row.sha256:
        headers["X-Output-Sha256"] = row.sha256
    return headers


def allowed_hosts(config: ServeConfig) -> list[str]:
    """The Host header values this server answers (TrustedHostMiddleware patterns; see ServeConfig.allowed_hosts)."""
    if config.allowed_hosts is None and config.api_key is not None:
        return ["*"]
    hosts = list(LOOPBACK_HOSTS) + list(config.allowed_hosts or [])
    bind = config.bind_host
    if bind and bind not in ("0.0.0.0", "::", ""):
        hosts.append(f"[{bind}]" if ":" in bind else bind)
    return hosts


def same_origin(origin: str, host: str | None, extra_hosts: list[str]) -> bool:
    """True when a browser's Origin ("scheme://host[:port]") is the server's own (its host:port equals the Host
    header) or names one of the explicitly allowed hosts (patterns as TrustedHostMiddleware's, "*" excluded)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(origin)
        name = (parts.hostname or "").lower()
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed frames, file: pages) and anything else
    if host is not None and parts.netloc.lower() == host.lower():
        return True
    return any(p != "*" and (name == p or (p.startswith("*.") and name.endswith(p[1:]))) for p in extra_hosts)


class _RequestMiddleware:
    """Request id, security headers, the Origin check of state-changing requests, the API key, and the 500 answer
    for internal errors (pure ASGI, so the body is not read first)."""

    def __init__(self, app, api_key: str | None, origin_hosts: list[str]):
        self.app, self.api_key, self.origin_hosts = app, api_key, [h.lower() for h in origin_hosts]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in SECURITY_NAMES]
                message["headers"] = headers + SECURITY_HEADERS + [(b"x-request-id", request_id.encode())]
            await send(message)

        path = scope.get("path", "")
        if scope.get("method") in STATE_CHANGING:
            headers = dict(scope.get("headers") or [])
            origin = headers.get(b"origin")
            host = headers.get(b"host")
            if origin is not None and not same_origin(origin.decode("latin-1"), host and host.decode("latin-1"),
                                                      self.origin_hosts):
                response = JSONResponse(error_body("cross_origin", "requests from another origin (a web page "
                                                                   "elsewhere) may not change anything here"),
                                        status_code=403)
                return await response(scope, receive, send_with_id)
        if self.api_key is not None and path not in OPEN_PATHS and not path.startswith("/static/"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not security.check_bearer(auth, self.api_key):
                response = JSONResponse(error_body("invalid_api_key", "missing or wrong API key: send "
                                                                      "'Authorization: Bearer KEY'"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.error("request %s %s failed:\n%s", request_id, path, traceback.format_exc())
            if started:
                raise
            response = JSONResponse(error_body("internal_error", f"internal server error (request id {request_id})"),
                                    status_code=500)
            await response(scope, receive, send_with_id)


def create_app(config: ServeConfig, *, workers: list[RemovalWorker] | None = None,
               fetcher: security.UrlFetcher | None = None) -> FastAPI:
    """The ASGI app. `workers`: the RemovalWorkers to run jobs on (default: one per GPU, or one on the CPU);
    `fetcher`: the URL downloader (tests inject a resolver). The store and the threads start with the app's lifespan."""
    service = Service(config, workers, fetcher)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(service.start)
        try:
            yield
        finally:
            await run_in_threadpool(service.stop)

    app = FastAPI(title="fastremover", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    # The last added runs first: request id, security headers and the Origin check wrap the Host check, so its
    # refusal carries them too.
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(config), www_redirect=False)
    app.add_middleware(_RequestMiddleware, api_key=config.api_key, origin_hosts=list(config.allowed_hosts or []))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc.code, exc.message), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(FastRemoverError)
    async def _user_error(request: Request, exc: FastRemoverError):
        return JSONResponse(error_body("invalid_request", service.scrub(str(exc))), status_code=400)

    @app.exception_handler(BadBody)
    async def _bad_body(request: Request, exc: BadBody):
        return JSONResponse(error_body("invalid_body", str(exc)), status_code=400)

    @app.exception_handler(UploadTooLarge)
    async def _too_large(request: Request, exc: UploadTooLarge):
        return JSONResponse(error_body("upload_too_large", str(exc)), status_code=413)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
        return JSONResponse(error_body("invalid_value", f"{where}: {first.get('msg', 'invalid')}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, f"{request.method} {request.url.path}: {exc.detail}"),
                            status_code=exc.status_code)

    def running() -> Service:
        if service.runner is None or service.runner.stopping:
            raise ApiError(503, "stopping", "the server is stopping; retry on the next start",
                           headers={"Retry-After": "5"})
        return service

    # -- meta ----------------------------------------------------------------------------------------------------------

    @app.get("/health")
    def health():
        s = service
        if s.runner is None or s.runner.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok", "queued": s.store.count("queued"), "in_progress": s.store.count("in_progress"),
                "workers": len(s.runner.workers)}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "fastremover"}]}

    # -- files ---------------------------------------------------------------------------------------------------------

    @app.post("/v1/files")
    async def create_file(request: Request):
        s = running()
        form = await read_body(request, s.config.max_upload_bytes, s.store.tmp_path)
        try:
            upload = form.files.get("file")
            extra = sorted(set(form.fields) - {"purpose", "expires_after"}) + sorted(set(form.files) - {"file"})
            if upload is None:
                raise ApiError(400, "missing_parameter", "send the file as the multipart field 'file'")
            if extra:
                raise ApiError(400, "unknown_parameter", f"unknown field {extra[0]!r}; send 'file' and 'purpose'")
            if upload.bytes == 0:
                raise ApiError(400, "invalid_file", "the uploaded file is empty")
            row = await run_in_threadpool(_store_file, s, upload, str(form.fields.get("purpose") or "user_data"))
        finally:
            form.discard()
        return s.file_object(row)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str):
        row = service.store.get_file(file_id) if FILE_ID.fullmatch(file_id) else None
        if row is None:
            raise ApiError(404, "not_found", f"no file {file_id!r}")
        return service.file_object(row)

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str):
        if not service.store.delete_file(file_id):
            raise ApiError(404, "not_found", f"no file {file_id!r}")
        return {"id": file_id, "object": "file", "deleted": True}

    # -- videos --------------------------------------------------------------------------------------------------------

    async def _create(request: Request) -> VideoRow:
        s = running()
        form = await read_body(request, s.config.max_upload_bytes, s.store.tmp_path)
        try:
            checked = await run_in_threadpool(s.check_form, form)
            await s.fetch_urls(form)
            return await run_in_threadpool(s.create_job, form, *checked)
        finally:
            form.discard()

    @app.post("/v1/videos")
    async def create_video(request: Request):
        row = await _create(request)
        return JSONResponse(service.video_object(row), headers={"openai-poll-after-ms": str(config.poll_after_ms)})

    @app.post("/v1/videos/sync")
    async def create_video_sync(request: Request):
        row = await _create(request)
        row = await wait_finished(service, row.id, config.sync_timeout_s)
        if row.status not in FINISHED and service.runner.stopping:
            raise ApiError(503, "stopping", f"the server stopped before the job finished; it stays queued as {row.id} "
                                            "(GET /v1/videos/{id} after the restart)", headers={"Retry-After": "5"})
        if row.status not in FINISHED:
            service.store.cancel_queued(row.id) or service.store.request_cancel(row.id)
            raise ApiError(504, "timeout", f"the job did not finish within {config.sync_timeout_s:g} s; it was "
                                           f"cancelled (use POST /v1/videos for long jobs)")
        if row.status != "completed":
            status = 400 if row.error_code == "invalid_input" else 500
            return JSONResponse(error_body(row.error_code or "failed", row.error_message or row.status),
                                status_code=status, headers={"X-Video-Id": row.id})
        path = service.store.job_dir(row.id) / OUTPUT_NAME
        return FileResponse(path, media_type="video/mp4", headers=result_headers(row),
                            filename=f"{row.id}.mp4")

    @app.get("/v1/videos")
    def list_videos(after: str | None = None, limit: int = Query(20, ge=1, le=100),
                    order: str = Query("desc", pattern="^(asc|desc)$")):
        rows, has_more = service.store.list_videos(after=after, limit=limit, order=order)
        data = [service.video_object(r) for r in rows]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    @app.get("/v1/videos/{video_id}")
    def get_video(video_id: str):
        row = service.video_row(video_id)
        headers = {"openai-poll-after-ms": str(config.poll_after_ms)}
        if row.status == "completed":
            headers.update(result_headers(row))
        return JSONResponse(service.video_object(row), headers=headers)

    @app.delete("/v1/videos/{video_id}")
    def delete_video(video_id: str):
        s = service
        row = s.video_row(video_id)
        if row.status in FINISHED:
            if not s.store.delete_video(video_id):
                raise ApiError(404, "not_found", f"no video {video_id!r}")
            return {"id": video_id, "object": "video.deleted", "deleted": True}
        if not s.store.cancel_queued(video_id):
            s.store.request_cancel(video_id)
            s.runner.wait(video_id, 5.0)  # the worker stops at its next progress report
        return s.video_object(s.video_row(video_id))

    @app.get("/v1/videos/{video_id}/content")
    def video_content(video_id: str, variant: str = Query("video", pattern="^(video|thumbnail|preview)$")):
        row = service.video_row(video_id)
        if row.status != "completed":
            raise ApiError(409, "not_ready", f"video {video_id} is {row.status}; content exists once it is completed")
        folder = service.store.job_dir(video_id)
        if variant == "thumbnail":
            return FileResponse(folder / THUMBNAIL_NAME, media_type="image/png", headers=result_headers(row))
        path = service.preview(row) if variant == "preview" else folder / OUTPUT_NAME
        return FileResponse(path, media_type="video/mp4", headers=result_headers(row))

    # -- the page ------------------------------------------------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon():
        return Response(status_code=204)  # no icon; an answer instead of a 404 in every browser's log

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def _store_file(service: Service, upload: Upload, purpose: str):
    file_id = new_id("file-")
    folder = service.store.file_dir(file_id)
    folder.mkdir(parents=True)
    name = Path(upload.filename.replace("\\", "/")).name or "upload"
    dest = folder / ("upload" + safe_suffix(name))
    os.replace(upload.path, dest)
    return service.store.add_file(file_id, name[:255], upload.bytes, purpose[:64], dest)

