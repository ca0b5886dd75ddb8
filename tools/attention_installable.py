"""Which fast attention can a user install? Candidates side by side on one GPU: python tools/attention_installable.py
[--seq 7290 32760] [--out F.json]

For issue 31's "installable fast attention": each candidate below runs on the same q/k/v (B=1, H=12, D=128, the DiT's
S = 7290 and 32760; q, k ~ N(0, 1) with a shared per-channel offset on K, v ~ N(0, 1), fp16, the strided views a fused
QKV projection produces) and is compared with an fp32 reference of the same values (cosine) and timed (CUDA events
around each call, after warm-up; the median of --iters calls). A candidate that cannot run here is listed with why.

Candidates (the project's backends go through the registry, `fastremover.ops.attention`, so they are measured the way
the engine calls them; FlashAttention-4 is called directly, it has no backend):
- `sdpa`: torch SDPA with its own kernel choice; `sdpa-flash`: torch SDPA forced to its FlashAttention-2 kernel;
- `cudnn-fp8`, `flashinfer-fa3`, `flashinfer-fa3-fp8`, `flashattn3-fp8` (FlashAttention-3 built from source): the
  registered backends' stand-alone `call(q, k, v)` (the FP8 ones include their quantization of q/k/v and the
  dequantization of o); for each FP8 backend also `<name> kernel`: its `codes_call` alone on codes made once beforehand
  (what the fast transformer runs: it quantizes in its own fused kernels);
- `fa4-fp16`, `fa4-bf16`: flash-attn-4's `flash_attn.cute.flash_attn_func` (CuTe DSL, JIT-compiled on first call: its
  first-call time is recorded separately); `fa4-fp8`: the same entry point on e4m3 codes with descale factors, where the
  installed version offers FP8 on this GPU (its refusal is recorded as the reason otherwise).

Installing what the candidates need is the caller's business (PYTHONPATH, pip --target); this script only imports.
TF32 is off for the reference (fp32 matmuls in full precision), restored afterwards. `--device cpu` runs the flow on
the CPU at tiny shapes (the GPU candidates then report why they cannot run; the timer falls back to perf_counter).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

DEFAULT_SEQ = (7290, 32760)


@dataclass
class Candidate:
    """One attention implementation: `unavailable(device) -> reason | None`, and `prepare(q, k, v) -> fn` which does
    the untimed set-up (dtype conversion, quantization for kernel-only rows) and returns (fn, to_fp32): `fn()` is the
    timed call, `to_fp32(out)` turns its output into the [B, S, H, D] fp32 attention output for the cosine."""

    name: str
    source: str  # "registry" | "torch" | "flash-attn-4"
    unavailable: Callable[[torch.device], str | None]
    prepare: Callable


def _registry():
    from fastremover.ops import attention as registry  # noqa: PLC0415 - registers the built-in backends

    return registry


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _as_float(out) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float()


# --- the project's backends (registry) ------------------------------------------------------------------------------

def _registry_call(name: str) -> Candidate:
    def unavailable(device):
        return _registry().unavailable_reason(name, device)

    def prepare(q, k, v):
        backend = _registry().get(name)
        return (lambda: backend.call(q, k, v)), _as_float

    return Candidate(name, "registry", unavailable, prepare)


def _registry_kernel(name: str) -> Candidate:
    """An FP8 backend's kernel alone on codes quantized once (K and V centred, as the fast transformer feeds them)."""
    def unavailable(device):
        return _registry().unavailable_reason(name, device)

    def prepare(q, k, v):
        from fastremover.ops.attention.quantize import quantize_qkv  # noqa: PLC0415

        backend = _registry().get(name)
        q8, k8, v8, sq, sk, sv, v_mean = quantize_qkv(q, k, v, smooth_k=True, smooth_v=True)
        b, _, h, d = q.shape

        def to_fp32(o):
            o = _as_float(o)
            if backend.output == "fp8-codes":  # codes of (o - c) / sv
                o = o * sv.float().view(())
            return o + v_mean.view(b, 1, h, d)  # (o - c) + c

        return (lambda: backend.codes_call(q8, k8, v8, sq, sk, sv, q.dtype)), to_fp32

    return Candidate(f"{name} kernel", "registry", unavailable, prepare)


# --- torch SDPA forced to its flash kernel --------------------------------------------------------------------------

def _sdpa_flash() -> Candidate:
    def unavailable(device):
        return None if device.type == "cuda" else "torch's FlashAttention kernel needs a CUDA GPU"

    def prepare(q, k, v):
        import torch.nn.attention as attn  # noqa: PLC0415
        import torch.nn.functional as F  # noqa: PLC0415

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def fn():
            with attn.sdpa_kernel(attn.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)

        return fn, _as_float

    return Candidate("sdpa-flash", "torch", unavailable, prepare)


# --- flash-attn-4 (CuTe DSL) ----------------------------------------------------------------------------------------

def fa4_import_error() -> str | None:
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401, PLC0415 - optional, pip install flash-attn-4
    except Exception as exc:  # ImportError, or a missing library of the CuTe DSL
        return f"flash_attn.cute does not import ({_first_line(exc)}); pip install --pre flash-attn-4"
    return None


def _fa4_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "flash-attn-4 needs a CUDA GPU"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "flash-attn-4 needs sm_80 or newer"
    return fa4_import_error()


def _fa4_half(dtype: torch.dtype) -> Candidate:
    def prepare(q, k, v):
        from flash_attn.cute import flash_attn_func  # noqa: PLC0415

        args = (q, k, v) if q.dtype == dtype else tuple(t.to(dtype) for t in (q, k, v))
        return (lambda: flash_attn_func(*args)), _as_float

    return Candidate(f"fa4-{'fp16' if dtype == torch.float16 else 'bf16'}", "flash-attn-4", _fa4_unavailable, prepare)


def _fa4_fp8() -> Candidate:
    """FA4's entry point on our e4m3 codes (K and V centred) with per-(batch, head) descale factors."""
    def prepare(q, k, v):
        from flash_attn.cute import flash_attn_func  # noqa: PLC0415

        from fastremover.ops.attention.quantize import quantize_qkv  # noqa: PLC0415

        q8, k8, v8, sq, sk, sv, v_mean = quantize_qkv(q, k, v, smooth_k=True, smooth_v=True)
        b, _, h, d = q.shape
        descale = [t.float().reshape(1, 1).expand(b, h).contiguous() for t in (sq, sk, sv)]

        def fn():
            return flash_attn_func(q8, k8, v8, q_descale=descale[0], k_descale=descale[1], v_descale=descale[2])

        return fn, lambda o: _as_float(o) + v_mean.view(b, 1, h, d)

    return Candidate("fa4-fp8", "flash-attn-4", _fa4_unavailable, prepare)


def candidates() -> list[Candidate]:
    out = [_registry_call("sdpa"), _sdpa_flash()]
    for name in ("cudnn-fp8", "flashinfer-fa3", "flashinfer-fa3-fp8", "flashattn3-fp8"):
        out.append(_registry_call(name))
        if _registry().get(name).takes_codes:
            out.append(_registry_kernel(name))
    return out + [_fa4_half(torch.float16), _fa4_half(torch.bfloat16), _fa4_fp8()]


# --- inputs, reference, timer ---------------------------------------------------------------------------------------

def make_qkv(seq: int, heads: int, head_dim: int, device: torch.device, k_bias: float = 1.0):
    """fp16 q, k, v [1, S, H, D]: strided views of one [1, S, 3, H, D] tensor (as the fused QKV projection gives
    them); K with a shared per-channel offset of size k_bias. Seeded by S."""
    g = torch.Generator(device=device).manual_seed(seq)
    qkv = torch.randn(1, seq, 3, heads, head_dim, device=device, generator=g, dtype=torch.float32)
    qkv[:, :, 1] += k_bias * torch.randn(heads, head_dim, device=device, generator=g)
    return qkv.half().unbind(2)


def reference_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v of the 16-bit inputs in fp32, [B, S, H, D]: one head at a time, queries in chunks
    of `chunk` rows (the score matrix is materialized per chunk), full-precision fp32 matmuls (TF32 off)."""
    b, s, h, d = q.shape
    out = torch.empty(b, s, h, d, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(d)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        for bi in range(b):
            for hi in range(h):
                kf, vf = k[bi, :, hi].float(), v[bi, :, hi].float()
                for i0 in range(0, s, chunk):
                    scores = (q[bi, i0:i0 + chunk, hi].float() @ kf.T) * scale
                    out[bi, i0:i0 + chunk, hi] = torch.softmax(scores, dim=-1) @ vf
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_float32_matmul_precision(saved[1])
    return out


def time_ms(fn: Callable, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-call times in ms of `iters` back-to-back calls after `warmup` untimed ones: CUDA events around each call
    on a GPU (one synchronize at the end), perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        torch.cuda.synchronize(device)
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    from fastremover.bench.metrics import cosine as _cos  # noqa: PLC0415

    return _cos(a, b)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the run --------------------------------------------------------------------------------------------------------

def run(seq_lens=DEFAULT_SEQ, heads: int = 12, head_dim: int = 128, device: torch.device | None = None,
        warmup: int = 3, iters: int = 20, only: list[str] | None = None,
        progress: Callable[[dict], None] | None = None) -> dict:
    """Every candidate at every S: a row each ({seq, candidate, ms (median), ms_min, ms_max, tflops, cos,
    first_call_s} or {seq, candidate, error}); `unavailable` maps each candidate that cannot run here to why.
    `progress(result so far)` is called after each row (a candidate that kills the process leaves the others')."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cands = [c for c in candidates() if not only or c.name in only]
    unavailable: dict[str, str] = {}
    for c in cands:
        try:
            why = c.unavailable(device)
        except Exception as exc:  # a validator that itself fails is a reason too
            why = f"availability check failed: {_first_line(exc)}"
        if why is not None:
            unavailable[c.name] = why
    rows = []
    result = {"shape": {"B": 1, "H": heads, "D": head_dim, "S": list(seq_lens)}, "device": _device_name(device),
              "versions": versions(), "warmup": warmup, "iters": iters, "rows": rows, "unavailable": unavailable}
    # candidates in the outer loop: one that leaves the GPU in an error state (the optional libraries, listed last)
    # spoils only the rows after it; the inputs and references are made once per S
    inputs = {s: make_qkv(s, heads, head_dim, device) for s in seq_lens}
    refs = {s: reference_fp32(*inputs[s]) for s in seq_lens}
    for c in cands:
        if c.name in unavailable:
            continue
        for s in seq_lens:
            (q, k, v), ref, flop = inputs[s], refs[s], 4.0 * s * s * heads * head_dim
            row = {"seq": s, "candidate": c.name, "source": c.source}
            try:
                fn, to_fp32 = c.prepare(q, k, v)
                _sync(device)
                t0 = time.perf_counter()
                out = fn()  # the first call (JIT compiles, cuDNN plan builds, module loads happen here)
                _sync(device)
                row["first_call_s"] = time.perf_counter() - t0
                row["cos"] = cosine(to_fp32(out), ref)
                del out
                times = time_ms(fn, device, warmup, iters)
                ms = statistics.median(times)
                row.update(ms=ms, ms_min=min(times), ms_max=max(times), iters=iters, tflops=flop / ms / 1e9)
            except Exception as exc:  # report it and go on with the others
                row["error"] = _first_line(exc)
            rows.append(row)
            if progress is not None:
                progress(result)
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})"
    return f"cpu ({platform.processor() or platform.machine()})"


def versions() -> dict:
    """Versions of what the candidates import (None: not installed), and where the source-built FA3 comes from."""
    from importlib import metadata  # noqa: PLC0415

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    for dist in ("flashinfer-python", "apache-tvm-ffi", "flash-attn-4", "nvidia-cutlass-dsl",
                 "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "nvidia-cudnn-frontend"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import flash_attn_interface  # noqa: PLC0415 - FA3 from tools/build_flash3.sh, on PYTHONPATH

        out["flash_attn_interface"] = flash_attn_interface.__file__
    except Exception as exc:
        out["flash_attn_interface"] = f"not importable: {_first_line(exc)}"
    return out


def table(result: dict) -> str:
    """The rows as a fixed-width text table (time relative to `sdpa-flash` at the same S, where it ran), then the
    candidates that could not run and why."""
    base = {r["seq"]: r["ms"] for r in result["rows"] if r["candidate"] == "sdpa-flash" and "ms" in r}
    lines = [f"{'candidate':<26} {'S':>6} {'ms':>9} {'TFLOP/s':>8} {'vs flash':>8} {'cos':>10} {'1st call s':>10}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['candidate']:<26} {r['seq']:>6}  ERROR {r['error']}")
            continue
        rel = f"{base[r['seq']] / r['ms']:.2f}x" if r["seq"] in base else "-"
        lines.append(f"{r['candidate']:<26} {r['seq']:>6} {r['ms']:>9.3f} {r['tflops']:>8.1f} {rel:>8} "
                     f"{r['cos']:>10.6f} {r['first_call_s']:>10.2f}")
    for name, why in result["unavailable"].items():
        lines.append(f"{name:<26} not available: {why}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=list(DEFAULT_SEQ), help="sequence lengths")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after the first one")
    parser.add_argument("--iters", type=int, default=20, help="timed calls; the median is reported")
    parser.add_argument("--only", nargs="+", default=None, help="run only these candidates (names as listed)")
    parser.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device) if args.device else None

    def write(result: dict) -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    result = run(args.seq, args.heads, args.head_dim, device, args.warmup, args.iters, args.only, progress=write)
    write(result)
    print(f"{result['device']}; " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v), flush=True)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
