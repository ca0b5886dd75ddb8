"""The service's job store: one SQLite database (WAL) under the data dir; the files themselves live next to it.

Layout under the data dir:
    jobs.sqlite3           the `files` and `videos` tables
    files/<file id>/<name> uploads made through POST /v1/files
    jobs/<video id>/       a job's own inputs (uploaded parts, copies of uploaded files) and its outputs
    tmp/                   uploads in flight (moved into place once complete)

The store is the queue: a worker claims the oldest queued row in one UPDATE, so queued jobs survive a restart, and a
row left `in_progress` by a crash is found again by `recover()`. All methods are thread-safe (one connection, one
lock; every statement is its own transaction, except `add_video`'s count-and-insert, which is one BEGIN IMMEDIATE
transaction so the queue cap holds under concurrent creates, also across processes sharing the data dir).

Ids are checked against their exact format (`FILE_ID`, `VIDEO_ID`) before any path is formed from them, and a
folder is deleted only for a row that matched, only when it lies directly under its own parent folder.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fastremover.serve")

STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
FINISHED = ("completed", "failed", "cancelled")
MAX_ATTEMPTS = 2  # a job interrupted by a crash is run once more, then failed

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    purpose TEXT NOT NULL,
    path TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS videos (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    started_at INTEGER,
    completed_at INTEGER,
    model TEXT NOT NULL,
    prompt TEXT,
    requested_size TEXT,
    requested_seconds TEXT,
    options TEXT NOT NULL,
    video_path TEXT NOT NULL,
    mask_path TEXT NOT NULL,
    mask_boxes TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    error_code TEXT,
    error_message TEXT,
    size TEXT,
    seconds TEXT,
    inference_s REAL,
    stages TEXT,
    sha256 TEXT,
    notes TEXT
);
CREATE INDEX IF NOT EXISTS videos_status ON videos(status, seq);
"""


def new_id(prefix: str) -> str:
    """A random, unguessable id: `prefix` + 128 random bits in hex ("file-...", "video_..." as OpenAI spells them)."""
    return prefix + secrets.token_hex(16)


FILE_ID = re.compile(r"file-[0-9a-f]{32}")  # exactly what new_id("file-") makes
VIDEO_ID = re.compile(r"video_[0-9a-f]{32}")  # exactly what new_id("video_") makes


class QueueFull(Exception):
    """`add_video` found `max_queued` jobs queued already; nothing was inserted."""


@dataclass
class VideoRow:
    id: str
    seq: int
    status: str
    progress: int
    created_at: int
    started_at: int | None
    completed_at: int | None
    model: str
    prompt: str | None
    requested_size: str | None
    requested_seconds: str | None
    options: dict
    video_path: str
    mask_path: str
    mask_boxes: dict | None  # {"boxes": ["X,Y,W,H", ...], "frame": n}: the mask is built from boxes before the run
    attempts: int
    cancel_requested: bool
    error_code: str | None
    error_message: str | None
    size: str | None
    seconds: str | None
    inference_s: float | None
    stages: dict
    sha256: str | None
    notes: list


@dataclass
class FileRow:
    id: str
    seq: int
    filename: str
    bytes: int
    purpose: str
    path: str
    created_at: int


class JobStore:
    def __init__(self, data_dir: str | Path):
        self.root = Path(data_dir).resolve()
        for sub in ("files", "jobs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- folders -------------------------------------------------------------------------------------------------------

    def job_dir(self, video_id: str) -> Path:
        return self._child("jobs", video_id)

    def file_dir(self, file_id: str) -> Path:
        return self._child("files", file_id)

    def _child(self, folder: str, name: str) -> Path:
        """root/folder/name, for a plain name only (no separator, not "." or ".."): ValueError otherwise."""
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(f"not a store id: {name!r}")
        return self.root / folder / name

    def _remove_folder(self, folder: str, name: str) -> None:
        """Delete root/folder/name (a job's or an upload's folder) when it really is a folder directly inside
        root/folder (after resolving links); anything else is left alone and logged."""
        path = self._child(folder, name)
        parent = (self.root / folder).resolve()
        if path.is_symlink() or path.resolve().parent != parent:
            log.error("not deleting %s: it does not resolve to a folder inside %s", path, parent)
            return
        shutil.rmtree(path, ignore_errors=True)

    def tmp_path(self) -> Path:
        return self.root / "tmp" / secrets.token_hex(16)

    # -- files ---------------------------------------------------------------------------------------------------------

    def add_file(self, file_id: str, filename: str, nbytes: int, purpose: str, path: Path) -> FileRow:
        now = int(time.time())
        self._exec("INSERT INTO files (id, filename, bytes, purpose, path, created_at) VALUES (?,?,?,?,?,?)",
                   (file_id, filename, nbytes, purpose, str(path), now))
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> FileRow | None:
        rows = self._rows("SELECT * FROM files WHERE id = ?", (file_id,))
        return FileRow(**dict(rows[0])) if rows else None

    def delete_file(self, file_id: str) -> bool:
        """Delete an upload's row and its folder; False (and nothing deleted) for an id that is not a stored file's."""
        if not FILE_ID.fullmatch(file_id):
            return False
        with self._lock:
            row = self._db.execute("DELETE FROM files WHERE id = ? RETURNING id", (file_id,)).fetchone()
        if row is None:
            return False
        self._remove_folder("files", row["id"])
        return True

    def files_older_than(self, cutoff: int) -> list[str]:
        return [r["id"] for r in self._rows("SELECT id FROM files WHERE created_at < ?", (cutoff,))]

    # -- videos --------------------------------------------------------------------------------------------------------

    def add_video(self, video_id: str, *, model: str, prompt: str | None, requested_size: str | None,
                  requested_seconds: str | None, options: dict, video_path: str, mask_path: str,
                  mask_boxes: dict | None = None, max_queued: int | None = None) -> VideoRow:
        """Queue a job. With `max_queued`, the count of queued jobs and the insert are one transaction (BEGIN
        IMMEDIATE takes SQLite's write lock first): QueueFull, and nothing inserted, when that many are queued."""
        now = int(time.time())
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if max_queued is not None:
                    queued = self._db.execute("SELECT COUNT(*) FROM videos WHERE status = 'queued'").fetchone()[0]
                    if queued >= max_queued:
                        raise QueueFull(queued)
                self._db.execute(
                    "INSERT INTO videos (id, status, created_at, model, prompt, requested_size, requested_seconds,"
                    " options, video_path, mask_path, mask_boxes) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (video_id, "queued", now, model, prompt, requested_size, requested_seconds, json.dumps(options),
                     video_path, mask_path, json.dumps(mask_boxes) if mask_boxes else None),
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return self.get_video(video_id)

    @staticmethod
    def _video(row: sqlite3.Row) -> VideoRow:
        d = dict(row)
        d["options"] = json.loads(d["options"])
        d["mask_boxes"] = json.loads(d["mask_boxes"]) if d["mask_boxes"] else None
        d["stages"] = json.loads(d["stages"]) if d["stages"] else {}
        d["notes"] = json.loads(d["notes"]) if d["notes"] else []
        d["cancel_requested"] = bool(d["cancel_requested"])
        return VideoRow(**d)

    def get_video(self, video_id: str) -> VideoRow | None:
        rows = self._rows("SELECT * FROM videos WHERE id = ?", (video_id,))
        return self._video(rows[0]) if rows else None

    def list_videos(self, *, after: str | None, limit: int, order: str) -> tuple[list[VideoRow], bool]:
        """A page of videos by creation order ("asc"/"desc"), starting after the video `after`; and has_more."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        args: tuple = ()
        where = ""
        if after is not None:
            where = f"WHERE seq {op} (SELECT seq FROM videos WHERE id = ?)"
            args = (after,)
        rows = self._rows(f"SELECT * FROM videos {where} ORDER BY seq {direction} LIMIT ?", args + (limit + 1,))
        return [self._video(r) for r in rows[:limit]], len(rows) > limit

    def count(self, status: str) -> int:
        return self._rows("SELECT COUNT(*) AS n FROM videos WHERE status = ?", (status,))[0]["n"]

    def claim_next(self) -> VideoRow | None:
        """Atomically move the oldest queued job to in_progress (one more attempt) and return it."""
        now = int(time.time())
        with self._lock:
            row = self._db.execute(
                "UPDATE videos SET status = 'in_progress', attempts = attempts + 1, started_at = ?, progress = 0 "
                "WHERE seq = (SELECT seq FROM videos WHERE status = 'queued' ORDER BY seq LIMIT 1) "
                "AND status = 'queued' RETURNING *",
                (now,),
            ).fetchone()
        return self._video(row) if row else None

    def set_progress(self, video_id: str, progress: int) -> None:
        self._exec("UPDATE videos SET progress = ? WHERE id = ? AND status = 'in_progress'", (progress, video_id))

    def complete(self, video_id: str, *, size: str, seconds: str, inference_s: float, stages: dict, sha256: str,
                 notes: list[str]) -> None:
        self._exec(
            "UPDATE videos SET status = 'completed', progress = 100, completed_at = ?, size = ?, seconds = ?, "
            "inference_s = ?, stages = ?, sha256 = ?, notes = ? WHERE id = ?",
            (int(time.time()), size, seconds, inference_s, json.dumps(stages), sha256, json.dumps(notes), video_id),
        )

    def finish(self, video_id: str, status: str, code: str | None = None, message: str | None = None) -> None:
        """Mark a job failed or cancelled (with the reason)."""
        assert status in ("failed", "cancelled"), status
        self._exec("UPDATE videos SET status = ?, completed_at = ?, error_code = ?, error_message = ? WHERE id = ?",
                   (status, int(time.time()), code, message, video_id))

    def requeue(self, video_id: str) -> None:
        """Give a job the server stopped (not a crash) back to the queue, without counting the attempt."""
        self._exec("UPDATE videos SET status = 'queued', progress = 0, attempts = MAX(0, attempts - 1) "
                   "WHERE id = ? AND status = 'in_progress'", (video_id,))

    def cancel_queued(self, video_id: str) -> bool:
        return self._exec(
            "UPDATE videos SET status = 'cancelled', completed_at = ?, error_code = 'cancelled', "
            "error_message = 'cancelled by the client' WHERE id = ? AND status = 'queued'",
            (int(time.time()), video_id),
        ).rowcount > 0

    def request_cancel(self, video_id: str) -> bool:
        return self._exec("UPDATE videos SET cancel_requested = 1 WHERE id = ? AND status = 'in_progress'",
                          (video_id,)).rowcount > 0

    def cancel_requested(self, video_id: str) -> bool:
        rows = self._rows("SELECT cancel_requested FROM videos WHERE id = ?", (video_id,))
        return bool(rows and rows[0]["cancel_requested"])

    def delete_video(self, video_id: str) -> bool:
        """Delete a finished job's row and its folder; False when it is not finished (or not there)."""
        deleted = self._exec(
            "DELETE FROM videos WHERE id = ? AND status IN ('completed', 'failed', 'cancelled')", (video_id,)
        ).rowcount > 0
        if deleted:
            self._remove_folder("jobs", video_id)
        return deleted

    def finished_before(self, cutoff: int) -> list[str]:
        rows = self._rows("SELECT id FROM videos WHERE status IN ('completed', 'failed', 'cancelled') "
                          "AND completed_at < ?", (cutoff,))
        return [r["id"] for r in rows]

    def recover(self) -> tuple[list[str], list[str]]:
        """On start: rows left in_progress by a crash go back to the queue if they have an attempt left, else fail.
        Returns (requeued ids, failed ids)."""
        rows = self._rows("SELECT id, attempts FROM videos WHERE status = 'in_progress'")
        requeued, failed = [], []
        for r in rows:
            if r["attempts"] < MAX_ATTEMPTS:
                self._exec("UPDATE videos SET status = 'queued', progress = 0 WHERE id = ?", (r["id"],))
                requeued.append(r["id"])
            else:
                self.finish(r["id"], "failed", "interrupted",
                            f"the server stopped while running this job {r['attempts']} times; not retried again")
                failed.append(r["id"])
        return requeued, failed
