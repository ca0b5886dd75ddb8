"""The weightless fallback remover: temporal nearest-visible fill, then OpenCV inpainting.

Each masked pixel takes its value from the temporally nearest frame in which that same pixel is not masked (ties go to
the earlier frame); pixels that are masked in every frame are filled per frame with OpenCV's Telea inpainting from the
surrounding visible pixels. This needs no weights and runs anywhere, which is why it is the default when no checkpoint
is given — it works well for static cameras and objects that move, and is only a rough fill otherwise.
"""

from __future__ import annotations

import cv2
import numpy as np

from fastremover.errors import FastRemoverError


def nearest_visible_fill(frames: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """frames uint8 [F,H,W,3], mask bool [F,H,W] -> (filled frames, bool [F,H,W] of pixels no frame could fill)."""
    num_frames = frames.shape[0]
    # next_visible[f, y, x]: first g >= f with mask[g, y, x] False, or num_frames if none (one backward scan).
    next_visible = np.empty(mask.shape, dtype=np.int32)
    current = np.full(mask.shape[1:], num_frames, dtype=np.int32)
    for f in range(num_frames - 1, -1, -1):
        current = np.where(mask[f], current, f)
        next_visible[f] = current
    out = frames.copy()
    unfilled = np.zeros_like(mask)
    prev_visible = np.full(mask.shape[1:], -1, dtype=np.int32)  # last g <= f with mask False, forward scan
    for f in range(num_frames):
        prev_visible = np.where(mask[f], prev_visible, f)
        ys, xs = np.nonzero(mask[f])
        if ys.size == 0:
            continue
        prev = prev_visible[ys, xs]
        nxt = next_visible[f, ys, xs]
        has_prev, has_next = prev >= 0, nxt < num_frames
        use_prev = has_prev & (~has_next | (f - prev <= nxt - f))
        src = np.where(use_prev, prev, nxt)
        ok = has_prev | has_next
        out[f, ys[ok], xs[ok]] = frames[src[ok], ys[ok], xs[ok]]
        unfilled[f, ys[~ok], xs[~ok]] = True
    return out, unfilled


def classic_remove(frames: np.ndarray, mask: np.ndarray, inpaint_radius: int = 5) -> np.ndarray:
    """Fill the masked pixels of `frames` (uint8 [F,H,W,3]) given a bool mask [F,H,W]; unmasked pixels are unchanged."""
    if mask.all():
        raise FastRemoverError(
            "the mask covers every pixel of every frame: the classic remover has nothing to fill from; "
            "use a diffusion model (--model PATH) or a mask that leaves part of the frame visible"
        )
    out, unfilled = nearest_visible_fill(frames, mask)
    for f in np.nonzero(unfilled.reshape(len(unfilled), -1).any(axis=1))[0]:
        # unfilled[f] is never the whole frame: that would mean mask.all(), refused above.
        hole = unfilled[f].astype(np.uint8) * 255
        bgr = cv2.cvtColor(out[f], cv2.COLOR_RGB2BGR)
        filled = cv2.inpaint(bgr, hole, inpaint_radius, cv2.INPAINT_TELEA)
        out[f] = cv2.cvtColor(filled, cv2.COLOR_BGR2RGB)
    return out
