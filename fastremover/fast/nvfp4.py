"""NVFP4, the 4-bit block-scaled format of FlashInfer / CUTLASS / TensorRT-LLM, as a torch reference (CPU or GPU).

Format of an [M, K] matrix (K a multiple of 16), quantized row by row in blocks of 16 consecutive elements:

    codes     e2m1 {0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6}: sign bit 3, magnitude index 0..7 in bits 0-2;
              two codes per byte, the even column in the low nibble            -> packed uint8 [M, K/2]
    scales    one e4m3 per block (always >= 0), linear [M, K/16], stored in the 128x4 swizzled block-scale layout
              with rows padded to a multiple of 128 and scale columns to a multiple of 4, padding zeroed
                                                                               -> float8_e4m3fn [Mpad, Cpad]
    global_sf one fp32 per tensor, conventionally 448 * 6 / amax(|x|)          -> fp32 [1]

    x[m, k] ~= e2m1(code[m, k]) * e4m3(scale[m, k // 16]) / global_sf

The quantizer follows FlashInfer's `cvt_warp_fp16_to_fp4` (csrc/nv_internal/tensorrt_llm/kernels/
quantization_utils.cuh, the default recipe, not its TE_EXACT_NVFP4 variant). Every rounding point, in order, for a
block b of 16 elements x_j (fp16/bf16/fp32 input; the fp32 widening is exact):

    (1) amax16  = max_j |x_j|                       exact; NaN elements are skipped (CUDA's __hmax2 returns the
                                                    non-NaN operand), a block of NaNs only gives NaN
    (2) r6      = rcp(6.0)                          FlashInfer: rcp.approx.ftz.f32; "exact": fl(1/6)
    (3) t       = fl(amax16 * r6)                   one rounded fp32 product
    (4) s       = fl(global_sf * t)                 one rounded fp32 product (in this order: g * (amax16 * r6))
    (5) sf      = e4m3_rn_satfinite(s)              round to nearest even, |s| > 448 (and inf) -> 448, NaN -> NaN
    (6) rg      = rcp(global_sf)                    FlashInfer: rcp.approx.ftz.f32; "exact": fl(1/global_sf)
    (7) p       = fl(float(sf) * rg)                one rounded fp32 product
    (8) out_s   = rcp(p) if amax16 != 0 else 0      FlashInfer: rcp.approx.ftz.f32; "exact": fl(1/p)
                                                    (sf == 0 with amax16 != 0 gives out_s = +inf)
    (9) y_j     = fl(x_j * out_s)                   one rounded fp32 product per element
   (10) code_j  = e2m1_rn_satfinite(y_j)            round to nearest even on the e2m1 grid (ties go to the even
                                                    magnitude index: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
                                                    2.5 -> 2, 3.5 -> 4, 5 -> 4), |y| > 6 and inf -> +-6; the sign
                                                    is kept on zero (-0.1 -> code 0x8); NaN -> +6 (0x7), our
                                                    reading of PTX's .satfinite rule for e2m1 (no NaN encoding)

The issue's idealized `e2m1(x * (global_sf / sf))` is the same up to the roundings of (6)-(8). With
reciprocal="exact" every step above is an IEEE operation and this module reproduces it bit for bit on the CPU.
rcp.approx.ftz.f32 has no public bit-level definition (PTX promises a maximum error of 1 ulp and flushes subnormals),
so it is NOT emulated here: the Triton quantizer (kernels/nvfp4.py) uses the instruction itself on the GPU
(reciprocal="approx"), which is what tests/kernels/test_nvfp4_gpu.py compares with FlashInfer.

Dequantization: w_unit = e2m1 * float(sf) is exact in fp32, fp16 and bf16 (at most 2 x 4 significant bits, within
range), so the W4A16 GEMM feeds w_unit to 16-bit MMAs unrounded and applies alpha = fl(1 / global_sf) once to the fp32
accumulator; the dequantized matrix is fl(w_unit * alpha), then cast to the requested dtype.

Swizzle (FlashInfer's get_sf_out_offset_128x4, vLLM's swizzle_blockscale): the zero-padded [Mpad, Cpad] scale matrix
viewed as (Mpad/128, 4, 32, Cpad/4, 4) = (m_tile, m_inner, m_outer, c_tile, c_inner) with m = 128 m_tile + 32 m_inner +
m_outer, c = 4 c_tile + c_inner, permuted to (m_tile, c_tile, m_outer, m_inner, c_inner) and stored contiguously:
    offset(m, c) = (m // 128) * (Cpad * 128) + (c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16  # elements per scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SF_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: global_sf = 2688 / amax puts the tensor's largest block at sf 448
ROW_TILE = 128  # swizzle tile: 128 rows x 4 scale columns
COL_TILE = 4
RECIPROCALS = ("exact",)  # the torch reference; the Triton kernels also have "approx" (GPU only)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8 = torch.float8_e4m3fn


@dataclass
class Nvfp4Tensor:
    """A quantized [rows, cols] matrix: packed codes [rows, cols/2] uint8, swizzled scales [Mpad, Cpad] e4m3 and
    global_scale [1] fp32 (see the module docstring)."""

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.global_scale))


# ----------------------------------------------------------------------------------------------------------------------
# Element formats


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15) with round-to-nearest-even and saturation (rounding point (10)).

    The magnitude index is the number of grid midpoints below |y|; a midpoint that lies exactly on |y| counts only when
    it leads to an even index (ties to even)."""
    a = y.abs()
    nan = torch.isnan(y)
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
           + (a > 5.0)).to(torch.uint8)
    sign = (torch.signbit(y) & ~nan).to(torch.uint8) << 3
    return torch.where(nan, torch.full_like(mag, 7), mag | sign)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> fp32 values (code 8 is -0.0)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def e4m3_satfinite(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, |s| > 448 and +-inf -> +-448, NaN -> NaN (rounding point (5);
    PTX cvt.rn.satfinite.e4m3x2.f32, CUDA's __nv_fp8_e4m3(float)). torch's own cast is not saturating (>= 464 -> NaN),
    so clamp first (clamp keeps NaN)."""
    return s.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def reciprocal(v: torch.Tensor, mode: str) -> torch.Tensor:
    """fp32 1/v for rounding points (2), (6), (8). Only "exact" (IEEE, correctly rounded) exists in torch."""
    if mode != "exact":
        raise ValueError(
            f"reciprocal={mode!r}: the torch reference implements only 'exact'; rcp.approx.ftz.f32 has no public "
            "bit-level definition, so reciprocal='approx' runs only in the Triton quantizer on a GPU"
        )
    return torch.reciprocal(v.float())


# ----------------------------------------------------------------------------------------------------------------------
# Packing and the swizzled scale layout


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[M, K] codes 0..15 -> [M, K/2] bytes, column 2j in the low nibble, 2j+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[M, K/2] bytes -> [M, K] codes 0..15 (inverse of pack_nibbles)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def padded_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """(Mpad, Cpad) of the swizzled scales of an [rows, cols] matrix: rows up to a multiple of 128, cols/16 scale
    columns up to a multiple of 4."""
    c = cols // BLOCK
    return -(-rows // ROW_TILE) * ROW_TILE, -(-c // COL_TILE) * COL_TILE


def swizzled_offset(m: int, c: int, cpad: int) -> int:
    """Storage offset of scale (row m, scale column c) in the swizzled layout with cpad padded scale columns."""
    return (m // 128) * (cpad * 128) + (c // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4


def swizzle_scales(sf: torch.Tensor) -> torch.Tensor:
    """Linear [M, C] scales -> swizzled [Mpad, Cpad] (same dtype; padding zero); storage order as in the docstring."""
    m, c = sf.shape
    mpad, cpad = -(-m // ROW_TILE) * ROW_TILE, -(-c // COL_TILE) * COL_TILE
    raw = sf.view(torch.uint8) if sf.dtype == FP8 else sf
    padded = torch.zeros((mpad, cpad), dtype=raw.dtype, device=sf.device)
    padded[:m, :c] = raw
    tiles = padded.view(mpad // 128, 4, 32, cpad // 4, 4).permute(0, 3, 2, 1, 4).contiguous()
    out = tiles.view(mpad, cpad)
    return out.view(FP8) if sf.dtype == FP8 else out


def unswizzle_scales(sw: torch.Tensor, rows: int, cols16: int) -> torch.Tensor:
    """Swizzled [Mpad, Cpad] -> linear [rows, cols16] (inverse of swizzle_scales, padding dropped)."""
    mpad, cpad = sw.shape
    raw = sw.view(torch.uint8) if sw.dtype == FP8 else sw
    lin = raw.reshape(mpad // 128, cpad // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(mpad, cpad)
    lin = lin[:rows, :cols16].contiguous()
    return lin.view(FP8) if sw.dtype == FP8 else lin


# ----------------------------------------------------------------------------------------------------------------------
# Quantize / dequantize


def check_matrix(name: str, x: torch.Tensor) -> None:
    """x must be a 2-D fp16/bf16/fp32 tensor whose column count is a positive multiple of 16."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {type(x).__name__} {getattr(x, 'shape', '')}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be fp16, bf16 or fp32, got {x.dtype}")
    if x.shape[1] == 0 or x.shape[1] % BLOCK:
        raise ValueError(f"{name} needs a column count that is a positive multiple of {BLOCK}, got {x.shape[1]}")


def global_scale_of(x: torch.Tensor) -> torch.Tensor:
    """[1] fp32 global_sf = fl(2688 / amax), amax over the finite elements of x; 1.0 when that amax is 0 (an all-zero
    tensor quantizes to zero codes and zero scales at any global_sf)."""
    a = x.detach().float().abs()
    amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax() if a.numel() else a.new_zeros(())
    g = torch.where(amax > 0, torch.tensor(GLOBAL_SF_NUMERATOR, device=a.device) / amax, torch.ones_like(amax))
    return g.reshape(1).to(torch.float32)


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [M, K/16] fp32 max |x| per block, NaN skipped; NaN only for a block of NaNs (rounding point (1))."""
    a = x.float().abs().unflatten(-1, (-1, BLOCK))
    nan = torch.isnan(a)
    amax = torch.where(nan, torch.zeros_like(a), a).amax(-1)
    return torch.where(nan.all(-1), torch.full_like(amax, float("nan")), amax)


def block_scales(amax16: torch.Tensor, global_sf: torch.Tensor, reciprocal_mode: str = "exact"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounding points (2)-(8): block amax [M, C] fp32 -> (sf e4m3 [M, C], out_scale fp32 [M, C])."""
    g = global_sf.float().reshape(())
    r6 = reciprocal(torch.tensor(E2M1_MAX, device=amax16.device), reciprocal_mode)
    t = amax16 * r6
    sf = e4m3_satfinite(g * t)
    p = sf.float() * reciprocal(g, reciprocal_mode)
    out_scale = torch.where(amax16 != 0, reciprocal(p, reciprocal_mode), torch.zeros_like(p))
    return sf, out_scale


def quantize_codes(x: torch.Tensor, global_sf: torch.Tensor, reciprocal_mode: str = "exact"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (codes uint8 [M, K] unpacked, linear scales e4m3 [M, K/16]): rounding points (1)-(10)."""
    check_matrix("x", x)
    sf, out_scale = block_scales(block_amax(x), global_sf, reciprocal_mode)
    y = x.float().unflatten(-1, (-1, BLOCK)) * out_scale[..., None]
    return e2m1_codes(y).flatten(-2), sf


def quantize_reference(x: torch.Tensor, global_sf: torch.Tensor | None = None, *, reciprocal: str = "exact"
                       ) -> Nvfp4Tensor:
    """[M, K] fp16/bf16/fp32 (K % 16 == 0) -> Nvfp4Tensor. global_sf: [1] fp32 (default global_scale_of(x))."""
    check_matrix("x", x)
    if global_sf is None:
        global_sf = global_scale_of(x)
    global_sf = global_sf.to(device=x.device, dtype=torch.float32).reshape(1)
    codes, sf = quantize_codes(x, global_sf, reciprocal)
    return Nvfp4Tensor(pack_nibbles(codes), swizzle_scales(sf), global_sf.clone())


def linear_scales(t: Nvfp4Tensor) -> torch.Tensor:
    """The [M, K/16] e4m3 scales of t in row order."""
    m, k = t.shape
    return unswizzle_scales(t.scales, m, k // BLOCK)


def unit_weight(t: Nvfp4Tensor) -> torch.Tensor:
    """[M, K] fp32 e2m1 * float(sf): exact, and exactly representable in fp16 and bf16 (what the W4A16 MMA reads)."""
    vals = e2m1_values(unpack_nibbles(t.packed)).unflatten(-1, (-1, BLOCK))
    return (vals * linear_scales(t).float()[..., None]).flatten(-2)


def alpha_of(global_sf: torch.Tensor) -> torch.Tensor:
    """[1] fp32 alpha = fl(1 / global_sf): the dequantization factor applied after the block scales."""
    return torch.reciprocal(global_sf.float().reshape(1))


def dequantize_reference(t: Nvfp4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[M, K] in dtype: fl(unit_weight * alpha), then cast."""
    return (unit_weight(t) * alpha_of(t.global_scale)).to(dtype)


def fake_quantize(x: torch.Tensor, *, reciprocal: str = "exact") -> torch.Tensor:
    """x [..., K] -> dequantize(quantize(x)) in x's dtype, with x's own global scale (the W4A4 emulation of
    activations: dynamic per-tensor global_sf, per-16 block scales along K)."""
    flat = x.reshape(-1, x.shape[-1])
    return dequantize_reference(quantize_reference(flat, reciprocal=reciprocal), x.dtype).reshape(x.shape)


def w4a16_linear_reference(x: torch.Tensor, t: Nvfp4Tensor, bias: torch.Tensor | None = None,
                           gelu: bool = False) -> torch.Tensor:
    """The W4A16 GEMM's math in fp32: y = (x @ unit_weight.T) * alpha (+ bias) (then tanh-GELU), cast to x.dtype.
    x [M, K]; returns [M, N]."""
    y = (x.float() @ unit_weight(t).t()) * alpha_of(t.global_scale)
    if bias is not None:
        y = y + bias.float()
    if gelu:
        y = torch.nn.functional.gelu(y, approximate="tanh")
    return y.to(x.dtype)
