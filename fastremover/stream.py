"""Streaming: clips of any length in bounded memory.

Three pieces, each small and testable on its own:

* :func:`open_clip` decodes the video and the mask lazily, frame by frame (video files, frame folders, single images;
  a one-frame mask applies to every frame), and :class:`Prefetch` runs such an iterator in a background thread a
  bounded number of items ahead, so decoding and mask preprocessing overlap the model's work.
* :class:`OrderedWriter` hands finished frames to one encoder thread that owns the codec and writes them in order
  (:func:`fastremover.media.write_frames`): the file is byte-identical to writing the whole array serially, and the
  write runs while the next window is computed (the last window's frames while it is still being decoded:
  `RemovalPipeline.remove_stream` emits them per latent frame).
* :class:`ResumeStore` keeps, beside the output, what a killed run needs to continue from its last finished window
  (see its docstring); `RemovalPipeline.remove_stream` reads and writes it.

Host memory is O(window + overlap + prefetch depth + writer queue) frames, whatever the clip's length.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import cv2
import numpy as np

from fastremover.errors import FastRemoverError
from fastremover.outputs import atomic_path, resume_path, temp_target

__all__ = ["Clip", "open_clip", "Prefetch", "OrderedWriter", "ResumeStore", "fingerprint_frames", "resume_dir"]


# ----------------------------------------------------------------------------------------------------------------------
# Lazy reading


@dataclass
class Clip:
    """A video and its mask opened for streaming. `pairs` yields (frame uint8 [H,W,3], mask bool [H,W]) in order,
    the mask thresholded and matched to the frame's size exactly as `media.read_mask` + `media.match_mask_to_video`
    do for the whole clip."""

    pairs: Iterator[tuple[np.ndarray, np.ndarray]]
    fps: Fraction
    source: str | None  # the video file (audio is copied from it); None for folders and images
    has_audio: bool
    expected: int  # the video's frame count as the container / folder states it (0: unknown)


def open_clip(video: str | os.PathLike, mask: str | os.PathLike, *, threshold: int = 20) -> Clip:
    """Open `video` and `mask` for streaming (nothing is decoded yet beyond what opening needs).

    Counts are checked as the frames arrive: a mask of one frame is used for every frame; any other mask that ends
    before the video, or goes on after it, raises FastRemoverError saying both counts (as far as they are known)."""
    from fastremover import media
    from fastremover.masks import threshold_mask

    frames, fps, source, has_audio, expected = media._iter_source(video, None, media.DEFAULT_FPS)
    masks, _, _, _, mask_expected = media._iter_source(mask, None, media.DEFAULT_FPS)

    def mismatch(mask_count: str, video_count: str) -> FastRemoverError:
        return FastRemoverError(f"the mask has {mask_count} frames but the video has {video_count}; give a mask with "
                                "as many frames as the video (or a single image to use for every frame)")

    def pairs() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        count = 0
        first: np.ndarray | None = None
        repeat = False  # the mask had one frame: it applies to every frame
        try:
            for frame in frames:
                if not repeat:
                    raw = next(masks, None)
                    if raw is None and count != 1:
                        raise mismatch(str(count), str(expected) if expected else f"at least {count + 1}")
                    repeat = raw is None
                    if not repeat:
                        current = _match_size(threshold_mask(raw[None], threshold)[0], frame.shape[:2])
                        first = current if count == 0 else first
                yield frame, (first if repeat else current)
                count += 1
            if not repeat and count and next(masks, None) is not None:
                raise mismatch(str(mask_expected) if mask_expected else f"more than {count}", str(count))
        finally:
            for gen in (frames, masks):
                with contextlib.suppress(Exception):
                    gen.close()

    return Clip(pairs=pairs(), fps=fps, source=source, has_audio=has_audio, expected=expected)


def _match_size(mask: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """One mask frame at the video's size: nearest-neighbour resize, as `media.match_mask_to_video` does."""
    if mask.shape == hw:
        return mask
    return cv2.resize(mask.view(np.uint8), (hw[1], hw[0]), interpolation=cv2.INTER_NEAREST) > 0


class _Done:
    """End of a queue's items."""


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetch(Iterator):
    """Iterate `items` in a background thread, at most `depth` items ahead of the consumer.

    Exceptions raised by `items` reach the consumer at the point they happened. `close()` (or leaving a `with`
    block) stops the thread and closes `items`; the order of the items is never changed."""

    def __init__(self, items: Iterable, depth: int, name: str = "fastremover-prefetch"):
        self._items = iter(items)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(_Done)
        except BaseException as exc:  # handed to the consumer
            self._put(_Failed(exc))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def __next__(self):
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _Done:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._finished = True
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()
        self._finished = True
        self._thread.join()

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------------
# Ordered writing


class _Abandoned(Exception):
    """Raised inside the writer thread when the producer gave up: the write is abandoned (temporary output removed)."""


class OrderedWriter:
    """One encoder thread that consumes frames in the order they are `put` and passes them, as one iterator, to
    `write(frames) -> int` (e.g. ``lambda frames: media.write_frames(path, frames, fps)``).

    One thread owns the codec, so the output equals a serial write of the same frames. At most `depth` frames wait
    in the queue: `put` blocks when the encoder is behind. An error in the writer is raised by the next `put` or by
    `close`; `abandon()` makes the writer's iterator raise, so an atomic writer removes its temporary output.
    `on_frame(count)` is called (in the writer thread) after each frame has been taken by the encoder."""

    def __init__(self, write: Callable[[Iterator[np.ndarray]], int], depth: int = 8,
                 on_frame: Callable[[int], None] | None = None):
        self._write = write
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._on_frame = on_frame
        self.frames_written = 0
        self.result: int | None = None
        self._waited = 0.0
        self.busy_s = 0.0  # seconds the writer thread worked (converting, encoding, muxing), not waiting for frames
        self._thread = threading.Thread(target=self._run, name="fastremover-writer", daemon=True)
        self._thread.start()

    def _frames(self) -> Iterator[np.ndarray]:
        while True:
            t = time.perf_counter()
            item = self._queue.get()
            self._waited += time.perf_counter() - t
            if item is _Done:
                return
            if item is _Abandoned:
                raise _Abandoned()
            yield item
            self.frames_written += 1
            if self._on_frame is not None:
                self._on_frame(self.frames_written)

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self.result = self._write(self._frames())
        except _Abandoned:
            pass
        except BaseException as exc:
            self._error = exc
            # Unblock a producer waiting on a full queue: nothing will consume it any more.
            with contextlib.suppress(queue.Empty):
                while True:
                    self._queue.get_nowait()
        finally:
            self.busy_s = time.perf_counter() - start - self._waited

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, frame: np.ndarray) -> None:
        """Queue one frame (uint8 [H,W,3]); it must not be modified afterwards."""
        while True:
            self._raise_error()
            if not self._thread.is_alive():
                raise RuntimeError("the writer thread stopped before all frames were written")
            try:
                self._queue.put(frame, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> int:
        """Finish the write (the file appears now, atomically) and return the writer's result."""
        self._put_control(_Done)
        self._thread.join()
        self._raise_error()
        return self.result

    def abandon(self) -> None:
        """Stop without finishing: the writer's iterator raises, so no output appears."""
        self._put_control(_Abandoned)
        self._thread.join()

    def _put_control(self, item) -> None:
        while self._thread.is_alive():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue


# ----------------------------------------------------------------------------------------------------------------------
# Resume store

STATE_NAME = "state.json"
STORE_VERSION = 1


def resume_dir(output: str | os.PathLike) -> Path:
    """The resume store of an output path: ``.<name>.fastremover-resume`` beside it (not a name that
    `fastremover.outputs.remove_stale_temps` matches, so a new run's cleanup leaves it for --resume)."""
    return resume_path(output)


def fingerprint_frames(frames: Iterable[np.ndarray]) -> str:
    """sha256 over the bytes (and shapes) of some frames: identifies the decoded content of a clip's start."""
    digest = hashlib.sha256()
    for frame in frames:
        frame = np.ascontiguousarray(frame)
        digest.update(f"{frame.dtype}{frame.shape}".encode())
        digest.update(frame.tobytes())
    return digest.hexdigest()


def file_identity(path: str | os.PathLike) -> dict:
    """Size and mtime of a file, or of a folder's image files (name, size, mtime each, hashed)."""
    p = Path(path)
    if p.is_dir():
        digest = hashlib.sha256()
        for entry in sorted(os.scandir(p), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                digest.update(f"{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return {"folder": digest.hexdigest()}
    st = p.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


class ResumeStore:
    """What a run needs to continue after it was killed, kept in one folder beside the output (:func:`resume_dir`).

    Per finished window k, ``window_<k>.npz`` holds the run's output for that window's frames [start, stop) as the
    difference from the input frames: per frame the box (y0, y1, x0, x1) of the pixels that differ and those pixels,
    lossless. ``state.json`` holds the identity of the run (inputs' size and mtime, options, model), a hash of the
    clip's first frames, and the finished windows (frames, overlap, crop box, run size); it is written after the
    window's file, each by an atomic rename, so a kill at any moment leaves a consistent store. The files are written
    by one background thread, in order, while the next window runs (`save` returns once the window's changed pixels
    are copied out); `flush` waits for them, and a write that failed raises at the next `save` or `flush`.

    A resumed run decodes the input again, rebuilds every finished window's output exactly from the store (the
    model does not run for those), encodes the whole output again from frame 0, and runs the model from the first
    unfinished window on: the file is byte-identical to an uninterrupted run.

    A store that cannot be used as it is (unreadable or empty state, a record without what the pipeline reads, a window
    file that is missing, truncated or not what its record says) is discarded when the run starts, and `note` says
    why: the run starts over rather than failing. Only files this class writes are ever deleted (`clear`), and the
    folder itself only when it is then empty.
    """

    def __init__(self, folder: str | os.PathLike, identity: dict, *, resume: bool):
        self.folder = Path(folder)
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))
        self.resume = resume
        self.windows: list[dict] = []
        self.first_frames = ""
        self.note: str | None = None  # why an existing store was not used, for the run's notes
        self._writer: "ThreadPoolExecutor | None" = None
        self._pending = None  # the Future of the last window's write

    # -- starting ----------------------------------------------------------------------------------------------------

    def start(self, first_frames: str) -> int:
        """Begin the run whose first decoded frames hash to `first_frames`; returns the number of windows already
        finished (0 unless resuming a matching store). A store that does not match is cleared, and `note` says why."""
        previous = self._read_state() if self.resume else None
        if self.resume and previous is None and self.folder.exists():
            self.note = "--resume: the saved state is unreadable; starting from the beginning"
        if previous is not None:
            if previous.get("identity") != self.identity:
                changed = sorted(k for k in set(self.identity) | set(previous.get("identity", {}))
                                 if self.identity.get(k) != previous.get("identity", {}).get(k))
                self.note = f"--resume: {', '.join(changed)} changed since the saved run; starting from the beginning"
            elif previous.get("first_frames") != first_frames:
                self.note = "--resume: the input's first frames changed since the saved run; starting from the beginning"
            elif not all((self.folder / _window_name(k)).is_file() for k in range(len(previous["windows"]))):
                self.note = "--resume: the saved windows are incomplete; starting from the beginning"
            elif (damaged := self._damaged(previous["windows"])) is not None:
                self.note = f"--resume: the saved window {damaged} is damaged; starting from the beginning"
            else:
                self.windows = previous["windows"]
                self.first_frames = first_frames
                return len(self.windows)
        if self.resume and previous is None and not self.folder.exists():
            self.note = "--resume: no saved state for this output; starting from the beginning"
        self.clear()
        self.first_frames = first_frames
        self.windows = []
        return 0

    def _read_state(self) -> dict | None:
        try:
            state = json.loads((self.folder / STATE_NAME).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict) or state.get("version") != STORE_VERSION or not isinstance(
                state.get("windows"), list) or not all(_valid_record(r) for r in state["windows"]):
            return None
        return state

    def _damaged(self, windows: list[dict]) -> int | None:
        """The first saved window whose file does not hold what its record says (read in full: a truncated or
        foreign file is found here, not in the middle of the run), or None."""
        for index, record in enumerate(windows):
            try:
                with np.load(self.folder / _window_name(index), allow_pickle=False) as data:
                    boxes, pixels = data["boxes"], data["pixels"]
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error):
                return index
            if (boxes.ndim != 2 or boxes.shape != (record["stop"] - record["start"], 4) or boxes.dtype.kind not in "iu"
                    or pixels.ndim != 1 or pixels.dtype != np.uint8 or (boxes < 0).any()
                    or int(((boxes[:, 1] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 2])).sum()) * 3 != pixels.size):
                return index
        return None

    # -- saving and loading windows ----------------------------------------------------------------------------------

    def save(self, index: int, record: dict, output: np.ndarray, inputs: np.ndarray) -> None:
        """Record window `index` as finished: `output` and `inputs` are its frames [start, stop), uint8 [F,H,W,3];
        `record` (JSON-able) describes the window."""
        if index != len(self.windows):
            raise RuntimeError(f"window {index} saved after {len(self.windows)} finished windows")
        self.flush()  # (the previous window's write: long done, a window ago; its error raises here)
        boxes, pixels = _diff_boxes(output, inputs)  # copies: the caller may reuse output and inputs
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise FastRemoverError(f"{self.folder} is in the way of the resume state (a file, not fastremover's "
                                   "folder); move it away") from None
        state = {"version": STORE_VERSION, "identity": self.identity, "first_frames": self.first_frames,
                 "windows": [*self.windows, record]}
        text = (json.dumps(state, indent=1, sort_keys=True) + "\n").encode()
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastremover-resume")
        self._pending = self._writer.submit(self._write, _window_name(index), boxes, pixels, text)
        self.windows.append(record)

    def _write(self, name: str, boxes: np.ndarray, pixels: np.ndarray, state: bytes) -> None:
        """The window's file, then the state that lists it (each atomically: a kill between them leaves a store
        whose state does not know the new file yet)."""
        with atomic_path(self.folder / name) as tmp, open(tmp, "wb") as f:
            _write_npz(f, boxes=boxes, pixels=pixels)
        with atomic_path(self.folder / STATE_NAME) as tmp:
            tmp.write_bytes(state)

    def flush(self) -> None:
        """Wait for the window file being written; a write that failed raises its error (once), and its window is
        no longer counted as finished (`windows`)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.exception() is not None:
            self.windows.pop()
            raise pending.exception()

    def load(self, index: int, inputs: np.ndarray) -> np.ndarray:
        """The output of finished window `index`, rebuilt from its input frames uint8 [F,H,W,3]."""
        with np.load(self.folder / _window_name(index)) as data:
            boxes, pixels = data["boxes"], data["pixels"]
        if len(boxes) != len(inputs):
            raise RuntimeError(f"saved window {index} has {len(boxes)} frames, the plan {len(inputs)}")
        out = inputs.copy()
        offset = 0
        for frame, (y0, y1, x0, x1) in zip(out, boxes):
            size = (y1 - y0) * (x1 - x0) * 3
            if size:
                frame[y0:y1, x0:x1] = pixels[offset : offset + size].reshape(y1 - y0, x1 - x0, 3)
            offset += size
        return out

    # -- ending ------------------------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Delete the store's own files (and the folder, if nothing else is in it), after the writes under way (one
        that failed loses nothing here: its file is deleted anyway)."""
        try:
            self.flush()
        except (OSError, FastRemoverError):
            pass
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
        if not self.folder.is_dir():
            return
        for entry in os.scandir(self.folder):
            name = temp_target(entry.name) or entry.name  # a write's temporary file counts as its target
            name = name.removesuffix(".part")  # the temporary names of earlier releases
            ours = name == STATE_NAME or (name.startswith("window_") and name.endswith(".npz"))
            if ours and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        with contextlib.suppress(OSError):
            self.folder.rmdir()


def _valid_record(record) -> bool:
    """A saved window's record has what a resumed run reads (RemovalPipeline.remove_stream)."""
    def ints(value, n):
        return isinstance(value, list) and len(value) == n and all(type(v) is int and v >= 0 for v in value)

    return (isinstance(record, dict) and all(type(record.get(k)) is int and record[k] >= 0
                                             for k in ("start", "stop", "overlap"))
            and record["stop"] > record["start"] and isinstance(record.get("ran"), bool)
            and (record.get("box") is None or ints(record["box"], 4))
            and (record.get("run_hw") is None or ints(record["run_hw"], 2)))


def _window_name(index: int) -> str:
    return f"window_{index:05d}.npz"


def _diff_boxes(output: np.ndarray, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per frame, the box of the pixels where `output` differs from `inputs`, and those boxes' pixels concatenated
    (uint8, row-major per box; an empty box is (0, 0, 0, 0)).

    Compared as bytes: each frame is an [H, W * 3] byte image, so the rows and byte columns that differ come from
    reductions along whole rows and columns (a per-pixel `any` over the 3 channels is a strided reduce numpy runs an
    order of magnitude slower); a pixel differs iff one of its bytes does, so pixel column = byte column // 3."""
    boxes = np.zeros((len(output), 4), np.int64)
    parts = []
    for i, (out, inp) in enumerate(zip(output, inputs)):
        h, w, c = out.shape
        differs = out.reshape(h, w * c) != inp.reshape(h, w * c)
        rows = np.flatnonzero(differs.any(axis=1))
        if rows.size:
            y0, y1 = rows[0], rows[-1] + 1
            cols = np.flatnonzero(differs[y0:y1].any(axis=0))
            x0, x1 = cols[0] // c, cols[-1] // c + 1
            boxes[i] = (y0, y1, x0, x1)
            parts.append(out[y0:y1, x0:x1].reshape(-1))
    pixels = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return boxes, pixels


def _write_npz(file, **arrays: np.ndarray) -> None:
    """`np.savez_compressed` at deflate level 1 (numpy's takes zlib's default, 6): the same .npz that `np.load`
    reads, written several times faster; a window's changed pixels are what is compressed."""
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for name, array in arrays.items():
            with archive.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
