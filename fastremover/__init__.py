"""fastremover: fast, verifiable video object removal (MiniMax-Remover) on NVIDIA GPUs, and a weightless remover.

The public API (each name is imported on first use, so ``import fastremover`` stays light)::

    from fastremover import EngineConfig, RemovalPipeline, RunOptions, read_video, read_mask, match_mask_to_video
    from fastremover import write_video

    video = read_video("in.mp4")
    mask = match_mask_to_video(read_mask("mask.mp4"), video)
    pipe = RemovalPipeline.from_model("classic")          # or a checkpoint folder, or "random" with preset=
    # pipe = RemovalPipeline.from_model("/path/to/minimax-remover", config=EngineConfig(mode="exact"))
    result = pipe.remove(video.frames, mask, RunOptions(steps=12, seed=42))
    write_video("out.mp4", result.frames, video.fps, audio_from=video.source)

For files end to end (every check of the inputs and the output first, an atomic write, all audio copied), use
``RemovalWorker(ModelSource("/path/to/minimax-remover"), EngineConfig()).run(Job(video, mask, output))``: the CLI,
the service and batch runs do. Notes (fallbacks, doubts about the inputs) go to the ``fastremover`` logger.
"""

from __future__ import annotations

import importlib

from fastremover.errors import FastRemoverError

__version__ = "0.1.0"

_LAZY = {
    "RemovalPipeline": "fastremover.pipeline",
    "RemovalResult": "fastremover.pipeline",
    "EngineConfig": "fastremover.config",
    "ModelSource": "fastremover.config",
    "ResolvedEngine": "fastremover.config",
    "RunOptions": "fastremover.options",
    "RemovalWorker": "fastremover.worker",
    "Job": "fastremover.worker",
    "JobResult": "fastremover.worker",
    "Video": "fastremover.media",
    "read_video": "fastremover.media",
    "read_mask": "fastremover.media",
    "match_mask_to_video": "fastremover.media",
    "write_video": "fastremover.media",
    "write_image": "fastremover.media",
    "synthetic_clip": "fastremover.media",
}

__all__ = ["FastRemoverError", "__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastremover' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
