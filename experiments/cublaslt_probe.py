"""Which cuBLASLt setups of ops/linear/cublaslt.py's FP8 GEMM the library accepts, what they run, and whether the output
equals torch._scaled_mm's (GPU; one JSON). Used to debug the setup (the first try failed the heuristic query with
status 7, CUBLAS_STATUS_INVALID_VALUE, when the scale pointers were left unset until the matmul call).

    python experiments/cublaslt_probe.py --out FILE
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from _provenance import save_experiment
from fastremover.ops.linear import cublaslt

FP8 = torch.float8_e4m3fn


def kernels(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:70] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 7290, 1536, 4608
    a = (torch.randn(m, k, device="cuda", generator=g) * 64).to(FP8)
    w = (torch.randn(n, k, device="cuda", generator=g) * 64).to(FP8)
    sa = torch.rand(m, 1, device="cuda", generator=g) * 1e-2 + 1e-4
    sw = torch.rand(1, n, device="cuda", generator=g) * 1e-2 + 1e-4
    bias = torch.randn(n, device="cuda", generator=g).half()
    print("unavailable_reason:", cublaslt.unavailable_reason("cuda", 0))
    lib = cublaslt._library()
    handle = lib.handle(0)
    aligns = (cublaslt._alignment(w.data_ptr()), cublaslt._alignment(a.data_ptr()), 256)
    rows = []
    setups = {
        "default": {},
        "null-pointers-at-heuristic": {"null": True},
        "no-align-prefs": {"align_prefs": False},
        "workspace-1MiB": {"max_workspace": 1 << 20},
        "no-bias": {"bias": False},
        "no-fast-accum": {"fast_accum": False},
    }
    for label, opt in setups.items():
        use_bias = opt.get("bias", True)
        fast_accum = opt.get("fast_accum", True)
        b = bias if use_bias else None
        pointers = ((0, 0, None) if opt.get("null")
                    else (sw.data_ptr(), sa.data_ptr(), b.data_ptr() if b is not None else None))
        row = {"setup": label}
        try:
            plan = cublaslt._Plan(lib, handle, m, n, k, cublaslt.CUDA_R_16F, use_bias, fast_accum, aligns, pointers,
                                  max_workspace=opt.get("max_workspace", 0), align_prefs=opt.get("align_prefs", True))
            row["workspace_size"] = plan.workspace_size
            ws_bytes = opt.get("max_workspace", 0)
            ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda") if ws_bytes else None
            y = torch.empty(m, n, dtype=torch.float16, device="cuda")
            stream = torch.cuda.current_stream().cuda_stream
            run = lambda: plan.run(handle, a, w, sa, sw, b, y, stream, ws)  # noqa: E731
            row["kernels"] = kernels(run)
            want = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, bias=b, out_dtype=torch.float16,
                                    use_fast_accum=fast_accum)
            row["equal_to_torch"] = bool(torch.equal(y, want))
            row["max_abs_diff"] = float((y.float() - want.float()).abs().max())
            row["torch_kernels"] = kernels(lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, bias=b,
                                                                    out_dtype=torch.float16, use_fast_accum=fast_accum))
        except Exception as e:  # the probe records every failure instead of stopping at the first
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row))
        rows.append(row)
    save_experiment(args.out, rows, cublaslt_version=lib.version, shape=[m, k, n])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
