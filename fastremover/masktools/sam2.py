"""Masks from a local SAM2 checkpoint: boxes or clicks on one frame, propagated by SAM2's video predictor.

Optional: needs the ``sam2`` package (``pip install -e ".[sam2]"``), imported only when this path is used.
Nothing is downloaded: ``--sam2 DIR`` names a folder holding

* exactly one checkpoint ``*.pt`` (the SAM2 release format, a dict with the state dict under ``"model"``), and
* the model's config ``*.yaml`` (the Hydra/OmegaConf file SAM2 ships under ``sam2/configs/``), or no yaml when the
  checkpoint has an official release name (``sam2.1_hiera_tiny.pt`` ...): its config is then taken from the
  installed package.

Each box is one object; all ``points`` together are one more object (label 1 = on the object, 0 = not on it).
SAM2 predicts whether each object is visible in each frame; a frame where an object's mask is empty is reported as
uncertain (confidence 0), like a lost track on the weightless path.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from fastremover.errors import FastRemoverError
from fastremover.masktools.track import Box, check_box

__all__ = ["Sam2Files", "find_checkpoint", "load_video_predictor", "build_mask_sam2", "Point", "parse_point"]

#: Official release checkpoint names -> their config inside the sam2 package.
RELEASE_CONFIGS = {
    "sam2_hiera_tiny.pt": "configs/sam2/sam2_hiera_t.yaml",
    "sam2_hiera_small.pt": "configs/sam2/sam2_hiera_s.yaml",
    "sam2_hiera_base_plus.pt": "configs/sam2/sam2_hiera_b+.yaml",
    "sam2_hiera_large.pt": "configs/sam2/sam2_hiera_l.yaml",
    "sam2.1_hiera_tiny.pt": "configs/sam2.1/sam2.1_hiera_t.yaml",
    "sam2.1_hiera_small.pt": "configs/sam2.1/sam2.1_hiera_s.yaml",
    "sam2.1_hiera_base_plus.pt": "configs/sam2.1/sam2.1_hiera_b+.yaml",
    "sam2.1_hiera_large.pt": "configs/sam2.1/sam2.1_hiera_l.yaml",
}

#: The settings SAM2's own ``build_sam2_video_predictor`` applies on top of a config (its post-processing).
VIDEO_SETTINGS = {
    "_target_": "sam2.sam2_video_predictor.SAM2VideoPredictor",
    "sam_mask_decoder_extra_args": {
        "dynamic_multimask_via_stability": True,
        "dynamic_multimask_stability_delta": 0.05,
        "dynamic_multimask_stability_thresh": 0.98,
    },
    "binarize_mask_from_pts_for_mem_enc": True,
    "fill_hole_area": 8,
}

_INSTALL_HINT = 'install it with pip install -e ".[sam2]" (or pip install sam2)'


@dataclass(frozen=True)
class Point:
    """A click in pixels of the source frame; ``label`` 1 = on the object, 0 = background."""

    x: int
    y: int
    label: int = 1


def parse_point(text: str) -> Point:
    """``"X,Y"`` or ``"X,Y,LABEL"`` (LABEL 1 = object, 0 = background) -> :class:`Point`."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or (len(values) == 3 and values[2] not in (0, 1)):
        raise FastRemoverError(f"--point {text!r} is not X,Y or X,Y,LABEL (integers in pixels, LABEL 1 = object, "
                               f"0 = background)")
    return Point(*values)


@dataclass(frozen=True)
class Sam2Files:
    checkpoint: Path
    config: Path


def _import_sam2():
    try:
        import sam2  # noqa: F401  (registers SAM2's config module with Hydra)
        from hydra.utils import instantiate
        from omegaconf import OmegaConf
    except ImportError as e:
        raise FastRemoverError(f"--sam2 needs the sam2 package ({e.name or e} is missing); {_INSTALL_HINT}") from e
    return sam2, instantiate, OmegaConf


def find_checkpoint(directory: str | Path) -> Sam2Files:
    """The checkpoint and config files in ``directory`` (see the module docstring); ``FastRemoverError`` otherwise."""
    folder = Path(directory)
    if not folder.is_dir():
        raise FastRemoverError(f"--sam2 {folder}: no such folder; give the folder that holds the SAM2 checkpoint "
                               f"(.pt) and its config (.yaml)")
    checkpoints = sorted(folder.glob("*.pt"))
    if not checkpoints:
        raise FastRemoverError(f"--sam2 {folder}: no checkpoint (*.pt) in it; put a SAM2 checkpoint such as "
                               f"sam2.1_hiera_tiny.pt there (nothing is downloaded)")
    if len(checkpoints) > 1:
        names = ", ".join(p.name for p in checkpoints)
        raise FastRemoverError(f"--sam2 {folder}: several checkpoints ({names}); keep exactly one .pt in the folder")
    configs = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
    if len(configs) > 1:
        names = ", ".join(p.name for p in configs)
        raise FastRemoverError(f"--sam2 {folder}: several configs ({names}); keep exactly one .yaml in the folder")
    if configs:
        return Sam2Files(checkpoints[0], configs[0])
    name = checkpoints[0].name
    if name not in RELEASE_CONFIGS:
        raise FastRemoverError(f"--sam2 {folder}: no config (*.yaml) next to {name}, and it is not an official "
                               f"release name; copy the model's config .yaml (from sam2/configs/) into the folder")
    sam2, _, _ = _import_sam2()
    config = Path(sam2.__file__).parent / RELEASE_CONFIGS[name]
    if not config.is_file():
        raise FastRemoverError(f"the installed sam2 package has no {RELEASE_CONFIGS[name]}; copy the config .yaml "
                               f"for {name} into {folder}")
    return Sam2Files(checkpoints[0], config)


def load_video_predictor(directory: str | Path, device: str | None = None):
    """SAM2's ``SAM2VideoPredictor`` built from the config in ``directory`` with the checkpoint's weights, in eval
    mode on ``device`` (default: CUDA when available).  A config that is not a SAM2 model, an unreadable checkpoint
    or one whose tensors do not fit the config raise ``FastRemoverError`` naming the file."""
    import torch

    files = find_checkpoint(directory)
    _, instantiate, OmegaConf = _import_sam2()
    try:
        cfg = OmegaConf.load(files.config)
    except Exception as e:  # yaml / OmegaConf errors have many types
        raise FastRemoverError(f"cannot read the SAM2 config {files.config}: {e}") from e
    if "model" not in cfg or "_target_" not in cfg.model:
        raise FastRemoverError(f"{files.config} is not a SAM2 model config (it has no model._target_)")
    cfg.model = OmegaConf.merge(cfg.model, VIDEO_SETTINGS)
    try:
        OmegaConf.resolve(cfg)
        model = instantiate(cfg.model, _recursive_=True)
    except Exception as e:  # Hydra wraps constructor errors in its own types
        raise FastRemoverError(f"cannot build a SAM2 model from {files.config}: {e}") from e
    try:
        payload = torch.load(files.checkpoint, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip / torch errors
        raise FastRemoverError(f"cannot read the SAM2 checkpoint {files.checkpoint}: {e}") from e
    state = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(state, dict):
        raise FastRemoverError(f"{files.checkpoint} is not a SAM2 checkpoint (no 'model' state dict in it)")
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        first = str(e).strip().splitlines()[-1].strip()
        raise FastRemoverError(f"{files.checkpoint} does not fit {files.config.name}: {first}") from e
    if missing or unexpected:
        raise FastRemoverError(
            f"{files.checkpoint} does not fit {files.config.name}: {len(missing)} missing and {len(unexpected)} "
            f"unexpected tensors (first: {(missing or unexpected)[0]}); use the config of this checkpoint"
        )
    from fastremover.engine.build import resolve_device

    return model.to(resolve_device(device)).eval()


def build_mask_sam2(frames: np.ndarray, directory: str | Path, boxes: Sequence[Box] = (),
                    points: Sequence[Point] = (), frame: int = 0, *, device: str | None = None,
                    progress=None, predictor=None):
    """:func:`fastremover.masktools.build_mask`'s result computed by SAM2 (see the module docstring).

    ``frames``: ``uint8 [F, H, W, 3]``.  The frames go to SAM2's video loader as JPEG files (quality 95) in a
    temporary folder, which is what SAM2 reads.  ``predictor``: an already loaded one (skips ``directory``).
    """
    import torch

    from fastremover.masktools import MaskResult

    frames = np.asarray(frames)
    count, height, width = frames.shape[:3]
    if not boxes and not points:
        raise FastRemoverError("give at least one --box X,Y,W,H or --point X,Y on the object")
    if not -count <= frame < count:
        raise FastRemoverError(f"--frame {frame} is out of range: the clip has {count} frames (0..{count - 1})")
    frame %= count
    for i, box in enumerate(boxes):
        check_box(box, height, width, label=f"box {i + 1}" if len(boxes) > 1 else "the box")
    for p in points:
        if not (0 <= p.x < width and 0 <= p.y < height):
            raise FastRemoverError(f"--point {p.x},{p.y} is outside the {width}x{height} frame")
    if predictor is None:
        predictor = load_video_predictor(directory, device)
    objects = len(boxes) + (1 if points else 0)
    masks = np.zeros((objects, count, height, width), bool)
    seen = [0]

    def collect(frame_idx: int, obj_ids, logits) -> None:
        for obj_id, logit in zip(obj_ids, logits, strict=True):
            masks[int(obj_id) - 1, frame_idx] = (logit[0] > 0.0).cpu().numpy()
        seen[0] += 1
        if progress is not None:
            progress("mask", min(seen[0], count), count)

    with tempfile.TemporaryDirectory(prefix="fastremover-sam2-") as tmp, torch.inference_mode():
        for i, image in enumerate(frames):
            cv2.imwrite(str(Path(tmp) / f"{i:05d}.jpg"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR),
                        [cv2.IMWRITE_JPEG_QUALITY, 95])
        state = predictor.init_state(video_path=tmp, offload_video_to_cpu=True)
        for i, box in enumerate(boxes):
            predictor.add_new_points_or_box(state, frame_idx=frame, obj_id=i + 1,
                                            box=np.array([box.x, box.y, box.x + box.w, box.y + box.h], np.float32))
        if points:
            predictor.add_new_points_or_box(state, frame_idx=frame, obj_id=objects,
                                            points=np.array([[p.x, p.y] for p in points], np.float32),
                                            labels=np.array([p.label for p in points], np.int32))
        for frame_idx, obj_ids, logits in predictor.propagate_in_video(state, start_frame_idx=frame):
            collect(frame_idx, obj_ids, logits)
        if frame > 0:
            for frame_idx, obj_ids, logits in predictor.propagate_in_video(state, start_frame_idx=frame,
                                                                           reverse=True):
                collect(frame_idx, obj_ids, logits)
    per_object = masks.any(axis=(2, 3)).astype(np.float32)  # [N, F]: 1 where SAM2 sees the object
    confidence = per_object.min(axis=0)
    uncertain = [int(i) for i in np.flatnonzero(confidence < 0.5)]
    bounds = np.zeros((objects, count, 4))
    for n in range(objects):
        for t in range(count):
            ys, xs = np.nonzero(masks[n, t])
            if len(ys):
                bounds[n, t] = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
    return MaskResult(mask=masks.any(axis=0), confidence=confidence, uncertain_frames=uncertain, boxes=bounds,
                      object_confidence=per_object)
