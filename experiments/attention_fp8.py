"""8-bit (FP8 e4m3) flash attention for Hopper in Triton, its quantization pass and eager references.

    q8, k8, v8, sc = quantize_qkv_fp8(q, k, v)                      # fp16/bf16/fp32 [B, S, H, D] -> e4m3 + scales
    o = attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v)                 # [B, S, H, D] fp16 (out_dtype)
    o = attention_fp8_qkv(q, k, v)                                  # both steps: the drop-in backend form

A lab experiment, not part of the package (it was the `triton-fp8` attention backend, the fast mode's last fallback,
no faster than SDPA; removed from the product). Import it with experiments/ on sys.path (`import attention_fp8`); the
benchmark and the offline sm_90 codegen report: experiments/bench_attention_fp8.py. Its tests were not kept
(experiments are not tested; the last version is tests/test_attention_fp8.py in git history).

Non-causal softmax(q k^T * sm_scale) v with sm_scale = 1/sqrt(D) by default, q, k, v as [B, S, H, D] (the
projections' layout; any strides in B, S, H), D in {64, 128}, any S (the last key block is masked).

Numerics (what the kernel computes; `attention_fp8_reference` emulates it step by step):
  * Inputs are e4m3 codes with fp32 dequantization scales (real = code * scale): per tensor (a 1-element tensor)
    or per (batch, head) ([B, H] tensor). The scales never touch the codes inside the kernel: the logits are the
    exact fp8 x fp8 products accumulated by the tensor cores in fp32, then multiplied by
    c = q_scale * k_scale * sm_scale * log2(e) (log2(e) folded in so that the softmax uses exp2).
  * Online softmax in fp32 over key blocks of BLOCK_N: running row max m (base-2 units), l = sum of p,
    acc = sum of p v rescaled by exp2(m_old - m_new) whenever the max grows.
  * P is quantized to e4m3 for the P @ V product with a fixed per-tensor scale of 2^8 = 256:
        p = exp2(x - m + 8)  in [0, 256],   P8 = RNE_e4m3(p)
    256 is the largest power of two <= 448 (e4m3's max), so p never saturates and the scale is exact (folded into
    the exp2 argument: no multiply). Relative precision 2^-4 for p >= 2^-6 (P >= 2^-14 of the running max);
    smaller p are e4m3 subnormals (absolute step 2^-9, i.e. 2^-17 in P units) and p < 2^-10 rounds to 0. The
    quantization is relative to the *running* max m of the current block, not the final row max (exactly what
    the reference emulates with block_n = BLOCK_N; block_n=None gives the ideal global-max variant). l sums the
    unquantized fp32 p; o = acc * v_scale / l at the end (the 256 cancels).
  * P @ V: V is the B operand. Hopper's fp8 wgmma only takes a K-major B, i.e. V stored with the *sequence*
    contiguous ([D, S] per head). quantize_qkv_fp8 writes v8 that way ([B, H, D, S_pad] memory, returned as a
    [B, S, H, D] view with stride 1 along S), so the attention kernel reads it directly; a v with stride 1 along D
    is transposed into such a copy by attention_fp8 first (one extra pass over V, S*H*D bytes each way: tens of
    microseconds at S = 32760, H = 12, D = 128, against ~8 ms of attention). Fed untransposed (transpose_v=False),
    Triton transposes every fp8 V tile through shared memory itself (the sm_90 SASS gains ~130 STS and ~100 PRMT
    per key block); experiments/bench_attention_fp8.py --bench measures all three.
  * Accumulation of P @ V (config `pv_acc`): Hopper's fp8 MMA accumulates with reduced precision inside the tensor
    core (SageAttention2 and DeepSeek-V3 report ~22-bit / ~14-bit-mantissa behaviour), so chaining all 256 key
    blocks through one MMA accumulator drifts. pv_acc=1 (default) computes each block's P @ V in a fresh MMA
    accumulator (zero-initialised) and adds it to the fp32 running sum on the CUDA cores as acc * alpha + PV: the
    rescale multiply becomes an FMA, so no extra instruction (checked in the sm_90 SASS; it costs ~16 registers).
    pv_acc=0 chains (the Triton-tutorial form); pv_acc=2 asks Triton for the promotion through
    max_num_imprecise_acc=BLOCK_N, which it implements by waiting after every k-step (slower). The bench reports
    both against the emulation.

Fidelity to expect (float64 emulation at the real shape S = 32760, D = 128, N(0, 1) inputs, 384 query rows, vs
exact attention): 1 - cos = 1.46e-3 (cos 0.9985), of which q/k quantization 7.8e-4, v 3.3e-4, P 3.5e-4; the same
with a per-channel K offset of 4 sigma when smoothed (0.9985; 0.9929 unsmoothed); block-running-max vs global-max
P quantization makes no difference. e4m3's relative precision does not depend on the scale, so finer scales do not
help Gaussian data (they help outliers); reaching 0.999 needs a finer QK product, e.g. INT8 q/k with per-block
scales (SageAttention's choice; same tensor-core rate on Hopper), which would cut the q/k term about 3x.

Quantization (quantize_qkv_fp8), all on the device, no host sync:
  * K smoothing (smooth_k=True): the mean of K over the sequence per (batch, head, channel) is subtracted before
    quantizing. q . (k - mu) = q . k - q . mu: a per-query constant added to every logit of a row, which softmax
    removes exactly; it takes the common offset (a per-channel bias, frequent in real K) out of the 8-bit range.
  * scale = max(amax, 1e-12) / 448, codes = RNE_e4m3(y * (448 / max(amax, 1e-12))) (both divisions correctly
    rounded, once per scale; a rounded fp32 product per element), the house rule of fastremover.fast.kernels.quant;
    granularity "head" (default: one scale per (batch, head) and tensor, free in the kernel) or "tensor".
  * Pass 1 (one read of q, k, v): per chunk of rows and (batch, head): amax |q|, amax |v|, and per channel
    sum / max / min of k. The (tiny) partials are reduced with torch on the device: mu = sum / S and
    amax |k - mu| = max_c max(kmax_c - mu_c, mu_c - kmin_c), which equals the elementwise amax exactly (fp32
    subtraction is monotonic). Pass 2 (one more read, one write): the codes, q8 and k8 as [B, H, S, D] memory,
    v8 transposed as [B, H, D, S_pad] (S_pad = S rounded up to 16 for TMA's 16-byte stride rule, pad = 0).
  * The eager reference quantize_qkv_fp8_reference gives bit-identical scales and codes (given the same K mean;
    the kernel's fp32 mean differs from torch's in the last bits because the summation order differs).

Kernel (Hopper): one program per (BLOCK_M query rows, batch * head); grid axis 0 runs over the query blocks of one
head first, so the ~132 resident programs stream the same head's K and V through L2. Compile-time options
(AttnConfig): BLOCK_M, BLOCK_N, num_warps, num_stages; `tma` = 0 pointer loads (cp.async pipelining), 1 host TMA
descriptors over a 2-D view of q/k/v (the quantizer's heads-major layout, or a [B, S, (3,) H, D] buffer view), 2
device-side TMA descriptors per (batch, head) (any 16-byte aligned strides); `warp_spec` = Triton's automatic warp
specialization of the key loop (tl.range(warp_specialize=True)). The full key blocks run unmasked; the last,
partial block runs in a second loop of 0 or 1 trips, masked (-inf logits past S; TMA zero-fills past the view).
Facts from compiling every config for sm_90 here (experiments/bench_attention_fp8.py --codegen, Triton 3.6 as on the H200; Triton ships ptxas):
  * both products are QGMMA (fp8 wgmma: QK^T from shared memory, P from registers); P's change from accumulator
    to operand layout is shuffles and byte permutes (as in FA3), no shared-memory round trip; no spills;
  * per key block and thread (8 warps, 128 x 128): 64 MUFU.EX2, ~130 FFMA, ~70 FADD, ~68 FMNMX, 32 F2FP (P ->
    e4m3 pairs), ~56 SHFL/PRMT/SEL. Per 128 x 128 key block a program does 8.4 MFLOP of fp8 MMA (~1100 cycles
    of one SM's tensor cores at peak) and 16 K exp2 (~1030 cycles of its 16/clock MUFU): the softmax costs as
    much as the MMAs, so speed comes from overlapping one warpgroup's softmax with the other's MMAs.
    (Emulating part of exp2 on the FMA pipe, as FA4 does on Blackwell, was tried: the split/join of the tile is
    free, but the 8 extra instructions per element make the issue rate the limit instead; not kept.)
  * Triton 3.6's Hopper warp specialization only applies with num_warps=4 (it then adds a producer warp for the
    TMA loads and splits the 128 rows over two consumer warpgroups, registers rebalanced with setmaxnreg; the
    consumers sync through mbarriers only, where the 8-warp build has a CTA barrier per key block that keeps the
    two warpgroups in lockstep), only with TMA loads (Q included), and not if the kernel has an `if` that yields
    values (hence the tail loop). Triton 3.9 rejects it for this kernel; the tuner then skips those configs.
The launch keeps Triton's default FMA contraction and flush-to-zero exp2 (unlike the bit-exact elementwise kernels
of this package): this kernel is held to a tolerance, not bit-exactness, and extra instructions in the softmax
cost throughput.

Autotuning (compiled path): the first call for a (B, S, H, D, layout) key compiles and runs each of AUTOTUNE_CONFIGS
(three; the warp-specialized ones are out, see AUTOTUNE_CONFIGS) on the real inputs, checks each result on sampled rows against the emulating reference (rel. L2 error <=
VALIDATE_REL_L2 = 5 %, a sanity bound that rejects broken builds; precision is judged by the tests and the bench),
times it (median of a few runs) and keeps the fastest valid one. A config that fails to compile is skipped and
reported (Triton prints the failing pass's IR to stderr; that is noise, not an error of the run). Tuning cannot run
inside CUDA graph capture: call once per shape before capturing. FASTREMOVER_FP8_ATTN_CONFIG=<name> forces one
config (no tuning); FASTREMOVER_FP8_ATTN_CONFIGS=<name>,<name> restricts the candidates. `tuning_report()` returns
what was measured; progress goes to stderr.

Interpreter (TRITON_INTERPRET=1, CPU tests): the same kernel code runs, with the fp32 -> e4m3 cast of P replaced by
the bit-exact emulation of fastremover.fast.kernels._common (the interpreter's own cast is wrong) and fp32 -> bf16
for the output likewise; fp8 x fp8 dots work there (exact products, fp32 sums).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastremover.fast.kernels._common import (
    FLOAT_DTYPES,
    FP8_MAX,
    SCALE_FLOOR,
    check_device,
    check_tensor,
    f32_to_fp8e4m3_rne,
    interpreting,
    launch_options,
    load_f32,
    quantize_fp8,
    round_to,
)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4
    TensorDescriptor = None

FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
P_LOG2 = 8  # P is quantized as e4m3(P * 2**P_LOG2): 256, the largest power of two <= 448
HEAD_DIMS = (64, 128)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEQ_ALIGN = 16  # S_pad of the transposed V: TMA needs 16-byte row strides
# Autotuning's sanity check: max rel. L2 error vs the emulating reference on sampled rows. The emulation cannot model
# the tensor cores' own rounding of the fp8 logit sums, which flips the e4m3 rounding of a fraction of P: a correct
# build is expected within ~1e-3..5e-3 of it; a broken one (wrong tile, mask or layout) is off by 1e-1 or more.
VALIDATE_REL_L2 = 5e-2

QUANT_ROWS = 64  # rows per program of the quantization pass
STATS_ROWS = 256  # rows per program of the statistics pass (4 sub-tiles of 64)


# ----------------------------------------------------------------------------------------------------------------------
# Configurations


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """Compile-time options of the attention kernel (see the module docstring)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    tma: int = 1  # 0: pointer loads; 1: host TMA descriptors (2-D views); 2: device-side TMA descriptors
    warp_spec: bool = False
    pv_acc: int = 1  # 0: chained in the MMA accumulator; 1: per-block MMA + fp32 add; 2: max_num_imprecise_acc

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"t{self.tma}ws{int(self.warp_spec)}a{self.pv_acc}")

    @classmethod
    def parse(cls, name: str) -> "AttnConfig":
        import re

        m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)t(\d)ws(\d)a(\d)", name.strip())
        if not m:
            raise ValueError(f"bad attention config name {name!r} (expected like {AUTOTUNE_CONFIGS[0].name!r})")
        bm, bn, w, s, t, ws, a = (int(g) for g in m.groups())
        return cls(bm, bn, w, s, t, bool(ws), a)


# Hopper candidates (compiled offline for sm_90 with Triton 3.6, see experiments/bench_attention_fp8.py --codegen: none spills; the QK^T and P V
# products are QGMMA (fp8 wgmma), P's register layout change is shuffles/byte permutes, no shared-memory round trip):
# 128 x 128 tiles with 8 warps (two warpgroups of 64 rows, ~233 registers: one program per SM) as in the Triton
# tutorial and FA3; the same tile with Triton's warp specialization, which on Hopper only applies with num_warps=4
# (it adds a TMA producer warp and splits the 128 rows over two consumer warpgroups, registers rebalanced with
# setmaxnreg; the consumers then synchronize through mbarriers only, not a CTA barrier per key block, so one can
# run its softmax while the other's MMAs run); 64-row tiles with 4 warps (two programs per SM, independent).
# The warp-specialized configs are NOT tuned by default: on the H200 (Triton 3.6, 2026-11-30) the first of them hit
# an illegal memory access at S = 130 (one full key block + a 2-key tail, tests/test_attention_fp8.py, now in git
# history; the sticky CUDA error then failed every later test of the process), while at S = 32760 / 7290 they had run
# and validated.
# Not root-caused (Triton's WS pass or our tail loop under it); until it is, they are reachable only by name
# (FASTREMOVER_FP8_ATTN_CONFIG / _CONFIGS), and WARP_SPEC_CONFIGS lists them. The engine pinned AUTOTUNE_CONFIGS[0].
AUTOTUNE_CONFIGS: tuple[AttnConfig, ...] = (
    AttnConfig(128, 128, 8, 2, tma=1, warp_spec=False, pv_acc=1),
    AttnConfig(128, 128, 8, 3, tma=1, warp_spec=False, pv_acc=1),
    AttnConfig(64, 128, 4, 2, tma=1, warp_spec=False, pv_acc=1),
)
WARP_SPEC_CONFIGS: tuple[AttnConfig, ...] = (
    AttnConfig(128, 128, 4, 2, tma=1, warp_spec=True, pv_acc=1),
    AttnConfig(128, 128, 4, 3, tma=1, warp_spec=True, pv_acc=1),
    AttnConfig(128, 64, 4, 3, tma=1, warp_spec=True, pv_acc=1),
)
# For inputs no TMA descriptor can describe (unaligned strides): pointer loads (cp.async). The 128 x 128 pointer
# variants spill registers on sm_90; this one does not.
POINTER_CONFIG = AttnConfig(128, 64, 8, 3, tma=0, warp_spec=False, pv_acc=1)
# Under the interpreter (CPU tests) there is nothing to tune: small blocks, pointer loads.
INTERPRET_CONFIG = AttnConfig(32, 32, 4, 1, tma=0, warp_spec=False, pv_acc=1)


class FP8Scales(NamedTuple):
    """Dequantization scales from quantize_qkv_fp8 (real = code * scale), fp32 on the device: shape [B, H]
    (granularity "head") or [] ("tensor"). k_mean: the fp32 [B, H, D] mean subtracted from K (None if not smoothed;
    the attention does not need it)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_mean: torch.Tensor | None


# ----------------------------------------------------------------------------------------------------------------------
# Attention kernel


@triton.jit
def _p_to_fp8(p, INTERPRET: tl.constexpr):
    """fp32 p in [0, 256] -> e4m3, round to nearest even (no saturation needed: 256 < 448)."""
    if INTERPRET:
        out = f32_to_fp8e4m3_rne(p, INTERPRET)  # the interpreter's own cast drops the mantissa carry
    else:
        out = p.to(tl.float8e4nv)  # cvt.rn.satfinite.e4m3x2.f32
    return out


@triton.jit
def _attn_block(acc, l_i, m_i, q, k, v, c, start_n, S, offs_n,
                MASK: tl.constexpr, V_T: tl.constexpr, PV_ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                P_SHIFT: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block: k is [BLOCK_N, D]; v is [D, BLOCK_N] (V_T, sequence-contiguous) or [BLOCK_N, D]."""
    qk = tl.dot(q, tl.trans(k))  # fp32 [BLOCK_M, BLOCK_N]: exact fp8 products, tensor-core sums
    if MASK:
        qk = tl.where((start_n + offs_n)[None, :] < S, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * c)  # base-2 running max (c > 0)
    p = tl.math.exp2(qk * c - (m_new - P_SHIFT)[:, None])  # in [0, 2^P_SHIFT]
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p8 = _p_to_fp8(p, INTERPRET)
    if V_T:
        vb = tl.trans(v)  # [BLOCK_N, D] view of a sequence-contiguous tile: the K-major B operand
    else:
        vb = v
    if PV_ACC == 0:
        acc = tl.dot(p8, vb, acc * alpha[:, None])
    elif PV_ACC == 1:
        acc = acc * alpha[:, None] + tl.dot(p8, vb)
    else:
        acc = tl.dot(p8, vb, acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
    return acc, l_i, m_new


@triton.jit
def _attn_fp8_kernel(
    Q, K, V, O, QS, KS, VS,
    S, H,
    sqb, sqs, sqh, q_rb, q_rh, q_ch,
    skb, sks, skh, k_rb, k_rh, k_ch,
    svb, svs, svh, svd, v_rb, v_rh, v_ch,
    sob, sos, soh,
    qsb, qsh, ksb, ksh, vsb, vsh,
    qk_mult,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr, V_T: tl.constexpr, WARP_SPEC: tl.constexpr, PV_ACC: tl.constexpr,
    P_SHIFT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Q, K, V: fp8 pointers (TMA 0/2) or host TensorDescriptors over 2-D views (TMA 1, with the row/col origin of
    (b, h) given by *_rb, *_rh (rows per batch / head) and *_ch (columns per head)). V is sequence-contiguous when
    V_T. O: [B, S, H, D] pointer, out dtype. QS/KS/VS: fp32 scales at b * s?b + h * s?h."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    c = tl.load(QS + b * qsb + h * qsh) * tl.load(KS + b * ksb + h * ksh) * qk_mult
    v_scale = tl.load(VS + b * vsb + h * vsh)

    if TMA == 1:
        kd = K
        vd = V
        k_r = b * k_rb + h * k_rh
        k_c = h * k_ch
        v_r = b * v_rb + h * v_rh
        v_c = h * v_ch
        q = Q.load([b * q_rb + h * q_rh + start_m, h * q_ch])
    elif TMA == 2:
        qd = tl.make_tensor_descriptor(Q + b64 * sqb + h64 * sqh, shape=[S, HEAD_DIM], strides=[sqs, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
        kd = tl.make_tensor_descriptor(K + b64 * skb + h64 * skh, shape=[S, HEAD_DIM], strides=[sks, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
        if V_T:
            vd = tl.make_tensor_descriptor(V + b64 * svb + h64 * svh, shape=[HEAD_DIM, S], strides=[svd, 1],
                                           block_shape=[HEAD_DIM, BLOCK_N])
        else:
            vd = tl.make_tensor_descriptor(V + b64 * svb + h64 * svh, shape=[S, HEAD_DIM], strides=[svs, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        k_r = 0
        k_c = 0
        v_r = 0
        v_c = 0
        q = qd.load([start_m, 0])
    else:
        q = tl.load(Q + b64 * sqb + h64 * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                    mask=offs_m[:, None] < S, other=0.0)
        k_ptrs = K + b64 * skb + h64 * skh + offs_n[:, None] * sks + offs_d[None, :]
        if V_T:
            v_ptrs = V + b64 * svb + h64 * svh + offs_d[:, None] * svd + offs_n[None, :]
            v_step = BLOCK_N
        else:
            v_ptrs = V + b64 * svb + h64 * svh + offs_n[:, None] * svs + offs_d[None, :]
            v_step = BLOCK_N * svs

    # (With warp specialization, Triton 3.6 needs Q as a TMA load too: the producer warp may only issue TMA loads.)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_full = (S // BLOCK_N) * BLOCK_N

    for start_n in tl.range(0, n_full, BLOCK_N, warp_specialize=WARP_SPEC):
        if TMA == 0:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
            k_ptrs += BLOCK_N * sks
            v_ptrs += v_step
        else:
            k = kd.load([k_r + start_n, k_c])
            if V_T:
                v = vd.load([v_r, v_c + start_n])
            else:
                v = vd.load([v_r + start_n, v_c])
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, k, v, c, start_n, S, offs_n,
                                    False, V_T, PV_ACC, BLOCK_N, P_SHIFT, INTERPRET)

    # The last, partial key block (0 or 1 trips): masked loads / TMA zero fill, -inf logits past S. A loop rather
    # than an `if`: Triton's Hopper warp specialization gives up on a kernel with an scf.if that yields values.
    for start_n in tl.range(n_full, S, BLOCK_N):
        if TMA == 0:
            n_ok = (start_n + offs_n) < S
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
            if V_T:
                v = tl.load(v_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k = kd.load([k_r + start_n, k_c])
            if V_T:
                v = vd.load([v_r, v_c + start_n])
            else:
                v = vd.load([v_r + start_n, v_c])
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, k, v, c, start_n, S, offs_n,
                                    True, V_T, PV_ACC, BLOCK_N, P_SHIFT, INTERPRET)

    o = acc * (v_scale / l_i)[:, None]
    o_ptrs = O + b64 * sob + h64 * soh + offs_m[:, None] * sos + offs_d[None, :]
    tl.store(o_ptrs, round_to(o, O.dtype.element_ty, INTERPRET), mask=offs_m[:, None] < S)


# ----------------------------------------------------------------------------------------------------------------------
# Quantization kernels


@triton.jit
def _qkv_stats_kernel(
    Q, K, V, QA, VA, KSUM, KMAX, KMIN,
    S, H, n_chunks,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Partials over rows [chunk * ROWS, +ROWS) of one (b, h): amax|q|, amax|v| (NaN if any NaN), and per channel
    sum, max, min of k. Outputs at [bh, chunk] (QA, VA) and [bh, chunk, :] (KSUM, KMAX, KMIN)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    qa = tl.zeros([HEAD_DIM], tl.float32)
    va = tl.zeros([HEAD_DIM], tl.float32)
    q_nan = tl.zeros([HEAD_DIM], tl.int32)
    v_nan = tl.zeros([HEAD_DIM], tl.int32)
    ksum = tl.zeros([HEAD_DIM], tl.float32)
    kmax = tl.full([HEAD_DIM], float("-inf"), tl.float32)
    kmin = tl.full([HEAD_DIM], float("inf"), tl.float32)
    for i in tl.static_range(ROWS // SUB):
        rows = (chunk * ROWS + i * SUB + tl.arange(0, SUB)).to(tl.int64)
        m = (rows < S)[:, None]
        x = load_f32(q_base + rows[:, None] * sqs + offs_d[None, :], m, INTERPRET)
        qa = tl.maximum(qa, tl.max(tl.abs(x), 0))
        q_nan += tl.sum((x != x).to(tl.int32), 0)
        x = load_f32(v_base + rows[:, None] * svs + offs_d[None, :], m, INTERPRET)
        va = tl.maximum(va, tl.max(tl.abs(x), 0))
        v_nan += tl.sum((x != x).to(tl.int32), 0)
        x = load_f32(k_base + rows[:, None] * sks + offs_d[None, :], m, INTERPRET)
        ksum += tl.sum(x, 0)  # masked rows read 0; a NaN in k propagates through the sum into the mean
        kmax = tl.maximum(kmax, tl.max(tl.where(m, x, float("-inf")), 0))
        kmin = tl.minimum(kmin, tl.min(tl.where(m, x, float("inf")), 0))
    part = bh * n_chunks + chunk
    tl.store(QA + part, tl.where(tl.max(q_nan, 0) > 0, float("nan"), tl.max(qa, 0)))  # torch's amax keeps NaN
    tl.store(VA + part, tl.where(tl.max(v_nan, 0) > 0, float("nan"), tl.max(va, 0)))
    tl.store(KSUM + part * HEAD_DIM + offs_d, ksum)
    tl.store(KMAX + part * HEAD_DIM + offs_d, kmax)
    tl.store(KMIN + part * HEAD_DIM + offs_d, kmin)


@triton.jit
def _qkv_quant_kernel(
    Q, K, V, Q8, K8, VT8, QINV, KINV, VINV, KMEAN,
    S, S_PAD, H,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, scb, sch,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, SMOOTH: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Codes for rows [chunk * ROWS, +ROWS) of one (b, h): Q8, K8 [B, H, S, D]; VT8 [B, H, D, S_PAD] (rows in
    [S, S_PAD) written as 0). Codes = RNE(y * inv_scale), inverse scales at b * scb + h * sch; KMEAN [B * H, D]."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    bh64 = bh.to(tl.int64)
    rows = (chunk * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    m_in = (rows < S)[:, None]
    out_off = bh64 * S * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]

    x = load_f32(Q + b64 * sqb + h64 * sqh + rows[:, None] * sqs + offs_d[None, :], m_in, INTERPRET)
    tl.store(Q8 + out_off, quantize_fp8(x, tl.load(QINV + b * scb + h * sch), INTERPRET), mask=m_in)

    x = load_f32(K + b64 * skb + h64 * skh + rows[:, None] * sks + offs_d[None, :], m_in, INTERPRET)
    if SMOOTH:
        x = x - tl.load(KMEAN + bh64 * HEAD_DIM + offs_d)[None, :]
    tl.store(K8 + out_off, quantize_fp8(x, tl.load(KINV + b * scb + h * sch), INTERPRET), mask=m_in)

    x = load_f32(V + b64 * svb + h64 * svh + rows[:, None] * svs + offs_d[None, :], m_in, INTERPRET)
    v8 = quantize_fp8(x, tl.load(VINV + b * scb + h * sch), INTERPRET)  # masked rows: 0 * inv = 0
    vt_off = bh64 * HEAD_DIM * S_PAD + offs_d[None, :] * S_PAD + rows[:, None]
    tl.store(VT8 + vt_off, v8, mask=(rows < S_PAD)[:, None])


# ----------------------------------------------------------------------------------------------------------------------
# Checks


def _check_qkv(names: tuple[str, str, str], q, k, v, dtypes: tuple, *, allow_v_seq_major: bool) -> tuple:
    for name, t in zip(names, (q, k, v)):
        check_tensor(name, t, ndim=4, dtypes=dtypes, dims=" [B, S, H, D]", contiguous=False)  # strides: below
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape [B, S, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, S, H, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim D must be one of {HEAD_DIMS}, got {D}")
    if min(B, S, H) < 1:
        raise ValueError(f"empty attention input, shape {tuple(q.shape)}")
    for name, t in zip(names[:2], (q, k)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have stride 1 along D, got strides {t.stride()}")
    if v.stride(3) != 1 and not (allow_v_seq_major and v.stride(1) == 1):
        raise ValueError(f"{names[2]} must have stride 1 along D" + (" or along S" if allow_v_seq_major else "")
                         + f", got strides {v.stride()}")
    return B, S, H, D


def _scale_strides(name: str, t, B: int, H: int, device) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 torch.Tensor (dequantization scale), got "
                         f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.numel() == 1:
        return 0, 0
    if tuple(t.shape) == (B, H):
        return t.stride(0), t.stride(1)
    raise ValueError(f"{name} must have one element (per tensor) or shape [B, H] = [{B}, {H}] (per head), "
                     f"got shape {tuple(t.shape)}")


def _aligned16(t: torch.Tensor, strides) -> bool:
    return t.data_ptr() % 16 == 0 and all(int(s) * t.element_size() % 16 == 0 for s in strides)


def _rows_view(t: torch.Tensor):
    """2-D view [R, C] (row stride rs, unit column stride) of a D-contiguous [B, S, H, D] tensor for a host TMA
    descriptor, with row origin b * rb + h * rh + s and column origin h * ch + d; None if the strides allow none.
    heads-major ([B, H, S, D] memory): rows (b, h, s); sequence-major ([B, S, (3,) H, D] memory): rows (b, s)."""
    B, S, H, D = t.shape
    sb, ss, sh, _ = t.stride()
    if S > 1 and ss >= D and (H == 1 or sh == S * ss) and (B == 1 or sb == H * S * ss):
        return (B * H * S, D, ss, H * S, S, 0)
    if S > 1 and ss >= H * D and (H == 1 or sh == D) and (B == 1 or sb == S * ss):
        return (B * S, H * D, ss, S, 0, D)
    return None


def _vt_rows_view(v: torch.Tensor):
    """Same for a sequence-contiguous v ([B, H, D, S'] memory, S' >= S): rows (b, h, d), columns s."""
    B, S, H, D = v.shape
    sb, _, sh, sd = v.stride()
    if sd >= S and (H == 1 or sh == D * sd) and (B == 1 or sb == H * D * sd):
        return (B * H * D, S, sd, H * D, D, 0)
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Attention wrapper


@dataclasses.dataclass
class _Prepared:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    v_t: bool
    scales: tuple
    scale_strides: tuple
    qk_mult: float
    out: torch.Tensor
    shape: tuple
    views: dict  # "q"/"k"/"v" -> 2-D view tuple or None
    aligned: bool  # device TMA descriptors possible


def _transpose_v(v: torch.Tensor) -> torch.Tensor:
    """D-contiguous fp8 v [B, S, H, D] -> the same values as a sequence-contiguous view of [B, H, D, S_pad]."""
    B, S, H, D = v.shape
    s_pad = -(-S // SEQ_ALIGN) * SEQ_ALIGN
    vt = torch.empty((B, H, D, s_pad), dtype=torch.uint8, device=v.device)
    if s_pad > S:
        vt[..., S:].zero_()  # never read by the kernel (masked / out of the TMA view), but defined
    vt[..., :S].copy_(v.view(torch.uint8).permute(0, 2, 3, 1))
    return vt.view(FP8)[..., :S].permute(0, 3, 1, 2)


def _prepare(q, k, v, q_scale, k_scale, v_scale, sm_scale, out_dtype, transpose_v: bool) -> _Prepared:
    B, S, H, D = _check_qkv(("q", "k", "v"), q, k, v, (FP8,), allow_v_seq_major=True)
    check_device(_attn_fp8_kernel, q=q, k=k, v=v)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")
    strides = tuple(_scale_strides(n, t, B, H, q.device)
                    for n, t in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)))
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    v_t = v.stride(1) == 1 and (v.stride(3) != 1 or S == 1)
    if not v_t and transpose_v:
        v = _transpose_v(v)
        v_t = True
    views = {"q": _rows_view(q), "k": _rows_view(k), "v": _vt_rows_view(v) if v_t else _rows_view(v)}
    for n, t in (("q", q), ("k", k), ("v", v)):
        vw = views[n]
        if vw is not None and not (t.data_ptr() % 16 == 0 and vw[2] % 16 == 0):
            views[n] = None
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    aligned = (_aligned16(q, (sq[0], sq[1], sq[2])) and _aligned16(k, (sk[0], sk[1], sk[2]))
               and _aligned16(v, (sv[0], sv[2], sv[3] if v_t else sv[1])))
    out = torch.empty((B, S, H, D), dtype=out_dtype, device=q.device)
    return _Prepared(q, k, v, v_t, (q_scale, k_scale, v_scale), strides, float(sm_scale) * LOG2E, out,
                     (B, S, H, D), views, aligned)


def _effective_tma(p: _Prepared, cfg: AttnConfig) -> int:
    if interpreting(_attn_fp8_kernel) and cfg.tma == 2:
        return 2
    if cfg.tma == 1 and TensorDescriptor is not None and all(p.views[n] is not None for n in "qkv"):
        return 1
    if cfg.tma in (1, 2) and p.aligned:
        return 2
    return 0


def _launch(p: _Prepared, cfg: AttnConfig) -> torch.Tensor:
    B, S, H, D = p.shape
    tma = _effective_tma(p, cfg)
    if cfg.warp_spec and tma == 0 and not interpreting(_attn_fp8_kernel):
        raise ValueError(f"config {cfg.name}: warp specialization needs TMA loads, and these inputs allow none")
    q, k, v = p.q, p.k, p.v
    args = {"q": q, "k": k, "v": v}
    origin = {"q": (0, 0, 0), "k": (0, 0, 0), "v": (0, 0, 0)}
    if tma == 1:
        blocks = {"q": [cfg.block_m, D], "k": [cfg.block_n, D],
                  "v": [D, cfg.block_n] if p.v_t else [cfg.block_n, D]}
        for n in "qkv":
            r, c, rs, rb, rh, ch = p.views[n]
            args[n] = TensorDescriptor(args[n], shape=[r, c], strides=[rs, 1], block_shape=blocks[n])
            origin[n] = (rb, rh, ch)
    if not interpreting(_attn_fp8_kernel):
        _ensure_allocator()  # device-side descriptors (tma=2) and some warp-specialized builds need scratch memory
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), p.out.stride()
    (qsb, qsh), (ksb, ksh), (vsb, vsh) = p.scale_strides
    grid = (triton.cdiv(S, cfg.block_m), B * H)
    _attn_fp8_kernel[grid](
        args["q"], args["k"], args["v"], p.out, *p.scales,
        S, H,
        sq[0], sq[1], sq[2], *origin["q"],
        sk[0], sk[1], sk[2], *origin["k"],
        sv[0], sv[1], sv[2], sv[3], *origin["v"],
        so[0], so[1], so[2],
        qsb, qsh, ksb, ksh, vsb, vsh,
        p.qk_mult,
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA=tma, V_T=p.v_t, WARP_SPEC=cfg.warp_spec,
        PV_ACC=cfg.pv_acc, P_SHIFT=P_LOG2, INTERPRET=interpreting(_attn_fp8_kernel),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return p.out


_ALLOCATOR_SET = False


def _ensure_allocator() -> None:
    """Device-side TMA descriptors (tl.make_tensor_descriptor) need a global scratch allocator; set a torch one
    unless the process already has one."""
    global _ALLOCATOR_SET
    if _ALLOCATOR_SET:
        return
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        needed = isinstance(current, _allocation.NullAllocator)
    except Exception:  # pragma: no cover - layout of triton internals changed
        needed = True
    if needed:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    _ALLOCATOR_SET = True


def attention_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_scale: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    sm_scale: float | None = None, out_dtype: torch.dtype = torch.float16, *,
    config: AttnConfig | str | None = None, transpose_v: bool = True,
) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v for e4m3 codes q, k, v [B, S, H, D] (real = code * scale), non-causal.

    q, k: stride 1 along D, any strides in B, S, H (views into one [B, S, 3, H, D] buffer are fine). v: stride 1
    along D (then transposed into a sequence-contiguous copy first, see the module docstring; transpose_v=False
    feeds it as is, for measurements) or stride 1 along S (quantize_qkv_fp8's v8: read directly). Scales: fp32
    tensors on the device, one element (per tensor) or [B, H] (per head); no host sync. sm_scale defaults to
    1/sqrt(D). Returns a new contiguous [B, S, H, D] tensor of out_dtype (fp16, bf16 or fp32).
    config: an AttnConfig or its name; None = the tuned config (compiled) / INTERPRET_CONFIG (interpreter)."""
    p = _prepare(q, k, v, q_scale, k_scale, v_scale, sm_scale, out_dtype, transpose_v)
    cfg = _select_config(p, config)
    return _launch(p, cfg)


def attention_fp8_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True, granularity: str = "head",
    out_dtype: torch.dtype | None = None, config: AttnConfig | str | None = None,
) -> torch.Tensor:
    """The backend form: fp16/bf16/fp32 q, k, v [B, S, H, D] -> quantize_qkv_fp8 -> attention_fp8 -> [B, S, H, D]
    of out_dtype (default: q's dtype if fp16/bf16, else fp16)."""
    if out_dtype is None:
        out_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float16
    q8, k8, v8, sc = quantize_qkv_fp8(q, k, v, smooth_k=smooth_k, granularity=granularity)
    return attention_fp8(q8, k8, v8, sc.q, sc.k, sc.v, out_dtype=out_dtype, config=config)


# ----------------------------------------------------------------------------------------------------------------------
# Autotuning (compiled path)


_TUNED: dict[tuple, AttnConfig] = {}
_REPORTS: dict[tuple, list[dict]] = {}


def _tune_key(p: _Prepared) -> tuple:
    return (p.shape, p.out.dtype, p.v_t, tuple(p.views[n] is not None for n in "qkv"), p.aligned,
            str(p.q.device))


def tuning_report() -> dict:
    """{key string: [per-config dicts: name, ms, tflops, rel_l2, cos, error, chosen]} of every tuning so far."""
    return {str(k): v for k, v in _REPORTS.items()}


def _candidates(p: _Prepared) -> list[AttnConfig]:
    only = os.environ.get("FASTREMOVER_FP8_ATTN_CONFIGS", "").strip()
    if only:
        return [AttnConfig.parse(n) for n in only.split(",") if n.strip()]
    if _effective_tma(p, AUTOTUNE_CONFIGS[0]) == 0:  # no TMA possible: pointer loads only
        return [POINTER_CONFIG]
    return list(AUTOTUNE_CONFIGS)


def _select_config(p: _Prepared, config) -> AttnConfig:
    if isinstance(config, AttnConfig):
        return config
    if isinstance(config, str):
        return AttnConfig.parse(config)
    if config is not None:
        raise ValueError(f"config must be an AttnConfig, its name or None, got {config!r}")
    if interpreting(_attn_fp8_kernel):
        return INTERPRET_CONFIG
    forced = os.environ.get("FASTREMOVER_FP8_ATTN_CONFIG", "").strip()
    if forced:
        return AttnConfig.parse(forced)
    key = _tune_key(p)
    if key not in _TUNED:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "attention_fp8: no tuned configuration for this shape/layout yet, and tuning cannot run during CUDA "
                "graph capture; call it once before capturing (or set FASTREMOVER_FP8_ATTN_CONFIG)")
        _TUNED[key] = _autotune(p, key)
    return _TUNED[key]


def _sample_rows(S: int) -> torch.Tensor:
    idx = sorted({*range(min(16, S)), *range(max(0, S // 2 - 8), min(S, S // 2 + 8)), *range(max(0, S - 16), S)})
    return torch.tensor(idx, dtype=torch.long)


def _check_rows(p: _Prepared, o: torch.Tensor, block_n: int) -> tuple[float, float]:
    """(rel. L2 error, cosine) of o against the emulating reference on sampled rows of the first and last head."""
    B, S, H, D = p.shape
    rows = _sample_rows(S).to(o.device)
    num = den = dot = onorm = 0.0
    for b, h in {(0, 0), (B - 1, H - 1)}:
        sel = lambda t: t[b, :, h, :]  # noqa: E731  [S, D] (any strides)
        qc = sel(p.q)[rows].double()
        kc, vc = sel(p.k).double(), sel(p.v).double()
        qs, ks, vs = (t.reshape(-1)[0] if t.numel() == 1 else t[b, h] for t in p.scales)
        c = (qs.float() * ks.float() * torch.tensor(p.qk_mult, dtype=torch.float32, device=o.device)).double()
        ref = _reference_core(qc, kc, vc, c, vs.double(), block_n)
        got = o[b, :, h, :][rows].double()
        if not torch.isfinite(got).all():
            return float("inf"), float("nan")
        num += float(((got - ref) ** 2).sum())
        den += float((ref**2).sum())
        dot += float((got * ref).sum())
        onorm += float((got**2).sum())
    return math.sqrt(num / max(den, 1e-300)), dot / math.sqrt(max(den * onorm, 1e-300))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_ms(fn, reps: int = 5, warmup: int = 2) -> float:
    """Median of `reps` timed calls (CUDA events; wall clock without a GPU, for smoke tests)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _autotune(p: _Prepared, key: tuple) -> AttnConfig:
    B, S, H, D = p.shape
    flops = 4.0 * B * H * S * S * D
    report, best = [], None
    for cfg in _candidates(p):
        row = {"name": cfg.name, "tma_used": None, "ms": None, "tflops": None, "rel_l2": None, "cos": None,
               "error": None, "chosen": False}
        report.append(row)
        print(f"[attention_fp8] tuning {cfg.name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            row["tma_used"] = _effective_tma(p, cfg)
            p.out.fill_(float("nan"))
            o = _launch(p, cfg)
            _sync()
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            rel, cos = _check_rows(p, o, cfg.block_n)
            row["rel_l2"], row["cos"] = rel, cos
            if not rel <= VALIDATE_REL_L2:
                row["error"] = f"wrong result: rel. L2 error {rel:.3g} > {VALIDATE_REL_L2} vs the reference"
                continue
            ms = _time_ms(lambda: _launch(p, cfg))
            row["ms"], row["tflops"] = ms, flops / ms * 1e-9
            if best is None or ms < best[1]:
                best = (cfg, ms)
        except Exception as e:  # compile errors (unsupported on this triton), resource limits: skip the config
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        finally:
            print(f"[attention_fp8]   {row}", file=sys.stderr, flush=True)
    _REPORTS[key] = report
    if best is None:
        raise RuntimeError("attention_fp8: no configuration compiled and passed validation on this GPU:\n"
                           + "\n".join(f"  {r['name']}: {r['error']}" for r in report))
    for r in report:
        r["chosen"] = r["name"] == best[0].name
    return best[0]


# ----------------------------------------------------------------------------------------------------------------------
# Quantization wrapper


def quantize_qkv_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_k: bool = True, granularity: str = "head",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, FP8Scales]:
    """fp16/bf16/fp32 q, k, v [B, S, H, D] (stride 1 along D; any strides in B, S, H) -> (q8, k8, v8, scales).

    q8, k8: e4m3 [B, S, H, D] views of [B, H, S, D] memory; v8: e4m3 [B, S, H, D] view of [B, H, D, S_pad]
    memory (stride 1 along S: the K-major operand the attention kernel wants; v8.contiguous() gives the usual
    layout). scales: FP8Scales (fp32, [B, H] for granularity "head", [] for "tensor"). smooth_k subtracts the
    per-(batch, head, channel) mean of K over the sequence first (exact under softmax). Two passes, no host sync."""
    if granularity not in ("head", "tensor"):
        raise ValueError(f"granularity must be 'head' or 'tensor', got {granularity!r}")
    B, S, H, D = _check_qkv(("q", "k", "v"), q, k, v, FLOAT_DTYPES, allow_v_seq_major=False)
    check_device(_qkv_quant_kernel, q=q, k=k, v=v)
    dev = q.device
    interp = interpreting(_qkv_quant_kernel)
    n_chunks = triton.cdiv(S, STATS_ROWS)
    f32 = dict(dtype=torch.float32, device=dev)
    qa = torch.empty((B * H, n_chunks), **f32)
    va = torch.empty((B * H, n_chunks), **f32)
    ksum = torch.empty((B * H, n_chunks, D), **f32)
    kmax = torch.empty((B * H, n_chunks, D), **f32)
    kmin = torch.empty((B * H, n_chunks, D), **f32)
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    _qkv_stats_kernel[(n_chunks, B * H)](
        q, k, v, qa, va, ksum, kmax, kmin, S, H, n_chunks,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
        HEAD_DIM=D, ROWS=STATS_ROWS, SUB=64, INTERPRET=interp, num_warps=4, **launch_options(_qkv_stats_kernel),
    )
    q_amax = qa.amax(dim=1).view(B, H)
    v_amax = va.amax(dim=1).view(B, H)
    kmax_c = kmax.amax(dim=1)
    kmin_c = kmin.amin(dim=1)
    if smooth_k:
        k_mean = ksum.sum(dim=1) / torch.tensor(float(S), **f32)
        k_amax = torch.maximum(kmax_c - k_mean, k_mean - kmin_c).amax(dim=1).view(B, H)
        # NaN in k: the sum (hence the mean) is NaN; max/min may have dropped it, the mean carries it here
        k_amax = torch.where(torch.isnan(k_mean).any(dim=1).view(B, H), float("nan"), k_amax)
    else:
        k_mean = None
        k_amax = torch.maximum(kmax_c, -kmin_c).amax(dim=1).view(B, H)
        k_amax = torch.where(torch.isnan(ksum).any(dim=2).any(dim=1).view(B, H), float("nan"), k_amax)
    if granularity == "tensor":
        q_amax, k_amax, v_amax = q_amax.amax(), k_amax.amax(), v_amax.amax()
    amaxes = [a.clamp_min(SCALE_FLOOR) for a in (q_amax, k_amax, v_amax)]
    scales = [_scale_of(a) for a in amaxes]
    invs = [_inverse_scale_of(a) for a in amaxes]
    scb, sch = (scales[0].stride(0), scales[0].stride(1)) if granularity == "head" else (0, 0)

    s_pad = -(-S // SEQ_ALIGN) * SEQ_ALIGN
    q8 = torch.empty((B, H, S, D), dtype=FP8, device=dev)
    k8 = torch.empty((B, H, S, D), dtype=FP8, device=dev)
    vt8 = torch.empty((B, H, D, s_pad), dtype=FP8, device=dev)
    _qkv_quant_kernel[(triton.cdiv(s_pad, QUANT_ROWS), B * H)](
        q, k, v, q8, k8, vt8, *invs, k_mean if k_mean is not None else scales[0], S, s_pad, H,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], scb, sch,
        HEAD_DIM=D, ROWS=QUANT_ROWS, SMOOTH=smooth_k, INTERPRET=interp, num_warps=4,
        **launch_options(_qkv_quant_kernel),
    )
    mean_out = k_mean.view(B, H, D) if k_mean is not None else None
    return (q8.permute(0, 2, 1, 3), k8.permute(0, 2, 1, 3), vt8[..., :S].permute(0, 3, 1, 2),
            FP8Scales(*scales, mean_out))


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """scale = amax / 448 for amax already clamped to >= 1e-12: a correctly rounded division (a tensor divisor:
    CUDA's tensor / Python-scalar multiplies by a rounded reciprocal instead; see quant.fp8_rowwise_reference)."""
    return amax / amax.new_full((), FP8_MAX)


def _inverse_scale_of(amax: torch.Tensor) -> torch.Tensor:
    """inv_scale = 448 / amax (correctly rounded): codes are RNE(y * inv_scale), the house rule of quant.py."""
    return amax.new_full((), FP8_MAX) / amax


# ----------------------------------------------------------------------------------------------------------------------
# Eager references


def quantize_qkv_fp8_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_k: bool = True, granularity: str = "head",
    k_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, FP8Scales]:
    """Eager torch version of quantize_qkv_fp8 (same outputs and layouts). k_mean (fp32 [B, H, D]) replaces the
    eager mean, to compare codes bit for bit against the kernel's own mean."""
    B, S, H, D = q.shape
    qf, kf, vf = (t.float().permute(0, 2, 1, 3) for t in (q, k, v))  # [B, H, S, D]
    if smooth_k:
        mean = kf.mean(dim=2) if k_mean is None else k_mean.float()
        kf = kf - mean[:, :, None, :]
    else:
        mean = None

    def quant(x):
        amax = (x.abs().amax(dim=(2, 3)) if granularity == "head" else x.abs().amax()).clamp_min(SCALE_FLOOR)
        inv = _inverse_scale_of(amax)
        inv = inv[:, :, None, None] if granularity == "head" else inv
        return (x * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8), _scale_of(amax)

    (q8, qs), (k8, ks), (v8, vs) = quant(qf), quant(kf), quant(vf)
    s_pad = -(-S // SEQ_ALIGN) * SEQ_ALIGN
    vt = torch.zeros((B, H, D, s_pad), dtype=torch.uint8, device=q.device)
    vt[..., :S] = v8.view(torch.uint8).transpose(2, 3)
    return (q8.contiguous().permute(0, 2, 1, 3), k8.contiguous().permute(0, 2, 1, 3),
            vt.view(FP8)[..., :S].permute(0, 3, 1, 2), FP8Scales(qs, ks, vs, mean))


def _reference_core(qc, kc, vc, c, vs, block_n: int | None):
    """float64 attention on codes: qc [..., M, D], kc/vc [..., N, D]; c = q_scale * k_scale * sm_scale * log2(e)
    and vs (v scale) broadcastable to [..., 1, 1] or scalars. Emulates the kernel's P quantization (see
    attention_fp8_reference)."""
    x = (qc @ kc.transpose(-1, -2)) * c  # base-2 logits
    N = x.shape[-1]
    bn = N if block_n is None else block_n
    nb = -(-N // bn)
    xp = torch.nn.functional.pad(x, (0, nb * bn - N), value=float("-inf")).unflatten(-1, (nb, bn))
    m_run = torch.cummax(xp.amax(dim=-1), dim=-1).values  # running max after each key block
    p = torch.exp2(xp - m_run[..., None] + P_LOG2)  # what the kernel computes in fp32 ...
    p8 = p.float().to(FP8).double()  # ... and rounds to e4m3
    corr = torch.exp2(m_run - m_run[..., -1:])[..., None]  # the later rescalings of each block's contribution
    l_sum = (p * corr).sum(dim=(-1, -2))
    w = (p8 * corr).flatten(-2)[..., :N]
    return (w @ vc) / l_sum[..., None] * vs


def attention_fp8_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_scale: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
    sm_scale: float | None = None, out_dtype: torch.dtype = torch.float16, *, block_n: int | None = None,
) -> torch.Tensor:
    """Eager emulation of attention_fp8 in float64 (same arguments; any strides).

    logits x = (q_codes . k_codes) * c with c = fp32(q_scale * k_scale * fp32(sm_scale * log2 e)) as the kernel
    forms it; p = exp2(x - m + 8) rounded to fp32 then to e4m3 (RNE) for P @ V, unquantized p summed into l;
    o = (sum P8 v_codes) / l * v_scale. m is the running max over key blocks of block_n keys (the kernel's
    BLOCK_N: each block's p is quantized relative to the max seen so far, and rescaled exactly afterwards), or the
    row's global max with block_n=None (the ideal variant). What remains between kernel and reference is fp32
    rounding (logits summation order, exp2, FMA) and the rare e4m3 rounding flip it causes."""
    B, S, H, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)

    def per_head(t):
        t = t.float()
        return t.reshape(()) if t.numel() == 1 else t.view(B, H)

    c = (per_head(q_scale) * per_head(k_scale) * torch.tensor(sm_scale * LOG2E, dtype=torch.float32,
                                                              device=q.device))
    bcast = lambda t: t.double().reshape(B, H, 1, 1) if t.dim() else t.double()  # noqa: E731
    qc, kc, vc = (t.permute(0, 2, 1, 3).double() for t in (q, k, v))
    o = _reference_core(qc, kc, vc, bcast(c), bcast(per_head(v_scale)), block_n)
    return o.permute(0, 2, 1, 3).to(out_dtype)


def attention_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """float64 softmax attention of (unquantized) [B, S, H, D] inputs, the ground truth for fidelity checks."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    qd, kd, vd = (t.permute(0, 2, 1, 3).double() for t in (q, k, v))
    w = torch.softmax((qd @ kd.transpose(-1, -2)) * scale, dim=-1)
    return (w @ vd).permute(0, 2, 1, 3)
