"""`fastremover batch`: the subcommand's flags (the remove flags come from the CLI's own helper) and its GPU slots; the
command itself is fastremover.cli.cmd_batch, `python -m fastremover.batch` its stand-alone entry.

Exit codes: 0 when every clip succeeded (or was done already), 1 when some clip failed (the report says which and
why), 2 for a problem with the batch itself (bad flags, missing folders, a model that cannot load).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from fastremover.errors import FastRemoverError

EXIT_CLIPS_FAILED = 1


def add_batch_parser(subparsers, add_model_args: Callable[[argparse.ArgumentParser, str | None], None]):
    """Add the ``batch`` subcommand to ``subparsers``; ``add_model_args`` adds the model and run flags that
    ``remove`` takes (``fastremover.cli._add_model_args``), so both accept exactly the same ones."""
    p = subparsers.add_parser(
        "batch", help="remove objects from a folder (or manifest) of clips, on every GPU of a host or a Ray cluster",
        description="Run `remove` on every clip of INPUTS: a folder (masks matched by name in --masks) or a manifest "
        "(.csv / .jsonl: video, mask, output and per-clip options). Outputs mirror the input names in OUT_DIR; "
        "clips already done with the same inputs and options are skipped; OUT_DIR/report.jsonl has one line per clip. "
        "OUT_DIR is new, empty, or a folder earlier batches wrote (nothing else in it is ever overwritten).",
    )
    p.add_argument("inputs", metavar="INPUTS", help="folder of clips (videos, or folders of numbered frames), or a "
                   "manifest .csv/.jsonl with columns video[,mask,output,steps,seed,dilate,size,window,overlap,crop,"
                   "schedule,composite,mask_threshold]")
    p.add_argument("--masks", default=None, help="folder of masks, matched by name: clip.mp4 takes clip.* or "
                   "clip_mask.* (video, image or frame folder); a manifest may list masks instead")
    p.add_argument("-o", "--output-dir", dest="output_dir", required=True, metavar="OUT_DIR",
                   help="folder for the outputs (same names as the inputs), the report and the resume records")
    p.add_argument("--gpus", default=None, help="all | N (the first N) | a list like 0,2 (default: all GPUs when "
                   "there are any): one worker process per GPU")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: one per GPU, or 1 on a "
                   "CPU machine); with --ray, the number of Ray actors (default: one per GPU of the cluster)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the workers as Ray actors: alone, on a new local Ray cluster; with ADDRESS (host:port, "
                   "auto), on that running cluster (inputs and outputs must be on a filesystem every node shares); "
                   "give it after INPUTS, or as --ray=ADDRESS")
    p.add_argument("--force", action="store_true", help="run every clip again, even those already done")
    add_model_args(p, None)
    return p


def _visible_gpu_count() -> int:
    """CUDA GPUs this process sees; on Linux without the NVIDIA driver, 0 without importing torch (seconds)."""
    import os

    if sys.platform.startswith("linux") and not os.path.exists("/proc/driver/nvidia"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_gpus(text: str, count: int) -> list[int]:
    """``--gpus``: "all", a count N (the first N) or a list "1,3" -> indices among the ``count`` visible GPUs."""
    if count == 0:
        raise FastRemoverError(f"--gpus {text}: no CUDA GPU is visible here; on a CPU machine use --workers N")
    value = text.strip().lower()
    if value == "all":
        return list(range(count))
    try:
        numbers = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise FastRemoverError(f"--gpus {text!r}: use all, a count N, or a list of GPU indices like 0,2") from None
    if "," not in value:
        if len(numbers) != 1 or not 1 <= numbers[0] <= count:
            raise FastRemoverError(f"--gpus {text}: this machine shows {count} GPUs; give 1..{count} or all")
        return list(range(numbers[0]))
    if not numbers or len(set(numbers)) != len(numbers) or not all(0 <= i < count for i in numbers):
        raise FastRemoverError(f"--gpus {text}: this machine shows GPUs 0..{count - 1}; list each once")
    return numbers


def pick_slots(gpus: str | None, workers: int | None, device: str | None,
               gpu_count: Callable[[], int] = _visible_gpu_count) -> list[int | None]:
    """The local workers: per process, the index of its GPU (among those this process sees) or None for the CPU.

    ``--gpus`` picks GPUs (all / a count / a list); ``--workers`` sets the process count (spread round-robin over
    the GPUs). Without ``--gpus``, all GPUs are used when there are any and ``--device`` does not say otherwise."""
    if workers is not None and workers < 1:
        raise FastRemoverError(f"--workers {workers}: must be at least 1")
    name = (device or "").strip().lower()
    pinned = name == "cpu" or name.startswith("cuda:")  # every worker on that one device
    if gpus is not None:
        if pinned:
            raise FastRemoverError(f"--gpus places one worker per GPU; it cannot be combined with --device {device}")
        picked = parse_gpus(gpus, gpu_count())
    else:
        count = 0 if pinned else gpu_count()
        if count == 0:
            if name == "cuda":
                raise FastRemoverError("--device cuda: no CUDA GPU is visible; drop --device, or use --device cpu")
            return [None] * (workers or 1)
        picked = list(range(count))
    return [picked[i % len(picked)] for i in range(workers or len(picked))]
