"""Test clips written with PyAV directly (not through fastremover.media): H.264 video plus AAC tone tracks."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np


def write_av_clip(path: Path, frames: np.ndarray, *, fps: int = 24, tones: tuple[int, ...] = (),
                  crf: int | None = None) -> None:
    """An H.264 mp4 of uint8 [F, H, W, 3] `frames`, with one one-second stereo AAC track per pitch (Hz) in `tones`."""
    out = av.open(str(path), "w")
    vs = out.add_stream("libx264", rate=fps)
    vs.width, vs.height, vs.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
    if crf is not None:
        vs.codec_context.options = {"crf": str(crf)}
    tracks = [out.add_stream("aac", rate=44100) for _ in tones]
    for track in tracks:
        track.layout = "stereo"
    for i, img in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        frame.pts = i
        out.mux(vs.encode(frame))
    out.mux(vs.encode(None))
    for pitch, track in zip(tones, tracks):
        t = np.arange(44100) / 44100
        tone = (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32)
        for k in range(0, len(tone), 1024):
            af = av.AudioFrame.from_ndarray(np.stack([tone[k:k + 1024]] * 2), format="fltp", layout="stereo")
            af.sample_rate, af.pts = 44100, k
            out.mux(track.encode(af))
        out.mux(track.encode(None))
    out.close()
