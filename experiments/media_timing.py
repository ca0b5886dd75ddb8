"""How long the H.264 write of a W2-sized result takes, split into RGB->YUV conversion and the whole write.

    python experiments/media_timing.py
"""

import time

import av
import numpy as np

from fastremover import media
from fastremover.media import _to_yuv

frames = np.random.default_rng(0).integers(0, 256, (81, 60, 104, 3), dtype=np.uint8)
frames = np.ascontiguousarray(frames.repeat(8, 1).repeat(8, 2))  # blocky 480x832: compressible like video
t = time.perf_counter()
for f in frames:
    _to_yuv(f, "yuv420p")
conv = time.perf_counter() - t
t = time.perf_counter()
media.write_video("/tmp/media_timing.mp4", frames, 30.0)
write = time.perf_counter() - t
print(f"81 x 480x832: RGB->YUV conversion {conv:.3f} s, whole write (conversion overlapped) {write:.3f} s, "
      f"av {av.__version__}")
