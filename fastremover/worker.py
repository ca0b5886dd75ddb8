"""The one worker: a loaded pipeline that runs file jobs (video + mask in, one output file or folder out).

A worker is a model source and an engine config (fastremover/config.py) plus the pipeline it builds from them on
first use. The CLI's `remove`, the HTTP service and batch runs (local processes and Ray actors) are thin layers over
`RemovalWorker.run`, so every check of the inputs and the output, the decoded-size budget, the atomic write and the
audio copy live in one place; the frames stream through `RemovalPipeline.remove_stream`, the one request loop.
Notes (engine fallbacks, doubts about the inputs) go to the package logger as they arise, and into the JobResult.

Thread safety: a worker (and the pipeline it owns) serves one job at a time; give each thread or process its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

from fastremover.config import EngineConfig, ModelSource
from fastremover.errors import FastRemoverError
from fastremover.log import logger
from fastremover.options import RunOptions, validate_mask_threshold

Progress = Callable[[str, int, int], None]  # (stage, done, total), as RemovalPipeline.remove reports it

#: Default limit on the host memory of the frames a job holds at a time while streaming (streaming_bytes), in GiB.
DEFAULT_MAX_DECODED_GIB = 4.0


@dataclass(frozen=True)
class Job:
    """One removal: input video and mask (paths), the output path, and the per-request options."""

    video: str
    mask: str
    output: str
    options: RunOptions = field(default_factory=RunOptions)
    mask_threshold: int = 20
    max_decoded_gib: float = DEFAULT_MAX_DECODED_GIB  # host memory for the frames held while streaming (GiB)
    resume: bool = False  # continue a killed run of this job from its last finished window (see stream.ResumeStore)

    def validate(self) -> None:
        """Everything checkable without reading the inputs: options, the threshold, the budget."""
        self.options.validate()
        validate_mask_threshold(self.mask_threshold)
        if not isinstance(self.max_decoded_gib, (int, float)) or not self.max_decoded_gib > 0:
            raise FastRemoverError(f"--max-decoded-gib {self.max_decoded_gib!r}: must be a positive number")


@dataclass
class JobResult:
    output: str
    num_frames: int
    width: int
    height: int
    fps: Fraction
    seconds: float  # the whole job: read, remove, write
    stages: dict[str, float]  # per-stage seconds of the removal (StageTimer), plus "read" and "write"
    notes: list[str]
    sha256: str  # of the output file (of the manifest's frame hashes for a frame folder)
    ran_model: bool
    geometry: str = ""  # how the clip was split into windows and cropped ("" for one full-frame window)
    describe: dict = field(default_factory=dict)  # the engine configuration that ran
    device_stages: dict = field(default_factory=dict)  # per-stage GPU span (CUDA events; empty off CUDA)


class RemovalWorker:
    """Owns one `RemovalPipeline` (built on first use from `source` and `config`) and runs `Job`s through it, one at
    a time. `pipeline`: an already built one (the source and config then only describe it)."""

    def __init__(self, source: ModelSource | None = None, config: EngineConfig | None = None, *, pipeline=None):
        self.source = source or ModelSource()
        self.source.validate()
        self.config = config if config is not None else EngineConfig.from_env()
        self._pipeline = pipeline

    @property
    def pipeline(self):
        if self._pipeline is None:
            from fastremover.timing import phase

            with phase("imports"):  # torch and the engine: the checks before this (`check`) import neither
                from fastremover.pipeline import RemovalPipeline

            self._pipeline = RemovalPipeline.from_model(self.source, config=self.config)
        return self._pipeline

    def check(self, job: Job):
        """Every check that needs no decoding: options, the output path against the inputs, the inputs' existence,
        and the memory the frames held while streaming need (:func:`streaming_bytes`) against the budget. Returns
        the output target (hand it to `run` to skip the checks there). Raises FastRemoverError."""
        from fastremover.media import check_inputs
        from fastremover.outputs import check_output

        job.validate()
        target = check_output(job.output, inputs=[job.video, job.mask])
        # The clip streams through the windows: its length does not matter, only what one window holds.
        probe = check_inputs(job.video, job.mask)
        target.check_frames(probe.num_frames)
        model = self.source.kind != "classic"
        needed = streaming_bytes(probe.num_frames, probe.height, probe.width, job.options, model)
        if needed > job.max_decoded_gib * 2**30:
            held = streaming_frames(probe.num_frames, job.options, model)
            raise FastRemoverError(
                f"{job.video} decodes to about {needed / 2**30:.2f} GiB of host memory while streaming ({held} frames "
                f"of {probe.width}x{probe.height} held at a time); the limit is {job.max_decoded_gib:g} GiB: raise it "
                f"with --max-decoded-gib {max(1, math.ceil(needed / 2**30))} if this machine has the memory, or use "
                "a smaller --window"
            )
        return target

    def run(self, job: Job, progress: Progress | None = None, *, target=None) -> JobResult:
        """Run one job, streaming: frames are decoded as the windows need them and written (by one encoder thread)
        as soon as they are final, so memory does not grow with the clip's length. The output appears atomically
        at the end. Every multi-window run keeps a resume store beside the output (`stream.ResumeStore`) until it
        finishes; `job.resume` continues from it, otherwise it is cleared first. `target`: what `check(job)`
        returned when the caller checked the job already (else it is checked here)."""
        from fastremover import media, stream
        from fastremover.timing import mark

        start = time.perf_counter()
        target = target if target is not None else self.check(job)
        clip = stream.open_clip(job.video, job.mask, threshold=job.mask_threshold)
        # the first window's frames are decoded in a background thread while the model loads (a first run's load
        # takes seconds); the frames after them are read by the request's own read-ahead
        head = stream.Prefetch(itertools.islice(clip.pairs, job.options.window + 1), job.options.window + 1,
                               name="fastremover-first-read")
        try:
            return self._run_clip(job, progress, target, clip, head, start)
        finally:
            head.close()  # (ended already after a finished run; a failed one's thread stops here)
            with contextlib.suppress(Exception):
                clip.pairs.close()

    def _run_clip(self, job: Job, progress, target, clip, head, start: float) -> JobResult:
        from fastremover import media, stream
        from fastremover.timing import mark

        pipe = self.pipeline  # load the model only after the cheap checks passed
        mark("engine_ready")  # the cold bench's `setup` phase ends here (from the CLI's main, less named phases)
        t0 = time.perf_counter()
        pairs = itertools.chain(head, clip.pairs)
        first = next(pairs, None)
        if first is None:
            raise FastRemoverError(f"video {job.video} contains no frames; give one with at least one frame")
        notes = media.swapped_inputs_warnings(job.video, first[0][None], job.mask)
        for message in notes:
            logger.warning(message)
        read_s = time.perf_counter() - t0
        pairs = itertools.chain([first], pairs)

        store = stream.ResumeStore(stream.resume_dir(target.path), self._identity(job, pipe), resume=job.resume)
        audio = clip.source if clip.has_audio else None
        writer = stream.OrderedWriter(
            lambda frames: media.write_frames(target.write_path, frames, clip.fps, audio_from=audio),
            depth=WRITER_DEPTH)
        try:
            result = pipe.remove_stream(pairs, writer.put, job.options, progress=progress, store=store,
                                        total_frames=clip.expected)
            t = time.perf_counter()
            writer.close()
            # the write time not hidden behind the windows: waits in put (queue full) + the final flush
            exposed = result.emit_s + time.perf_counter() - t
        except BaseException:
            writer.abandon()  # no output appears; the resume store stays for --resume
            raise
        store.clear()  # finished: nothing to resume
        stages = {"read": read_s + result.timer.wall_s.pop("read", 0.0), **result.timer.wall_s, "write": exposed,
                  "write_overlapped": max(0.0, writer.busy_s - exposed)}
        return JobResult(
            output=str(target.path), num_frames=result.num_frames, width=result.width, height=result.height,
            fps=clip.fps, seconds=time.perf_counter() - start, stages=stages, notes=notes + result.notes,
            sha256=output_sha256(target.path), ran_model=result.ran_model, geometry=geometry_line(result),
            describe=pipe.config.describe(), device_stages=result.timer.device_s(),
        )

    def _identity(self, job: Job, pipe) -> dict:
        """What a resumed run must share with the saved one: the inputs (size, mtime), options, model, engine."""
        from fastremover.stream import file_identity

        engine = {k: v for k, v in pipe.config.describe().items() if k != "notes"}
        return {"video": str(Path(job.video).resolve()), "video_file": file_identity(job.video),
                "mask": str(Path(job.mask).resolve()), "mask_file": file_identity(job.mask),
                "options": asdict(job.options), "mask_threshold": job.mask_threshold, "model": self.source.describe(),
                "engine": engine, "output": str(Path(job.output).resolve())}

    def close(self) -> None:
        """Release the pipeline (and its GPU memory); the worker loads it again if it runs another job."""
        pipe, self._pipeline = self._pipeline, None
        if pipe is not None and hasattr(pipe, "close"):
            pipe.close()


#: Frames the writer's queue and the reader's prefetch hold beyond the window (see RemovalPipeline.remove_stream).
WRITER_DEPTH = 8
#: Bytes per pixel of each held frame: RGB input and output (3 + 3), the dilated mask (1), and the window's transient
#: working copies (the fill and its composite, window masks), about 8 more. (Measured: 720p, the default window and
#: the classic fill peak at 1.7 GB RSS, about 14 bytes per pixel of each of the 106 held frames above the 0.3 GB the
#: process starts with; tests/e2e/test_stream.py.)
BYTES_PER_HELD_PIXEL = 3 + 3 + 1 + 8


#: Bytes per pixel of a frame read ahead beyond STREAM_PREFETCH (a model run's deeper read-ahead): the input (3) and
#: its dilated mask (1); nothing else exists for it yet.
BYTES_PER_PREFETCHED_PIXEL = 3 + 1


def streaming_frames(num_frames: int, options: RunOptions, model: bool = False) -> int:
    """Frames held at a time while streaming a clip of `num_frames` (0: unknown) with `options`: the window plus
    one frame of look-ahead, the read-ahead (`windows.stream_prefetch`: one window's new frames with a model, at most
    STREAM_PREFETCH for the classic fill) and the writer's queue; never more than the clip plus the queue."""
    from fastremover.windows import stream_prefetch

    held = options.window + 1 + stream_prefetch(options, model) + WRITER_DEPTH
    return min(held, num_frames + WRITER_DEPTH) if num_frames > 0 else held


def streaming_bytes(num_frames: int, height: int, width: int, options: RunOptions, model: bool = False) -> int:
    """An upper estimate of the host memory the frames held while streaming take (model memory not included): each
    held frame at BYTES_PER_HELD_PIXEL, except the read-ahead beyond STREAM_PREFETCH (model runs) at
    BYTES_PER_PREFETCHED_PIXEL."""
    from fastremover.windows import STREAM_PREFETCH, stream_prefetch

    frames = streaming_frames(num_frames, options, model)
    deep = min(frames, max(0, stream_prefetch(options, model) - STREAM_PREFETCH))
    return ((frames - deep) * BYTES_PER_HELD_PIXEL + deep * BYTES_PER_PREFETCHED_PIXEL) * height * width


def geometry_line(result) -> str:
    """How the clip was split and cropped, when it was (empty for one full-frame window)."""
    runs = [w for w in result.windows if w.ran]
    cropped = [w for w in runs if w.box is not None]
    if len(result.windows) <= 1 and not cropped:
        return ""
    parts = []
    if len(result.windows) > 1:
        longest = max(w.stop - w.start for w in result.windows)
        overlap = min(w.overlap for w in result.windows[1:])  # the last window may share more
        parts.append(f"{len(result.windows)} windows of up to {longest} frames (overlap {overlap})")
    if cropped:
        sizes = sorted({f"{w.box[3] - w.box[2]}x{w.box[1] - w.box[0]}" for w in cropped})
        parts.append(f"cropped in {len(cropped)} of {len(runs)} windows ({', '.join(sizes)})")
    return "windows: " + "; ".join(parts)


def output_sha256(path: str | os.PathLike) -> str:
    """sha256 of an output file; for a frame folder, of its frames' bytes in order."""
    path = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix == ".png") if path.is_dir() else [path]
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
