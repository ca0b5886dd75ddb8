"""One clip on one worker: `RemovalWorker.run` (the same call `fastremover remove` and the HTTP service make), with
the outcome turned into a report entry instead of an exception, so that one bad clip does not stop the batch."""

from __future__ import annotations

import os
import socket
import time
import traceback

from fastremover.batch.plan import ClipTask
from fastremover.env import visible_cuda_devices
from fastremover.errors import FastRemoverError
from fastremover.worker import Progress, RemovalWorker


def where() -> str:
    """This worker's place for the report: host, process id and visible GPUs."""
    gpus = visible_cuda_devices()
    return f"{socket.gethostname()}:{os.getpid()}" + (f" gpu {gpus}" if gpus else "")


def failed(task: ClipTask, error: str, *, seconds: float | None = None, worker: str | None = None,
           trace: str | None = None) -> dict:
    entry = {"index": task.index, "status": "failed", "error": error, "seconds": seconds, "frames": None,
             "sha256": None, "worker": worker}
    if trace:
        entry["traceback"] = trace
    return entry


def run_clip(worker: RemovalWorker, task: ClipTask, progress: Progress | None = None) -> dict:
    """Run ``task`` on ``worker``; returns a JSON-able entry: status "ok" (frames, sha256, seconds, notes) or "failed"
    (error: the one-line FastRemoverError message, or "internal error: ..." with the traceback for a bug).
    KeyboardInterrupt and SystemExit propagate."""
    start = time.perf_counter()
    if task.error is not None:
        return failed(task, task.error, worker=where())
    try:
        result = worker.run(task.job, progress)
    except FastRemoverError as exc:
        return failed(task, str(exc), seconds=time.perf_counter() - start, worker=where())
    except Exception as exc:  # noqa: BLE001 - a bug on one clip is recorded (with its traceback); the batch goes on
        return failed(task, f"internal error: {type(exc).__name__}: {exc}", seconds=time.perf_counter() - start,
                      worker=where(), trace=traceback.format_exc())
    return {"index": task.index, "status": "ok", "error": None, "seconds": result.seconds,
            "frames": result.num_frames, "sha256": result.sha256, "worker": where(), "notes": list(result.notes)}
