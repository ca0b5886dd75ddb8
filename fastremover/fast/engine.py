"""Engine modes: which denoiser runs, decided once when the pipeline is built.

    auto   exact where it can run, else eager (the default; no note when it picks eager)
    eager  the reference-order module (every device)
    exact  fused Triton kernels + torch SDPA + CUDA-graph loop, no quantization   (CUDA GPUs)
    fast   exact + FP8 e4m3 W8A8 linears + 8-bit attention (cuDNN's FP8 SDPA with K and V centred; our Triton FP8
           kernel with a note where it cannot build, fp16 SDPA with a note where neither runs)
                                                                                  (GPUs with FP8 tensor cores, sm_89+)
A mode the device cannot run falls back to the next safer one with a note (never silently): the pipeline's config
records what is active, `fastremover info` and the bench JSON print it.

The fast mode runs its first FFN GEMM with the GELU and its quantization in the GEMM's epilogue where that kernel runs
(fast/kernels/gemm_fp8.py: sm_90), else the two-pass path (`_scaled_mm`, then the GELU quantization) - the config's
`ffn1` says which. FASTREMOVER_FUSED_FFN1=0 forces the two-pass path (A/B runs, or a suspected fused-kernel problem).
"""

from __future__ import annotations

import os

import torch

from fastremover.errors import FastRemoverError
from fastremover.ops import attention as attention_backends
from fastremover.fast.denoise import EagerDenoiser, FastDenoiser
from fastremover.models.transformer import RemoverTransformer

MODES = ("eager", "exact", "fast")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_mode(mode: str, device: torch.device) -> tuple[str, list[str]]:
    """The mode that can run on `device` and the notes explaining any fallback."""
    if mode == "auto":
        return ("exact" if device.type == "cuda" and triton_available() else "eager"), []
    notes = []
    if mode in ("exact", "fast") and (device.type != "cuda" or not triton_available()):
        why = "no CUDA GPU" if device.type != "cuda" else "Triton is not installed"
        notes.append(f"mode {mode} needs a CUDA GPU with Triton ({why}): running the eager path")
        return "eager", notes
    if mode == "fast" and not fp8_supported(device):
        notes.append("mode fast needs FP8 tensor cores (sm_89 or newer): running mode exact (no quantization)")
        return "exact", notes
    return mode, notes


def resolve_attention(attention: str, mode: str, device: torch.device) -> tuple[str, list[str]]:
    """(canonical attention backend, notes) for an (already resolved) mode: `auto` picks by the registry's priorities;
    an explicit backend must belong to the mode and be able to run (fastremover.ops.attention.registry.resolve)."""
    return attention_backends.resolve(attention, mode, device)


def build_denoiser(transformer: RemoverTransformer, scheduler_config: dict, mode: str, device: torch.device,
                   attention: str = "auto"):
    """(denoiser, notes) for a resolved mode."""
    backend, notes = resolve_attention(attention, mode, device)
    if mode == "eager":
        return EagerDenoiser(transformer, scheduler_config), notes
    flag = os.environ.get("FASTREMOVER_FUSED_FFN1", "")
    if flag not in ("", "0", "1"):
        raise FastRemoverError(f"FASTREMOVER_FUSED_FFN1={flag!r}: use 1 (the default: fused where it runs) or 0 "
                               "(the two-pass FFN)")
    fused_ffn1 = mode == "fast" and flag != "0"
    from fastremover.fast.transformer_fast import FastTransformer  # needs Triton: only for the exact / fast modes

    fast = FastTransformer(transformer, fp8=(mode == "fast"), attention=backend, fused_ffn1=fused_ffn1)
    if flag == "1" and mode == "fast" and not fast.fused_ffn1:
        notes.append("FASTREMOVER_FUSED_FFN1=1: the fused FFN GEMM needs an sm_90 GPU with Triton tensor descriptors; "
                     "running the two-pass FFN")
    return FastDenoiser(fast, scheduler_config, cuda_graphs=device.type == "cuda"), notes
