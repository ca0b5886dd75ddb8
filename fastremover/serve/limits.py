"""The decoded-size cap of a job's inputs, checked from their headers before anything is decoded.

Contracts:
* `header_size` reads a frame size without decoding a picture: PNG and JPEG from their own headers (the IHDR chunk,
  the SOFn segment), every other file from its container's stream parameters through PyAV, with FFmpeg's
  `max_pixels` set so that a format whose parameters FFmpeg must decode a frame to learn cannot make it allocate a
  picture larger than the cap allows (the size then stays unknown, and the input is refused).
* `check_decoded_size` counts the video (as the worker does: the frames held while streaming) and a mask of another
  size (decoded at its own size before it is resized to the video's) against `--max-decoded-gib`, and raises
  `FastRemoverError` (-> 400) naming the sizes before the job is queued.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from fastremover.errors import FastRemoverError
from fastremover.options import RunOptions
from fastremover.worker import BYTES_PER_HELD_PIXEL, streaming_bytes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JPEG_MAGIC = b"\xff\xd8\xff"
# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic ...): all but DHT (C4), JPG (C8), DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_SCAN_BYTES = 1 << 20  # EXIF and ICC segments come before the frame header; give up after this much
#: Frames of a mask at its own size held at once (each at BYTES_PER_HELD_PIXEL) when its size differs from the
#: video's: a mask frame is decoded whole, thresholded, then resized. (Measured peaks of a classic run of a 96x64 clip:
#: a 6000x6000 PNG mask about 24 bytes per mask pixel, 3000x3000 and 4000x4000 mp4 masks 45-49, the decoder's
#: buffers and the swapped-inputs look at the mask's first frame included.)
MASK_IMAGE_FRAMES_HELD = 2
MASK_VIDEO_FRAMES_HELD = 4


@dataclass(frozen=True)
class HeaderSize:
    frames: int  # 0: not stated by the container (the worker's estimate then assumes a long clip)
    height: int
    width: int


def png_size(head: bytes) -> tuple[int, int] | None:
    """(height, width) from a PNG's IHDR chunk, which the format requires first; None if it is not there."""
    if len(head) < 24 or not head.startswith(PNG_MAGIC) or head[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", head[16:24])
    return height, width


def jpeg_size(path: Path) -> tuple[int, int] | None:
    """(height, width) from a JPEG's first start-of-frame segment (the segments before it are skipped by their
    lengths); None if none is found in the first MiB."""
    with open(path, "rb") as f:
        data = f.read(_JPEG_SCAN_BYTES)
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers: no length
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if marker in _SOF_MARKERS:
            if i + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[i + 5:i + 9])
            return height, width
        i += 2 + length
    return None


def header_size(path: Path, max_pixels: int, what: str) -> HeaderSize:
    """The frame count and size of `path` (a video or an image) from its headers; nothing is decoded, and no
    picture of more than `max_pixels` pixels is allocated. FastRemoverError when the size cannot be read so."""
    with open(path, "rb") as f:
        head = f.read(32)
    if head.startswith(PNG_MAGIC) or head.startswith(JPEG_MAGIC):
        size = png_size(head) if head.startswith(PNG_MAGIC) else jpeg_size(path)
        if size is None or 0 in size:
            raise FastRemoverError(f"{what}: the image header is corrupt (no frame size in it)")
        return HeaderSize(1, *size)
    import av

    try:
        with av.open(str(path), options={"max_pixels": str(max_pixels)}) as container:
            if not container.streams.video:
                raise FastRemoverError(f"{what}: no video stream in the file; give a video or an image")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            frames = stream.frames
            if not frames and stream.duration is not None and stream.average_rate:
                frames = round(float(stream.duration * stream.time_base * stream.average_rate))
            if container.format.name.endswith("_pipe"):  # FFmpeg's single-image demuxers (png_pipe, webp_pipe ...)
                frames = 1
    except av.FFmpegError as e:
        raise FastRemoverError(f"{what}: corrupt or not a video or image ({e.strerror or type(e).__name__})") from None
    if not width or not height:
        raise FastRemoverError(f"{what}: its frame size cannot be read without decoding a picture of more than "
                               f"{max_pixels} pixels (what --max-decoded-gib allows for one frame), or it is corrupt")
    return HeaderSize(int(frames or 0), int(height), int(width))


def check_decoded_size(video: Path, mask: Path | None, options: RunOptions, *, model: bool,
                       max_decoded_gib: float) -> None:
    """Refuse (FastRemoverError) a job whose inputs, by their headers, decode to more than `max_decoded_gib`: the
    video's frames held while streaming (`worker.streaming_bytes`), plus, for a mask whose size differs from the
    video's, MASK_*_FRAMES_HELD frames at the mask's own size (it is decoded whole before it is resized). `mask`
    None: a mask built at the video's size (boxes)."""
    budget = max_decoded_gib * 2**30
    max_pixels = max(1, int(budget // BYTES_PER_HELD_PIXEL))  # one held frame must fit
    v = header_size(video, max_pixels, "input_reference")
    needed = streaming_bytes(v.frames, v.height, v.width, options, model)
    sizes = f"the video is {v.width}x{v.height}"
    if mask is not None:
        m = header_size(mask, max_pixels, "mask")
        if (m.height, m.width) != (v.height, v.width):
            held = MASK_IMAGE_FRAMES_HELD if m.frames == 1 else MASK_VIDEO_FRAMES_HELD
            needed += held * BYTES_PER_HELD_PIXEL * m.height * m.width
            sizes += f" and the mask {m.width}x{m.height}"
    if needed > budget:
        raise FastRemoverError(f"the inputs decode to about {needed / 2**30:.2f} GiB while streaming ({sizes}); this "
                               f"server's limit is {max_decoded_gib:g} GiB (--max-decoded-gib): send smaller inputs")
