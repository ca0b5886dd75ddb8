"""Reading and writing videos, frame folders, images and masks.

Everything the package reads or writes as media goes through here, so the rules are in one place:

* Frames are ``uint8`` RGB arrays shaped ``[F, H, W, 3]``; masks are ``bool`` arrays shaped ``[F, H, W]``.
* Video files are decoded with PyAV (FFmpeg), images with OpenCV (imported where an image is read or written).  Display rotation stored in a video
  (phones record portrait video as rotated landscape) is applied, so frames are in the orientation a
  player shows.  Colour conversion honours the stream's colour matrix and range tags.
* Output is written atomically: to a temporary file next to the target, then renamed over it, so a crash
  or an error never leaves a half-written file or destroys an existing one.
* Problems a user can cause (missing file, corrupt video, mismatched mask, unwritable location) raise
  :class:`~fastremover.errors.FastRemoverError` with a one-line message that says what to do.
"""

from __future__ import annotations

import contextlib
import fractions
import itertools
import json
import os
import re
import shutil
import struct
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from fastremover import outputs
from fastremover.errors import FastRemoverError
from fastremover.masks import threshold_mask

__all__ = [
    "Video",
    "read_video",
    "read_mask",
    "match_mask_to_video",
    "write_video",
    "write_frames",
    "write_image",
    "atomic_write_path",
    "probe",
    "synthetic_clip",
    "DEFAULT_FPS",
    "VIDEO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
]

#: Frame rate given to frame folders and single images, which carry none.
DEFAULT_FPS = Fraction(24)

#: File endings read with PyAV.  Other endings are refused up front: FFmpeg will happily "decode" a text
#: file as ANSI art, which would turn a typo into a confusing result instead of a clear error.
VIDEO_EXTENSIONS = frozenset(
    {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".gif", ".mpg", ".mpeg", ".ts", ".mts", ".m2ts",
     ".wmv", ".flv", ".3gp", ".ogv"}
)
#: File endings read with OpenCV, alone or as numbered frames in a folder.
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"})

#: Containers ``write_video`` produces (all H.264), and single-image outputs (1-frame results).
_VIDEO_OUTPUTS = outputs.VIDEO_OUTPUTS
_IMAGE_OUTPUTS = outputs.IMAGE_OUTPUTS

#: Audio codecs copied without re-encoding, per output container.  Others are transcoded to AAC.
#: Kept explicit (rather than trusting FFmpeg's ``supported_codecs``, which also lists codecs that only
#: mux with ``-strict experimental`` or that common players reject in that container).
_AUDIO_COPY = {
    "mp4": frozenset({"aac", "mp3", "alac", "opus", "flac", "ac3", "eac3"}),
    "mov": frozenset({"aac", "mp3", "alac", "ac3", "eac3", "pcm_s16le", "pcm_s16be", "pcm_s24le",
                      "pcm_s24be", "pcm_f32le", "pcm_f32be"}),
    "matroska": None,  # Matroska takes nearly anything: trust FFmpeg's list.
}

# Colour conversion quality.  swscale's default fast path for YUV 4:2:0 <-> RGB barely interpolates chroma;
# on chroma-rich content that alone costs ~2.5 levels of mean error per round trip.  Bicubic (FFmpeg's own CLI
# default) with accurate rounding and full-resolution chroma roughly halves it for ~2.5 ms/frame at 854x480.
_Interp = av.video.reformatter.Interpolation
_DECODE_INTERPOLATION = _Interp.BICUBIC | _Interp.ACCURATE_RND | _Interp.FULL_CHR_H_INT
_ENCODE_INTERPOLATION = _Interp.AREA | _Interp.ACCURATE_RND | _Interp.FULL_CHR_H_INP | _Interp.FULL_CHR_H_INT

# errno values that mean "this location can't be written", i.e. the user's problem, not a bug.
_USER_ERRNOS = outputs.USER_ERRNOS


# --------------------------------------------------------------------------------------------------------------
# Data type
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Video:
    """Decoded frames plus the facts needed to write a faithful result."""

    frames: np.ndarray  #: ``uint8 [F, H, W, 3]`` RGB.
    fps: fractions.Fraction  #: Average frame rate of the source (``DEFAULT_FPS`` for folders/images).
    source: str | None = None  #: Path read from; ``write_video(audio_from=...)`` copies its audio.
    has_audio: bool = False  #: Whether ``source`` has an audio stream.

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------


def _as_fraction(fps: Fraction | float | int, what: str = "fps") -> Fraction:
    """Exact Fractions and ints stay exact; floats become the nearest short fraction (29.97 -> 2997/100)."""
    if isinstance(fps, Fraction):
        rate = fps
    elif isinstance(fps, int):
        rate = Fraction(fps)
    else:
        rate = Fraction(str(float(fps))).limit_denominator(1_000_000)
    if rate <= 0:
        raise FastRemoverError(f"{what} must be positive, got {fps}; pass a frame rate such as 24 or 30000/1001")
    return rate


def _natural_key(name: str) -> list:
    """Sort key that orders ``frame_2.png`` before ``frame_10.png`` (numbers compared as numbers)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part.lower()) for part in re.split(r"(\d+)", name)]


def _frame_files(folder: Path) -> list[Path]:
    """Image files in ``folder`` in natural order; hidden files (``.DS_Store``, editor droppings) are skipped."""
    files = [
        p for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    ]
    return sorted(files, key=lambda p: _natural_key(p.name))


#: An image larger than this (pixels, by its header) is not decoded by :func:`probe` to learn its displayed size
#: (EXIF orientation): its header's size is reported, so a decompression bomb is refused by the caller's size checks
#: without being decoded. 8192 x 8192; a decode of this size takes 200 MB.
PROBE_DECODE_PIXELS = 1 << 26


def _tiff_size(f, head: bytes) -> tuple[int, int] | None:
    """(width, height) from the first IFD of a TIFF file (`head`: its first bytes)."""
    order = "<" if head[:2] == b"II" else ">"
    (offset,) = struct.unpack_from(order + "I", head, 4)
    f.seek(offset)
    (count,) = struct.unpack(order + "H", f.read(2))
    entries = f.read(12 * min(count, 4096))
    found: dict[int, int] = {}
    for i in range(len(entries) // 12):
        tag, kind, _, value = struct.unpack_from(order + "HHI4s", entries, 12 * i)
        if tag in (256, 257):
            found[tag] = struct.unpack_from(order + ("H" if kind == 3 else "I"), value)[0]
    return (found[256], found[257]) if len(found) == 2 else None


def _jpeg_size(f) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header (SOFn), read marker by marker."""
    f.seek(2)
    while True:
        byte = f.read(1)
        while byte and byte != b"\xff":
            byte = f.read(1)
        while byte == b"\xff":
            byte = f.read(1)
        if not byte:
            return None
        marker = byte[0]
        if marker in (0x01, *range(0xD0, 0xDA)):  # no length
            continue
        length = struct.unpack(">H", f.read(2))[0]
        if length < 2:
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            _, height, width = struct.unpack(">BHH", f.read(5))
            return width, height
        f.seek(length - 2, os.SEEK_CUR)


def image_size(path: str | os.PathLike) -> tuple[int, int] | None:
    """(width, height) of a PNG, JPEG, BMP, WebP or TIFF file from its header, without decoding it (as stored: an
    EXIF orientation is not applied); None when the header is none of these or is cut short."""
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024)
            if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
                return struct.unpack_from(">II", head, 16)
            if head[:2] == b"BM":
                (size,) = struct.unpack_from("<I", head, 14)
                if size == 12:
                    return struct.unpack_from("<HH", head, 18)
                width, height = struct.unpack_from("<ii", head, 18)
                return abs(width), abs(height)
            if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
                chunk = head[12:16]
                if chunk == b"VP8 ":
                    width, height = struct.unpack_from("<HH", head, 26)
                    return width & 0x3FFF, height & 0x3FFF
                if chunk == b"VP8L":
                    (bits,) = struct.unpack_from("<I", head, 21)
                    return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
                if chunk == b"VP8X":
                    w, h = head[24:27] + b"\0", head[27:30] + b"\0"
                    return struct.unpack("<I", w)[0] + 1, struct.unpack("<I", h)[0] + 1
                return None
            if head[:4] in (b"II*\0", b"MM\0*"):
                return _tiff_size(f, head)
            if head[:2] == b"\xff\xd8":
                return _jpeg_size(f)
    except (struct.error, ValueError):
        return None
    return None


def _read_image_rgb(path: Path) -> np.ndarray:
    """Decode one image as ``uint8 [H, W, 3]`` RGB.

    ``IMREAD_COLOR`` turns grey, palette, 16-bit and RGBA images into 8-bit BGR (alpha dropped) and applies
    the EXIF orientation, so images and masks from the same camera line up.  ``np.fromfile`` + ``imdecode``
    rather than ``imread`` so non-ASCII paths work on every platform.
    """
    import cv2

    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as exc:
        reason = exc.strerror or exc
        raise FastRemoverError(f"cannot read {path}: {reason}; check the path and its permissions") from exc
    image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if image is None:
        raise FastRemoverError(
            f"{path} is not a readable image (corrupt or unsupported); re-export it as PNG or JPEG"
        )
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _rotate_for_display(image: np.ndarray, rotation: int) -> np.ndarray:
    """Apply a display-matrix rotation (degrees counter-clockwise, as PyAV reports it) to an ``[H, W, ...]`` array."""
    quarter_turns = round(rotation / 90) % 4
    if quarter_turns == 0:
        return image
    return np.ascontiguousarray(np.rot90(image, k=quarter_turns))


def _open_input(path: Path) -> av.container.InputContainer:
    try:
        return av.open(str(path), mode="r")
    except av.FFmpegError as exc:
        raise FastRemoverError(
            f"{path} is not a readable video ({exc.strerror or type(exc).__name__}); "
            f"check the file is complete, or convert it to MP4 (H.264) or a folder of PNG frames"
        ) from exc


#: Rates that containers with coarse clocks (Matroska/WebM count milliseconds) can only approximate.
_STANDARD_RATES = tuple(Fraction(n * 1000, 1001) for n in (24, 30, 48, 60, 120, 240)) + tuple(
    Fraction(n) for n in range(1, 241)
)


def _snap_rate(rate: Fraction) -> Fraction:
    """Return the standard rate ``rate`` approximates to 1e-4 (19001/317 from an mkv is 60000/1001), else ``rate``."""
    if rate.denominator in (1, 1001):
        return rate
    for standard in _STANDARD_RATES:
        if abs(rate - standard) <= standard * Fraction(1, 10_000):
            return standard
    return rate


def _stream_fps(stream: av.video.stream.VideoStream) -> Fraction:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate is not None and rate > 0:
            return _snap_rate(Fraction(rate))
    return DEFAULT_FPS


def _decode_frames(path: Path, max_frames: int | None) -> tuple[Iterator[np.ndarray], Fraction, bool, int]:
    """Open a video file and return (a generator of RGB frames, average fps, has_audio, expected frame count)."""
    container = _open_input(path)
    if not container.streams.video:
        container.close()
        raise FastRemoverError(f"{path} has no video stream; give a video file, an image, or a folder of frames")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"  # frame+slice threads: several times faster on long clips
    fps = _stream_fps(stream)
    has_audio = bool(container.streams.audio)
    expected = stream.frames or 0  # from the container index; 0 when unknown (e.g. webm)

    def frames() -> Iterator[np.ndarray]:
        count = 0
        try:
            if max_frames is not None and max_frames <= 0:
                return
            for frame in container.decode(stream):
                # Colour conversion uses the frame's own matrix/range tags (PyAV 18 does that by default).
                rgb = frame.to_ndarray(format="rgb24", interpolation=_DECODE_INTERPOLATION)
                yield _rotate_for_display(rgb, getattr(frame, "rotation", 0) or 0)
                count += 1
                if max_frames is not None and count >= max_frames:
                    return
        except av.FFmpegError as exc:
            if count == 0:
                raise FastRemoverError(
                    f"{path} could not be decoded ({exc.strerror or type(exc).__name__}); "
                    f"check the file is complete, or convert it to MP4 (H.264)"
                ) from exc
            # A truncated tail (interrupted recording/download) still yields the frames before it; keep those
            # rather than refusing the whole clip, and say so.
            warnings.warn(f"{path}: decoding stopped after {count} frames ({exc}); using those frames", stacklevel=3)
        finally:
            container.close()

    return frames(), fps, has_audio, expected


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise FastRemoverError(f"{path} does not exist; check the path")


def _iter_source(
    path: str | os.PathLike, max_frames: int | None, default_fps: Fraction | float
) -> tuple[Iterator[np.ndarray], Fraction, str | None, bool, int]:
    """Shared front end of ``read_video`` and ``read_mask``.

    Returns (RGB frame iterator, fps, source path, has_audio, expected frame count or 0 if unknown).
    """
    path = Path(path)
    _check_exists(path)
    fallback_fps = _as_fraction(default_fps, "default_fps")
    limit = None if max_frames is None else max(0, int(max_frames))

    if path.is_dir():
        files = _frame_files(path)
        if not files:
            exts = ", ".join(sorted(e.lstrip(".") for e in IMAGE_EXTENSIONS))
            raise FastRemoverError(f"folder {path} has no image frames; put numbered {exts} files in it")
        if limit is not None:
            files = files[:limit]
        return _iter_folder(path, files), fallback_fps, None, False, len(files)

    suffix = path.suffix.lower()
    if suffix in IMAGE_EXTENSIONS:
        frames = iter([] if limit == 0 else [_read_image_rgb(path)])
        return frames, fallback_fps, None, False, 1
    if suffix in VIDEO_EXTENSIONS:
        frames, fps, has_audio, expected = _decode_frames(path, limit)
        if limit is not None:
            expected = min(expected, limit)
        return frames, fps, str(path), has_audio, expected
    raise FastRemoverError(
        f"{path} is not a supported video or image (ending {suffix or 'missing'!r}); "
        f"use mp4/mov/mkv/webm/avi/gif, png/jpg, or a folder of numbered frames"
    )


def _iter_folder(folder: Path, files: list[Path]) -> Iterator[np.ndarray]:
    first_shape = None
    for file in files:
        image = _read_image_rgb(file)
        if first_shape is None:
            first_shape = (image.shape, file.name)
        elif image.shape != first_shape[0]:
            (h0, w0, _), name0 = first_shape
            raise FastRemoverError(
                f"frames in {folder} differ in size: {name0} is {w0}x{h0} but {file.name} is "
                f"{image.shape[1]}x{image.shape[0]}; resize them all to one size"
            )
        yield image


def _collect(
    items: Iterator[np.ndarray], expected: int, path: str | os.PathLike, what: str, max_bytes: int | None = None
) -> np.ndarray:
    """Stack same-shaped frames into one array, filling a preallocated buffer when the count is known.

    A list + ``np.stack`` would briefly hold every frame twice (2 GB extra for 300 frames of 1080p); with
    the container's frame count we fill the final array in place.  Counts are only hints: extra frames
    are appended and missing ones trimmed.  ``max_bytes`` bounds the decoded size: decoding stops with a
    FastRemoverError as soon as the frames (announced or decoded) would exceed it.
    """
    buffer: np.ndarray | None = None
    extra: list[np.ndarray] = []
    count = 0

    def too_large(frames: int, item: np.ndarray) -> FastRemoverError:
        h, w = item.shape[:2]
        return FastRemoverError(
            f"{what} {path} decodes to more than {max_bytes / 2**30:.1f} GiB ({frames} frames of {w}x{h} or more); "
            "raise the limit with --max-decoded-gib if this machine has the memory, or use a shorter or smaller clip"
        )

    for item in items:
        if max_bytes is not None and (max(count + 1, expected) * item.nbytes > max_bytes):
            raise too_large(max(count + 1, expected), item)
        if buffer is None:
            buffer = np.empty((max(1, expected),) + item.shape, item.dtype)
        elif item.shape != buffer.shape[1:]:
            # Resolution changes mid-stream are legal in some containers, but one clip needs one size.
            raise FastRemoverError(f"{what} {path} changes resolution mid-stream; re-encode it at one resolution")
        if count < buffer.shape[0]:
            buffer[count] = item
        else:
            extra.append(item)
        count += 1
    if buffer is None:
        raise FastRemoverError(f"{what} {path} contains no frames; give one with at least one frame")
    if count < expected:
        # MP4 frame counts come from the index and are exact, so a shortfall means a damaged/truncated file.
        warnings.warn(
            f"{path}: the file lists {expected} frames but only {count} could be decoded "
            f"(truncated or damaged?); using those {count}",
            stacklevel=3,
        )
    if extra:
        return np.concatenate([buffer, np.stack(extra)])
    return buffer[:count] if count < buffer.shape[0] else buffer


def _check_image_budget(path: str | os.PathLike, max_frames: int | None, max_bytes: int | None, what: str,
                        bytes_per_pixel: int) -> None:
    """An image, or a folder of them, whose frames would take more than ``max_bytes`` is refused from the first
    image's header, before anything is decoded (a decoded frame also passes through 3 bytes per pixel)."""
    if max_bytes is None:
        return
    path = Path(path)
    try:
        if path.is_dir():
            files = _frame_files(path)
            count = len(files) if max_frames is None else min(len(files), max(0, int(max_frames)))
        elif path.suffix.lower() in IMAGE_EXTENSIONS:
            files, count = [path], 1
        else:
            return
    except OSError:
        return  # the reader says what is wrong
    size = image_size(files[0]) if files else None
    if size is None:
        return
    width, height = size
    needed = max(count * bytes_per_pixel, 3) * width * height
    if needed > max_bytes:
        raise FastRemoverError(
            f"{what} {path} decodes to more than {max_bytes / 2**30:.1f} GiB ({count} frames of {width}x{height}); "
            "raise the limit with --max-decoded-gib if this machine has the memory, or use a smaller image"
        )


def read_video(
    path: str | os.PathLike,
    *,
    max_frames: int | None = None,
    default_fps: Fraction | float = DEFAULT_FPS,
    max_bytes: int | None = None,
) -> Video:
    """Read a video file, a folder of numbered frames, or one image into memory.

    * Video files (mp4/mov/mkv/webm/avi/gif, ...) are decoded with PyAV; ``fps`` is the stream's average
      rate.  Variable-frame-rate sources are not resampled: every decoded frame is kept.
    * A folder is read as frames sorted by the numbers in their names (``2.png`` before ``10.png``); all
      frames must have the same size.
    * A single image is a 1-frame video.
    Folders and images carry no frame rate, so they get ``default_fps`` (24 unless given).

    ``max_frames`` stops reading after that many frames (useful to preview a long clip); ``max_bytes`` refuses a
    clip whose decoded frames would take more memory (checked before and while decoding).
    """
    _check_image_budget(path, max_frames, max_bytes, "video", 3)
    frames_iter, fps, source, has_audio, expected = _iter_source(path, max_frames, default_fps)
    frames = _collect(frames_iter, expected, path, "video", max_bytes)
    return Video(frames=frames, fps=fps, source=source, has_audio=has_audio)


def read_mask(
    path: str | os.PathLike, *, threshold: int = 20, max_frames: int | None = None, max_bytes: int | None = None
) -> np.ndarray:
    """Read a mask video / folder / image as ``bool [F, H, W]``: first (red) channel ``> threshold``.

    Same inputs as :func:`read_video`.  Grey masks have equal channels, so "first channel" equals the grey
    value; for RGB(A) masks the red channel is used (as upstream MiniMax-Remover does).  The default threshold
    of 20 (upstream's value) ignores compression noise around black in lossy mask videos.
    Frames are thresholded as they are decoded, so a long mask costs 1 byte per pixel, not 3.
    """
    _check_image_budget(path, max_frames, max_bytes, "mask", 1)
    frames_iter, _, _, _, expected = _iter_source(path, max_frames, DEFAULT_FPS)
    masks = (threshold_mask(frame[None], threshold)[0] for frame in frames_iter)
    return _collect(masks, expected, path, "mask", max_bytes)


def match_mask_to_video(mask: np.ndarray, video: Video) -> np.ndarray:
    """Return ``mask`` (``bool [F, H, W]``) aligned to ``video``: same frame count and size.

    * Equal frame counts pair frame *i* with frame *i*; frame rates may differ (a mask exported at another
      rate from the same edit is still frame-accurate), so nothing is said about that.
    * A 1-frame mask (a single image) applies to every frame.
    * A different resolution is resized with nearest neighbour, which keeps the mask binary and never
      grows it by interpolation.
    * Any other count mismatch is the user's to fix: we will not guess an alignment.
    """
    mask = np.asarray(mask)
    if mask.ndim == 2:
        mask = mask[None]
    if mask.ndim != 3:
        raise ValueError(f"mask must be [F, H, W] or [H, W], got shape {mask.shape}")
    mask = mask.astype(bool, copy=False)
    count, n = mask.shape[0], video.num_frames
    if count != n and count != 1:
        raise FastRemoverError(
            f"the mask has {count} frames but the video has {n}; give a mask with {n} frames "
            f"(or a single image to use for every frame)"
        )
    if mask.shape[1:] != (video.height, video.width):
        import cv2

        size = (video.width, video.height)
        mask = np.stack([cv2.resize(m.view(np.uint8), size, interpolation=cv2.INTER_NEAREST) for m in mask]) > 0
    if count == 1 and n != 1:
        mask = np.repeat(mask, n, axis=0)
    return np.ascontiguousarray(mask)


def _sample(frames: np.ndarray, count: int = 5) -> np.ndarray:
    return frames[np.unique(np.linspace(0, len(frames) - 1, num=min(count, len(frames))).round().astype(int))]


def looks_binary(frames: np.ndarray) -> float:
    """Share of pixels (of a few sampled frames) that are grey and near black or white, as in a mask video."""
    x = _sample(frames).astype(np.int16)
    grey = (x.max(axis=-1) - x.min(axis=-1)) <= 12
    level = x.mean(axis=-1)
    return float((grey & ((level <= 24) | (level >= 231))).mean())


def swapped_inputs_warnings(video_path: str | os.PathLike, frames: np.ndarray, mask_path: str | os.PathLike) -> list[str]:
    """Warnings when the inputs look swapped: the video looks like a black-and-white mask and the mask's first frame
    like a natural picture (or the mask alone looks natural). A look at a few frames only; the run goes on."""
    mask_rgb = read_video(mask_path, max_frames=1).frames
    natural = 1.0 - looks_binary(mask_rgb)
    notes = []
    if looks_binary(frames) >= 0.98 and natural >= 0.3:
        notes.append(f"the video {video_path} looks like a black-and-white mask and the mask {mask_path} "
                     "like a natural video: are the two swapped? (the video comes first, the mask after --mask)")
    elif natural >= 0.5:
        notes.append(f"the mask {mask_path} does not look like a black-and-white mask ({natural:.0%} of its first "
                     "frame is neither dark nor white): check that --mask names the mask")
    return notes


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------


def _user_os_error(path: Path | str, exc: OSError) -> FastRemoverError:
    return outputs.write_error(path, exc)


def _ensure_parent(path: Path) -> None:
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise FastRemoverError(
            f"cannot write {path}: {parent} is not a folder (a file is in the way); choose another output path"
        ) from exc
    except OSError as exc:
        raise _user_os_error(path, exc) from exc


def atomic_write_path(path: str | os.PathLike) -> contextlib.AbstractContextManager[Path]:
    """Yield a temporary path next to ``path``; on success rename it over ``path``, on error delete it.

    :func:`fastremover.outputs.atomic_path`, the one mechanism every write goes through: the temporary file lives in
    the same folder (so the final ``os.replace`` is an atomic rename on the same filesystem) and is named
    ``.<name>.fastremover-<host>-<pid>-<random>.tmp``; temporary files that killed runs left for the same target are
    removed first. Writers must say the format explicitly: the temporary name does not end like the target.  Any
    exception (also KeyboardInterrupt and the CLI's SIGTERM) removes the temporary file.
    """
    return outputs.atomic_path(path)


def _check_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"frames must be uint8 [F, H, W, 3] with F >= 1, got shape {frames.shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    return frames


def _encode_image(path: Path, frame: np.ndarray) -> bytes:
    import cv2

    ext = path.suffix.lower()
    params: list[int] = []
    if ext in (".jpg", ".jpeg"):
        params = [cv2.IMWRITE_JPEG_QUALITY, 95]
    ok, buf = cv2.imencode(ext, cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR), params)
    if not ok:
        raise FastRemoverError(f"OpenCV cannot encode {ext} images here; write a .png instead")
    return buf.tobytes()


def write_image(path: str | os.PathLike, frame: np.ndarray) -> None:
    """Write one ``uint8 [H, W, 3]`` RGB frame as png/jpg/bmp/webp/tif (chosen by ending), atomically."""
    path = Path(path)
    if path.suffix.lower() not in _IMAGE_OUTPUTS:
        raise FastRemoverError(f"cannot write an image to {path}: use a .png or .jpg ending")
    frame = np.asarray(frame)
    if frame.ndim == 4 and frame.shape[0] == 1:
        frame = frame[0]
    if frame.ndim != 3:
        raise ValueError(f"write_image takes one uint8 [H, W, 3] frame, got shape {frame.shape}")
    data = _encode_image(path, _check_frames(frame[None])[0])
    with atomic_write_path(path) as tmp:
        tmp.write_bytes(data)


def _write_frame_folder(folder: Path, frames: Iterable[np.ndarray]) -> int:
    """Write ``00000.png, 00001.png, ...`` and the manifest into a new hidden folder beside ``folder``, then swap it
    in (:func:`fastremover.outputs.swap_in_folder`): readers see the old folder or the new one, never a mix. An
    existing ``folder`` must be empty or one fastremover wrote (its manifest lists every file in it); nothing else is
    ever deleted. An error or interruption removes the half-written new folder.
    """
    reason = outputs.replaceable_folder(folder)
    if reason is not None:
        raise FastRemoverError(f"cannot write frames to {folder}: {reason}")
    _ensure_parent(folder)
    outputs.remove_stale_temps(folder.parent, folder.name)
    tmp = folder.with_name(outputs.temp_name(folder.name))
    try:
        tmp.mkdir()
    except OSError as exc:
        raise _user_os_error(folder, exc) from exc
    names: list[str] = []
    try:
        for frame in frames:  # written as they arrive: a stream of frames is never held whole
            name = f"{len(names):05d}.png"
            (tmp / name).write_bytes(_encode_image(tmp / name, _check_frames(frame[None])[0]))
            names.append(name)
        if not names:
            raise ValueError("no frames to write")
        manifest = {"fastremover": "frame folder", "files": names}
        (tmp / outputs.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
        outputs.swap_in_folder(tmp, folder)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in _USER_ERRNOS:
            raise _user_os_error(folder, exc) from exc
        raise
    return len(names)


#: libx264's thread count for every H.264 write (see _encode_h264): fixed, so the output does not depend on the
#: machine or on the CPU affinity of the writing thread.
ENCODER_THREADS = 8


def x264_params(cpuinfo: str | None = None) -> dict[str, str]:
    """Extra libx264 options for every H.264 write: on a CPU with AVX-512, x264's SIMD level is capped at AVX2
    (`asm=AVX2`). With its AVX-512 code the same converted pictures gave different files within one process (the
    first encode of a run unlike the next ones, on the H200 machine's Xeon; at AVX2 every encode was the same file,
    the one the later AVX-512 encodes gave: experiments/x264_determinism.py --isolate --x264-params,
    bench/results/x264-isolate-asm-*.json). cpuinfo: /proc/cpuinfo's text (read when None; no cap where it cannot
    be read, e.g. off Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return {}
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return {"x264-params": "asm=AVX2"} if "avx512f" in flags and "avx2" in flags else {}


def write_video(
    path: str | os.PathLike,
    frames: np.ndarray,
    fps: Fraction | float,
    *,
    audio_from: str | os.PathLike | None = None,
    crf: int = 18,
    preset: str = "medium",
) -> None:
    """Write ``uint8 [F, H, W, 3]`` RGB frames.  What is written depends on ``path``:

    * ``.mp4`` / ``.mov`` / ``.mkv``: H.264 (libx264, ``crf`` quality, ``preset`` speed) at exactly ``fps``
      (a Fraction such as 30000/1001 stays exact: it is the codec time base), tagged BT.709 limited range,
      with ``+faststart`` for mp4/mov so it streams in browsers. The bytes are a function of the frames and these
      options alone: x264 runs ``ENCODER_THREADS`` threads on every machine (its output depends on the count).
    * a path ending in ``/`` or an existing folder: PNG frames ``00000.png, 00001.png, ...`` (lossless) plus a
      manifest; an existing folder must be empty or one that fastremover wrote (see ``_write_frame_folder``).
    * ``.png`` / ``.jpg`` (and bmp/webp/tif): a single image; the result must have exactly one frame.

    Frame size is kept exactly.  Even sizes use ``yuv420p`` (plays everywhere).  yuv420p cannot store an odd
    width or height, so odd sizes are encoded as ``yuv444p`` (H.264 High 4:4:4) instead of padding or
    cropping: the output has the input's exact size and full colour, and FFmpeg, VLC and mpv play it, but
    browsers and QuickTime may not — a warning says so.  (Padding would change the size the mask and the
    source refer to; cropping would drop real pixels.)

    Audio: every audio stream of ``audio_from`` is copied into the video without re-encoding when the
    container accepts that codec (mp4 takes aac/mp3/alac/opus/flac/ac3/eac3), otherwise transcoded to AAC
    (192 kb/s), and cut to the video's duration (to within one audio packet when copied, to the sample when
    transcoded).  Copied audio keeps its timing relative to the source's first video frame; transcoded audio
    starts with the first video frame.  A stream that can be neither copied nor transcoded is dropped with a
    warning naming it.  ``audio_from`` without audio is fine: no audio is written.
    The source is meant to be the clip the frames came from (``Video.source``); any other file also works.

    The file appears atomically: an error leaves no partial output and any existing file untouched.
    """
    frames = _check_frames(frames)
    folder = os.fspath(path).endswith(("/", os.sep)) or Path(path).is_dir()
    if not folder and Path(path).suffix.lower() in _IMAGE_OUTPUTS and frames.shape[0] != 1:
        raise FastRemoverError(
            f"cannot write {frames.shape[0]} frames to the image {path}; use an .mp4 path or a folder path ending in '/'"
        )
    write_frames(path, iter(frames), fps, audio_from=audio_from, crf=crf, preset=preset)


def write_frames(
    path: str | os.PathLike,
    frames: Iterable[np.ndarray],
    fps: Fraction | float,
    *,
    audio_from: str | os.PathLike | None = None,
    crf: int = 18,
    preset: str = "medium",
) -> int:
    """:func:`write_video` for frames that arrive one at a time (``uint8 [H, W, 3]`` each, all the same size): each
    frame is converted and encoded as it comes, so a clip of any length is written in constant memory. The bytes
    written are those ``write_video`` writes for the same frames stacked. Returns the number of frames written.

    The iterator may raise to abandon the write (the temporary output is then removed, as for any error)."""
    path_str = os.fspath(path)
    path = Path(path_str)
    suffix = path.suffix.lower()

    if path_str.endswith(("/", os.sep)) or (path.is_dir() and suffix not in _VIDEO_OUTPUTS):
        return _write_frame_folder(path, frames)
    if suffix in _IMAGE_OUTPUTS:
        images = [frame for frame, _ in zip(frames, range(2))]
        if len(images) != 1:
            raise FastRemoverError(
                f"cannot write {'several' if images else 'no'} frames to the image {path}; "
                f"use an .mp4 path or a folder path ending in '/'"
            )
        write_image(path, images[0])
        return 1
    if suffix not in _VIDEO_OUTPUTS:
        raise FastRemoverError(
            f"cannot write {path}: unsupported ending {suffix or '(none)'!r}; use .mp4, .mov, .mkv, "
            f"a folder path ending in '/', or .png for a single frame"
        )

    rate = _as_fraction(fps)
    container_format = _VIDEO_OUTPUTS[suffix]
    audio_path = None if audio_from is None else Path(audio_from)
    if audio_path is not None:
        _check_exists(audio_path)
    # the temporary output appears with the first frame: a write abandoned before it (a run stopped early, its
    # producer interrupted before it could abandon the writer) leaves no file
    frames = iter(frames)
    first = next(frames, None)
    frames = iter(()) if first is None else itertools.chain([first], frames)
    with atomic_write_path(path) as tmp:
        return _encode_h264(tmp, container_format, frames, rate, crf=crf, preset=preset, audio_from=audio_path,
                            label=path)


def _encode_h264(
    tmp: Path,
    container_format: str,
    frames: Iterable[np.ndarray],
    rate: Fraction,
    *,
    crf: int,
    preset: str,
    audio_from: Path | None,
    label: Path,
) -> int:
    """Encode `frames` (an iterable of equal-size uint8 [H, W, 3]) into `tmp`; returns the frame count."""
    frames = iter(frames)
    first = next(frames, None)
    if first is None:
        raise ValueError("no frames to write")
    first = _check_frames(first[None])[0]
    frames = itertools.chain([first], frames)
    height, width, _ = first.shape
    odd = height % 2 or width % 2
    pix_fmt = "yuv444p" if odd else "yuv420p"
    if odd:
        warnings.warn(
            f"{label}: {width}x{height} has an odd side, so it is encoded as H.264 4:4:4 to keep that exact "
            f"size; browsers and QuickTime may not play it (crop or resize to an even size, or write PNG "
            f"frames, if that matters)",
            stacklevel=3,
        )
    options = {"movflags": "+faststart"} if container_format in ("mp4", "mov") else {}
    out = av.open(str(tmp), mode="w", format=container_format, container_options=options)
    try:
        stream = out.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        ctx = stream.codec_context
        ctx.time_base = 1 / rate  # pts are frame indices: exact for any rational rate
        ctx.options = {"crf": str(int(crf)), "preset": preset, **_X264_PARAMS}
        ctx.thread_type = "AUTO"
        # x264's bytes depend on its thread count, and "auto" counts the CPUs the opening thread may run on (its
        # affinity), so the same frames gave different files on different machines and threads: a fixed count
        # makes the file a function of the frames alone.
        ctx.thread_count = ENCODER_THREADS
        # Tag what we convert with, so players and our own reader invert the same matrix.
        ctx.colorspace = av.video.reformatter.Colorspace.ITU709
        ctx.color_range = av.video.reformatter.ColorRange.MPEG
        ctx.color_primaries = 1  # BT.709
        ctx.color_trc = 1  # BT.709

        audio = _AudioCopier(audio_from, out, container_format) if audio_from is not None else None
        try:
            num_frames = 0
            for index, frame in enumerate(_yuv_frames(_same_shape(frames, first.shape), pix_fmt)):
                frame.pts = index
                frame.time_base = ctx.time_base
                out.mux(stream.encode(frame))
                num_frames = index + 1
            out.mux(stream.encode(None))
            if audio is not None:
                audio.copy(duration=float(num_frames / rate))
                for why in audio.dropped:
                    warnings.warn(f"{label}: {why}; that stream was dropped", stacklevel=3)
        finally:
            if audio is not None:
                audio.close()
    finally:
        out.close()
    return num_frames


_X264_PARAMS = x264_params()


def _same_shape(frames: Iterator[np.ndarray], shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    for frame in frames:
        if frame.shape != shape or frame.dtype != np.uint8:
            raise ValueError(f"every frame must be uint8 {list(shape)}, got {frame.dtype} {list(frame.shape)}")
        yield frame


def _to_yuv(rgb: np.ndarray, pix_fmt: str) -> av.VideoFrame:
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    yuv = frame.reformat(
        format=pix_fmt,
        dst_colorspace=av.video.reformatter.Colorspace.ITU709,
        dst_color_range=av.video.reformatter.ColorRange.MPEG,
        interpolation=_ENCODE_INTERPOLATION,
    )
    _zero_row_padding(yuv)
    return yuv


def _zero_row_padding(frame: av.VideoFrame) -> None:
    """Zero the bytes between each row's end and the next row's start of every plane (FFmpeg aligns rows to the
    CPU's widest vector, 64 bytes with AVX-512, and leaves the gap uninitialized). The encoder is handed a picture
    that is a function of the pixels alone, so nothing it may read past a row's end can differ between runs.
    (Not what made the H200 machine's files differ, whose W2 planes are not padded: see `x264_params`. 8-bit
    planar formats: a plane's width in bytes is its width.)"""
    for plane in frame.planes:
        if plane.line_size > plane.width:
            rows = np.asarray(memoryview(plane)).reshape(plane.height, plane.line_size)
            rows[:, plane.width:] = 0


def _yuv_frames(frames: Iterable[np.ndarray], pix_fmt: str) -> Iterator[av.VideoFrame]:
    """The frames converted to `pix_fmt`, each converted in one background thread while the caller encodes the
    previous one (swscale and the encoder both release the GIL). Exactly one conversion runs at a time, in frame
    order, so the output is the same as converting inline (concurrent swscale conversions were not reproducible)."""
    frames = iter(frames)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastremover-yuv") as pool:
        current = next(frames, None)
        pending = pool.submit(_to_yuv, current, pix_fmt) if current is not None else None
        while pending is not None:
            frame = pending.result()
            following = next(frames, None)
            pending = pool.submit(_to_yuv, following, pix_fmt) if following is not None else None
            yield frame


@dataclass
class _AudioTrack:
    source: av.audio.stream.AudioStream
    out: av.audio.stream.AudioStream
    transcode: bool
    total: int = 0  # samples to write (transcoded tracks)
    written: int = 0
    done: bool = False


class _AudioCopier:
    """Copies (or, where the container needs it, transcodes to AAC) every audio stream of a source file, in one
    demuxing pass. A stream that can be neither is dropped, and ``dropped`` says which and why."""

    def __init__(self, source: Path, out: av.container.OutputContainer, container_format: str) -> None:
        self.source = source
        self.out = out
        self.input = _open_input(source)
        self.tracks: dict[int, _AudioTrack] = {}
        self.dropped: list[str] = []
        # Audio timing is relative to the source's first video frame, which is t=0 in our output.
        self.offset = 0.0
        if self.input.streams.video and self.input.streams.video[0].start_time is not None:
            video = self.input.streams.video[0]
            self.offset = float(video.start_time * video.time_base)
        allowed = _AUDIO_COPY[container_format]
        for stream in self.input.streams.audio:
            # The codec's canonical name ("mp3"), not the decoder's ("mp3float").
            codec = stream.codec_context.codec.canonical_name
            copyable = codec in out.supported_codecs if allowed is None else codec in allowed
            try:
                if copyable:
                    self.tracks[stream.index] = _AudioTrack(stream, out.add_stream_from_template(stream), False)
                    continue
                in_ctx = stream.codec_context
                encoder = out.add_stream("aac", rate=in_ctx.sample_rate or 48000)
                # Map by channel count: sources often carry an unnamed layout ("1 channels") the encoder rejects.
                encoder.layout = {1: "mono", 6: "5.1"}.get(in_ctx.layout.nb_channels, "stereo")
                encoder.bit_rate = 192_000
                self.tracks[stream.index] = _AudioTrack(stream, encoder, True)
            except (av.FFmpegError, ValueError) as exc:
                self.dropped.append(f"audio stream {stream.index} ({codec}): {exc}")

    def copy(self, duration: float) -> None:
        if not self.tracks:
            return
        for track in self.tracks.values():
            if track.transcode:
                track.total = int(round(duration * track.out.codec_context.sample_rate))
        for packet in self.input.demux(*(t.source for t in self.tracks.values())):
            track = self.tracks[packet.stream.index]
            if track.done:
                continue
            if track.transcode:
                for frame in packet.decode():
                    self._encode(track, frame, duration)
            else:
                self._remux(track, packet, duration)
            if all(t.done for t in self.tracks.values()):
                break
        for track in self.tracks.values():
            if track.transcode:
                self.out.mux(track.out.encode(None))

    def _remux(self, track: _AudioTrack, packet: av.Packet, duration: float) -> None:
        if packet.pts is None or packet.dts is None:  # demuxer flush packet
            return
        start = float(packet.pts * packet.time_base) - self.offset
        length = float((packet.duration or 0) * packet.time_base)
        if start >= duration:
            track.done = True
            return
        if start + length <= 0 and packet.pts >= 0:
            # Entirely before the first video frame.  (Codec priming packets, which already have negative
            # timestamps in the source, are kept: the decoder needs them and the muxer hides them.)
            return
        shift = round(self.offset / packet.time_base)
        packet.pts -= shift
        packet.dts -= shift
        packet.stream = track.out
        self.out.mux(packet)

    def _encode(self, track: _AudioTrack, frame: av.AudioFrame, duration: float) -> None:
        """Re-encode to AAC, from the first video frame's time for ``duration`` seconds (sample-exact end)."""
        if frame.time is not None:
            start = frame.time - self.offset
            if start >= duration:
                track.done = True
                return
            if start + frame.samples / frame.sample_rate <= 0:
                return  # entirely before the first video frame
        frame.pts = None  # the encoder numbers samples from 0 = the first video frame
        if track.written + frame.samples > track.total:
            keep = track.total - track.written
            if keep <= 0:
                track.done = True
                return
            frame = _trim_audio_frame(frame, keep)
        track.written += frame.samples
        self.out.mux(track.out.encode(frame))

    def close(self) -> None:
        self.input.close()


def _trim_audio_frame(frame: av.AudioFrame, samples: int) -> av.AudioFrame:
    """First ``samples`` samples of ``frame`` (to end audio where the video ends)."""
    data = frame.to_ndarray()
    planar = frame.format.is_planar
    data = data[:, :samples] if planar else data[:, : samples * len(frame.layout.channels)]
    trimmed = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=frame.format.name, layout=frame.layout.name)
    trimmed.sample_rate = frame.sample_rate
    return trimmed


# --------------------------------------------------------------------------------------------------------------
# Probing
# --------------------------------------------------------------------------------------------------------------


def _probe_image(path: Path) -> tuple[int, int]:
    """(width, height) of an image as displayed: from its header, decoded only up to PROBE_DECODE_PIXELS (to apply
    an EXIF orientation), so a small file that decodes huge is never decoded here."""
    size = image_size(path)
    if size is not None and size[0] * size[1] > PROBE_DECODE_PIXELS:
        return size
    if size is not None and 0 in size:
        raise FastRemoverError(f"{path} is an image of {size[0]}x{size[1]} pixels; give one with pixels")
    h, w, _ = _read_image_rgb(path).shape
    return w, h


def probe(path: str | os.PathLike) -> dict:
    """Cheap facts about an input without decoding it (for messages and ``info``-style output).

    Returns ``{"kind": "video"|"folder"|"image", "num_frames": int, "fps": Fraction, "height": int,
    "width": int, "has_audio": bool, "duration": float | None}``.  For videos ``num_frames`` is the
    container's count, or duration x fps when the container has none, so treat it as an estimate.
    Size is the displayed size (rotation applied); images are not decoded beyond ``PROBE_DECODE_PIXELS`` (above it,
    the size their header states, EXIF orientation not applied).
    """
    path = Path(path)
    _check_exists(path)
    if path.is_dir():
        files = _frame_files(path)
        if not files:
            raise FastRemoverError(f"folder {path} has no image frames; put numbered png/jpg files in it")
        w, h = _probe_image(files[0])
        return {"kind": "folder", "num_frames": len(files), "fps": DEFAULT_FPS, "height": h, "width": w,
                "has_audio": False, "duration": float(len(files) / DEFAULT_FPS)}
    suffix = path.suffix.lower()
    if suffix in IMAGE_EXTENSIONS:
        w, h = _probe_image(path)
        return {"kind": "image", "num_frames": 1, "fps": DEFAULT_FPS, "height": h, "width": w,
                "has_audio": False, "duration": None}
    if suffix not in VIDEO_EXTENSIONS:
        raise FastRemoverError(f"{path} is not a supported video or image; use mp4/mov/mkv/webm/avi/gif or png/jpg")
    with _open_input(path) as container:
        if not container.streams.video:
            raise FastRemoverError(f"{path} has no video stream; give a video file")
        stream = container.streams.video[0]
        fps = _stream_fps(stream)
        duration = None
        if stream.duration is not None:
            duration = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration = container.duration / av.time_base
        num_frames = stream.frames or (round(duration * fps) if duration else 0)
        width, height = stream.codec_context.width, stream.codec_context.height
        rotation = _stream_rotation(stream)
        if round(rotation / 90) % 2:
            width, height = height, width
        return {"kind": "video", "num_frames": int(num_frames), "fps": fps, "height": height, "width": width,
                "has_audio": bool(container.streams.audio), "duration": duration}


def _stream_rotation(stream) -> int:
    """Display rotation of a stream, read from its first frame (the only place PyAV exposes it reliably)."""
    try:
        for frame in stream.container.decode(stream):
            return getattr(frame, "rotation", 0) or 0
    except av.FFmpegError:
        pass
    return 0


# --------------------------------------------------------------------------------------------------------------
# Synthetic clip
# --------------------------------------------------------------------------------------------------------------


def synthetic_clip(
    num_frames: int = 33,
    height: int = 240,
    width: int = 432,
    *,
    seed: int = 0,
    object_fraction: float = 0.15,
    fps: Fraction | float = 24,
    travel: float = 1.0,
) -> tuple[Video, np.ndarray]:
    """A deterministic test clip: a textured, panning background with a striped ellipse moving across it.

    Returns ``(video, mask)`` where ``mask`` (``bool [F, H, W]``) is exactly the ellipse, which covers about
    ``object_fraction`` of each frame and stays fully inside it.  The background is a sum of sinusoids plus
    smooth noise that pans a few pixels per frame (so an inpainter has real, moving texture to continue) and
    the object has a hard edge (so pixels outside the mask never carry object colour).  Everything is
    vectorised: 152 frames at 854x480 take about a second.  ``travel`` (0..1] is the part of the frame the object's
    path spans (1: from the left edge to the right edge; 0.2: a short path around the centre, as for a small object
    that a crop can follow).
    """
    if num_frames < 1 or height < 8 or width < 8:
        raise ValueError("synthetic_clip needs num_frames >= 1 and a frame of at least 8x8")
    if not 0 < object_fraction < 0.6:
        raise ValueError("object_fraction must be in (0, 0.6) so the ellipse fits inside the frame")
    if not 0 < travel <= 1:
        raise ValueError("travel must be in (0, 1]")
    import cv2

    rng = np.random.default_rng(seed)
    pan = int(rng.integers(2, 5))  # px per frame, horizontal
    drift = int(rng.integers(-1, 2))  # px per frame, vertical
    pad_y = abs(drift) * (num_frames - 1)
    big_h, big_w = height + pad_y, width + pan * (num_frames - 1)

    # Background: one panorama (sinusoids + smooth noise at two scales), windowed per frame to pan it.
    yy = np.arange(big_h, dtype=np.float32)[:, None]
    xx = np.arange(big_w, dtype=np.float32)[None, :]
    texture = np.empty((big_h, big_w, 3), np.float32)
    for channel in range(3):
        fx, fy = rng.uniform(0.02, 0.09, size=2)
        phase = rng.uniform(0, 2 * np.pi, size=2)
        texture[..., channel] = np.sin(fx * xx + phase[0]) * np.sin(fy * yy + 0.8 * np.sin(0.015 * xx) + phase[1])
    for cell, weight in ((32, 0.8), (8, 0.25)):
        noise = rng.standard_normal((max(2, big_h // cell), max(2, big_w // cell), 3)).astype(np.float32)
        texture += weight * cv2.resize(noise, (big_w, big_h), interpolation=cv2.INTER_CUBIC)
    base = rng.uniform(80, 170, size=3).astype(np.float32)
    panorama = np.clip(base + 40 * texture, 0, 255).astype(np.uint8)
    f = np.arange(num_frames)
    y0s = f * drift if drift >= 0 else pad_y + f * drift
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    for i in range(num_frames):  # 152 slice copies: faster than one fancy-index gather
        frames[i] = panorama[y0s[i] : y0s[i] + height, i * pan : i * pan + width]

    # Object: an ellipse (axes ratio 0.7) with area ~ object_fraction, kept inside the frame, crossing it
    # left to right while bobbing up and down.  Drawn on a per-frame patch around it (sub-pixel centre).
    area = object_fraction * height * width
    a = np.sqrt(area / (np.pi * 0.7))
    b = 0.7 * a
    scale = min(1.0, (width / 2 - 1) / a, (height / 2 - 1) / b)
    a, b = a * scale, b * scale
    t = f / max(1, num_frames - 1)
    span = width - 2 * a - 2
    cx = a + 0.5 + (1 - travel) / 2 * span + t * travel * span  # pixel centres: stays within columns 1 .. width-2
    cy = height / 2 + (height / 2 - b - 1) * 0.6 * travel * np.sin(2 * np.pi * t + rng.uniform(0, 2 * np.pi))
    px0 = np.clip(np.floor(cx - a) - 1, 0, None).astype(int)
    py0 = np.clip(np.floor(cy - b) - 1, 0, None).astype(int)
    pw, ph = min(width, int(np.ceil(2 * a)) + 3), min(height, int(np.ceil(2 * b)) + 3)
    px0, py0 = np.minimum(px0, width - pw), np.minimum(py0, height - ph)
    dx = np.arange(pw, dtype=np.float32)[None, None, :] + (px0 - cx).astype(np.float32)[:, None, None]
    dy = np.arange(ph, dtype=np.float32)[None, :, None] + (py0 - cy).astype(np.float32)[:, None, None]
    inside = (dx / a) ** 2 + (dy / b) ** 2 <= 1.0  # [F, ph, pw]
    color = rng.uniform(0, 255, size=3)
    color[int(np.argmin(base))] = 255  # saturated where the background is weakest, so it stands out
    stripes = np.sin(dx * (6.0 / a) + dy * (3.0 / b)) > 0  # stripes move with the object
    patch = np.where(stripes[..., None], color.astype(np.uint8), (color * 0.45).astype(np.uint8))
    mask = np.zeros((num_frames, height, width), bool)
    for i in range(num_frames):
        ys, xs = slice(py0[i], py0[i] + ph), slice(px0[i], px0[i] + pw)
        mask[i, ys, xs] = inside[i]
        np.copyto(frames[i, ys, xs], patch[i], where=inside[i][..., None])
    video = Video(frames=frames, fps=_as_fraction(fps), source=None, has_audio=False)
    return video, mask


# ----------------------------------------------------------------------------------------------------------------------
# Checking the inputs before a run


#: A mask may be at most this many times the video's width or height (it is scaled to the video's size, nearest
#: neighbour): anything larger is the wrong file, or a small file that decodes huge (a decompression bomb).
MAX_MASK_SCALE = 8


@dataclass(frozen=True)
class InputProbe:
    num_frames: int  # the video's (an estimate when the container has no count; 0 when unknown)
    width: int
    height: int


def _check_readable(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    try:
        if not p.exists():
            raise FastRemoverError(f"{what} {p} does not exist; check the path")
        if p.is_dir():
            os.listdir(p)
        else:
            with open(p, "rb"):
                pass
    except FastRemoverError:
        raise
    except OSError as exc:
        raise FastRemoverError(f"cannot read the {what} {p}: {exc.strerror or exc}") from None
    return p


def check_inputs(video: str | os.PathLike, mask: str | os.PathLike) -> InputProbe:
    """Both inputs readable and probed as media (from the container or the image header, not decoded); the video's
    frame count and size. A mask more than MAX_MASK_SCALE times the video's width or height is refused. What memory
    the run needs is the worker's to check (it depends on the window, not on the clip's length)."""
    video_path = _check_readable(video, "video")
    mask_path = _check_readable(mask, "mask")
    v = probe(video_path)  # sizes from headers: nothing is decoded that a check below would refuse
    m = probe(mask_path)  # a corrupt or unsupported mask fails here, before anything runs
    side = max(m["width"] / max(1, v["width"]), m["height"] / max(1, v["height"]))
    if side > MAX_MASK_SCALE:
        raise FastRemoverError(
            f"the mask {mask_path} is {m['width']}x{m['height']}, far larger than the video ({v['width']}x"
            f"{v['height']}); it would be decoded only to be scaled down: give a mask at the video's size"
        )
    return InputProbe(num_frames=int(v["num_frames"]), width=int(v["width"]), height=int(v["height"]))
