"""The linear-method registry: how the fast transformer's block linears are stored and what activation format they read.

A *linear method* turns the eager model's `nn.Linear` layers into inference layers once, when the FastTransformer is
built, and declares the activation format its layers consume. The transformer asks the method and its layers; it
never compares method names.

    method.activation        ACT_16BIT ("16bit": a [M, K] tensor in the model dtype) or ACT_FP8_ROWWISE
                             ("fp8-rowwise": an `Fp8Activation`, e4m3 codes [M, K] + fp32 row scales [M, 1]). The
                             fused norm kernels (adaln_modulate / gate_residual_adaln with fp8=True) and the row-wise
                             quantizers produce the second; `method.wrap` turns their (codes, row_scale) output into
                             the typed object, `method.quantize_input` brings a 16-bit tensor into the format.
    method.build(linear, out_dtype, gemm)           one layer (a `LinearLayer`)
    method.build_fused(linears, out_dtype, gemm)    one layer whose output is the given linears' outputs side by side
                                                    (q/k/v); exact where the method's scales are per output channel
    layer(x, bias=None)      x in the method's activation format -> [M, N] in out_dtype; `bias` replaces the layer's
                             own bias for this call (a per-call constant folded into the GEMM epilogue)
    layer.gelu(x)            tanh-GELU of layer(x) (a method may fuse it into its GEMM)
    layer.weight_row_norms() [N] fp32 L2 norms of the weight rows the GEMM multiplies by (the FFN's static bound)
    layer.fused_gelu_quant_available(device), layer.gelu_quant(x, bias, amax)
                             optional: ff1 + GELU + its static-bound FP8 quantization in one kernel

Registered (each method's module registers itself; `fastremover.ops.linear` imports them): `dense` (here: F.linear
on the model dtype), `fp8-rowwise` (fp8_rowwise.py: per-output-channel e4m3 weights, per-row e4m3 activations,
cuBLASLt / _scaled_mm), `nvfp4` (nvfp4.py, W4A16) and `nvfp4-w4a4` (activations fake-quantized to NVFP4 too). Adding a
method is one file that calls `register(method)` plus its import in ops/linear/__init__.py (a sharded linear is meant to
be one more entry); the tests register a dummy.

The engine (engine/build.py) picks the method for a plan (`fast`: fp8-rowwise, `exact`: dense, `eager`: the stored
`--weights`) and passes it on: to the FastTransformer, which builds its layers with `build` / `fused`, or, in the eager
mode, to `prepare_eager(transformer) -> report` (a method whose layers replace the eager model's block linears in
place; the report's `summary()` is a note and its `describe()` goes into the ResolvedEngine under `report_key`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

ACT_16BIT = "16bit"
ACT_FP8_ROWWISE = "fp8-rowwise"
ACTIVATION_FORMATS = (ACT_16BIT, ACT_FP8_ROWWISE)


@dataclass(frozen=True)
class Fp8Activation:
    """An FP8 row-wise activation: codes [M, K] float8_e4m3fn and row_scale [M, 1] fp32, x ~= codes * row_scale."""

    codes: torch.Tensor
    row_scale: torch.Tensor

    @classmethod
    def of(cls, produced) -> "Fp8Activation":
        """The typed form of a kernel's (codes, row_scale) output (an Fp8Activation passes through)."""
        if isinstance(produced, cls):
            return produced
        codes, row_scale = produced
        return cls(codes, row_scale)

    def rows(self, rows: slice) -> "Fp8Activation":
        """A row slice (views of both tensors)."""
        return Fp8Activation(self.codes[rows], self.row_scale[rows])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.row_scale).to(dtype)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


class LinearLayer(nn.Module):
    """What the fast transformer calls (see the module docstring). Subclasses implement forward and
    weight_row_norms; gelu and the fused GELU quantization have generic defaults."""

    in_features: int
    out_features: int

    def forward(self, x, bias: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def gelu(self, x) -> torch.Tensor:
        return F.gelu(self(x), approximate="tanh")

    def weight_row_norms(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def fused_gelu_quant_available(self, device: torch.device) -> bool:
        return False

    def gelu_quant(self, x, bias: torch.Tensor, amax: torch.Tensor) -> Fp8Activation:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__} has no fused GELU quantization")


def gelu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh(x @ weight.T + bias). On CUDA (2-D x, a bias) one cuBLASLt GEMM with the GELU_BIAS epilogue (torch's
    `_addmm_activation`): the tanh-GELU is applied to the fp32 accumulator before the single rounding to x.dtype,
    where eager rounds the GEMM output first and then runs a separate GELU pass (so results differ by an ulp-level
    rounding, not by formula). Elsewhere: the eager composition."""
    if x.is_cuda and x.dim() == 2 and bias is not None:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


class DenseLinear(LinearLayer):
    """F.linear on the model dtype. Holds the given weight / bias tensors themselves (no copy): the transformer's
    dense layers share their storage with the eager model."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if bias is None else bias)

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_linear(x, self.weight, self.bias)

    def weight_row_norms(self) -> torch.Tensor:
        return self.weight.detach().float().norm(dim=1)


class ConcatLinear(LinearLayer):
    """Several layers on one input, their outputs side by side ([M, sum N]): the fused q/k/v of a method whose weights
    cannot be concatenated exactly (NVFP4's per-tensor global scale)."""

    def __init__(self, layers: Sequence[LinearLayer]):
        super().__init__()
        self.parts = nn.ModuleList(layers)
        self.in_features = layers[0].in_features
        self.out_features = sum(p.out_features for p in layers)

    def forward(self, x, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        splits = bias.split([p.out_features for p in self.parts])
        return torch.cat([p(x, bias=b) for p, b in zip(self.parts, splits)], dim=-1)

    def weight_row_norms(self) -> torch.Tensor:
        return torch.cat([p.weight_row_norms() for p in self.parts])


def concat_linears(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the given Linears' outputs side by side (weights and biases concatenated)."""
    first = linears[0]
    fused = nn.Linear(first.in_features, sum(l.out_features for l in linears), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([l.weight for l in linears]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([l.bias for l in linears]))
    return fused


# ----------------------------------------------------------------------------------------------------------------------
# Methods


@dataclass(frozen=True)
class LinearMethod:
    """A registry entry. build(linear, out_dtype, gemm) -> LinearLayer; build_fused(linears, out_dtype, gemm) ->
    LinearLayer (default: build on the concatenated weights); quantize_input(x, ops) -> the activation format
    (default: identity for 16-bit methods, ops.quant_rowwise for FP8 ones); quantized: whether its weights are
    quantized (a record for describe())."""

    name: str
    activation: str
    build: Callable[..., LinearLayer]
    build_fused: Callable[..., LinearLayer] | None = None
    quantize_input: Callable | None = None
    quantized: bool = False
    description: str = ""
    prepare_eager: Callable | None = None  # (eager RemoverTransformer) -> report; None: the eager model runs as stored
    report_key: str | None = None  # the ResolvedEngine field prepare_eager's report is recorded in

    def __post_init__(self):
        if self.activation not in ACTIVATION_FORMATS:
            raise ValueError(f"linear method {self.name!r}: activation must be one of {ACTIVATION_FORMATS}, "
                             f"got {self.activation!r}")

    @property
    def fp8_activations(self) -> bool:
        """The norm kernels must write e4m3 codes + row scales for this method's layers."""
        return self.activation == ACT_FP8_ROWWISE

    def fused(self, linears: Sequence[nn.Linear], out_dtype: torch.dtype, gemm: str = "auto") -> LinearLayer:
        if self.build_fused is not None:
            return self.build_fused(linears, out_dtype, gemm)
        return self.build(concat_linears(linears), out_dtype, gemm)

    def wrap(self, produced):
        """A producing kernel's output in this method's activation format (tuples become Fp8Activation)."""
        return Fp8Activation.of(produced) if self.fp8_activations else produced

    def prepare(self, x: torch.Tensor, ops) -> object:
        """A 16-bit [M, K] tensor brought into this method's activation format (`ops`: the transformer's kernel set)."""
        if self.quantize_input is not None:
            return self.quantize_input(x, ops)
        return Fp8Activation.of(ops.quant_rowwise(x)) if self.fp8_activations else x


_REGISTRY: dict[str, LinearMethod] = {}


def register(method: LinearMethod, *, replace: bool = False) -> LinearMethod:
    if method.name in _REGISTRY and not replace:
        raise ValueError(f"linear method {method.name!r} is registered already")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    return list(_REGISTRY)


def get(method: "str | LinearMethod") -> LinearMethod:
    if isinstance(method, LinearMethod):
        return method
    try:
        return _REGISTRY[method]
    except KeyError:
        raise ValueError(f"unknown linear method {method!r}: choose one of {names()}") from None


def _dense(linear: nn.Linear, out_dtype: torch.dtype, gemm: str = "auto") -> LinearLayer:
    return DenseLinear(linear.weight, linear.bias)


register(LinearMethod("dense", ACT_16BIT, _dense, description="16-bit weights, F.linear / cuBLAS"))
