"""NVFP4 weights for the DiT's block linears (`--weights nvfp4`, `--weights nvfp4-w4a4`) and their memory figures.

Hopper has no FP4 tensor cores, so NVFP4 here buys memory (the block linears' weights shrink 3.55x against fp16 at
the released config: 0.5 byte per weight + one e4m3 scale per 16) and a W4A16 compute path - weights dequantized in
the GEMM's load path, 16-bit MMAs - not FP4 speed. docs/nvfp4.md has the numbers and the argument.

    Nvfp4Linear(linear, mode)       a frozen nn.Linear as packed e2m1 codes + swizzled e4m3 block scales + fp32
                                    global scale (+ the bias in the model dtype), all buffers; the master is not kept.
        mode "w4a16"   y = (x @ W_unit^T) * alpha + bias: the Triton W4A16 GEMM on sm_90 (fp16/bf16 x), else the same
                       math in torch (nvfp4.w4a16_linear_reference: fp32, W_unit dequantized per call)
        mode "w4a4"    activations quantized to NVFP4 too (per-16 block scales along K, a dynamic per-tensor global
                       scale) and dequantized before the same GEMM: an emulation of an FP4 x FP4 GEMM's numerics
                       (FlashRT's transformer path), not a speed path. Crop mode only (engine/build.py's
                       Plan.check_window refuses full frames unless --force-w4a4).
    quantize_linears_nvfp4(transformer, w4a4=False) -> Nvfp4Report
                                    replaces to_q / to_k / to_v / to_out.0 / ffn.net.0.proj / ffn.net.2 of every block
                                    (patch_embedding, condition_embedder and proj_out stay dense) and reports resident
                                    bytes before and after.
    nvfp4_memory_estimate(config)  the same figures computed from a transformer config alone (for `info`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from fastremover.errors import FastRemoverError
from fastremover.fast import nvfp4 as ref
from fastremover.models.transformer import RemoverTransformerConfig
from fastremover.ops.linear.registry import ACT_16BIT, ConcatLinear, LinearLayer, LinearMethod, register

MODES = ("w4a16", "w4a4")
GEMMS = ("auto", "dequant", "triton")
# (module path inside a block, (out, in) in units of (dim, ffn)): the replaced linears of one DiT block
BLOCK_LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ffn.net.0.proj", "ffn.net.2")
W4A4_FULL_FRAME_REFUSAL = (
    "--weights nvfp4-w4a4 quantizes activations to 4 bits too, which collapses on full frames (FlashRT measured "
    "~7 dB over 12 steps; it holds on small crops, ~52 dB): use --crop on, or add --force-w4a4 to run it on full frames "
    "anyway"
)
W4A4_WHOLE_CROP_REFUSAL = (  # the same rule under --crop on, where the box around the window's mask is the whole frame
    "--weights nvfp4-w4a4 quantizes activations to 4 bits too, which collapses on full frames (FlashRT measured "
    "~7 dB over 12 steps); with --crop on, the box around this window's mask is the whole frame: use a mask that "
    "leaves the frame's edges free, or add --force-w4a4 to run it on full frames anyway"
)


def _on_triton_gpu(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    from fastremover.fast.kernels.nvfp4 import w4a16_available

    return w4a16_available(t.device)


class Nvfp4Linear(LinearLayer):
    """A frozen nn.Linear stored as NVFP4 (see the module docstring). Input [..., in_features] -> [..., out_features]
    in the input's dtype. The `nvfp4` / `nvfp4-w4a4` linear methods of ops/linear/registry.py."""

    def __init__(self, linear: nn.Linear, mode: str = "w4a16", gemm: str = "auto"):
        """gemm (sm_90, fp16/bf16 inputs): "dequant" = the exact unit weight dequantized into a transient buffer per
        call, then cuBLAS with alpha folded into its epilogue (torch.addmm); "triton" = the fused W4A16 kernel;
        "auto" = dequant (faster at every DiT shape measured on H200, docs/nvfp4.md). Elsewhere the torch math."""
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        self.gemm = "dequant" if gemm == "auto" else gemm
        w = linear.weight.detach()
        out_f, in_f = w.shape
        if in_f % ref.BLOCK:
            raise ValueError(f"NVFP4 needs in_features % {ref.BLOCK} == 0, got {in_f}")
        if _on_triton_gpu(w):
            from fastremover.fast.kernels.nvfp4 import quantize_nvfp4

            q = quantize_nvfp4(w.contiguous())  # bit-equal to the torch reference (reciprocal="exact")
        else:
            q = ref.quantize_reference(w)
        self.in_features, self.out_features, self.mode = in_f, out_f, mode
        self.register_buffer("packed", q.packed)
        self.register_buffer("scales", q.scales)
        self.register_buffer("global_scale", q.global_scale)
        self.register_buffer("alpha", ref.alpha_of(q.global_scale))
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.multipliers: dict[torch.dtype, float] = {}  # host alphas of the dequant GEMM (read once, here)
        if self.gemm == "dequant" and _on_triton_gpu(w):
            from fastremover.fast.kernels.nvfp4 import unit_multiplier

            self.multipliers = {d: unit_multiplier(q.global_scale, d) for d in (torch.float16, torch.bfloat16)}

    def weight_nvfp4(self) -> ref.Nvfp4Tensor:
        return ref.Nvfp4Tensor(self.packed, self.scales, self.global_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"

    def weight_row_norms(self) -> torch.Tensor:
        """[N] fp32 norms of the dequantized weight rows."""
        return ref.dequantize_reference(self.weight_nvfp4()).norm(dim=1)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """bias: [N], replaces the layer's own bias for this call."""
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"Nvfp4Linear: bias override must have shape [{self.out_features}], "
                             f"got {list(bias.shape)}")
        own_bias = self.bias if bias is None else bias
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        gpu = _on_triton_gpu(x2) and x2.dtype in (torch.float16, torch.bfloat16)
        if self.mode == "w4a4":
            if gpu:
                from fastremover.fast.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4

                x2 = dequantize_nvfp4(quantize_nvfp4(x2.contiguous()), x2.dtype)
            else:
                x2 = ref.fake_quantize(x2)
        t = self.weight_nvfp4()
        if gpu:
            from fastremover.fast.kernels.nvfp4 import unit_weight_nvfp4, w4a16_gemm

            bias = None if own_bias is None else own_bias.to(x2.dtype)
            if self.gemm == "triton":
                y = w4a16_gemm(x2.contiguous(), t, bias, alpha=self.alpha)
            else:
                if x2.dtype not in self.multipliers:  # moved to the GPU after construction: read it once now
                    from fastremover.fast.kernels.nvfp4 import unit_multiplier

                    self.multipliers[x2.dtype] = unit_multiplier(self.global_scale, x2.dtype)
                w, mult = unit_weight_nvfp4(t, x2.dtype), self.multipliers[x2.dtype]
                y = torch.mm(x2, w.t()).mul_(mult) if bias is None else torch.addmm(bias, x2, w.t(), alpha=mult)
        else:
            y = ref.w4a16_linear_reference(x2, t, own_bias)
        return y.reshape(*lead, self.out_features)


# ----------------------------------------------------------------------------------------------------------------------
# Replacing the DiT's linears


def resident_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of `module` (each storage counted once)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


@dataclass(frozen=True)
class Nvfp4Report:
    """What quantize_linears_nvfp4 did: the mode, how many linears it replaced, resident bytes of those linears and
    of the whole module before and after."""

    mode: str
    layers: int
    linear_bytes_before: int
    linear_bytes_after: int
    model_bytes_before: int
    model_bytes_after: int

    def describe(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"NVFP4 {self.mode}: {self.layers} linears, {self.linear_bytes_before / mib:.1f} -> "
                f"{self.linear_bytes_after / mib:.1f} MiB; transformer resident {self.model_bytes_before / mib:.1f} -> "
                f"{self.model_bytes_after / mib:.1f} MiB")


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def _set(module: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, last = path.rpartition(".")
    parent = _get(module, parent_path) if parent_path else module
    if last.isdigit():
        parent[int(last)] = new
    else:
        setattr(parent, last, new)


def quantize_linears_nvfp4(module: nn.Module, *, w4a4: bool = False, gemm: str = "auto") -> Nvfp4Report:
    """Replace the six linears of every block of a RemoverTransformer by Nvfp4Linear (in place, layer by layer, so
    at most one dense master is duplicated at a time) and return the report. Call it after the model is on its device
    and in its inference dtype. gemm: Nvfp4Linear's GPU GEMM choice. The module must not hold Nvfp4Linear layers
    already."""
    blocks = getattr(module, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError("quantize_linears_nvfp4 expects a RemoverTransformer (a module with .blocks)")
    targets = [(f"blocks.{i}.{p}", _get(block, p)) for i, block in enumerate(blocks) for p in BLOCK_LINEARS]
    for name, lin in targets:
        if isinstance(lin, Nvfp4Linear):
            raise ValueError(f"{name} is NVFP4 already: quantize_linears_nvfp4 was called twice")
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{name} is a {type(lin).__name__}, expected nn.Linear")
        if lin.in_features % ref.BLOCK:
            raise FastRemoverError(
                f"--weights nvfp4 needs every block linear's input width to be a multiple of {ref.BLOCK}; {name} has "
                f"{lin.in_features}: run this model with --weights dense"
            )
    for name, lin in targets:  # one host sync per layer, at load time only
        if not bool(torch.isfinite(lin.weight).all()):
            raise FastRemoverError(f"the checkpoint's {name}.weight holds NaN or inf values: the checkpoint is "
                                   "damaged; re-download it (or run with --weights dense to see the dense result)")
    mode = "w4a4" if w4a4 else "w4a16"
    model_before = resident_bytes(module)
    linear_before = sum(resident_bytes(lin) for _, lin in targets)
    linear_after = 0
    for name, lin in targets:
        new = Nvfp4Linear(lin, mode, gemm)
        _set(module, name, new)
        linear_after += resident_bytes(new)
        del lin, new
    targets.clear()
    return Nvfp4Report(mode, len(blocks) * len(BLOCK_LINEARS), linear_before, linear_after, model_before,
                       resident_bytes(module))


# ----------------------------------------------------------------------------------------------------------------------
# Memory at a config, without building the model


def nvfp4_linear_bytes(out_features: int, in_features: int, bias_bytes: int = 2) -> int:
    """Resident bytes of one Nvfp4Linear: codes N*K/2, swizzled scales Mpad*Cpad, global scale + alpha (fp32), bias."""
    mpad, cpad = ref.padded_scale_shape(out_features, in_features)
    return out_features * in_features // 2 + mpad * cpad + 4 + 4 + out_features * bias_bytes


def nvfp4_memory_estimate(config: RemoverTransformerConfig, dtype_bytes: int = 2) -> dict:
    """Resident transformer bytes at `config` in a 16-bit dtype (dtype_bytes=2; fp32 islands stay fp32, as
    RemoverTransformer.to_inference_dtype keeps them): dense vs the block linears in NVFP4. Pure arithmetic."""
    dim, ffn, layers = config.dim, config.ffn_dim, config.num_layers
    shapes = [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn)]  # (out, in) of BLOCK_LINEARS
    dense_linears = layers * sum((o * i + o) * dtype_bytes for o, i in shapes)
    nvfp4_linears = layers * sum(nvfp4_linear_bytes(o, i, dtype_bytes) for o, i in shapes)
    patch = math.prod(config.patch_size)
    out_patch = config.out_channels * patch
    other = (
        (config.in_channels * dim * patch + dim) * dtype_bytes               # patch_embedding
        + (config.freq_dim * dim + dim + dim * dim + dim) * 4                 # time_embedder (fp32)
        + (dim * 6 * dim + 6 * dim) * dtype_bytes                             # time_proj
        + layers * (2 * dim * dtype_bytes + 6 * dim * 4)                      # norm_q, norm_k; scale_shift_table fp32
        + (dim * out_patch + out_patch) * dtype_bytes                         # proj_out
        + 2 * dim * 4                                                         # final scale_shift_table (fp32)
    )
    dense_total, nvfp4_total = other + dense_linears, other + nvfp4_linears
    return {
        "dtype_bytes": dtype_bytes,
        "block_linears": layers * len(shapes),
        "dense_linear_bytes": dense_linears,
        "nvfp4_linear_bytes": nvfp4_linears,
        "other_bytes": other,
        "dense_total_bytes": dense_total,
        "nvfp4_total_bytes": nvfp4_total,
        "saved_bytes": dense_total - nvfp4_total,
        "linear_ratio": dense_linears / nvfp4_linears,
        "total_ratio": dense_total / nvfp4_total,
    }


def format_memory_estimate(est: dict) -> str:
    """Two lines for `fastremover info`."""
    gib = float(1 << 30)
    return (
        f"transformer weights, {8 * est['dtype_bytes']}-bit dense: {est['dense_total_bytes'] / gib:.3f} GiB "
        f"(block linears {est['dense_linear_bytes'] / gib:.3f} GiB)\n"
        f"transformer weights, --weights nvfp4: {est['nvfp4_total_bytes'] / gib:.3f} GiB "
        f"(block linears {est['nvfp4_linear_bytes'] / gib:.3f} GiB, {est['linear_ratio']:.2f}x smaller; "
        f"total {est['total_ratio']:.2f}x)"
    )


# ----------------------------------------------------------------------------------------------------------------------
# The linear methods (ops/linear/registry.py)


def _method(mode: str) -> dict:
    """build / build_fused / prepare_eager of the NVFP4 method in `mode` ("w4a16" or "w4a4")."""

    def build(linear: nn.Module, out_dtype: torch.dtype, gemm: str = "auto") -> LinearLayer:
        if isinstance(linear, Nvfp4Linear):  # the eager model was quantized already: share its layer (no master)
            if linear.mode != mode:
                raise ValueError(f"linear method nvfp4 ({mode}): the model's layer is {linear.mode}")
            return linear
        return Nvfp4Linear(linear, mode, gemm="auto" if gemm in ("auto", "torch", "cublaslt") else gemm)

    def build_fused(linears, out_dtype, gemm="auto") -> LinearLayer:
        # one global scale per tensor: q, k and v keep their own (the eager NVFP4 model's numerics)
        return ConcatLinear([build(l, out_dtype, gemm) for l in linears])

    def prepare_eager(transformer: nn.Module) -> Nvfp4Report:
        return quantize_linears_nvfp4(transformer, w4a4=mode == "w4a4")

    return {"build": build, "build_fused": build_fused, "prepare_eager": prepare_eager, "report_key": "nvfp4"}


W4A16 = register(LinearMethod("nvfp4", ACT_16BIT, **_method("w4a16"), quantized=True,
                              description="NVFP4 weights (packed e2m1 + e4m3 block scales), 16-bit activations (W4A16)"))
W4A4 = register(LinearMethod("nvfp4-w4a4", ACT_16BIT, **_method("w4a4"), quantized=True,
                             description="NVFP4 weights and NVFP4-emulated activations (crop mode only)"))
