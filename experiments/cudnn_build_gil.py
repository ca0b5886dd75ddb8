"""Does building a cuDNN FP8 attention graph (cuDNN-frontend's Python bindings) let other Python threads run?

If it releases the GIL, the engine could build the graphs of the windows ahead in a background thread while the
current window runs (issue 45: 0.03-0.35 s a new shape). Builds graphs of new sequence lengths on a background
thread while the main thread counts loop iterations, and compares the main thread's rate with the rate alone.

    python experiments/cudnn_build_gil.py [--out JSON]
"""

from __future__ import annotations

import argparse
import threading
import time

from _provenance import save_experiment


def spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch

    from fastremover.ops.attention import cudnn_fp8

    dev = torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    one = torch.ones(1, device=dev)

    def build(s):
        x = torch.randn(1, s, 12, 128, device=dev).to(fp8)
        out = torch.empty(x.shape, dtype=fp8, device=dev)
        t = time.perf_counter()
        cudnn_fp8._Fp8Graph(x, x, x, cudnn_fp8._bhsd(out), fp8, 128 ** -0.5, dev)
        return time.perf_counter() - t

    build(4096)  # the library's own first-use costs
    alone = spin(0.5) / 0.5
    rows = []
    for s in (5120, 6144, 7168):
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("s", build(s)))
        t0 = time.perf_counter()
        th.start()
        n = 0
        while th.is_alive():
            n += 1
        wall = time.perf_counter() - t0
        th.join()
        inline = build(s + 64)  # the same kind of build on the main thread
        rows.append({"seq": s, "build_s_in_thread": round(box["s"], 4), "build_s_inline": round(inline, 4),
                     "main_loop_rate_during_build": round(n / wall), "main_loop_rate_alone": round(alone),
                     "share_of_main_thread_left": round(n / wall / alone, 3)})
        print(rows[-1])
    save_experiment(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
