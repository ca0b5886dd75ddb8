"""FP8 (e4m3) W8A8 linear layers for Hopper: per-output-channel weight scales, per-token dynamic activation scales.

    y[m, n] = (sum_k qa[m, k] * qw[n, k]) * sa[m] * sw[n] + bias[n]

The weights are quantized once when the fast transformer is built; activations arrive already quantized from the
fused kernel that produced them (LayerNorm+adaLN, GELU, or a plain row-wise quantizer), so no host sync ever happens.
The GEMM is cuBLASLt with row-wise scales: on sm_90 called directly with a workspace-free algorithm (cublaslt.py: no
memset node in front of each GEMM in the CUDA graph; the same products as torch._scaled_mm), elsewhere
`torch._scaled_mm` (ATen also implements it on the CPU, which is what the CPU tests use). Some torch builds accept
only bf16 outputs with row-wise scales: `scaled_mm_out_dtype` probes once and the layer then casts to the model dtype
itself.

Accumulation: `use_fast_accum=True` on the GPU - the FP8 tensor cores' own accumulator, without cuBLASLt's periodic
promotion to fp32. At the DiT's shapes (H200, bench/results/gemm-scales-*.json) it takes the four block GEMMs from
69.3 to 58.2 ms per W2 step (1000-1170 -> 1200-1310 TFLOP/s); its error against the fp32 GEMM of the same codes is
7e-4 relative at K = 1536 and 2.2e-3 at K = 8960, against 2.4e-4 with promotion - both far below the e4m3 rounding
of the operands themselves (2^-4 per element), which is what the fast mode's fidelity is measured on.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from fastremover.ops.linear import cublaslt
from fastremover.ops.linear.registry import ACT_FP8_ROWWISE, Fp8Activation, LinearLayer, LinearMethod, register

FP8 = torch.float8_e4m3fn


@functools.lru_cache(maxsize=None)
def scaled_mm_out_dtype(device_type: str, device_index: int | None, want: torch.dtype) -> torch.dtype:
    """The output dtype `torch._scaled_mm` accepts with row-wise scales and a bias on this device (want, else bf16)."""
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    a = torch.ones(16, 32, device=device).to(FP8)
    b = torch.ones(16, 32, device=device).to(FP8)
    sa, sb = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
    try:
        torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=torch.zeros(16, device=device, dtype=want), out_dtype=want)
        return want
    except RuntimeError:
        return torch.bfloat16


class Fp8Linear(LinearLayer):
    """A frozen nn.Linear in e4m3 with per-output-channel scales; takes pre-quantized activations (the
    `fp8-rowwise` linear method of ops/linear/registry.py)."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype, gemm: str = "auto"):
        """gemm: "cublaslt" (cublaslt.scaled_mm; an error where it cannot run), "torch" (torch._scaled_mm) or "auto"
        (cublaslt where it can run, else torch)."""
        super().__init__()
        if gemm not in ("auto", "cublaslt", "torch"):
            raise ValueError(f"gemm must be 'auto', 'cublaslt' or 'torch', got {gemm!r}")
        from fastremover.fast.kernels.quant import quant_fp8_weight  # Triton-importing module: only when used

        codes, scale = quant_fp8_weight(linear.weight.detach())
        # _scaled_mm wants the second operand column-major: keep codes [N, K] row-major and pass codes.t().
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale.view(1, -1).contiguous())
        self.out_dtype = out_dtype
        dev = codes.device
        self.mm_dtype = scaled_mm_out_dtype(dev.type, dev.index, out_dtype)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", None if bias is None else bias.to(self.mm_dtype).contiguous())
        self.gemm = "torch"
        if gemm != "torch":
            reason = cublaslt.unavailable_reason(dev.type, dev.index)
            if gemm == "cublaslt" and reason is not None:
                raise ValueError(f"gemm='cublaslt' cannot run here: {reason}")
            if reason is None:
                self.gemm = "cublaslt"

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def forward(self, x_codes, x_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: an Fp8Activation, or x_codes [M, K] e4m3 with x_scale [M, 1] fp32 -> [M, N] in out_dtype. bias: [N],
        replaces the layer's own bias for this call (the fast transformer passes bias + W m to fold a per-call
        constant into the GEMM epilogue)."""
        if isinstance(x_codes, Fp8Activation):
            if x_scale is not None:
                raise ValueError("Fp8Linear: an Fp8Activation carries its own row scales")
            x_codes, x_scale = x_codes.codes, x_codes.row_scale
        elif x_scale is None:
            raise ValueError("Fp8Linear takes an Fp8Activation or (codes, row_scale)")
        if bias is None:
            bias = self.bias
        elif bias.shape != (self.out_features,):
            raise ValueError(f"Fp8Linear: bias override must have shape [{self.out_features}], got {list(bias.shape)}")
        else:
            bias = bias.to(self.mm_dtype)
        if self.gemm == "cublaslt":
            y = cublaslt.scaled_mm(x_codes, self.codes, x_scale, self.scale, bias, self.mm_dtype, fast_accum=True)
        else:
            y = torch._scaled_mm(
                x_codes, self.codes.t(), scale_a=x_scale, scale_b=self.scale, bias=bias, out_dtype=self.mm_dtype,
                use_fast_accum=x_codes.is_cuda,
            )
        return y if self.mm_dtype == self.out_dtype else y.to(self.out_dtype)

    def weight_row_norms(self) -> torch.Tensor:
        """[N] fp32 norms of the dequantized weight rows (codes * scale: what the GEMM multiplies by)."""
        return (self.codes.float() * self.scale.t()).norm(dim=1)

    def fused_gelu_quant_available(self, device: torch.device) -> bool:
        """ff1 + GELU + static-bound quantization in one Triton GEMM (kernels/gemm_fp8.py: sm_90 or the interpreter)."""
        from fastremover.fast.kernels.gemm_fp8 import fused_ffn1_available

        return fused_ffn1_available(device, self.codes.shape[1], self.out_features)

    def gelu_quant(self, x: Fp8Activation, bias: torch.Tensor, amax: torch.Tensor) -> Fp8Activation:
        """e4m3 codes of gelu_tanh(x @ W^T + bias) with the static per-tensor bound amax [1], from the GEMM's
        epilogue (the 16-bit hidden is never written)."""
        from fastremover.fast.kernels.gemm_fp8 import gemm_fp8_gelu_quant

        x = Fp8Activation.of(x)
        return Fp8Activation.of(gemm_fp8_gelu_quant(x.codes, x.row_scale, self.codes, self.scale, bias, amax))


def _build(linear: nn.Linear, out_dtype: torch.dtype, gemm: str = "auto") -> LinearLayer:
    return Fp8Linear(linear, out_dtype, gemm)


METHOD = register(LinearMethod("fp8-rowwise", ACT_FP8_ROWWISE, _build, quantized=True,
                               description="e4m3 weights (per output channel) x e4m3 activations (per row), cuBLASLt"))
