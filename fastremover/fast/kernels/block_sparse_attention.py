"""Block-sparse attention: each query tile attends only to its own list of key tiles (Hopper, Triton).

    o = block_sparse_attention(q, k, v, kv_idx, kv_cnt, tile_q=64, tile_k=64)              16-bit q/k/v
    o8 = block_sparse_attention(q8, k8, v8, kv_idx, kv_cnt, tile_q=64, tile_k=64,
                                scales=(sq, sk, sv))                                       e4m3 codes -> codes

Layout: q, k, v [B, S, H, D] (any strides with unit stride along D; D a power of two, 16..256, 32..256 for e4m3
codes: see Shapes), tokens already in the order whose consecutive runs of `tile_q` (queries) and `tile_k` (keys)
tokens are the tiles (the last tile of the sequence may be short). Query tile i of (b, h) attends to the key tiles
kv_idx[b, h, i, :kv_cnt[b, h, i]]: int32 tensors [B, H, NQ, J] and [B, H, NQ] (NQ = cdiv(S, tile_q); any strides, 0
for a list shared by every batch or head). Contract on the lists (what the mask builders in
fastremover/ops/attention/sparse_layout.py produce; the kernel does not check it, `check_lists` does on the host):
every row has at least one tile, its tiles in ascending order without repeats, so the sequence's last key tile (the
only one that may be short) is the row's last entry. Rows are attended in that order: with every tile kept the kernel
walks the keys exactly as a dense flash kernel with the same block sizes does.

Numerics (non-causal softmax(q k^T * sm_scale) v, sm_scale = 1/sqrt(D) by default):
  * logits: tensor-core products accumulated in fp32 (fp8 x fp8 products are exact in fp32), times
    c = sm_scale * log2(e) (* sq * sk for codes); online softmax in base 2 over key blocks of BLOCK_N, fp32 running
    max m, sum l of the unrounded p, accumulator acc;
  * 16-bit inputs: p in [0, 1] rounded to the input dtype for P @ V (one MMA chain, fp32 accumulator); o = acc / l
    rounded to the output dtype;
  * e4m3 codes: p = exp2(x - m + 8) in [0, 256] rounded to e4m3 (256 = the largest power of two <= 448: exact,
    never saturates), each key block's P @ V in a fresh fp32 MMA accumulator added to acc on the CUDA cores (Hopper's
    FP8 MMA accumulates with reduced precision inside a chain; `BlockSparseConfig.chain_acc` accumulates into acc in
    the chain instead, one addition less per block, bound below); out_dtype e4m3: codes of o / sv (acc / l in V's code
    units, saturating RNE: |o / sv| <= 448 since each output is a convex combination of V's codes); a 16-bit
    out_dtype: o = acc / l * sv.
Bound against `block_sparse_attention_reference` (the same lists expanded to a token mask, masked softmax attention
in fp32 on the same, dequantized inputs), per element, with vmax[b, h, d] = max_s |v[b, s, h, d]| (dequantized):
  * fp16 / bf16: |o - ref| <= 2 eps vmax + 1e-6 vmax, eps = 2^-11 (fp16) or 2^-8 (bf16): p's rounding moves each
    weight of the convex combination by <= eps relative (<= eps vmax in all), the output rounding <= eps |o|; the
    fp32 logits, exp2 and sums add well under 1e-6 relative.
  * e4m3 codes: |o - ref| <= 2^-3 vmax + n 2^-18 vmax + 2^-9 sv, n = keys kept by the row: p's e4m3 rounding is
    <= 2^-4 relative for p >= 2^-6 (normal codes; <= 2^-4 vmax in all) and <= 2^-10 absolute in the 256-scaled
    units below that (subnormal codes; l >= 256, so <= 2^-18 vmax per key), the output's e4m3 rounding <= 2^-4 |o|
    (normal) or 2^-10 sv (subnormal). With `chain_acc`, plus n 2^-19 vmax: each FP8 MMA of K = 32 keys adds into
    acc keeping about 14 bits (DeepSeek-V3's measurement of Hopper's FP8 accumulation), <= 2^-14 |acc| <= 2^-14 l
    vmax per addition, n / 32 additions (the `gpu` tests hold the variant to it). `BlockSparseConfig.lazy` (codes)
    moves a row's running max only when a key block raises it by more than LAZY_TAU = 0.75 (base 2), and rescales acc
    only in a block where some row moved (FlashAttention-4's conditional rescaling): p <= 2^(8 + 0.75) < 448 still
    fits e4m3 unsaturated, and the row's largest p stays >= 256, so l >= 256 and the bound is unchanged.
(tests/kernels/test_sparse_attention.py asserts these on the CPU interpreter and, `gpu`, on an H200 at the real shapes.)

Shapes: Triton's tensor-core `tl.dot` on NVIDIA takes K >= 16 for 16-bit operands and K >= 32 for 8-bit ones
(`MIN_DOT_K`); K is D in q @ k^T and BLOCK_N in P @ V, so e4m3 codes need D >= 32 and BLOCK_N >= 32 (hence
tile_k >= 32). The wrapper refuses smaller shapes on every device, the interpreter included (it would run them and
hide what the GPU compiler rejects); tests/kernels/test_sparse_attention.py compiles both sides of each limit for
sm_90 offline. Refused, not padded: zero-padding D to 32 would be exact (zero columns change neither q . k nor the
output's first D columns) but costs a copy of q, k, v and o per call, for head dims no released model has (the
Remover's is 128). The sparse backends' registry validators (fastremover/ops/attention/sparse.py) refuse such a
model when the engine is built, before any work.

Kernel (one program per BLOCK_M query rows x (batch, head); grid axis 0 runs over one head's query blocks, so
programs running together share that head's key tiles in L2): the query tile's list is walked as one flat loop over
(list entry, BLOCK_N sub-block of the tile) - the index load is pipelined with the K / V loads - followed by a masked
loop of 0 or 1 tiles for the sequence's short last key tile (no `if` in the main loop: Triton's Hopper warp
specialization gives up on one that yields values). Loads are host TMA descriptors over 2-D views of q/k/v
(`BlockSparseConfig.tma`) or plain pointer loads. For codes, `v_t` gives the kernel a sequence-contiguous copy of V
(Hopper's FP8 MMA only takes a K-major B operand; fed D-contiguous V, Triton transposes each tile through shared
memory itself). `BlockSparseConfig` holds the compile-time choices; `config_for` the default per (tile, dtype),
`FASTREMOVER_SPARSE_ATTN_CONFIG=<name>` forces one (tools/bench_sparse_attention.py sweeps them on the GPU).
The launch keeps Triton's default FMA contraction and fast exp2: held to the bounds above, not bit-exactness.

Interpreter (TRITON_INTERPRET=1): the same code; the e4m3 and bf16 casts go through the bit-exact emulations of
fastremover.fast.kernels._common (the interpreter's own casts round wrongly).
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch
import triton
import triton.language as tl

from fastremover.env import kernel_tuning
from fastremover.fast.kernels._common import bf16_to_f32, check_device, f32_to_fp8e4m3_rne, interpreting, round_to

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4: pointer loads only
    TensorDescriptor = None

FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
P_SHIFT = tl.constexpr(8)  # codes: p = exp2(x - m + 8) in [0, 256], rounded to e4m3
LAZY_TAU = tl.constexpr(0.75)  # codes, lazy: a row's max moves when a block raises it by more (2^(8 + tau) < 448)
HEAD_DIMS = (16, 32, 64, 128, 256)
MIN_DOT_K = {False: 16, True: 32}  # Triton's smallest K of a tensor-core tl.dot on NVIDIA: 16-bit, e4m3 operands
SEQ_ALIGN = 16  # the sequence-contiguous V copy's row length is padded to 16 elements (TMA's 16-byte strides)


# ----------------------------------------------------------------------------------------------------------------------
# Configurations


@dataclasses.dataclass(frozen=True)
class BlockSparseConfig:
    """Compile-time choices of the kernel: BLOCK_M query rows and BLOCK_N keys per step (each dividing its tile),
    warps, pipeline stages, TMA descriptor loads (else pointer loads), Triton's warp specialization of the main loop
    (Hopper, TMA only), and for e4m3 codes a sequence-contiguous copy of V (`v_t`)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = True
    warp_spec: bool = False
    v_t: bool = True
    chain_acc: bool = False  # codes: P @ V accumulated into acc inside the MMA chain (module docstring's bound)
    lazy: bool = False  # codes: conditional rescaling (module docstring); not with warp_spec (an `if` in the loop)

    def __post_init__(self):
        if self.lazy and self.warp_spec:
            raise ValueError("block-sparse attention: lazy rescaling (lz1) branches in the main loop, which Triton's "
                             "warp specialization (ws1) does not take")

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}t{int(self.tma)}"
                f"ws{int(self.warp_spec)}vt{int(self.v_t)}" + ("ca1" if self.chain_acc else "")
                + ("lz1" if self.lazy else ""))

    @classmethod
    def parse(cls, name: str) -> "BlockSparseConfig":
        m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)t([01])ws([01])vt([01])(ca1)?(lz1)?", name.strip())
        if not m:
            raise ValueError(f"bad block-sparse attention config {name!r} (expected like "
                             f"{BlockSparseConfig().name!r}, optionally followed by ca1, then lz1)")
        bm, bn, w, s, t, ws, vt = (int(g) for g in m.groups()[:7])
        return cls(bm, bn, w, s, bool(t), bool(ws), bool(vt), m.group(8) is not None, m.group(9) is not None)


def config_for(tile_q: int, tile_k: int, fp8: bool) -> BlockSparseConfig:
    """The default config for a tile size and input kind (FASTREMOVER_SPARSE_ATTN_CONFIG, KernelTuning's
    sparse_attn_config, overrides it): one query tile per program up to 128 rows (8 warps at 128: two warpgroups),
    64-key steps."""
    forced = kernel_tuning().sparse_attn_config
    if forced:
        return BlockSparseConfig.parse(forced)
    block_m = min(tile_q, 128)
    block_n = min(tile_k, 64)
    # codes at 64-row blocks: P @ V in the MMA chain (ca1) was the fastest of the sweep's configs at W2's keep 0.25
    # on the H100 (2.59 against 2.76 ms, bench/results/sparse-attention-w2-fp8-quick-2026-12-05-fa45ae9-h100.json)
    return BlockSparseConfig(block_m=block_m, block_n=block_n, num_warps=8 if block_m >= 128 else 4,
                             num_stages=2 if block_m >= 128 else 3, tma=True, warp_spec=False, v_t=fp8,
                             chain_acc=fp8 and block_m == 64)


def head_dims(fp8: bool) -> tuple[int, ...]:
    """The head dims the kernel compiles for: 16-bit q/k/v, or (fp8) e4m3 codes (D is the K of q @ k^T)."""
    return tuple(d for d in HEAD_DIMS if d >= MIN_DOT_K[fp8])


INTERPRET_BLOCK = 32  # the interpreter's largest block sizes (numpy runs a few large steps faster than many small)


# ----------------------------------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _p_to_fp8(p, INTERPRET: tl.constexpr):
    """p in [0, 256] -> e4m3, round to nearest even."""
    if INTERPRET:
        out = f32_to_fp8e4m3_rne(p, INTERPRET)
    else:
        out = p.to(tl.float8e4nv)
    return out


@triton.jit
def _operand(x, INTERPRET: tl.constexpr):
    """An MMA operand as loaded; under the interpreter bf16 is widened to fp32 first (exactly: its bf16 dot is
    wrong in Triton 3.9, and products of bf16 values are exact in fp32 either way)."""
    if INTERPRET and x.dtype == tl.bfloat16:
        out = bf16_to_f32(x, INTERPRET)
    else:
        out = x
    return out


@triton.jit
def _step(acc, l_i, m_i, q, k, v, c, start_n, S, offs_n, MASK: tl.constexpr, FP8: tl.constexpr,
          V_T: tl.constexpr, CHAIN_ACC: tl.constexpr, LAZY: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block: k [BLOCK_N, D]; v [BLOCK_N, D] or, V_T, [D, BLOCK_N] (sequence-contiguous)."""
    qk = tl.dot(q, tl.trans(_operand(k, INTERPRET)))  # fp32 [BLOCK_M, BLOCK_N]
    if MASK:
        qk = tl.where((start_n + offs_n)[None, :] < S, qk, float("-inf"))
    m_blk = tl.max(qk, 1) * c  # base-2 (c > 0)
    if FP8 and LAZY:
        m_new = tl.where(m_blk > m_i + LAZY_TAU, m_blk, m_i)  # the running max moves only by more than tau
    else:
        m_new = tl.maximum(m_i, m_blk)  # the running max
    if FP8:
        p = tl.math.exp2(qk * c - (m_new - P_SHIFT)[:, None])  # [0, 256]
    else:
        p = tl.math.exp2(qk * c - m_new[:, None])  # [0, 1]
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_T:
        vb = tl.trans(v)
    else:
        vb = v
    if FP8 and LAZY:
        if tl.max(m_new - m_i, 0) > 0:  # some row's max moved (alpha is 1 for the others)
            acc = acc * alpha[:, None]
        if CHAIN_ACC:
            acc = tl.dot(_p_to_fp8(p, INTERPRET), vb, acc)
        else:
            acc = acc + tl.dot(_p_to_fp8(p, INTERPRET), vb)
    elif FP8 and CHAIN_ACC:
        acc = tl.dot(_p_to_fp8(p, INTERPRET), vb, acc * alpha[:, None])
    elif FP8:
        acc = acc * alpha[:, None] + tl.dot(_p_to_fp8(p, INTERPRET), vb)
    else:
        acc = tl.dot(_operand(round_to(p, vb.dtype, INTERPRET), INTERPRET), _operand(vb, INTERPRET),
                     acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _block_sparse_attn_kernel(
    Q, K, V, O, KV_IDX, KV_CNT, SQ, SK, SV,
    S, H, n_k_tiles, qk_mult,
    sqb, sqs, sqh, q_rb, q_rh, q_ch,
    skb, sks, skh, k_rb, k_rh, k_ch,
    svb, svs, svh, svd, v_rb, v_rh, v_ch,
    sob, sos, soh,
    sib, sih, sim, sij, scb, sch, scm,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_Q: tl.constexpr,
    TILE_K: tl.constexpr, TAIL: tl.constexpr, FP8: tl.constexpr, OUT_FP8: tl.constexpr, V_T: tl.constexpr,
    TMA: tl.constexpr, WARP_SPEC: tl.constexpr, CHAIN_ACC: tl.constexpr, LAZY: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Q, K, V: pointers, or (TMA) host descriptors over 2-D views with the row / column origin of (b, h) given by
    *_rb, *_rh (rows per batch, per head) and *_ch (columns per head). TAIL: the last key tile is short."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    q_tile = start_m // TILE_Q
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    c = qk_mult
    if FP8:
        c = c * tl.load(SQ) * tl.load(SK)
    if TMA:
        q = Q.load([b * q_rb + h * q_rh + start_m, h * q_ch])
        k_r = b * k_rb + h * k_rh
        k_c = h * k_ch
        v_r = b * v_rb + h * v_rh
        v_c = h * v_ch
    else:
        q = tl.load(Q + b64 * sqb + h64 * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                    mask=offs_m[:, None] < S, other=0.0)
        k_base = K + b64 * skb + h64 * skh
        v_base = V + b64 * svb + h64 * svh

    q = _operand(q, INTERPRET)
    idx_row = KV_IDX + b64 * sib + h64 * sih + q_tile * sim
    cnt = tl.load(KV_CNT + b64 * scb + h64 * sch + q_tile * scm)
    n_main = cnt
    if TAIL:  # the short last key tile, when listed, is the row's last entry: it runs in the masked loop below
        last = tl.load(idx_row + (cnt - 1) * sij)
        n_main = cnt - (last == n_k_tiles - 1).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    SUBS: tl.constexpr = TILE_K // BLOCK_N
    for it in tl.range(0, n_main * SUBS, warp_specialize=WARP_SPEC):
        kt = tl.load(idx_row + (it // SUBS) * sij)
        start_n = kt * TILE_K + (it % SUBS) * BLOCK_N
        if TMA:
            k = K.load([k_r + start_n, k_c])
            if V_T:
                v = V.load([v_r, v_c + start_n])
            else:
                v = V.load([v_r + start_n, v_c])
        else:
            rows = (start_n + offs_n).to(tl.int64)
            k = tl.load(k_base + rows[:, None] * sks + offs_d[None, :])
            if V_T:
                v = tl.load(v_base + offs_d[:, None] * svd + rows[None, :])
            else:
                v = tl.load(v_base + rows[:, None] * svs + offs_d[None, :])
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k, v, c, start_n, S, offs_n, False, FP8, V_T, CHAIN_ACC, LAZY,
                              INTERPRET)

    if TAIL:  # 0 or 1 short tiles: masked logits past S (a loop, not an `if`: see the module docstring)
        tail_start = (n_k_tiles - 1) * TILE_K
        tail_end = tl.where(n_main < cnt, S, tail_start)
        for start_n in tl.range(tail_start, tail_end, BLOCK_N):
            if TMA:
                k = K.load([k_r + start_n, k_c])
                if V_T:
                    v = V.load([v_r, v_c + start_n])
                else:
                    v = V.load([v_r + start_n, v_c])
            else:
                rows = (start_n + offs_n).to(tl.int64)
                ok = rows < S
                k = tl.load(k_base + rows[:, None] * sks + offs_d[None, :], mask=ok[:, None], other=0.0)
                if V_T:
                    v = tl.load(v_base + offs_d[:, None] * svd + rows[None, :], mask=ok[None, :], other=0.0)
                else:
                    v = tl.load(v_base + rows[:, None] * svs + offs_d[None, :], mask=ok[:, None], other=0.0)
            acc, l_i, m_i = _step(acc, l_i, m_i, q, k, v, c, start_n, S, offs_n, True, FP8, V_T, CHAIN_ACC,
                                  LAZY, INTERPRET)

    o = acc / l_i[:, None]
    o_ptrs = O + b64 * sob + h64 * soh + offs_m[:, None].to(tl.int64) * sos + offs_d[None, :]
    if OUT_FP8:
        out = f32_to_fp8e4m3_rne(o, INTERPRET)  # saturating RNE: codes of o / sv
    else:
        if FP8:
            o = o * tl.load(SV)
        out = round_to(o, O.dtype.element_ty, INTERPRET)
    tl.store(o_ptrs, out, mask=offs_m[:, None] < S)


# ----------------------------------------------------------------------------------------------------------------------
# Wrapper


def _rows_view(t: torch.Tensor):
    """A 2-D view (rows, cols, row stride) of a D-contiguous [B, S, H, D] tensor for a TMA descriptor, with the
    row / column origin of (b, h, s) = b * rb + h * rh + s and h * ch: (rows, cols, row_stride, rb, rh, ch); None
    when the strides allow none. Token-major memory ([B, S, H, D] rows of H*D, any row stride >= H*D: a column slice
    of a fused QKV output works) or heads-major ([B, H, S, D])."""
    B, S, H, D = t.shape
    sb, ss, sh, _ = t.stride()
    if (H == 1 or sh == D) and ss >= H * D and (B == 1 or sb == S * ss):
        return (B * S, H * D, ss, S, 0, D)
    if (H == 1 or sh == S * ss) and ss >= D and (B == 1 or sb == H * S * ss):
        return (B * H * S, D, ss, H * S, S, 0)
    return None


def _vt_rows_view(v: torch.Tensor):
    """The same for a sequence-contiguous v ([B, H, D, S'] memory, S' >= S): rows (b, h, d), columns s."""
    B, S, H, D = v.shape
    sb, _, sh, sd = v.stride()
    if sd >= S and (H == 1 or sh == D * sd) and (B == 1 or sb == H * D * sd):
        return (B * H * D, S, sd, H * D, D, 0)
    return None


def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """D-contiguous v [B, S, H, D] -> the same values as a view of sequence-contiguous memory [B, H, D, S_pad]
    (S_pad = S rounded up to 16, the padding zero): the K-major operand Hopper's FP8 MMA takes for P @ V."""
    B, S, H, D = v.shape
    s_pad = -(-S // SEQ_ALIGN) * SEQ_ALIGN
    raw = v.view(torch.uint8) if v.dtype == FP8 else v
    vt = torch.empty((B, H, D, s_pad), dtype=raw.dtype, device=v.device)
    if s_pad > S:
        vt[..., S:].zero_()
    vt[..., :S].copy_(raw.permute(0, 2, 3, 1))
    return (vt.view(FP8) if v.dtype == FP8 else vt)[..., :S].permute(0, 3, 1, 2)


def _aligned(t: torch.Tensor, view) -> bool:
    return view is not None and t.data_ptr() % 16 == 0 and view[2] * t.element_size() % 16 == 0


def _check_lists(kv_idx, kv_cnt, B: int, H: int, nq: int, device) -> None:
    for name, t, ndim in (("kv_idx", kv_idx, 4), ("kv_cnt", kv_cnt, 3)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != ndim:
            raise ValueError(f"{name} must be an int32 tensor with {ndim} dims, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
    if tuple(kv_idx.shape[:3]) != (B, H, nq) or tuple(kv_cnt.shape) != (B, H, nq):
        raise ValueError(f"kv_idx [B, H, NQ, J] and kv_cnt [B, H, NQ] must have B, H, NQ = {B}, {H}, {nq}; got "
                         f"{tuple(kv_idx.shape)} and {tuple(kv_cnt.shape)}")
    if kv_idx.shape[3] < 1:
        raise ValueError("kv_idx needs at least one column")


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor, *,
    tile_q: int, tile_k: int, scales: tuple | None = None, sm_scale: float | None = None,
    out_dtype: torch.dtype | None = None, config: BlockSparseConfig | str | None = None,
) -> torch.Tensor:
    """Block-sparse softmax(q k^T * sm_scale) v (see the module docstring for the list contract and the bound).

    q, k, v: [B, S, H, D], fp16 / bf16, or float8_e4m3fn codes with `scales` = (sq, sk, sv), one-element fp32
    device tensors (real = code * scale; nothing syncs with the host). tile_q / tile_k: tokens per query / key tile
    (powers of two; tile_k >= 32 for codes). D: `head_dims(fp8)` (see Shapes in the module docstring). out_dtype:
    16-bit inputs: their dtype; codes: float8_e4m3fn (codes of o / sv, the default) or fp16 / bf16 (o). Returns a
    new contiguous [B, S, H, D] tensor."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        raise ValueError("q, k, v must be 4-D tensors [B, S, H, D]")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, S, H, D = q.shape
    fp8 = q.dtype == FP8
    dtypes = (FP8,) if fp8 else (torch.float16, torch.bfloat16)
    if q.dtype not in (FP8, torch.float16, torch.bfloat16) or k.dtype not in dtypes or v.dtype not in dtypes:
        raise ValueError(f"q, k, v must all be fp16, all bf16 or all float8_e4m3fn, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not fp8 and not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if D not in head_dims(fp8):
        raise ValueError(f"head dim must be one of {head_dims(fp8)} for {'e4m3 codes' if fp8 else '16-bit inputs'}, "
                         f"got {D}" + (" (Triton's FP8 tl.dot needs K >= 32; K is D in q @ k^T)" if fp8 else ""))
    if min(B, S, H) < 1:
        raise ValueError(f"empty attention input, shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")
    if v.stride(3) != 1 and v.stride(1) != 1:
        raise ValueError(f"v must have unit stride along D or along S, got strides {v.stride()}")
    for name, tile in (("tile_q", tile_q), ("tile_k", tile_k)):
        if not isinstance(tile, int) or tile < 16 or tile & (tile - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {tile!r}")
    if fp8 and tile_k < MIN_DOT_K[True]:
        raise ValueError(f"e4m3 codes need tile_k >= {MIN_DOT_K[True]} (BLOCK_N, the K of P @ V, divides it; "
                         f"Triton's FP8 tl.dot needs K >= 32), got {tile_k}")
    if fp8:
        if scales is None or len(scales) != 3:
            raise ValueError("e4m3 codes need scales=(sq, sk, sv)")
        for name, s in zip(("sq", "sk", "sv"), scales):
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1 or s.device != q.device:
                raise ValueError(f"{name} must be a one-element float32 tensor on {q.device}")
        out_dtype = out_dtype or FP8
        if out_dtype not in (FP8, torch.float16, torch.bfloat16):
            raise ValueError(f"out_dtype for codes must be float8_e4m3fn, fp16 or bf16, got {out_dtype}")
    else:
        if scales is not None:
            raise ValueError("scales are for e4m3 codes only")
        out_dtype = out_dtype or q.dtype
        if out_dtype != q.dtype:
            raise ValueError(f"out_dtype for 16-bit inputs must be the input dtype {q.dtype}, got {out_dtype}")
    nq, nk = triton.cdiv(S, tile_q), triton.cdiv(S, tile_k)
    _check_lists(kv_idx, kv_cnt, B, H, nq, q.device)
    check_device(_block_sparse_attn_kernel, q=q, k=k, v=v, kv_idx=kv_idx, kv_cnt=kv_cnt)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")

    interp = interpreting(_block_sparse_attn_kernel)
    if isinstance(config, str):
        config = BlockSparseConfig.parse(config)
    cfg = config or config_for(tile_q, tile_k, fp8)
    if interp and config is None:
        cfg = dataclasses.replace(cfg, block_m=min(INTERPRET_BLOCK, tile_q), block_n=min(INTERPRET_BLOCK, tile_k),
                                  warp_spec=False)
    if tile_q % cfg.block_m or tile_k % cfg.block_n or cfg.block_m < 16 or cfg.block_n < MIN_DOT_K[fp8]:
        raise ValueError(f"config {cfg.name}: BLOCK_M / BLOCK_N must be >= 16 / {MIN_DOT_K[fp8]} "
                         f"({'e4m3 codes' if fp8 else '16-bit inputs'}) and divide tile_q / tile_k "
                         f"({tile_q} / {tile_k})")

    v_t = v.stride(1) == 1 and v.stride(3) != 1
    if fp8 and cfg.v_t and not v_t:
        v, v_t = transpose_v(v), True
    views = {"q": _rows_view(q), "k": _rows_view(k), "v": _vt_rows_view(v) if v_t else _rows_view(v)}
    tma = (cfg.tma and TensorDescriptor is not None and all(_aligned(t, views[n]) for n, t in zip("qkv", (q, k, v))))
    if cfg.warp_spec and not tma:
        raise ValueError(f"config {cfg.name}: warp specialization needs TMA loads, and these inputs allow none")
    out = torch.empty((B, S, H, D), dtype=out_dtype, device=q.device)
    args = {"q": q, "k": k, "v": v}
    origin = {n: (0, 0, 0) for n in "qkv"}
    if tma:
        blocks = {"q": [cfg.block_m, D], "k": [cfg.block_n, D], "v": [D, cfg.block_n] if v_t else [cfg.block_n, D]}
        for n in "qkv":
            rows, cols, rs, rb, rh, ch = views[n]
            args[n] = TensorDescriptor(args[n], shape=[rows, cols], strides=[rs, 1], block_shape=blocks[n])
            origin[n] = (rb, rh, ch)
    dummy = torch.empty(1, dtype=torch.float32, device=q.device)
    sq_, sk_, sv_ = scales if fp8 else (dummy, dummy, dummy)
    st_q, st_k, st_v, st_o = q.stride(), k.stride(), v.stride(), out.stride()
    grid = (triton.cdiv(S, cfg.block_m), B * H)
    _block_sparse_attn_kernel[grid](
        args["q"], args["k"], args["v"], out, kv_idx, kv_cnt, sq_, sk_, sv_,
        S, H, nk, float(sm_scale) * LOG2E,
        st_q[0], st_q[1], st_q[2], *origin["q"],
        st_k[0], st_k[1], st_k[2], *origin["k"],
        st_v[0], st_v[1], st_v[2], st_v[3], *origin["v"],
        st_o[0], st_o[1], st_o[2],
        *kv_idx.stride(), *kv_cnt.stride(),
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILE_Q=tile_q, TILE_K=tile_k, TAIL=S % tile_k != 0,
        FP8=fp8, OUT_FP8=out_dtype == FP8, V_T=v_t, TMA=tma, WARP_SPEC=cfg.warp_spec, CHAIN_ACC=cfg.chain_acc,
        LAZY=cfg.lazy, INTERPRET=interp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Reference and list helpers


def expand_lists(kv_idx: torch.Tensor, kv_cnt: torch.Tensor, n_k_tiles: int) -> torch.Tensor:
    """The tile mask of the lists: [B, H, NQ, NK] bool, True where query tile i of (b, h) attends to key tile j."""
    B, H, nq, J = kv_idx.shape
    used = torch.arange(J, device=kv_idx.device) < kv_cnt.unsqueeze(-1)
    idx = torch.where(used, kv_idx, n_k_tiles).long().expand(B, H, nq, J)
    mask = torch.zeros((B, H, nq, n_k_tiles + 1), dtype=torch.bool, device=kv_idx.device)
    return mask.scatter_(3, idx, True)[..., :n_k_tiles]


def check_lists(kv_idx: torch.Tensor, kv_cnt: torch.Tensor, n_k_tiles: int) -> None:
    """ValueError unless every row has 1..J tiles in ascending order without repeats, all < n_k_tiles (host sync:
    for tests and mask builders, not the hot path)."""
    idx, cnt = kv_idx.cpu().long(), kv_cnt.cpu().long()
    J = idx.shape[-1]
    if bool((cnt < 1).any()) or bool((cnt > J).any()):
        raise ValueError(f"every row needs 1..{J} tiles, got counts {cnt.min().item()}..{cnt.max().item()}")
    used = torch.arange(J) < cnt.unsqueeze(-1)
    if bool(((idx < 0) | (idx >= n_k_tiles))[used.expand_as(idx)].any()):
        raise ValueError(f"tile indices must be in [0, {n_k_tiles})")
    pairs = used[..., 1:].expand(*idx.shape[:-1], J - 1)
    if bool((idx[..., 1:] <= idx[..., :-1])[pairs].any()):
        raise ValueError("each row's tiles must be in ascending order without repeats")


def block_sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_idx: torch.Tensor, kv_cnt: torch.Tensor, *,
    tile_q: int, tile_k: int, scales: tuple | None = None, sm_scale: float | None = None,
    out_dtype: torch.dtype | None = None, rows_per_chunk: int = 4096,
) -> torch.Tensor:
    """Eager torch: the lists expanded to a token mask, masked softmax attention in fp32 on the (dequantized)
    inputs, rounded once to the output (codes: RNE e4m3 of o / sv, saturated). Same signature and result layout as
    `block_sparse_attention`; query rows in chunks of `rows_per_chunk` (memory: chunk x S logits per head)."""
    B, S, H, D = q.shape
    fp8 = q.dtype == FP8
    if fp8:
        sq, sk, sv = (s.reshape(()).float() for s in scales)
        qf, kf, vf = q.float() * sq, k.float() * sk, v.float() * sv
        out_dtype = out_dtype or FP8
    else:
        qf, kf, vf = q.float(), k.float(), v.float()
        out_dtype = out_dtype or q.dtype
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    nk = -(-S // tile_k)
    tiles = expand_lists(kv_idx, kv_cnt, nk)  # [B, H, NQ, NK]
    key_tile = torch.arange(S, device=q.device) // tile_k
    qf, kf, vf = (t.transpose(1, 2) for t in (qf, kf, vf))  # [B, H, S, D]
    out = torch.empty((B, H, S, D), dtype=torch.float32, device=q.device)
    chunk = max(tile_q, rows_per_chunk // tile_q * tile_q)
    for r0 in range(0, S, chunk):
        r1 = min(S, r0 + chunk)
        q_tile = torch.arange(r0, r1, device=q.device) // tile_q
        allowed = tiles[:, :, q_tile][..., key_tile]  # [B, H, rows, S]
        logits = torch.matmul(qf[:, :, r0:r1], kf.transpose(-1, -2)) * sm_scale
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out[:, :, r0:r1] = torch.matmul(probs, vf)
    out = out.transpose(1, 2)
    if out_dtype == FP8:
        return (out / sv).clamp(-448.0, 448.0).to(FP8)
    return out.to(out_dtype)


def reference_bound(v: torch.Tensor, kv_cnt: torch.Tensor, *, tile_q: int, tile_k: int, scales: tuple | None = None,
                    out_dtype: torch.dtype | None = None, chain_acc: bool | None = None) -> torch.Tensor:
    """The per-element bound of |kernel - reference| stated in the module docstring, [B, S, H, D] fp32 (for the
    output in real units: codes times sv); `chain_acc`: for a config that accumulates P @ V in the MMA chain (None:
    as `config_for(tile_q, tile_k, ...)`, the config a call without one runs)."""
    B, S, H, D = v.shape
    if chain_acc is None:
        chain_acc = config_for(tile_q, tile_k, v.dtype == FP8).chain_acc
    if v.dtype == FP8:
        sv = scales[2].reshape(()).float()
        vmax = (v.float() * sv).abs().amax(dim=1, keepdim=True)  # [B, 1, H, D]
        keys = (kv_cnt.long() * tile_k).clamp(max=S).float()  # [B, H, NQ] (an upper bound of keys per row)
        per_row = keys.repeat_interleave(tile_q, dim=2)[:, :, :S].transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
        per_key = 2.0 ** -18 + (2.0 ** -19 if chain_acc else 0.0)
        return (2.0 ** -3 + per_row * per_key) * vmax + 2.0 ** -9 * sv
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[v.dtype]
    vmax = v.float().abs().amax(dim=1, keepdim=True)
    return (2 * eps + 1e-6) * vmax.expand(B, S, H, D)
