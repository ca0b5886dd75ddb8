"""The workload options and inputs the profiling tools share (tools/profile_first_run.py, tools/profile_request.py):
a cold-bench clip (fastremover/bench/cold.py's COLD_CLIPS, or another size) written as files, and a checkpoint folder
(given, or random weights written once), in a temporary work folder."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    from fastremover.bench.cold import COLD_CLIPS

    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", choices=sorted(COLD_CLIPS), default="real")
    ap.add_argument("--mode", default="fast")
    ap.add_argument("--checkpoint", help="a checkpoint folder (default: random weights written to a temp folder)")
    ap.add_argument("--preset", default="minimax-remover", help="random weights' preset (tiny: a CPU smoke run)")
    ap.add_argument("--clip", help="FRAMESxHEIGHTxWIDTH instead of the workload's clip")


def workload_inputs(a: argparse.Namespace) -> tuple[Path, Path, tuple, Path, Path, Path]:
    """(out folder, work folder, clip spec (frames, height, width, object fraction, travel), video, mask, checkpoint)
    for the parsed options `a`."""
    from fastremover.bench.cold import COLD_CLIPS, write_checkpoint, write_clip

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fastremover-profile-"))
    ckpt = Path(a.checkpoint) if a.checkpoint else write_checkpoint(work / "ckpt", a.preset, 0)
    spec = COLD_CLIPS[a.workload]
    if a.clip:
        spec = (*map(int, a.clip.split("x")), *spec[3:])
    video, mask = write_clip(work / "clip", *spec)
    return out, work, spec, video, mask, ckpt
