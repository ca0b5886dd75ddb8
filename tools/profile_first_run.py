"""Where a fresh `fastremover remove` process spends its time (CUDA): the first-ever run with empty caches (`-v`:
one log line per Triton compile), then the second run (caches warm) under cProfile, and `import torch`'s import time.

    python tools/profile_first_run.py --out DIR [--workload real|w2] [--mode fast] [--checkpoint DIR]

Writes DIR/first.log, DIR/first.timings.json, DIR/second.timings.json, DIR/second.prof (pstats), DIR/profile.txt
(the second run's top functions by cumulative and by own time) and DIR/importtime.txt. Times nothing against a bar:
this is for finding where the run goes (fastremover bench --cold measures it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fastremover.bench.cold import _pythonpath_env
    from tools._workload import add_workload_args, workload_inputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--runs", type=int, default=1, help="second runs under cProfile (the last one is kept)")
    a = ap.parse_args(argv)
    out, work, _, video, mask, ckpt = workload_inputs(a)
    cache = work / "cache"
    env = _pythonpath_env({"FASTREMOVER_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")})
    base = [sys.executable]
    cmd = ["-m", "fastremover", "remove", str(video), "--mask", str(mask), "--model", str(ckpt), "--mode", a.mode]
    rows = []

    def run(label, prefix, extra, log=None):
        t = time.perf_counter()
        proc = subprocess.run(base + prefix + cmd + ["-o", str(work / f"{label}.mp4"), "--timings-json",
                                                     str(out / f"{label}.timings.json"), *extra],
                              env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if log:
            Path(log).write_text(proc.stderr)
        if proc.returncode:
            print(proc.stderr[-3000:])
            raise SystemExit(f"{label} failed")
        rec = json.loads((out / f"{label}.timings.json").read_text())
        rows.append((label, wall, rec.get("seconds"), rec.get("phases_s", {}), rec.get("windows_s"),
                     rec.get("stages_s")))
        return rec

    run("first", [], ["-v"], log=out / "first.log")
    for i in range(a.runs):
        run("second", ["-m", "cProfile", "-o", str(out / "second.prof")], ["--quiet"])
    run("third", [], ["--quiet"])
    buf = io.StringIO()
    st = pstats.Stats(str(out / "second.prof"), stream=buf)
    st.sort_stats("cumulative").print_stats(70)
    st.sort_stats("tottime").print_stats(40)
    (out / "profile.txt").write_text(buf.getvalue())
    if a.preset == "tiny":  # a CPU smoke run: no CUDA below
        print(buf.getvalue()[:1500])
        return 0
    imp = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True, text=True,
                         env=env)
    lines = [ln for ln in imp.stderr.splitlines() if ln.startswith("import time:")]
    top = sorted(lines[1:], key=lambda ln: -int(ln.split("|")[1]))[:40]
    (out / "importtime.txt").write_text("\n".join(top) + "\n")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"],
                   env=env)
    print(f"python -c 'import torch; CUDA init': {time.perf_counter() - t:.2f} s")
    print("top import (cumulative us):", top[0] if top else "?")
    for label, wall, req, phases, windows, stages in rows:
        print(f"{label:7s} wall {wall:6.2f} s  request {req}  windows {windows}")
        print(f"        phases {json.dumps({k: round(v, 2) for k, v in phases.items()})}")
        print(f"        stages {json.dumps({k: round(v, 2) for k, v in (stages or {}).items()})}")
    print(buf.getvalue()[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
