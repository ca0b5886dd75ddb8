"""Worker threads that take jobs from the store and run them through `RemovalWorker`, and the retention cleaner.

One thread per `RemovalWorker` (one per GPU, one for the CPU); each owns its worker and so its `RemovalPipeline`. The
HTTP side only inserts rows and calls `notify()`; it never touches a pipeline.

Cancelling and stopping go through the pipeline's progress callback: it raises, the request loop
(`RemovalPipeline.remove_stream`, inside `RemovalWorker.run`) unwinds, and the worker abandons its streaming writer:
the output is written to a temporary name and renamed into place only after the whole clip is done, so nothing
half-written is left.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import traceback
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from fastremover.errors import FastRemoverError
from fastremover.options import RunOptions
from fastremover.serve.jobs import FINISHED, JobStore, VideoRow
from fastremover.serve.security import scrub_paths
from fastremover.worker import Job, RemovalWorker

log = logging.getLogger("fastremover.serve")

OUTPUT_NAME = "output.mp4"
THUMBNAIL_NAME = "thumbnail.png"
PREVIEW_NAME = "preview.mp4"
BOX_MASK_NAME = "box_mask/"  # a PNG frame folder (lossless), written from the job's boxes


class JobCancelled(Exception):
    """Raised from the progress callback when the client cancelled the running job."""


class ServerStopping(Exception):
    """Raised from the progress callback when the server stops before the job finished."""


@dataclass
class RunnerConfig:
    max_decoded_gib: float = 4.0
    mask_threshold: int = 20
    idle_poll_s: float = 1.0  # how often an idle worker looks at the store even without notify()


class _Progress:
    """Maps the pipeline's (stage, done, total) reports ("window", "denoise", "frames") to 0-99 % and stores
    changes; raises to cancel or stop."""

    def __init__(self, runner: "Runner", video_id: str):
        self.runner, self.video_id = runner, video_id
        self.windows, self.windows_done, self.inner = 1, 0, 0.0
        self.frames = 0.0  # frames written / the clip's frames, when the pipeline reports them
        self.last = 0

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage == "window":
            self.windows, self.windows_done, self.inner = max(total, 1), done, 0.0
        elif stage == "denoise" and total:
            self.inner = done / total
        elif stage == "frames" and total:
            self.frames = done / total
        by_windows = (self.windows_done + self.inner) / self.windows
        percent = min(99, int(100 * max(by_windows, self.frames)))
        if percent != self.last:
            self.last = percent
            self.runner.store.set_progress(self.video_id, percent)
        if self.runner.aborting:
            raise ServerStopping()
        if self.runner.store.cancel_requested(self.video_id):
            raise JobCancelled()


class Runner:
    """Worker threads over a `JobStore`. start() once; stop(grace_s) on shutdown."""

    def __init__(self, store: JobStore, workers: list[RemovalWorker], config: RunnerConfig | None = None,
                 roots: list[Path] | None = None):
        if not workers:
            raise ValueError("a Runner needs at least one RemovalWorker")
        self.store = store
        self.workers = workers
        self.config = config or RunnerConfig()
        self.roots = roots or []  # media roots, named instead of spelled out in error messages
        self._changed = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._running: dict[int, str] = {}  # worker index -> video id
        self.stopping = False  # no new jobs are claimed
        self.aborting = False  # the running jobs are interrupted and re-queued

    # -- lifecycle -----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        for index, worker in enumerate(self.workers):
            thread = threading.Thread(target=self._loop, args=(index, worker), name=f"removal-worker-{index}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, grace_s: float) -> None:
        """Stop claiming jobs; give the running ones `grace_s` to finish, then interrupt and re-queue them."""
        self.stopping = True
        self.notify()
        deadline = time.monotonic() + grace_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            self.aborting = True
            for thread in self._threads:
                thread.join()
        for worker in self.workers:
            worker.close()

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    @property
    def busy(self) -> int:
        return len(self._running)

    def wait(self, video_id: str, timeout_s: float) -> VideoRow | None:
        """The job's row once it is finished, or its current row after `timeout_s` or once the runner has stopped."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                row = self.store.get_video(video_id)
                left = deadline - time.monotonic()
                if row is None or row.status in FINISHED or left <= 0 or (self.stopping and not self._running):
                    return row
                self._changed.wait(min(left, self.config.idle_poll_s))

    # -- the worker thread ---------------------------------------------------------------------------------------------

    def _loop(self, index: int, worker: RemovalWorker) -> None:
        try:
            worker.pipeline  # load the model before the first job arrives
        except Exception:
            log.exception("worker %d: loading the model failed; jobs will report the error", index)
        while not self.stopping:
            row = self.store.claim_next()
            if row is None:
                with self._changed:
                    if not self.stopping:
                        self._changed.wait(self.config.idle_poll_s)
                continue
            self._running[index] = row.id
            try:
                self._run(worker, row)
            except Exception:  # a bug outside the job itself (the store, the thumbnail): keep the thread alive
                log.error("worker %d, job %s:\n%s", index, row.id, traceback.format_exc())
                self.store.finish(row.id, "failed", "internal_error",
                                  f"internal error while finishing job {row.id}; the server log has the details")
            finally:
                del self._running[index]
                self.notify()

    def _run(self, worker: RemovalWorker, row: VideoRow) -> None:
        folder = self.store.job_dir(row.id)
        folder.mkdir(parents=True, exist_ok=True)
        # resume: a job re-queued after a crash or a shutdown continues from its last finished window (the worker's
        # resume store beside the output; byte-identical to an uninterrupted run); a first run finds none.
        job = Job(video=row.video_path, mask=row.mask_path, output=str(folder / OUTPUT_NAME),
                  options=RunOptions(**row.options), mask_threshold=self.config.mask_threshold,
                  max_decoded_gib=self.config.max_decoded_gib, resume=True)
        progress = _Progress(self, row.id)
        try:
            notes = build_box_mask(row, self.config.max_decoded_gib, progress) if row.mask_boxes else []
            result = worker.run(job, progress)
            result.notes[:0] = notes
            write_thumbnail(Path(result.output), folder / THUMBNAIL_NAME)
        except JobCancelled:
            _remove_outputs(folder)
            self.store.finish(row.id, "cancelled", "cancelled", "cancelled by the client while running")
            return
        except ServerStopping:
            _remove_outputs(folder, keep_resume=True)
            self.store.requeue(row.id)
            log.info("job %s: re-queued (server stopping)", row.id)
            return
        except FastRemoverError as e:
            _remove_outputs(folder)
            self.store.finish(row.id, "failed", "invalid_input", scrub_paths(str(e), self.store.root, self.roots))
            return
        except Exception:
            _remove_outputs(folder)
            log.error("job %s failed:\n%s", row.id, traceback.format_exc())
            self.store.finish(row.id, "failed", "internal_error",
                              f"internal error while running job {row.id}; the server log has the details")
            return
        seconds = Fraction(result.num_frames) / result.fps if result.fps else Fraction(0)
        self.store.complete(row.id, size=f"{result.width}x{result.height}", seconds=f"{float(seconds):.3f}",
                            inference_s=result.seconds, stages=result.stages, sha256=result.sha256,
                            notes=result.notes)


def build_box_mask(row: VideoRow, max_decoded_gib: float, progress) -> list[str]:
    """Write the mask of the objects inside the job's boxes (fastremover.masktools.build_mask) to `row.mask_path`;
    returns notes (frames where the object may be lost)."""
    import numpy as np

    from fastremover import media
    from fastremover.masktools import build_mask, format_frames

    video = media.read_video(row.video_path, max_bytes=int(max_decoded_gib * 2**30))
    result = build_mask(video.frames, row.mask_boxes["boxes"], row.mask_boxes["frame"], progress=progress)
    white = np.repeat(result.mask[..., None] * np.uint8(255), 3, axis=-1)
    media.write_video(row.mask_path.rstrip("/") + "/", white, video.fps)  # a PNG frame folder: lossless
    if result.uncertain_frames:
        return [f"the box mask may have lost the object in frames {format_frames(result.uncertain_frames)}"]
    return []


def write_thumbnail(video: Path, png: Path) -> None:
    """The first frame of `video` as a PNG."""
    from fastremover import media

    media.write_image(png, media.read_video(video, max_frames=1).frames[0])


def write_preview(video_in: str, video_out: Path, preview: Path, max_decoded_gib: float) -> None:
    """Input | output side by side (the input resized to the output's size if they differ) as an mp4."""
    import cv2
    import numpy as np

    from fastremover import media

    out = media.read_video(video_out)
    src = media.read_video(video_in, max_frames=out.num_frames)
    budget = max_decoded_gib * 2**30
    if 2 * out.frames.nbytes > budget:
        raise FastRemoverError(f"the preview would need more than --max-decoded-gib {max_decoded_gib:g} GiB")
    frames = src.frames
    if frames.shape[1:3] != out.frames.shape[1:3]:
        frames = np.stack([cv2.resize(f, (out.width, out.height), interpolation=cv2.INTER_AREA) for f in frames])
    count = min(len(frames), out.num_frames)
    media.write_video(preview, np.concatenate([frames[:count], out.frames[:count]], axis=2), out.fps)


def _remove_outputs(folder: Path, keep_resume: bool = False) -> None:
    """Delete what a run that did not complete left in its job folder (the worker never leaves a partial output)."""
    from fastremover.stream import resume_dir

    for name in (OUTPUT_NAME, THUMBNAIL_NAME, PREVIEW_NAME):
        (folder / name).unlink(missing_ok=True)
    shutil.rmtree(folder / BOX_MASK_NAME, ignore_errors=True)
    if not keep_resume:
        shutil.rmtree(resume_dir(folder / OUTPUT_NAME), ignore_errors=True)


class Cleaner:
    """Deletes finished jobs and uploaded files older than `keep_hours`, every `interval_s`, and stale tmp/ files."""

    def __init__(self, store: JobStore, keep_hours: float, interval_s: float = 600.0):
        self.store, self.keep_hours, self.interval_s = store, keep_hours, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self, now: float | None = None) -> tuple[int, int]:
        """One pass; returns (jobs deleted, files deleted)."""
        cutoff = int((time.time() if now is None else now) - self.keep_hours * 3600)
        jobs = [v for v in self.store.finished_before(cutoff) if self.store.delete_video(v)]
        files = [f for f in self.store.files_older_than(cutoff) if self.store.delete_file(f)]
        return len(jobs), len(files)

    def clear_tmp(self) -> None:
        """Uploads left half-done by a crash (only at start, when none is in flight)."""
        tmp = self.store.root / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.sweep()
                except Exception:
                    log.exception("retention sweep failed")

        self._thread = threading.Thread(target=loop, name="retention-cleaner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
