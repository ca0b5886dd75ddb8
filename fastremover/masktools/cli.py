"""Command-line side of the mask tools: ``fastremover mask`` and the ``--box`` options of ``remove`` / ``demo``.

``add_mask_parser(subparsers)`` adds the ``mask`` command; ``add_box_args(parser)`` adds ``--box``, ``--point``,
``--frame``, ``--sam2``, ``--preview-mask`` and ``--allow-uncertain`` to another command; ``mask_from_args(args,
video)`` builds the mask those options describe (``None`` when no box or point was given).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from fastremover.errors import FastRemoverError

__all__ = ["add_mask_parser", "add_box_args", "cmd_mask", "mask_from_args", "mask_result_from_args", "box_mask_file"]


def _box_options(p: argparse.ArgumentParser, preview_flag: str) -> None:
    p.add_argument("--box", action="append", default=[], metavar="X,Y,W,H",
                   help="box around an object on --frame, in pixels of the source (X,Y = top-left); repeat for "
                   "several objects. The object is tracked through the whole clip in both directions")
    p.add_argument("--point", action="append", default=[], metavar="X,Y[,LABEL]",
                   help="with --sam2: a click on the object (LABEL 1, the default) or on the background (0); all "
                   "points together are one object")
    p.add_argument("--frame", type=int, default=0, help="frame the boxes / points are drawn on (default 0)")
    p.add_argument("--sam2", metavar="CHECKPOINT_DIR", default=None,
                   help="segment with SAM2's video predictor from a local folder holding one checkpoint .pt and its "
                   "config .yaml (needs pip install -e \".[sam2]\"); default: the weightless tracker (OpenCV)")
    p.add_argument(preview_flag, dest="preview_mask", metavar="PREVIEW.mp4", default=None,
                   help="also write the clip with the mask overlaid in red (tracked boxes in green, uncertain frames "
                   "in yellow) to check the mask")
    p.add_argument("--allow-uncertain", action="store_true",
                   help="keep going when the tracker may have lost the object on some frames (default: stop and say "
                   "which frames)")


def add_box_args(parser: argparse.ArgumentParser) -> None:
    """``--box`` / ``--point`` / ``--frame`` / ``--sam2`` / ``--preview-mask`` / ``--allow-uncertain`` for
    ``remove`` and ``demo``: the mask is built from them, then removed."""
    _box_options(parser, "--preview-mask")


def add_mask_parser(subparsers) -> argparse.ArgumentParser:
    """The ``mask`` command: ``fastremover mask VIDEO --box X,Y,W,H [--box ...] [--frame N] -o MASK.mp4
    [--preview PREVIEW.mp4]``."""
    p = subparsers.add_parser("mask", help="build a mask video from boxes drawn on one frame, tracked through the clip")
    p.add_argument("video", help="video file, folder of numbered frames, or an image")
    p.add_argument("-o", "--output", required=True,
                   help="mask output: .mp4/.mov/.mkv (white = object), a folder ending in / for PNG frames, or .png")
    _box_options(p, "--preview")
    p.add_argument("--dilate", type=int, default=0,
                   help="grow the written mask by this many pixels (L1 diamond; default 0: remove dilates it itself)")
    p.add_argument("--max-decoded-gib", type=float, default=4.0,
                   help="host memory for the clip's decoded frames (the whole clip is held; default 4)")
    p.add_argument("--device", default=None, help="--sam2 only: cpu | cuda (default: cuda if available)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_mask)
    return p


def _progress(enabled: bool):
    """A ``progress(stage, done, total)`` callback drawing one tqdm bar, and its closer."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar: list = []

    def update(stage: str, done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc=stage, unit="frame", leave=False, file=sys.stderr))
        bar[0].update(done - bar[0].n)

    return update, lambda: bar and bar[0].close()


def mask_result_from_args(args, frames: np.ndarray, fps=None):
    """The :class:`~fastremover.masktools.MaskResult` for the parsed options (``None`` without ``--box`` /
    ``--point``), after the uncertain-frame check and with the preview written (at ``fps``) when asked for."""
    from fastremover import masktools

    boxes = [masktools.parse_box(b) for b in getattr(args, "box", None) or []]
    texts = getattr(args, "point", None) or []
    if not boxes and not texts:
        if getattr(args, "sam2", None):
            raise FastRemoverError("--sam2 needs at least one --box X,Y,W,H or --point X,Y on the object")
        return None
    frame = getattr(args, "frame", 0)
    update, close = _progress(not getattr(args, "quiet", False))
    try:
        if getattr(args, "sam2", None):
            from fastremover.masktools.sam2 import build_mask_sam2, parse_point

            points = [parse_point(t) for t in texts]
            result = build_mask_sam2(frames, args.sam2, boxes, points, frame, device=getattr(args, "device", None),
                                     progress=update)
        else:
            if texts:
                raise FastRemoverError("--point needs --sam2 CHECKPOINT_DIR; the weightless tracker takes --box only")
            result = masktools.build_mask(frames, boxes, frame, progress=update)
    finally:
        close()
    if getattr(args, "preview_mask", None):
        from fastremover import media

        preview = masktools.overlay_preview(frames, result.mask, result.boxes, result.uncertain_frames)
        media.write_video(args.preview_mask, preview, fps or media.DEFAULT_FPS)
    if result.uncertain_frames:
        where = masktools.format_frames(result.uncertain_frames)
        per_object = result.object_confidence
        if per_object is not None and len(per_object) > 1:  # say which object (in --box order; --point last)
            lost = [np.flatnonzero(c < masktools.MIN_CONFIDENCE).tolist() for c in per_object]
            where = "; ".join(f"{masktools.format_frames(frames_n)} (object {n + 1})"
                              for n, frames_n in enumerate(lost) if frames_n)
        if not getattr(args, "allow_uncertain", False):
            hint = f" (see {args.preview_mask})" if getattr(args, "preview_mask", None) else ""
            raise FastRemoverError(
                f"the tracked object may be lost on frames {where}{hint}; draw the box on a frame where the object "
                f"is clearly visible (--frame), tighten it, or pass --allow-uncertain to keep this mask"
            )
        print(f"fastremover: warning: the tracked object may be lost on frames {where}", file=sys.stderr)
    return result


def mask_from_args(args, video) -> np.ndarray | None:
    """``bool [F, H, W]`` mask (undilated) built from ``--box`` / ``--point`` for ``video`` (a
    :class:`fastremover.media.Video` or ``uint8 [F, H, W, 3]`` frames), or ``None`` when neither was given.

    Raises ``FastRemoverError`` for bad boxes, an out-of-range ``--frame``, or frames where the object may be lost
    (unless ``--allow-uncertain``).  Writes ``--preview-mask`` when given.
    """
    result = mask_result_from_args(args, getattr(video, "frames", video), getattr(video, "fps", None))
    return None if result is None else result.mask


def box_mask_file(args, folder) -> str | None:
    """For ``remove --box``: build the mask from ``--box`` / ``--point`` for ``args.video`` and write it losslessly
    as PNG frames under ``folder`` (a temporary folder the caller owns); returns that frame folder's path for the
    removal job, or ``None`` when no box or point was given.  Checks ``args.output`` first, so a bad output path
    fails before any decoding; honours ``args.max_decoded_gib`` when the parser has it."""
    if not (getattr(args, "box", None) or getattr(args, "point", None) or getattr(args, "sam2", None)):
        return None  # (before the imports: a --mask run imports the media readers only for its own checks)
    from pathlib import Path

    from fastremover import media
    from fastremover.outputs import Wanted, check_outputs

    if getattr(args, "mask", None):
        raise FastRemoverError("give either --mask MASK or --box X,Y,W,H, not both")
    check_outputs([Wanted("-o", args.output), Wanted("--preview-mask", getattr(args, "preview_mask", None))],
                  inputs=[args.video])
    budget = getattr(args, "max_decoded_gib", None)
    video = media.read_video(args.video, max_bytes=None if budget is None else int(budget * 2**30))
    mask = mask_from_args(args, video)
    target = Path(folder) / "box-mask"
    media.write_video(f"{target}/", np.repeat(mask[..., None], 3, axis=-1).astype(np.uint8) * np.uint8(255), video.fps)
    return str(target)


def cmd_mask(args) -> int:
    """``fastremover mask``: read the video, build the mask, write it (white = object) and the preview."""
    from fastremover import media
    from fastremover.masks import dilate_masks
    from fastremover.options import validate_gib
    from fastremover.outputs import Wanted, check_outputs

    if args.dilate < 0:
        raise FastRemoverError(f"--dilate must be >= 0, got {args.dilate}")
    if not args.box and not args.point:
        raise FastRemoverError("give at least one --box X,Y,W,H around the object (or --point X,Y with --sam2)")
    # Both paths this command writes, against the input and each other, before anything is read.
    validate_gib(args.max_decoded_gib)
    check_outputs([Wanted("-o", args.output), Wanted("--preview", args.preview_mask)], inputs=[args.video])
    video = media.read_video(args.video, max_bytes=int(args.max_decoded_gib * 2**30))
    result = mask_result_from_args(args, video.frames, video.fps)
    mask = dilate_masks(result.mask, args.dilate) if args.dilate else result.mask
    media.write_video(args.output, np.repeat(mask[..., None], 3, axis=-1).astype(np.uint8) * np.uint8(255), video.fps)
    objects = 0 if result.boxes is None else len(result.boxes)
    wrote = f"wrote {args.output}: {len(mask)} frames {video.width}x{video.height}, {objects} object(s), " \
            f"lowest confidence {float(result.confidence.min()):.2f}"
    if args.preview_mask:
        wrote += f"; preview {args.preview_mask}"
    print(wrote)
    return 0
