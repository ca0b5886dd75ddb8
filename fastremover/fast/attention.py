"""Attention backends for the fast transformer, chosen by name, device and dtype.

Each backend takes q, k, v as [B, S, H, D] fp16/bf16 (the layout the projections produce; any strides with a unit
stride in D and rows of H*D) and returns [B, S, H, D] in the same dtype.
- `sdpa`: torch's scaled_dot_product_attention with its own backend choice (cuDNN on Hopper in torch >= 2.5),
  numerically the eager path. The `exact` mode's default.
- `fp8`: 8-bit attention through cuDNN's FP8 SDPA (fast/cudnn_sdpa.py): q, k, v quantized per tensor to e4m3 on the
  device (fast/kernels/quant.py: amax tile kernel + quantize kernel), K and V first centred by subtracting their mean
  over the sequence (per batch, head and channel). Both are exact under softmax: K's mean subtracts q . mean_k from
  every logit of a query row (a per-row constant), and since each row of P sums to 1, attn(V) = attn(V - m) + m, so
  the mean comes back as an add on the output (the fast transformer folds it into its O projection: + W_o m). K
  smoothing buys resolution (K's shared per-channel offset no longer eats the e4m3 range). V centring fixes a loss
  found end to end: without it this backend took the fast mode's W2 PSNR vs the reference to 34.5 dB
  (bench/results/w2-fast-2026-11-30-62048d2.json) although its kernel-level cosine on zero-mean synthetic inputs was
  0.9982. Hopper's FP8 MMA accumulates in reduced precision, so P @ V summed over 32760 keys loses low bits when V
  has a shared offset (a sum of same-sign terms; FA3's FP8 forward has the same issue: vLLM issue 23813,
  flash-attention PR 2250). `--bench --v-bias 1` shows it (H200, S = 32760: cosine 0.99641 plain, 1.00000 centred;
  bench/results/attention-vbias1-smoothv-*.json), and with centring the W2 fast mode reaches 48.6 dB (worst frame
  47.3) at denoise 4.26 s (bench/results/w2-fast-2026-11-30-4a2054d.json). The fastest 8-bit backend (784-856
  TFLOP/s vs SDPA's 541-563; centring costs ~0.3 ms of 8.5 at S = 32760) and the `fast` mode's default.
- `fp8-triton`: our own Triton FP8 flash kernel (fast/kernels/attention_fp8.py), the same quantization (V not
  centred: the kernel adds each key block's P @ V into an fp32 register accumulator, so a V offset costs it nothing;
  `smooth_v=True` is available), one pinned config. End to end at W2 47.2 dB at denoise 5.34 s
  (bench/results/w2-fast-fp8triton-2026-11-30-62048d2.json). Not faster than fp16 SDPA for now: without its
  warp-specialized configs (out of autotuning: an illegal address at S = 130, and no case at S <= 1000 passed,
  bench/results/attention-ws-crash-*.json)
  it takes 11.79-12.1 ms at S = 32760 vs SDPA's 11.5-11.8 (8.95 ms with them, at 1697f8b). The fast mode's fallback
  when cuDNN's FP8 attention cannot run.
- `fa3` / `fp8-fa3`: FlashInfer's FA3-style Hopper kernels (fast/flashinfer_attention.py; optional package), fp16 and
  FP8 (the FP8 one with the same quantization as `fp8`, V centred). At S = 32760 the fp16 kernel takes 10.18 ms vs
  SDPA's 11.87 (cosine 0.9999999), so it is the `exact` mode's default where it can run (W2 exact denoise 5.94 ->
  5.46 s); the FP8 one 8.14 ms incl. quantization vs cuDNN's 8.54, but no faster in the denoise loop (W2 4.18 vs
  4.17 s), so `fast` keeps cuDNN's (bench/results/attention-fa3-*.json, w2-*-fa3-*.json).
- `fp8-flash3`: FlashAttention-3's own FP8 forward kernel (fast/flash3_attention.py; built from source), the same
  quantization: 7.47 ms at S = 32760 vs cuDNN's 8.46 (kernel alone 6.94 ms, 950 TFLOP/s). With the fast transformer
  feeding its O projection o - m (quantized again, V's mean in the projection's bias) the W2 fast mode reaches
  48.6 dB at denoise 3.88 s vs cuDNN's 48.6 dB at 4.17 s (bench/results/w2-fast-fp8flash3-*-25812b9.json), so it is
  the `fast` mode's default where it is installed. (Requantizing o with the mean added back had given 47.2 dB.)
A backend that cannot run here is an error naming why, never a silent fallback, so a bench row labelled fp8 always
ran fp8; `auto_backend` is what the engine modes use to pick.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Callable

import torch
import torch.nn.attention
import torch.nn.functional as F

from fastremover.bench.metrics import cosine as _cos
from fastremover.errors import FastRemoverError
from fastremover.timing import cuda_time_ms as _time_ms

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] with rows of H*D contiguous -> the [B*S, H*D] row-strided view the quantizer reads."""
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    if sd != 1 or sh != d or (b > 1 and sb != s * ss):
        raise ValueError(f"attention: q/k/v need rows of H*D contiguous values, got strides {t.stride()}")
    return t.as_strided((b * s, h * d), (ss, 1))


def _seq_mean(rows: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """[B*S, N] rows -> fp32 mean over each batch's S rows, [B, N] contiguous."""
    return torch.mean(rows.unflatten(0, (b, s)), dim=1, dtype=torch.float32)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
                 smooth_v: bool = False):
    """Per-tensor e4m3 codes and scales of q, k (mean-smoothed over the sequence when smooth_k) and v, [B, S, H, D]
    each; all on the device, no host sync. smooth_v: v is centred the same way and its mean [B, H*D] fp32 is
    returned as a 7th value; the caller adds it back to the output (exact: each row of P sums to 1)."""
    from fastremover.fast.kernels.quant import quant_fp8_tensorwise

    b, s, h, d = q.shape
    q8, sq = quant_fp8_tensorwise(_rows(q))
    k_rows = _rows(k)
    mean = _seq_mean(k_rows, b, s) if smooth_k else None
    k8, sk = quant_fp8_tensorwise(k_rows, mean, s)
    v_rows = _rows(v)
    v_mean = _seq_mean(v_rows, b, s) if smooth_v else None
    v8, sv = quant_fp8_tensorwise(v_rows, v_mean, s)
    shape = (b, s, h, d)
    out = (q8.view(shape), k8.view(shape), v8.view(shape), sq, sk, sv)
    return out + (v_mean,) if smooth_v else out


def quantize_qkv_reference(q, k, v, *, smooth_k: bool = True, smooth_v: bool = False):
    from fastremover.fast.kernels.quant import quant_fp8_tensorwise_reference

    b, s, h, d = q.shape
    q8, sq = quant_fp8_tensorwise_reference(q.reshape(b * s, h * d))
    kr = k.reshape(b * s, h * d)
    mean = _seq_mean(kr, b, s) if smooth_k else None
    k8, sk = quant_fp8_tensorwise_reference(kr, mean, s)
    vr = v.reshape(b * s, h * d)
    v_mean = _seq_mean(vr, b, s) if smooth_v else None
    v8, sv = quant_fp8_tensorwise_reference(vr, v_mean, s)
    shape = (b, s, h, d)
    out = (q8.view(shape), k8.view(shape), v8.view(shape), sq, sk, sv)
    return out + (v_mean,) if smooth_v else out


def _add_v_mean(o: torch.Tensor, v_mean: torch.Tensor | None) -> torch.Tensor:
    if v_mean is None:
        return o
    b, s, h, d = o.shape
    return o.add_(v_mean.view(b, 1, h, d))  # fp32 add, one rounding to o's dtype


def fp8_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
              smooth_v: bool = True) -> torch.Tensor:
    from fastremover.fast.cudnn_sdpa import sdpa_fp8

    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    o8 = sdpa_fp8(q8, k8, v8, sq, sk, sv)  # codes of o / sv (Hopper writes FP8 output)
    # the fast transformer skips this: its O projection takes the codes
    return _add_v_mean(o8.to(q.dtype).mul_(sv.view(())), v_mean[0] if v_mean else None)


def fp8_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
               smooth_v: bool = False) -> torch.Tensor:
    from fastremover.fast.kernels.attention_fp8 import AUTOTUNE_CONFIGS, attention_fp8

    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    # One pinned kernel config, not the autotuner's pick: configs differ in key-block size, which changes where P is
    # quantized, so a timing-based choice could change output bits from one process to the next.
    config = os.environ.get("FASTREMOVER_FP8_ATTN_CONFIG", "").strip() or AUTOTUNE_CONFIGS[0]
    o = attention_fp8(q8, k8, v8, sq, sk, sv, out_dtype=q.dtype, config=config)
    return _add_v_mean(o, v_mean[0] if v_mean else None)


def fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from fastremover.fast.flashinfer_attention import fa3_half

    return fa3_half(q, k, v)


def fp8_fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
            smooth_v: bool = True) -> torch.Tensor:
    from fastremover.fast.flashinfer_attention import fa3_fp8

    return fa3_fp8(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)


def fp8_flash3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True,
               smooth_v: bool = True) -> torch.Tensor:
    from fastremover.fast.flash3_attention import flash3_fp8

    return flash3_fp8(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)


BACKENDS: dict[str, AttentionFn] = {"sdpa": sdpa, "fp8": fp8_cudnn, "fp8-triton": fp8_triton, "fa3": fa3,
                                    "fp8-fa3": fp8_fa3, "fp8-flash3": fp8_flash3}


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """None when backend `name` can run on `device`, else why not."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r} (known: {sorted(BACKENDS)})"
    if name == "sdpa":
        return None
    if device.type != "cuda":
        return f"attention backend {name} needs a CUDA GPU"
    if name == "fp8":
        from fastremover.fast.cudnn_sdpa import supported

        why = supported(device.index if device.index is not None else torch.cuda.current_device())
        return None if why is None else f"cuDNN FP8 attention is not available: {why}"
    if name in ("fa3", "fp8-fa3"):
        from fastremover.fast.flashinfer_attention import unavailable_reason as flashinfer_unavailable

        return flashinfer_unavailable(device)
    if name == "fp8-flash3":
        from fastremover.fast.flash3_attention import unavailable_reason as flash3_unavailable

        return flash3_unavailable(device)
    if name == "fp8-triton":
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "FP8 tensor cores need sm_89 or newer"
        try:
            import fastremover.fast.kernels.attention_fp8  # noqa: F401
        except ImportError as exc:
            return f"the Triton FP8 attention kernel is not importable: {exc}"
    return None


def available_backends(device: torch.device) -> list[str]:
    return [name for name in BACKENDS if unavailable_reason(name, device) is None]


def auto_backend(mode: str, device: torch.device) -> tuple[str, list[str]]:
    """The backend an engine mode uses: for exact `fa3` (FlashInfer, when installed and runnable) else `sdpa`, with a
    note saying why on a GPU; for fast `fp8-flash3` (FlashAttention-3's FP8 kernel, when built and on the path: the
    fastest at equal end-to-end fidelity, see the module docstring), else `fp8` (cuDNN, V centred), else `fp8-triton`
    with a note saying why, else sdpa with a note."""
    if mode != "fast":
        # FlashInfer's FA3 fp16 kernel where it can run: 10.2 ms vs SDPA's 11.9 at S = 32760 (W2 exact denoise 5.94 ->
        # 5.46 s, bench/results/w2-exact-fa3-*.json); no quantization, fp32 accumulation, like SDPA
        why_fa3 = unavailable_reason("fa3", device)
        if why_fa3 is None:
            return "fa3", []
        # on a GPU say why, since it costs ~10 % of W2's denoise; on the CPU sdpa is the only choice, so no note
        return "sdpa", ([f"mode {mode}: FlashInfer's FA3 attention is not used ({why_fa3}); attention runs torch "
                         "SDPA"] if device.type == "cuda" else [])
    if unavailable_reason("fp8-flash3", device) is None:
        return "fp8-flash3", []
    why_cudnn = unavailable_reason("fp8", device)
    if why_cudnn is None:
        return "fp8", []
    why_triton = unavailable_reason("fp8-triton", device)
    if why_triton is None:
        return "fp8-triton", [f"mode fast: {why_cudnn}; attention runs our Triton FP8 kernel (fp8-triton: slower)"]
    return "sdpa", [f"mode fast: 8-bit attention unavailable ({why_cudnn}; {why_triton}); attention runs in fp16 "
                    "(sdpa)"]


def get_backend(name: str, device: torch.device) -> AttentionFn:
    why = unavailable_reason(name, device)
    if why is not None:
        raise FastRemoverError(f"attention backend {name!r} cannot run here: {why}")
    return BACKENDS[name]


# ----------------------------------------------------------------------------------------------------------------------
# Side-by-side benchmark (GPU): python -m fastremover.fast.attention --bench [--out FILE]


def bench(seq_lens=(32760, 7290), heads: int = 12, head_dim: int = 128, k_bias: float = 1.0,
          v_bias: float = 0.0) -> list[dict]:
    """fp16 SDPA vs the 8-bit backends at the DiT's shapes; q, k ~ N(0, 1) with a shared per-channel offset on K of
    size k_bias (trained DiTs have one; it is what smoothing removes), v ~ N(0, 1) plus a shared per-channel offset
    of size v_bias (a long same-sign P @ V sum: what exposes a reduced-precision accumulator)."""
    from fastremover.fast.cudnn_sdpa import sdpa_fp8

    rows = []
    dev = torch.device("cuda")
    for s in seq_lens:
        g = torch.Generator(device=dev).manual_seed(s)
        qkv = torch.randn(1, s, 3, heads, head_dim, device=dev, generator=g, dtype=torch.float16)
        qkv[:, :, 1] += (k_bias * torch.randn(heads, head_dim, device=dev, generator=g)).half()
        qkv[:, :, 2] += (v_bias * torch.randn(heads, head_dim, device=dev, generator=g)).half()
        q, k, v = qkv.unbind(2)  # strided views, as the fused QKV projection produces them
        flop = 4.0 * s * s * heads * head_dim
        ref = sdpa(q, k, v)
        base_ms = _time_ms(lambda: sdpa(q, k, v))
        rows.append({"seq": s, "backend": "sdpa-fp16", "ms": base_ms, "tflops": flop / base_ms / 1e9, "cos": 1.0,
                     "speedup": 1.0})
        try:  # cuDNN's fp16 SDPA through the frontend (own heuristics) and torch's flash backend, for reference
            from fastremover.fast.cudnn_sdpa import sdpa_half

            out = sdpa_half(q, k, v)
            ms = _time_ms(lambda: sdpa_half(q, k, v))
            rows.append({"seq": s, "backend": "cudnn-frontend-fp16", "ms": ms, "tflops": flop / ms / 1e9,
                         "cos": _cos(out, ref), "speedup": base_ms / ms})
        except Exception as exc:
            rows.append({"seq": s, "backend": "cudnn-frontend-fp16", "error": repr(exc)[:300]})
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            ms = _time_ms(lambda: sdpa(q, k, v))
        rows.append({"seq": s, "backend": "sdpa-fp16 (flash)", "ms": ms, "tflops": flop / ms / 1e9,
                     "speedup": base_ms / ms})
        if unavailable_reason("fa3", dev) is None:
            try:
                out = fa3(q, k, v)
                ms = _time_ms(lambda: fa3(q, k, v))
                rows.append({"seq": s, "backend": "fa3 (flashinfer, fp16)", "ms": ms, "tflops": flop / ms / 1e9,
                             "cos": _cos(out, ref), "speedup": base_ms / ms})
            except Exception as exc:
                rows.append({"seq": s, "backend": "fa3 (flashinfer, fp16)", "error": repr(exc)[:300]})
        for name in ("fp8", "fp8-fa3", "fp8-flash3", "fp8-triton"):
            why = unavailable_reason(name, dev)
            if why:
                rows.append({"seq": s, "backend": name, "error": why})
                continue
            centred_default = name in ("fp8", "fp8-fa3", "fp8-flash3")
            for smooth, smooth_v in ((True, centred_default), (True, not centred_default), (False, False)):
                fn = BACKENDS[name]
                label = name + (" smooth_v" if smooth_v else " no smooth_v")
                try:
                    out = fn(q, k, v, smooth_k=smooth, smooth_v=smooth_v)
                    ms = _time_ms(lambda: fn(q, k, v, smooth_k=smooth, smooth_v=smooth_v))
                except Exception as exc:  # report, keep benchmarking the rest
                    rows.append({"seq": s, "backend": label, "smooth_k": smooth, "error": repr(exc)[:300]})
                    continue
                rows.append({"seq": s, "backend": label, "smooth_k": smooth, "smooth_v": smooth_v, "ms": ms,
                             "tflops": flop / ms / 1e9, "cos": _cos(out, ref), "speedup": base_ms / ms})
            if name == "fp8":  # the kernel alone (quantization excluded), fp8 output codes
                q8, k8, v8, sq, sk, sv = quantize_qkv(q, k, v)
                inv = torch.reciprocal(sv)
                o8 = sdpa_fp8(q8, k8, v8, sq, sk, sv, scale_o=inv)
                ms = _time_ms(lambda: sdpa_fp8(q8, k8, v8, sq, sk, sv, scale_o=inv))
                rows.append({"seq": s, "backend": "fp8 kernel only (fp8 out)", "ms": ms, "tflops": flop / ms / 1e9,
                             "cos": _cos(o8.float() * sv, ref), "speedup": base_ms / ms})
                try:
                    from fastremover.fast.cudnn_sdpa import survey_plans

                    for plan in survey_plans(q8, k8, v8, sq, sk, sv, _time_ms):
                        if "ms" in plan:
                            plan["tflops"] = flop / plan["ms"] / 1e9
                        rows.append({"seq": s, "backend": f"fp8 plan {plan['plan']}: {plan['name'][:60]}", **plan})
                except Exception as exc:
                    rows.append({"seq": s, "backend": "fp8 plan survey", "error": repr(exc)[:300]})
                ms = _time_ms(lambda: quantize_qkv(q, k, v))
                rows.append({"seq": s, "backend": "quantize q/k/v only", "ms": ms})
            if name in ("fp8-flash3", "fp8-fa3"):  # the kernel alone (bf16 / fp16 output), our codes in
                rows += _kernel_only_rows(name, s, q, k, v, ref, flop, base_ms, contiguous=name == "fp8-fa3")
    return rows


def _kernel_only_rows(name: str, s: int, q, k, v, ref, flop: float, base_ms: float, contiguous: bool) -> list[dict]:
    """Bench rows of an FP8 library kernel alone on our q/k/v codes (quantization excluded); with `contiguous`, also
    on contiguous copies of the codes (the strided views are what the engine passes)."""
    if name == "fp8-flash3":
        from fastremover.fast.flash3_attention import flash3_fp8_codes as codes_fn
    else:
        from fastremover.fast.flashinfer_attention import fa3_fp8_codes as codes_fn

    label = f"{name} kernel only"
    q8, k8, v8, sq, sk, sv = quantize_qkv(q, k, v)
    rows = []
    try:
        o = codes_fn(q8, k8, v8, sq, sk, sv)
        ms = _time_ms(lambda: codes_fn(q8, k8, v8, sq, sk, sv))
        rows.append({"seq": s, "backend": label, "ms": ms, "tflops": flop / ms / 1e9, "cos": _cos(o, ref),
                     "speedup": base_ms / ms})
        if contiguous:
            qc, kc, vc = (t.contiguous() for t in (q8, k8, v8))
            ms = _time_ms(lambda: codes_fn(qc, kc, vc, sq, sk, sv))
            rows.append({"seq": s, "backend": f"{label}, contiguous q/k/v", "ms": ms, "tflops": flop / ms / 1e9,
                         "speedup": base_ms / ms})
    except Exception as exc:  # report, keep benchmarking the rest
        rows.append({"seq": s, "backend": label, "error": repr(exc)[:300]})
    return rows


def _bhsd_memory(t: torch.Tensor) -> torch.Tensor:
    """The same [B, S, H, D] values stored head-major ([B, H, S, D] contiguous), viewed back as [B, S, H, D]."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def bench_layouts(seq_lens=(32760, 7290), heads: int = 12, head_dim: int = 128) -> list[dict]:
    """Does the memory layout of q/k/v/o change the attention kernels' speed? Same values, three layouts: the fused
    QKV projection's strided views ([B, S, 3, H, D] unbound), token-major contiguous [B, S, H, D], head-major
    contiguous [B, H, S, D]; for torch SDPA (fp16) and cuDNN's FP8 kernel (codes in, codes out; the output stays
    token-major where the O projection needs it, or head-major)."""
    from fastremover.fast.cudnn_sdpa import sdpa_fp8

    rows = []
    dev = torch.device("cuda")
    for s in seq_lens:
        g = torch.Generator(device=dev).manual_seed(s)
        qkv = torch.randn(1, s, 3, heads, head_dim, device=dev, generator=g, dtype=torch.float16)
        flop = 4.0 * s * s * heads * head_dim
        strided = qkv.unbind(2)
        layouts = {"qkv-strided": strided, "bshd": tuple(t.contiguous() for t in strided),
                   "bhsd": tuple(_bhsd_memory(t) for t in strided)}
        ref = sdpa(*strided)
        for name, (q, k, v) in layouts.items():
            out = sdpa(q, k, v)
            ms = _time_ms(lambda: sdpa(q, k, v))
            rows.append({"seq": s, "backend": f"sdpa-fp16 in={name}", "ms": ms, "tflops": flop / ms / 1e9,
                         "equal_to_strided": bool(torch.equal(out, ref))})
            try:  # cuDNN through the frontend, output written token-major (what the O projection reads)
                from fastremover.fast.cudnn_sdpa import sdpa_half

                o = torch.empty(q.shape, dtype=q.dtype, device=dev)
                sdpa_half(q, k, v, out=o)
                ms = _time_ms(lambda: sdpa_half(q, k, v, out=o))
                rows.append({"seq": s, "backend": f"cudnn-fe-fp16 in={name} out=bshd", "ms": ms,
                             "tflops": flop / ms / 1e9, "cos": _cos(o, ref)})
            except Exception as exc:
                rows.append({"seq": s, "backend": f"cudnn-fe-fp16 in={name}", "error": repr(exc)[:300]})
        if unavailable_reason("fp8", dev) is None:
            from fastremover.fast.cudnn_sdpa import survey_plans_half

            try:  # is there a faster fp16 engine than the heuristics' choice?
                for plan in survey_plans_half(*layouts["bshd"], _time_ms):
                    if "ms" in plan:
                        plan["tflops"] = flop / plan["ms"] / 1e9
                    rows.append({"seq": s, "backend": f"fp16 plan {plan['plan']}: {plan['name'][:50]}", **plan})
            except Exception as exc:
                rows.append({"seq": s, "backend": "fp16 plan survey", "error": repr(exc)[:300]})
            q8, k8, v8, sq, sk, sv = quantize_qkv(*strided)
            inv = torch.reciprocal(sv)
            codes = {"bshd": (q8, k8, v8), "bhsd": tuple(_bhsd_memory(t) for t in (q8, k8, v8))}
            for name, (a, b, c) in codes.items():
                for out_layout in ("bshd", "bhsd"):
                    o = torch.empty(q8.shape, dtype=q8.dtype, device=dev)
                    if out_layout == "bhsd":
                        o = _bhsd_memory(o)
                    sdpa_fp8(a, b, c, sq, sk, sv, scale_o=inv, out=o)
                    ms = _time_ms(lambda: sdpa_fp8(a, b, c, sq, sk, sv, scale_o=inv, out=o))
                    rows.append({"seq": s, "backend": f"fp8 kernel in={name} out={out_layout}", "ms": ms,
                                 "tflops": flop / ms / 1e9, "cos": _cos(o.float() * sv, ref)})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--layouts", action="store_true", help="only the q/k/v/o memory-layout survey")
    parser.add_argument("--v-bias", type=float, default=0.0, help="shared per-channel offset added to v (default 0)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not args.bench:
        parser.error("nothing to do (use --bench)")
    if args.layouts and args.v_bias:
        parser.error("--v-bias applies to the backend comparison, not to --layouts")
    rows = bench_layouts() if args.layouts else bench(v_bias=args.v_bias)
    for r in rows:
        if "error" in r:
            print(f"S={r['seq']:>6} {r['backend']:<28} smooth={r.get('smooth_k', '-')!s:<5} ERROR {r['error']}")
        else:
            print(f"S={r['seq']:>6} {r['backend']:<28} smooth={r.get('smooth_k', '-')!s:<5} {r['ms']:8.3f} ms "
                  f"{r.get('tflops', math.nan):7.1f} TFLOP/s  x{r.get('speedup', math.nan):5.2f}  "
                  f"cos {r.get('cos', math.nan):.5f}"
                  + (f"  equal {r['equal_to_strided']}" if "equal_to_strided" in r else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "inputs": "layouts" if args.layouts else {"k_bias": 1.0, "v_bias": args.v_bias},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
