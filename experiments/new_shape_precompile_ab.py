"""Does recording a new shape's Triton launches in a background thread (FASTREMOVER_PRECOMPILE=record-background)
make a warm process's first run of a new shape faster than recording it before the window (background, the default)?

One process per variant, in turn, each with empty caches of its own: random weights at the released config on the
GPU, the real clip (152 frames 854x480) twice (the process is then warm for its shapes), then `bench --cold`'s six
new-shape clips (fastremover/bench/cold.new_shape_ratio: each clip's first run over its warm run). Prints one line
per variant and clip.

    python experiments/new_shape_precompile_ab.py [--variants background,record-background] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _provenance import save_experiment

ROOT = Path(__file__).resolve().parents[1]


def child(out: str, preset: str, clip: str | None) -> None:
    from fastremover import EngineConfig, RemovalPipeline, RunOptions, media
    from fastremover.bench.cold import COLD_CLIPS, new_shape_ratio, shape_clips

    pipe = RemovalPipeline.from_model("random", preset=preset, config=EngineConfig(mode="fast"))
    frames, height, width, fraction, travel = COLD_CLIPS["real"]
    if clip:  # a smaller clip (a CPU smoke run)
        frames, height, width = (int(v) for v in clip.split("x"))
    video, mask = media.synthetic_clip(frames, height, width, seed=0, object_fraction=fraction, travel=travel)
    main_s = []
    for _ in range(2):
        t = time.perf_counter()
        pipe.remove(video.frames, mask, RunOptions())
        main_s.append(round(time.perf_counter() - t, 4))
    record = new_shape_ratio(pipe, shape_clips(min(frames, 41), height, width), RunOptions(), warm_runs=2)
    Path(out).write_text(json.dumps({"main_clip_s": main_s, **record}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="background,record-background")
    ap.add_argument("--out")
    ap.add_argument("--preset", default="minimax-remover")
    ap.add_argument("--clip", help="FRAMESxHEIGHTxWIDTH instead of the real clip (a CPU smoke run: --preset tiny)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.preset, a.clip)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastremover-ab-") as work:
        for variant in a.variants.split(","):
            folder = Path(work) / variant
            env = {**os.environ, "FASTREMOVER_PRECOMPILE": variant, "TRITON_CACHE_DIR": str(folder / "triton"),
                   "FASTREMOVER_CACHE_DIR": str(folder / "cache"), "CUDA_CACHE_PATH": str(folder / "cuda"),
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            result = folder / "result.json"
            folder.mkdir(parents=True)
            argv = [sys.executable, __file__, "--child", str(result), "--preset", a.preset] + (
                ["--clip", a.clip] if a.clip else [])
            proc = subprocess.run(argv, env=env, text=True, capture_output=True)
            if proc.returncode:
                print(proc.stderr[-3000:])
                return 1
            record = json.loads(result.read_text())
            rows.append({"variant": variant, **record})
            print(f"{variant}: main clip {record['main_clip_s']}  new_shape_ratio {record['new_shape_ratio']}")
            for c in record["clips"]:
                print(f"  {c['run_shapes']} first {c['first_s']} warm {c['warm_s']} ratio {c['ratio']} "
                      f"{ {k: round(v, 3) for k, v in c['first_phases_s'].items()} }")
    save_experiment(a.out, rows, command=" ".join(["python"] + sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
