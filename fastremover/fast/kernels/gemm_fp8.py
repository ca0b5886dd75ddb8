"""The FFN's first FP8 GEMM with its tanh-GELU and the static-scale e4m3 quantization in the epilogue (Hopper, TMA).

The fast transformer's default on sm_90 (transformer_fast.py, `fused_ffn1`; FASTREMOVER_FUSED_FFN1=0 turns it off).
It replaces this pair, which still runs everywhere else:

    h     = torch._scaled_mm(a, w.T, scale_a=sa, scale_b=sw, bias=b, out_dtype=fp16)   # [M, F] 16-bit, written
    codes = quant_fp8_static(h, amax, gelu=True)                                          # read back, e4m3 written

with one kernel that never writes h: y = acc * sa[m] * sw[n] + b[n] in fp32 from the tensor cores' fp32 accumulator,
the tanh-GELU of y, codes = RNE_e4m3(gelu * fl(448 / max(amax, 1e-12))) (quant.py's rule), plus the [M, 1] row-scale
vector (every row max(amax, 1e-12) / 448) that the next FP8 GEMM reads as its row-wise scale.

The GELU form decides whether the fusion pays (bench/results/ffn1-fused-gemm-shipped-*.json, H200, same inputs):
quant.py's sigmoid form x / (1 + exp(-2u)) costs an ex2 and a division per element, and the epilogue then eats the
saved memory traffic (W2's [32760, 1536] x [1536, 8960]: 0.915 ms against 0.901 for the pair); 0.5 x (1 + tanh(u))
with the MUFU's `tanh.approx.f32` takes 0.781 ms (W1, M = 7290: 0.1765 against 0.2258 ms at 128 x 128 tiles with
two CTAs per SM). tanh.approx's relative error (~2^-11) is far below an e4m3 step (2^-4).

This is a lossy path next to the pair, not a bit-exact one: the pair rounds h to fp16 before the GELU, this kernel
does not, its GELU is approximate, and its accumulation order differs from cuBLAS's. The codes agreed with the pair's
on 99.77 % (W2) / 99.79 % (W1) of elements and were never more than one e4m3 step apart (same file).
tests/kernels/test_gemm_fp8.py asserts that bound against the fp32 composition `gemm_fp8_gelu_quant_reference`
(interpreter, both GELU forms) and, at the real shape on the GPU, against the pair; there it also asserts the kernel
is as close to the fp32 GEMM as the pair is (both accumulate FP8 products without fp32 promotion).

Kernel: persistent (CTAs-per-SM programs per SM, tiles in grouped order so GROUP_M row tiles share their B tiles in
L2), A [M, K] and B [N, K] e4m3 K-major through TMA descriptors, fp32 accumulation (tl.dot of e4m3 on wgmma), the
codes stored through a TMA descriptor. Two CTAs per SM let one CTA's epilogue overlap the other's main loop; they
need 4 warps (at 8 the 128 x 128 kernels take 178-193 registers per thread: two CTAs would not fit the SM's 64K).

Gate (`fused_ffn1_available`): CUDA sm_90 exactly (the configurations are Hopper's; other GPUs keep the pair),
Triton with host tensor descriptors, and K and N multiples of 16 (TMA's 16-byte row strides). The interpreter runs
the kernel on the CPU for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastremover.fast.kernels._common import (
    check_device,
    check_tensor,
    interpreting,
    launch_options,
    quantize_fp8,
)
from fastremover.fast.kernels.quant import GELU_BETA, GELU_KAPPA, gelu_tanh_f32_device

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: no host descriptors, the fused path is unavailable
    TensorDescriptor = None

FP8 = torch.float8_e4m3fn
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, CTAs per SM, GELU form): bench/results/ffn1-fused-gemm-*.json.
# CTAs per SM > 1 launches that many persistent programs per SM (they must fit its shared memory and registers
# together): one program's epilogue then overlaps another's main loop. GELU form "sigmoid" is quant.py's
# x / (1 + exp(-2u)); "tanh" is 0.5 x (1 + tanh(u)) with the MUFU's tanh.approx.f32 (one special-function op instead
# of ex2 + a division; max relative error ~2^-11, far below an e4m3 step), the formula in the interpreter. Up to
# SMALL_M rows the smaller tiles (more tiles to spread over the SMs; the module docstring has the measurements).
CONFIG = (128, 256, 128, 8, 3, 8, 1, "tanh")
CONFIG_SMALL_M = (128, 128, 128, 8, 3, 4, 2, "tanh")
SMALL_M = 16384
INTERPRETER_CONFIG = (32, 32, 32, 2, 2, 4, 1, "sigmoid")
GELU_FORMS = ("sigmoid", "tanh")


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles sweep the columns together (their B tiles stay in L2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@triton.jit
def gelu_tanh_approx_device(x, INTERPRET: tl.constexpr):
    """fp32 tanh-GELU as 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): tanh.approx.f32 on the GPU, the
    exact tanh formula (1 - e) / (1 + e), e = exp(-2|u|), with u's sign, in the interpreter."""
    u = GELU_BETA * tl.fma(GELU_KAPPA, (x * x) * x, x)
    if INTERPRET:
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(u < 0, -t, t)
    else:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                      pack=1)
    h = 0.5 * x
    return tl.fma(h, t, h)


@triton.jit(do_not_specialize=["M"])  # M: tile count and row masks only (TMA clips the edges)
def _gemm_gelu_quant_kernel(
    a_desc, b_desc, c_desc, SA, SW, BIAS, AMAX, RS, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, TANH: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    amax = tl.maximum(tl.load(AMAX), 1e-12)
    inv = tl.math.div_rn(448.0, amax)
    row_scale = tl.math.div_rn(amax, 448.0)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BLOCK_K)):
            acc = tl.dot(a_desc.load([off_m, ki * BLOCK_K]), b_desc.load([off_n, ki * BLOCK_K]).T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        sa = tl.load(SA + rows, mask=rows < M, other=0.0)
        sw = tl.load(SW + cols, mask=cols < N, other=0.0)
        b = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = acc * sa[:, None] * sw[None, :] + b[None, :]  # three rounded fp32 ops (launches never fuse into FMAs)
        if TANH:
            g = gelu_tanh_approx_device(y, INTERPRET)
        else:
            g = gelu_tanh_f32_device(y, INTERPRET)
        c_desc.store([off_m, off_n], quantize_fp8(g, inv, INTERPRET))
        # the row scales from the first column tile of each row block (a mask, not an `if`: a branch inside the
        # flattened persistent loop breaks Triton 3.6's loop fusion pass)
        first_col_tile = (tl.zeros_like(rows) + pid_n) == 0
        tl.store(RS + rows, tl.broadcast_to(row_scale, rows.shape), mask=(rows < M) & first_col_tile)


def fused_ffn1_available(device: torch.device, k: int, n: int) -> bool:
    """The fused kernel can run here: an sm_90 GPU (or the interpreter), Triton's host tensor descriptors, and
    16-byte TMA row strides (K and N multiples of 16 e4m3 elements)."""
    if TensorDescriptor is None or k % 16 or n % 16:
        return False
    if interpreting(_gemm_gelu_quant_kernel):
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def gemm_fp8_gelu_quant(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor,
    amax: torch.Tensor, *, config: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, K] e4m3 contiguous with a_scale [M, 1] fp32 (row-wise), w [N, K] e4m3 contiguous with w_scale [1, N] fp32
    (per output channel), bias [N] fp16/bf16/fp32, amax [1] fp32 (the GELU output's static bound) -> (codes e4m3
    [M, N], row_scale fp32 [M, 1], every row max(amax, 1e-12) / 448): see the module docstring."""
    check_tensor("a", a, ndim=2, dtypes=(FP8,))
    m, k = a.shape
    check_tensor("w", w, ndim=2, dtypes=(FP8,))
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"w must be [N, {k}] to match a [M, {k}], got {list(w.shape)}")
    check_tensor("a_scale", a_scale, ndim=2, dtypes=(torch.float32,), shape=(m, 1))
    check_tensor("w_scale", w_scale, ndim=2, dtypes=(torch.float32,), shape=(1, n))
    check_tensor("bias", bias, ndim=1, dtypes=(torch.float16, torch.bfloat16, torch.float32), shape=(n,))
    check_tensor("amax", amax, ndim=1, dtypes=(torch.float32,), shape=(1,))
    check_device(_gemm_gelu_quant_kernel, a=a, a_scale=a_scale, w=w, w_scale=w_scale, bias=bias, amax=amax)
    if not fused_ffn1_available(a.device, k, n):
        raise ValueError(f"gemm_fp8_gelu_quant needs an sm_90 GPU with Triton tensor descriptors and K, N multiples of "
                         f"16 (got device {a.device}, K={k}, N={n}); use _scaled_mm + quant_fp8_static instead")
    codes = torch.empty((m, n), dtype=FP8, device=a.device)
    row_scale = torch.empty((m, 1), dtype=torch.float32, device=a.device)
    if m == 0:
        return codes, row_scale
    if config is None:  # the interpreter (tests) gets small tiles: the real ones would be mostly padding there
        if interpreting(_gemm_gelu_quant_kernel):
            config = INTERPRETER_CONFIG
        else:
            config = CONFIG_SMALL_M if m <= SMALL_M else CONFIG
    bm, bn, bk, group_m, stages, warps, ctas_per_sm, gelu = config
    if gelu not in GELU_FORMS:
        raise ValueError(f"gemm_fp8_gelu_quant: GELU form {gelu!r} is not one of {GELU_FORMS}")
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if interpreting(_gemm_gelu_quant_kernel):
        programs = min(4, tiles)
    else:
        programs = min(ctas_per_sm * torch.cuda.get_device_properties(a.device).multi_processor_count, tiles)
    _gemm_gelu_quant_kernel[(programs,)](
        TensorDescriptor(a, [m, k], [k, 1], [bm, bk]), TensorDescriptor(w, [n, k], [k, 1], [bn, bk]),
        TensorDescriptor(codes, [m, n], [n, 1], [bm, bn]), a_scale, w_scale, bias, amax, row_scale, m, n, k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, NUM_PROGRAMS=programs, TANH=gelu == "tanh",
        INTERPRET=interpreting(_gemm_gelu_quant_kernel), num_stages=stages, num_warps=warps,
        **launch_options(_gemm_gelu_quant_kernel),
    )
    return codes, row_scale


def gemm_fp8_gelu_quant_reference(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor,
    amax: torch.Tensor, **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager fp32 composition of the same math: (a @ w.T) * sa * sw + bias in fp32, then quant_fp8_static_reference's
    GELU and codes (torch's F.gelu tanh form)."""
    from fastremover.fast.kernels.quant import quant_fp8_static_reference

    y = (a.float() @ w.float().t()) * a_scale * w_scale + bias.float()
    return quant_fp8_static_reference(y, amax, gelu=True)
