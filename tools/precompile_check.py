"""Which of a fast run's Triton compiles the precompile did ahead, and why the others were not (issue 45), on a GPU.

Runs one fast-mode removal in this process (fresh Triton and fastremover cache dirs) with the precompile on and
Triton's `_do_compile` observed: every compile is kept with its kernel, key and whether it was submitted ahead (the
precompile's thread) or lazily at a launch, and each compile's own duration (the slowest bound a window's precompile). Prints the precompile's own debug notes (what it recorded, submitted, what
failed and why) and, for each kernel compiled lazily, its lazy keys beside the keys the precompile submitted for the
same kernel (a mismatch shows which argument's specialization differs). JSON to --json.

    python tools/precompile_check.py --preset tiny --json out.json
    python tools/precompile_check.py --preset minimax-remover --frames 81 --height 480 --width 832
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections import defaultdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--height", type=int, default=240)
    ap.add_argument("--width", type=int, default=432)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="precompile-check-")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tmp, "triton"))
    os.environ.setdefault("FASTREMOVER_CACHE_DIR", os.path.join(tmp, "cache"))
    os.environ["FASTREMOVER_PRECOMPILE"] = "1"

    notes: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("precompile"):
                notes.append(msg)

    log = logging.getLogger("fastremover")
    log.setLevel(logging.DEBUG)
    log.addHandler(Keep())

    from triton.runtime.jit import JITFunction

    from fastremover import EngineConfig, RemovalPipeline, RunOptions, media, timing

    compiles: list[dict] = []
    original = JITFunction._do_compile

    def observed(self, key, *a, **k):
        compiles.append({"kernel": getattr(self, "__name__", "?"), "key": str(key),
                         "ahead": bool(getattr(timing._precompiling, "on", False))})
        return original(self, key, *a, **k)

    JITFunction._do_compile = observed  # below fastremover's own wrapper (which it calls), so both see each compile

    import threading

    import triton.compiler

    durations: list[dict] = []  # every compile's own time (on a pool thread when ahead): the critical path
    real_compile = triton.compiler.compile

    def timed(src, *a, **k):
        t = time.perf_counter()
        try:
            return real_compile(src, *a, **k)
        finally:
            durations.append({"kernel": getattr(getattr(src, "fn", None), "__name__", "?"),
                              "s": round(time.perf_counter() - t, 4), "thread": threading.current_thread().name})

    triton.compiler.compile = timed  # (a JITFunction imports it when it first runs)
    pipe = RemovalPipeline.from_model("random", preset=args.preset, config=EngineConfig(mode="fast"))
    video, mask = media.synthetic_clip(args.frames, args.height, args.width, seed=0, object_fraction=0.1)
    pipe.remove(video.frames, mask, RunOptions(steps=args.steps, crop="off"))

    ahead = defaultdict(set)
    for c in compiles:
        if c["ahead"]:
            ahead[c["kernel"]].add(c["key"])
    lazy = [c for c in compiles if not c["ahead"] and c["key"] not in ahead[c["kernel"]]]
    print("\n".join(notes[:60]))
    print(f"compiles: {len(compiles)}; ahead {sum(c['ahead'] for c in compiles)}; lazy {len(lazy)}")
    slowest = sorted(durations, key=lambda d: -d["s"])[:8]
    print("slowest compiles: " + ", ".join(f"{d['kernel']} {d['s']:.2f}s" for d in slowest))
    for c in lazy:
        print(f"LAZY {c['kernel']} {c['key'][:600]}")
        for k in sorted(ahead.get(c["kernel"], ()))[:4]:
            print(f"   AHEAD {k[:600]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "shape": [args.frames, args.height, args.width], "notes": notes,
                       "compiles": compiles, "compile_durations": durations}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
