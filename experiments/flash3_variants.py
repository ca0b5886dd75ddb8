"""FlashAttention-3 FP8 builds side by side: the kernel alone and our full fp8-flash3 path, time and cosine vs fp16
SDPA, at the DiT's shapes (q, k ~ N(0, 1), K with a shared per-channel offset of 1, as tools/bench_attention.py).

Each build registers the same torch ops, so one process holds one build: run once per build with its output folder
first on PYTHONPATH and a label, and compare the JSON rows (same seeds, same inputs).

    PYTHONPATH=.fa3:$PYTHONPATH python experiments/flash3_variants.py --label stock --out a.json
    PYTHONPATH=.fa3-emu4:$PYTHONPATH python experiments/flash3_variants.py --label emu4 --out b.json
"""

from __future__ import annotations

import argparse
import json

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_attention import _cos, _kernel_only_rows, _time_ms, sdpa  # noqa: E402

from fastremover.ops.attention.flashattn3_fp8 import flash3_fp8, import_error  # noqa: E402
from fastremover.ops import attention as registry  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--seq", type=int, nargs="+", default=[32760, 7290])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if import_error():
        raise SystemExit(f"flash_attn_interface does not import: {import_error()}")
    import flash_attn_interface

    heads, d, rows = 12, 128, []
    dev = torch.device("cuda")
    for s in a.seq:
        g = torch.Generator(device=dev).manual_seed(s)
        qkv = torch.randn(1, s, 3, heads, d, device=dev, generator=g, dtype=torch.float16)
        qkv[:, :, 1] += torch.randn(heads, d, device=dev, generator=g).half()
        q, k, v = qkv.unbind(2)
        flop = 4.0 * s * s * heads * d
        ref = sdpa(q, k, v)
        base = _time_ms(lambda: sdpa(q, k, v))
        out = flash3_fp8(q, k, v)
        ms = _time_ms(lambda: flash3_fp8(q, k, v))
        rows.append({"seq": s, "backend": "fp8-flash3 (quant + kernel + mean)", "ms": ms, "tflops": flop / ms / 1e9,
                     "cos": _cos(out, ref), "speedup": base / ms})
        rows += _kernel_only_rows(registry.get("flashattn3-fp8"), s, q, k, v, ref, flop, base, contiguous=False)
        rows.insert(len(rows) - 2, {"seq": s, "backend": "sdpa-fp16", "ms": base})
    for r in rows:
        r["build"] = a.label
        print(f"{a.label:12s} S={r['seq']:6d} {r['backend']:38s} {r.get('ms', float('nan')):8.3f} ms "
              f"{r.get('tflops', 0):6.0f} TF/s cos {r.get('cos', float('nan')):.6f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "build": a.label,
                       "module": flash_attn_interface.__file__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
