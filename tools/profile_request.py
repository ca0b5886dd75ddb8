"""Where the requests of one process go, host and GPU: the real clip (or W2) through a `RemovalWorker`, each request
under torch.profiler. The first request after the load is what a fresh `fastremover remove` with warm caches pays
(the caches are filled first by one fresh-process run, as a user's first run would); the later ones are the warm
engine. Per request: wall seconds, the GPU's busy seconds (the union of its kernels and copies), its idle gaps, the
host's top operations by own time and the CUDA driver / runtime calls (module loads, allocations, syncs).

    python tools/profile_request.py --out DIR [--workload real|w2] [--mode fast] [--checkpoint DIR] [--requests 3]
                                    [--no-prime]

Writes DIR/profile-request.json and prints a short table. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def busy_and_gaps(intervals: list[tuple[float, float]], gap_us: float = 1000.0) -> dict:
    """Union length of [start, end) intervals (microseconds) and the idle gaps longer than `gap_us` between them."""
    busy, gaps, gap_total = 0.0, 0, 0.0
    end = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None and s - end > gap_us:
                gaps += 1
                gap_total += s - end
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    return {"busy_s": round(busy / 1e6, 4), "span_s": round(span / 1e6, 4), "gaps_over_1ms": gaps,
            "gap_s": round(gap_total / 1e6, 4)}


def summarize(prof, wall_s: float, top: int = 25) -> dict:
    from torch.autograd import DeviceType

    device = [(ev.time_range.start, ev.time_range.end) for ev in prof.events()
              if ev.device_type == DeviceType.CUDA and ev.time_range.end > ev.time_range.start]
    rows = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)
    host = [{"name": r.key[:90], "count": r.count, "self_ms": round(r.self_cpu_time_total / 1e3, 2)} for r in rows[:top]]
    driver = [{"name": r.key, "count": r.count, "self_ms": round(r.self_cpu_time_total / 1e3, 2)} for r in rows
              if r.key.startswith(("cuda", "cu")) and r.self_cpu_time_total > 0]
    return {"wall_s": round(wall_s, 4), "gpu": busy_and_gaps(device), "gpu_events": len(device), "host_top": host,
            "driver": driver[:top]}


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fastremover.bench.cold import engine_process
    from tools._workload import add_workload_args, workload_inputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--no-prime", action="store_true", help="no fresh-process run first (the caches stay empty)")
    a = ap.parse_args(argv)
    out, work, spec, video, mask, ckpt = workload_inputs(a)
    cache = work / "cache"
    variables = {"FASTREMOVER_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    record: dict = {"command": "python tools/profile_request.py " + " ".join(argv or sys.argv[1:]),
                    "clip": list(spec[:3]), "mode": a.mode}
    if not a.no_prime:  # `fastremover remove` in a fresh process with this cache folder (a failure raises)
        record["prime_run_s"] = engine_process(video, mask, work / "prime.mp4", ckpt, a.mode, cache, [],
                                               "the priming run")["wall_s"]
    os.environ.update(variables)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from fastremover.bench.harness import environment
    from fastremover.config import EngineConfig, ModelSource
    from fastremover.options import RunOptions
    from fastremover.worker import Job, RemovalWorker

    record.update(environment())
    config = EngineConfig.from_env().with_(mode=a.mode)
    worker = RemovalWorker(ModelSource(str(ckpt)), config)
    t = time.perf_counter()
    worker.pipeline  # noqa: B018 (the load, outside the profiles)
    record["load_s"] = round(time.perf_counter() - t, 3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    requests = []
    for i in range(a.requests):
        job = Job(video=str(video), mask=str(mask), output=str(work / f"out{i}.mp4"), options=RunOptions(seed=42))
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            result = worker.run(job)
            wall = time.perf_counter() - t
        row = summarize(prof, wall)
        row["stages_s"] = {k: round(v, 3) for k, v in result.stages.items()}
        row["sha256"] = result.sha256
        requests.append(row)
        print(f"request {i + 1}: wall {wall:.2f} s, GPU busy {row['gpu']['busy_s']} s of span {row['gpu']['span_s']} s"
              f" ({row['gpu']['gaps_over_1ms']} gaps > 1 ms, {row['gpu']['gap_s']} s)", flush=True)
    worker.close()
    record["requests"] = requests
    (out / "profile-request.json").write_text(json.dumps(record, indent=1))
    first, last = requests[0], requests[-1]
    before = {r["name"]: r for r in first["host_top"] + first["driver"]}
    after = {r["name"]: r for r in last["host_top"] + last["driver"]}
    print(f"{'host op / driver call (own time)':60s} {'first ms':>9s} {'n':>6s} {'warm ms':>9s} {'n':>6s}")
    for name in sorted(before.keys() | after.keys(),
                       key=lambda n: -(before.get(n, {}).get("self_ms", 0) - after.get(n, {}).get("self_ms", 0))):
        f, w = before.get(name, {}), after.get(name, {})
        print(f"{name[:60]:60s} {f.get('self_ms', 0):9.1f} {f.get('count', 0):6d} {w.get('self_ms', 0):9.1f} "
              f"{w.get('count', 0):6d}")
    print(f"stages first {first['stages_s']}\nstages warm  {last['stages_s']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
