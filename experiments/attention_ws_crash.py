"""Which warp-specialized configs of the Triton FP8 attention crash, at which shapes? (GPU experiment.)

On the H200 (Triton 3.6, 2026-11-30) the first warp-specialized config (m128n128w4s2t1ws1a1) hit an illegal memory
access at S = 130 (one full 128-key block + a 2-key tail, fp32 output), while at S = 32760 / 7290 the same configs
had run and validated. An illegal access poisons the CUDA context, so every case runs in its own process. For each
(config, S, out dtype, H) the child runs attention_fp8_qkv with that config pinned and compares with fp16 SDPA;
the parent prints one line per case (ok + cosine + ms, or the error) and --out writes JSON. Cases cover: S a
multiple of the key block and not, one or several full blocks, S < BLOCK_M, fp16 / fp32 output, and the W1/W2 S.
Hypothesis to test: the warp-specialized, software-pipelined key loop breaks when it runs fewer trips than its
num_stages (S = 130: one full block with 2-3 stages), which the W1/W2 runs (56 / 255 trips) never hit; if so, the
engine can use those configs whenever S >= num_stages * BLOCK_N (they were 1.3x faster at W2).

    python experiments/attention_ws_crash.py [--out FILE] [--configs NAME,NAME]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)  # experiments/: the kernel module (attention_fp8.py) lives here

CHILD = r'''
import json, sys, torch
import torch.nn.functional as F
sys.path.insert(0, sys.argv[5])
import attention_fp8 as A
cfg, s, dt, h = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
g = torch.Generator(device="cuda").manual_seed(s)
q, k, v = (torch.randn(1, s, h, 128, device="cuda", generator=g, dtype=torch.float16) for _ in range(3))
out_dtype = {"fp16": torch.float16, "fp32": torch.float32}[dt]
o = A.attention_fp8_qkv(q, k, v, out_dtype=out_dtype, config=cfg)
torch.cuda.synchronize()
ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
cos = float(F.cosine_similarity(o.double().flatten(), ref.double().flatten(), dim=0))
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
for _ in range(5):
    A.attention_fp8_qkv(q, k, v, out_dtype=out_dtype, config=cfg)
e1.record()
torch.cuda.synchronize()
print(json.dumps({"cos": cos, "ms": e0.elapsed_time(e1) / 5}))
'''


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--configs", default=None, help="comma-separated config names (default: the WS configs + the "
                                                   "engine's pinned one as a control)")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--jobs", type=int, default=4, help="cases with S < 7290 run this many processes at once (their "
                                                     "times are then only indicative); the long ones run alone")
    args = p.parse_args()
    sys.path.insert(0, HERE)
    import attention_fp8 as A

    names = (args.configs.split(",") if args.configs else
             [A.AUTOTUNE_CONFIGS[0].name] + [c.name for c in A.WARP_SPEC_CONFIGS])
    cases = [(130, "fp32", 2), (130, "fp16", 2), (256, "fp16", 2), (258, "fp16", 2), (386, "fp16", 2),
             (100, "fp16", 2), (1000, "fp16", 12), (7290, "fp16", 12), (32760, "fp16", 12)]
    def run_case(name, s, dt, h):
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, name, str(s), dt, str(h), HERE], capture_output=True,
                               text=True, timeout=args.timeout)
            if r.returncode == 0:
                return {"config": name, "S": s, "out": dt, "H": h, **json.loads(r.stdout.strip().splitlines()[-1])}
            err = [ln for ln in r.stderr.splitlines() if "Error" in ln or "error" in ln]
            return {"config": name, "S": s, "out": dt, "H": h, "error": (err[-1] if err else r.stderr[-300:])[:300]}
        except subprocess.TimeoutExpired:
            return {"config": name, "S": s, "out": dt, "H": h, "error": f"timeout {args.timeout} s"}

    def show(row):
        status = (f"ok cos {row['cos']:.5f} {row['ms']:.3f} ms" if "error" not in row else "ERROR " + row["error"])
        print(f"{row['config']:<24} S={row['S']:<6} out={row['out']} H={row['H']:<3} {status}", flush=True)
        if args.out:  # after every case: an outer timeout keeps what has run
            with open(args.out, "w") as f:
                json.dump({"rows": rows}, f, indent=1)

    all_cases = [(name, *case) for name in names for case in cases]
    short = [c for c in all_cases if c[1] < 7290]
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(lambda c: run_case(*c), short):
            row["concurrent"] = args.jobs > 1
            rows.append(row)
            show(row)
    for c in all_cases:
        if c[1] >= 7290:
            rows.append(run_case(*c))
            show(rows[-1])


if __name__ == "__main__":
    main()
