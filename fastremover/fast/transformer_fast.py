"""The Remover DiT on fused kernels: the same weights and math as `models/transformer.py`, fewer passes over memory.

Per block (M = B*S tokens, D = 1536, activations token-major [M, D]):
    n      = adaln_modulate(x, shift, scale)            LayerNorm (fp32 stats) + adaLN in one pass [-> fp8 + row scales]
    q,k,v  = linear(n)                                  exact: three GEMMs; fast: one fused [D, 3D] FP8 GEMM (FP8
                                                        GEMMs: cuBLASLt's workspace-free algorithms on sm_90,
                                                        ops/linear/cublaslt.py; `gemm`)
    q,k    = qk_norm_rope(q), qk_norm_rope(k)           RMSNorm across heads + 3D RoPE in one pass, [B,S,H,Dh] layout;
                                                        with 8-bit attention the same pass writes e4m3 codes (below)
    o      = attention(q, k, v); linear(o)              backend from the registry (fastremover/ops/attention); in the
                                                        fast mode a backend that takes codes gets e4m3 q/k/v: an
                                                        "fp8-codes" output (cuDNN) feeds the FP8 O projection
                                                        directly (per-tensor scale broadcast to rows), a
                                                        "centred-16bit" one (FlashInfer FA3 FP8, FlashAttention-3) is
                                                        quantized again with a static scale; V's centre (V is
                                                        centred) rides in the O projection's bias
    x      = gate_residual(x, o, gate)                  in place, fp32 math; fused with the adaLN that follows
    n2     = adaln_modulate(x, c_shift, c_scale)        (one kernel: gate_residual_adaln)
    f      = linear(gelu_tanh(linear(n2)))              fp8: GELU fused with the quantization of its output (static
                                                        per-tensor bound, see below); on sm_90 both in the first
                                                        GEMM's epilogue (kernels/gemm_fp8.py, fused_ffn1)
    x      = gate_residual(x, f, c_gate)                fused with the next block's first adaLN (or norm_out)
Everything that depends only on the timestep (time embedding, every block's modulation rows, the final norm's rows)
is precomputed for all steps by `conditioning()`, so a denoise step is pure device work and can be graph-captured.

Concurrency (CUDA, 8-bit attention; `concurrent`, `tail_overlap`): q's codes, k's codes and V's statistics + codes are
three independent chains, run on the current stream and two side streams and joined before the attention (b_o + W_o c
runs beside the attention kernel); V's stream, the longest chain, at a higher priority (`stream_priority`).
FlashAttention-3's persistent grid leaves a partial last wave of tiles (W2: 36 of 3072 tiles on 132 SMs, W1: 24 of
684; `attention_row_split`), so with one batch the query rows of that wave run as a second attention call on a side
stream while the first rows go on through the O projection, the norms and the FFN (everything after the attention
is row-wise: `_rowwise_rest`); the next norm's outputs land in row slices of shared tensors. Same kernels, same
inputs: the outputs equal the one-stream order's (GPU test), and the split's equal the unsplit block's up to the
GEMMs' choice of kernels at two row counts (equal in the GPU test's runs).

8-bit attention's q/k/v quantization (fast mode, a backend that takes codes): per-tensor e4m3 with K and V
centred. Softmax makes ANY centre exact: q . (k - c) moves every logit of a query row by the same q . c, and
attn(v) = attn(v - c) + c because each row of P sums to 1 (the + c is W_o c in the O projection's bias). V is
centred on its own sequence mean every step: that is what keeps Hopper's reduced-precision FP8 P @ V accumulation
exact enough (a centre frozen at the first step took W2 to 33.8 dB, because the adaLN shift moves V's mean every
step). K's centre only buys resolution (a shared per-channel offset no longer eats the e4m3 range), so it is
calibrated on the first step of a run (sequence mean per layer, [B, D] fp32) and frozen for the rest, like a static
activation scale. q and k then need no amax pass: RMSNorm bounds every element by sqrt(D) * max|weight|
(`rope_amax_bound`), so qk_norm_rope writes their codes directly with that static scale (k's bound plus
max|centre|). The attention's 16-bit output o - c is bounded by 1.125 max|v - c|, a static scale too.

The FFN's GELU output is quantized with a static per-tensor bound as well (`Conditioning.ffn_amax`, no amax pass):
|h_j| = |n . w_j + b_j| <= ||n|| ||w_j|| + |b_j| (Cauchy-Schwarz) with ||n|| <= sqrt(D) max|1 + scale| + ||shift||
for the modulated LayerNorm output n (||LN(x)|| <= sqrt(D)), and |gelu(h)| <= max(h, 0.17). On the tiny test model
it is 4-6x the true amax (tests/parity/test_fast_transformer.py asserts it holds and stays under 100x); e4m3 is a
floating-point format, so a looser scale costs nothing until values fall below 2^-6 of it (the subnormals).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.config import AttentionOptions, TransformerOptions
from fastremover.errors import FastRemoverError
from fastremover.ops import linear
from fastremover.ops.linear.registry import Fp8Activation, concat_linears, gelu_linear  # noqa: F401 (re-exported)
from fastremover.fast.kernels.qk_norm_rope import rope_amax_bound
from fastremover.lru import LRUCache
from fastremover.models.transformer import RemoverTransformer
from fastremover.ops import attention as attention_backends
from fastremover.engine.interfaces import SINGLE


def kernel_ops(use_triton: bool) -> SimpleNamespace:
    """The fused ops: Triton kernels, or their eager references (same math, for devices without Triton)."""
    from fastremover.fast.kernels import adaln, qk_norm_rope, quant

    if use_triton:
        return SimpleNamespace(
            adaln_modulate=adaln.adaln_modulate,
            gate_residual_adaln=adaln.gate_residual_adaln,
            qk_norm_rope=qk_norm_rope.qk_norm_rope,
            quant_rowwise=quant.quant_fp8_rowwise,
            quant_centred=quant.quant_fp8_centred,
            quant_static=quant.quant_fp8_static,
        )
    return SimpleNamespace(
        adaln_modulate=adaln.adaln_modulate_reference,
        gate_residual_adaln=adaln.gate_residual_adaln_reference,
        qk_norm_rope=qk_norm_rope.qk_norm_rope_reference,
        quant_rowwise=quant.quant_fp8_rowwise_reference,
        quant_centred=quant.quant_fp8_centred_reference,
        quant_static=quant.quant_fp8_static_reference,
    )


# |o - c| <= 1.125 * max|v - c| = 1.125 * 448 * sv for the FP8 attention kernels' 16-bit output (see _attention_fp8)
O_AMAX_PER_V_SCALE = 448.0 * 1.125


# FlashAttention-3's FP8 forward at head dim 128 works on 128-query-row tiles (hopper/tile_size.h: 128 x 224)
FLASH3_FP8_BLOCK_M = 128  # FlashAttention-3's FP8 query tile: attention_row_split's default
SHAPE_CACHE_SIZE = 16  # per-shape kernel state kept (V statistics counters)


def attention_row_split(s: int, tiles_per_block_row: int, sms: int, block_m: int = FLASH3_FP8_BLOCK_M) -> int | None:
    """Query rows [0, s_a) whose attention tiles fill whole waves of `sms` SMs, or None where there is no partial
    last wave to split off. The attention kernel is persistent: ceil(s / block_m) * tiles_per_block_row (= batch *
    heads) equal tiles over the SMs, so the last wave runs on (tiles mod sms) SMs while the rest idle (W2: 3072 tiles,
    36 in the last wave on an H200's 132 SMs; W1: 684 tiles, 24). Rows [s_a, s) - the last wave's tiles - then run
    as a second attention call beside the rest of the block on the first rows (_attention_tail_overlap)."""
    m_blocks = -(-s // block_m)
    tiles = m_blocks * tiles_per_block_row
    if tiles <= sms or tiles % sms == 0:
        return None
    step = sms // math.gcd(sms, tiles_per_block_row)  # block rows per whole number of waves
    m_a = (m_blocks - 1) // step * step
    return m_a * block_m if m_a > 0 else None


def o_projection_bias(v_centre: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """b_o + W_o c per batch, [B, D] in the weight's dtype: what attn(v) = attn(v - c) + c adds after the O
    projection when V is quantized centred on c."""
    return F.linear(v_centre.to(weight.dtype), weight, bias)


@dataclass
class AttentionCalibration:
    """The 8-bit attention's per-run K constants for one batch size, all layers (written by the first step of a run,
    read by the others; fixed addresses, so a captured graph reads what its own first step wrote)."""

    k_centre: torch.Tensor  # [L, B, D] fp32: K's sequence mean at the first step
    k_amax: torch.Tensor  # [L, 1] fp32: static bound of |k - c_k| (rope bound + max|c_k|)
    k_scale: torch.Tensor  # [L, 1] fp32: k_amax / 448
    fp8_max: torch.Tensor  # [] fp32 448 on the device


def _on(stream):
    """`with torch.cuda.stream(stream)`, or nothing for None (the current stream)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _fused_linear(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs side by side (weights and biases concatenated)."""
    return concat_linears(linears)


@dataclass
class Conditioning:
    """Per-step tensors that depend only on the timesteps (precomputed once per run / graph)."""

    block_mods: torch.Tensor  # [N, L, 6, B, D] fp32: shift, scale, gate, c_shift, c_scale, c_gate per block
    final_mods: torch.Tensor  # [N, 2, B, D] fp32: shift, scale of norm_out
    ffn_amax: torch.Tensor | None = None  # fp8: [N, L, 1] fp32 static bound of |gelu(h)| per step and block

    def slot(self) -> "Conditioning":
        """A one-step Conditioning in this one's layouts (each block's rows at the pointer alignment they have in
        every step's rows, so the kernels that read them specialize alike): the static input of a CUDA graph of one
        step, filled with step i's rows by `fill`."""
        ffn = None
        if self.ffn_amax is not None:  # rows of L padded (ffn_amax_bound): the same strides
            ffn = self.ffn_amax.new_zeros(1, self.ffn_amax.stride(0), 1)[:, :self.ffn_amax.shape[1]]
        return Conditioning(torch.empty_like(self.block_mods[:1]), torch.empty_like(self.final_mods[:1]), ffn)

    def fill(self, source: "Conditioning", step: int) -> None:
        """This slot's rows := `source`'s rows of `step` (device copies: graph-safe, no host sync)."""
        self.block_mods.copy_(source.block_mods[step:step + 1])
        self.final_mods.copy_(source.final_mods[step:step + 1])
        if self.ffn_amax is not None:
            self.ffn_amax.copy_(source.ffn_amax[step:step + 1])


class FastTransformer(nn.Module):
    # the sequence-parallel hook (fastremover.parallel.context): this rank's tokens, the attention wrapped in the
    # all-to-all, K's centre and V's statistics all-reduced; size 1 (one process) leaves every path as it is
    parallel = SINGLE

    def __init__(self, model: RemoverTransformer, *, linear_method: "str | linear.LinearMethod" = "dense",
                 attention: str = "sdpa", use_triton: bool | None = None, fused_ffn1: bool = True,
                 options: TransformerOptions = TransformerOptions(),
                 attention_options: AttentionOptions | None = None):
        """linear_method: how the block linears are stored and run (ops/linear/registry.py: dense, fp8-rowwise,
        nvfp4, nvfp4-w4a4 or a registered one; the engine passes the plan's). A method with FP8 activations makes
        the norms write e4m3 codes + row scales and enables the 8-bit attention path. use_triton: the Triton kernels
        (default: on CUDA) or their eager references. options: the switches of config.TransformerOptions (streams,
        the fp8-rowwise GEMM choice). attention_options: the config's AttentionOptions (a sparse backend's keep rate
        and window; None: its defaults)."""
        super().__init__()
        self.model = model  # eager module: weights, config, rope tables, condition embedder
        self.config = model.config
        device = model.proj_out.weight.device
        self.dtype = model.proj_out.weight.dtype
        self.options = options
        gemm = options.gemm
        self.linear_method = linear.get(linear_method)
        fp8 = self.fp8 = self.linear_method.fp8_activations  # norms write e4m3 codes + row scales
        self.fused_ffn1 = False  # set below in fp8 mode
        self.use_triton = device.type == "cuda" if use_triton is None else use_triton
        self.ops = kernel_ops(self.use_triton)
        heads, head_dim = self.config.num_attention_heads, self.config.attention_head_dim
        # (the fast mode hands e4m3 codes to a backend that takes them; engine.build checked this before building)
        self.backend = attention_backends.runnable(attention, device, dtype=self.dtype, shape=(heads, head_dim),
                                                   fp8_activations=fp8)
        # a sparse backend: the tokens run in its layout's order (cube order) from the patch embedding to proj_out,
        # one layout per grid (`_token_layout`), passed to every attention call
        self.attention_options = attention_options
        self._layouts: LRUCache[tuple] = LRUCache(SHAPE_CACHE_SIZE)
        self._attention_kw: dict = {}
        self.attention_name = self.backend.name
        self.attention = self.backend.call
        # Every block linear built once by the method: q/k/v as one layer (one 4608-wide GEMM instead of three where
        # the method concatenates exactly: dense, fp8-rowwise's per-output-channel scales), out/ffn their own
        method = self.linear_method
        self.linears = nn.ModuleList(
            nn.ModuleDict({
                "qkv": method.fused([b.attn1.to_q, b.attn1.to_k, b.attn1.to_v], self.dtype, gemm),
                "o": method.build(b.attn1.to_out[0], self.dtype, gemm),
                "ff1": method.build(b.ffn.net[0].proj, self.dtype, gemm),
                "ff2": method.build(b.ffn.net[2], self.dtype, gemm),
            })
            for b in model.blocks
        )
        # The backend's capabilities (registry record), not its name, decide the path. fp8-codes output (cuDNN): the
        # codes go straight into the FP8 O projection (no dequantize / requantize pass). centred-16bit output
        # (FlashInfer's FA3 FP8 kernel, FlashAttention-3's): 16-bit (o - c), quantized again (static scale) for the O
        # projection, V's centre in the projection's bias (quantizing o itself, centre included, would spend the e4m3
        # codes' range on the centre)
        takes_codes = fp8 and self.backend.takes_codes
        self.fp8_attention_codes = takes_codes and self.backend.output == "fp8-codes"
        self.fp8_attention_requant = takes_codes and self.backend.output == "centred-16bit"
        self._calibrations: dict[tuple, AttentionCalibration] = {}
        # CUDA: the 8-bit attention's three independent preparations (q, k, V statistics + codes) run on their own
        # streams, and b_o + W_o c beside the attention kernel (see _attention_fp8); a captured graph keeps them as
        # parallel branches
        self.concurrent = options.concurrent and device.type == "cuda"
        self._side_streams: dict[torch.device, tuple] = {}
        # V's side stream at a higher priority than the others (see _streams)
        self.stream_priority = options.stream_priority
        # V's statistics pass does its own final reduction (quant_fp8_centred(fused_finalize=True): two kernels on
        # V's chain instead of three), with one program counter per layer kept here (the kernel resets it)
        self.fused_v_stats = options.fused_v_stats and self.use_triton
        self._v_counters: LRUCache[torch.Tensor] = LRUCache(SHAPE_CACHE_SIZE)  # per (device, batch, tokens, width)
        # a backend with row_split_block_m (FlashAttention-3's FP8), one batch: the attention's partial last wave of
        # tiles as a second call, overlapped with the rest of the block on the other rows (attention_row_split);
        # sm_count None = no split (a test may set it on the CPU to exercise the split with a faked kernel)
        self.tail_overlap = options.tail_overlap
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        if fp8:
            # static amax bounds of the q and k rope outputs, and q's dequantization scale (quant.py's rule)
            self.q_amax = [rope_amax_bound(b.attn1.norm_q.weight) for b in model.blocks]
            self.q_scale = [a / a.new_full((), 448.0) for a in self.q_amax]
            self.k_bound = torch.cat([rope_amax_bound(b.attn1.norm_k.weight) for b in model.blocks])
            # the GELU output's static bound (module docstring): ||w_j|| of the dequantized ff1 weight rows (what
            # the GEMM multiplies by) and |b_j|, [L, F] fp32
            self.ff1_row_norm = torch.stack([blk["ff1"].weight_row_norms() for blk in self.linears])
            # fused_ffn1 (the default): ff1 + GELU + the static-bound quantization in one Triton GEMM where it runs
            # (kernels/gemm_fp8.py: sm_90 or the interpreter), else _scaled_mm then quant_fp8_static. The fused
            # epilogue needs a bias vector (zeros for a bias-free ff1).
            ff1 = self.linears[0]["ff1"]
            self.fused_ffn1 = fused_ffn1 and self.use_triton and ff1.fused_gelu_quant_available(device)
            self.ff1_bias = [blk["ff1"].bias if blk["ff1"].bias is not None
                             else torch.zeros(blk["ff1"].out_features, device=device, dtype=torch.float32)
                             for blk in self.linears]
            self.ff1_bias_abs = torch.stack([b.float().abs() for b in self.ff1_bias])

    @property
    def fp8_blocks(self) -> nn.ModuleList:
        """The block linears of an FP8 method (the name the fp8 tests and tools use; `linears` for any method)."""
        if not self.fp8:
            raise AttributeError("fp8_blocks: this transformer's linear method has 16-bit activations; use .linears")
        return self.linears

    @property
    def fp8_attention(self) -> bool:
        """q/k/v go to an 8-bit attention kernel as e4m3 codes quantized here (see the module docstring)."""
        return self.fp8_attention_codes or self.fp8_attention_requant

    def describe(self) -> dict:
        out = {"fused_kernels": "triton" if self.use_triton else "eager-reference", "fp8_linears": self.fp8,
               "attention": self.attention_name}
        if self.fp8:
            out["ffn1"] = "fused GEMM+GELU+quant (Triton)" if self.fused_ffn1 else "_scaled_mm + GELU quant"
            gemm = getattr(self.linears[0]["qkv"], "gemm", None)
            out["fp8_gemm"] = ("cuBLASLt, workspace-free algorithm" if gemm == "cublaslt" else
                               "torch._scaled_mm" if gemm == "torch" else self.linear_method.name)
            out["concurrent_branches"] = self.concurrent and self.fp8_attention
        return out

    def split_rows(self, b: int, s: int, heads: int) -> int | None:
        """The first attention call's query rows when the last wave is split off (attention_row_split), else None."""
        block_m = self.backend.row_split_block_m
        if not (self.tail_overlap and block_m is not None and self.fp8_attention_requant and b == 1 and self.sm_count
                and not self.parallel.is_parallel):  # sequence parallel: the attention is wrapped in the all-to-all
            return None
        return attention_row_split(s, b * heads, self.sm_count, block_m)

    def _token_layout(self, grid: tuple, device: torch.device, rope: tuple) -> tuple:
        """(layout, RoPE tables in its order) of a sparse backend for this grid, made once per (grid, device);
        (None, rope) for a dense backend."""
        if self.backend.token_layout is None:
            return None, rope
        if self.parallel.is_parallel:
            raise FastRemoverError(f"--attention {self.attention_name} does not run under sequence parallelism")
        key = (tuple(grid), device)
        entry = self._layouts.get(key)
        if entry is None:
            layout = self.backend.token_layout(tuple(grid), device, self.attention_options)
            entry = (layout, layout.rope(*rope))
            self._layouts.put(key, entry)
        return entry

    def token_layouts(self) -> list[dict]:
        """The sparse backend's layouts made so far (one per token grid), described; [] for a dense backend."""
        return [layout.describe() for layout, _ in self._layouts.values()]

    def _v_stats_options(self, index: int, v: torch.Tensor, b: int, s: int) -> dict:
        """quant_centred's keyword options for layer `index`: the fused finalize and this layer's counter."""
        if not self.fused_v_stats:
            return {}
        key = (v.device, b, s, v.shape[1])
        counters = self._v_counters.get(key)
        if counters is None:
            counters = self._new_v_counters(v, b, s)
            self._v_counters.put(key, counters)
        return {"fused_finalize": True, "counter": counters[index]}

    def _new_v_counters(self, v: torch.Tensor, b: int, s: int, make=torch.zeros) -> torch.Tensor:
        from fastremover.fast.kernels.quant import centred_counter_size

        size = centred_counter_size(s, v.shape[1], b)
        return make((len(self.model.blocks), size), dtype=torch.int32, device=v.device)

    def shape_state(self, hidden_shape: tuple, device: torch.device) -> tuple:
        """The per-shape tensors a step of this input shape reads from this module's caches (RoPE tables, V's
        statistics counters). A captured graph keeps them referenced, so evicting them from the bounded caches
        never frees memory the graph still reads."""
        grid = self.model.post_patch_grid(hidden_shape)
        b, s = hidden_shape[0], grid[0] * grid[1] * grid[2]
        width = self.config.num_attention_heads * self.config.attention_head_dim
        return (self.model.rope(grid, device), self._v_counters.get((device, b, s, width)),
                self._layouts.get((tuple(grid), device)))

    def _streams(self, device: torch.device) -> tuple:
        """(side_v, side_k, side_tail) per device, created once (a captured graph refers to the streams it was
        recorded on): V's preparation chain, k's chain + b_o + W_o c, and the attention's last-wave chunk.

        With `stream_priority`, V's stream runs at a higher priority than the others (lower numbers are higher; the
        default is 0): q's and k's norm + RoPE kernels launch thousands of CTAs each, and at equal priority the block
        scheduler ran the three chains one after another (W1 timeline: q's, then k's, then V's column statistics,
        finalize and codes, 67 us from the QKV GEMM to the attention; with V's stream first, 55 us:
        bench/results/step-timeline-*.json). The last-wave chunk keeps its own normal-priority stream: at V's
        priority its CTAs would take SMs before the first call's and delay that call's end, and on k's stream the
        first chunk's wait for b_o + W_o c would also wait for the tail attention (what a first try did: +70 us per
        layer). CUDA graphs keep the priorities (PyTorch instantiates them with UseNodePriority)."""
        streams = self._side_streams.get(device)
        if streams is None:
            v_priority = -1 if self.stream_priority else 0
            streams = (torch.cuda.Stream(device, priority=v_priority), torch.cuda.Stream(device),
                       torch.cuda.Stream(device))
            self._side_streams[device] = streams
        return streams

    @torch.no_grad()
    def conditioning(self, timesteps: torch.Tensor, batch: int) -> Conditioning:
        """Modulation rows for every step: the same fp32 values the eager blocks compute on the fly."""
        block_mods, final_mods = [], []
        for t in timesteps:
            temb, tproj = self.model.condition_embedder(t.reshape(1).expand(batch))
            block_mods.append(torch.stack(
                [(blk.scale_shift_table + tproj.float()).permute(1, 0, 2) for blk in self.model.blocks]
            ))
            final_mods.append((self.model.scale_shift_table + temb.unsqueeze(1)).permute(1, 0, 2))
        block_mods = torch.stack(block_mods).contiguous()
        ffn_amax = self.ffn_amax_bound(block_mods) if self.fp8 else None
        return Conditioning(block_mods, torch.stack(final_mods).contiguous(), ffn_amax)

    def ffn_amax_bound(self, block_mods: torch.Tensor) -> torch.Tensor:
        """[N, L, 6, B, D] modulation rows -> [N, L, 1] fp32: a bound of |gelu(h)| for the FFN's hidden h = ff1(n) of
        every step and block (module docstring). ||n|| <= sqrt(D) max|1 + c_scale| + ||c_shift|| per batch row;
        x 1.07 for n's e4m3 rounding (<= 2^-4 per element) and the GEMM's rounding; the largest over the batch."""
        c_shift, c_scale = block_mods[:, :, 3], block_mods[:, :, 4]  # [N, L, B, D]
        d = c_shift.shape[-1]
        n_norm = (d ** 0.5) * (1 + c_scale).abs().amax(-1) + c_shift.norm(dim=-1)  # [N, L, B]
        n_norm = n_norm.amax(-1) * 1.07  # [N, L]
        h_amax = (n_norm[..., None] * self.ff1_row_norm + self.ff1_bias_abs).amax(-1)  # [N, L]
        bound = torch.clamp_min(h_amax, 0.17)  # gelu(h) >= -0.17
        # each step's rows start on a 16-byte boundary (L padded to a multiple of 4): block i's bound has the same
        # pointer alignment at every step, so the fused FFN1 GEMM (which specializes on it) compiles once for all steps
        n, blocks = bound.shape
        out = bound.new_zeros(n, -(-blocks // 4) * 4, 1)[:, :blocks]
        out[..., 0] = bound
        return out

    def _calibration(self, b: int, device: torch.device, create: bool) -> AttentionCalibration:
        key = (b, device)
        cal = self._calibrations.get(key)
        if cal is None:
            if not create:
                raise RuntimeError("FastTransformer: 8-bit attention calibration missing - a run's first step "
                                   "(forward_step with step 0) calibrates the K/V centres for the later steps")
            cal = self._calibrations[key] = self._new_calibration(b, device)
        return cal

    def _new_calibration(self, b: int, device: torch.device, make=torch.zeros) -> AttentionCalibration:
        n, d = len(self.model.blocks), self.config.num_attention_heads * self.config.attention_head_dim
        f32 = dict(dtype=torch.float32, device=device)
        return AttentionCalibration(make((n, b, d), **f32), make((n, 1), **f32), make((n, 1), **f32),
                                    torch.full((), 448.0, **f32))

    def _code_out(self, b: int, s: int, like: torch.Tensor) -> dict:
        """{"out": the e4m3 code buffer [b * s, D]} for q, k or v when the backend reads past the sequence (its
        `code_rows`: a kernel loading whole tiles): the first b * s rows of one allocated that long, the rows past
        them zero (a masked key still multiplies its V row by P = 0, and 0 x NaN is NaN); else {} (the kernel
        allocates exactly b * s rows). Allocated on the stream that writes it, as the kernel's own would be."""
        if self.backend.code_rows is None:
            return {}
        if b != 1:
            raise ValueError(f"attention backend {self.backend.name} runs one batch at a time, got {b}")
        rows = self.backend.code_rows(s, self._attention_kw["layout"])
        buf = torch.empty((rows, like.shape[1]), dtype=torch.float8_e4m3fn, device=like.device)
        buf[s:].zero_()
        return {"out": buf[:s]}

    def _attention_fp8(self, index: int, q, k, v, rope, shape, calibrate: bool, x: torch.Tensor, mods: torch.Tensor,
                       next_mods: tuple, ffn_amax: torch.Tensor):
        """8-bit attention, then the rest of the block (`_rowwise_rest`: O projection, gated residual + adaLN, FFN,
        gated residual + the next norm; see the module docstring): q, k, v [M, D] column views of the fused QKV
        output, x the residual stream (updated in place) -> the next norm's output, as `_block` returns it."""
        ops, attn = self.ops, self.model.blocks[index].attn1
        b, s, heads = shape
        eps = self.config.eps
        cal = self._calibration(b, q.device, create=calibrate)
        # Three independent chains feed the attention kernel: q's codes, k's codes, and V's statistics + codes (V's
        # chain, three kernels, is the longest). With `concurrent` they run on the current stream and two side
        # streams, joined before the attention; b_o + W_o c (only the O projection reads it) runs on a side stream
        # beside the attention kernel. At W1 these kernels are too small to fill the GPU one after another.
        # Memory: everything a side stream allocates is read only by work ordered before the next layer's fork
        # (each fork waits on the current stream, which waited on both side streams), so the caching allocator
        # never hands a block to a new writer while an old reader may still run.
        main = torch.cuda.current_stream(q.device) if self.concurrent else None
        side_v, side_k, side_tail = self._streams(q.device) if self.concurrent else (None, None, None)
        if main is not None:
            side_v.wait_stream(main)
            side_k.wait_stream(main)
        with _on(side_v):
            # V is centred on this step's own mean: the adaLN shift moves V's mean every step, and a stale centre
            # let the FP8 P @ V accumulation lose the low bits again (W2 33.8 dB with a frozen one,
            # bench/results/w2-fast-frozenv-*.json)
            # (one statistics pass finds the mean and the amax of v - mean together: quant.quant_fp8_centred)
            if self.parallel.is_parallel:  # sequence parallel: mean and amax over every rank's tokens
                v8, sv, v_centre = self.parallel.quant_centred(v, s)
            else:
                v8, sv, v_centre = ops.quant_centred(v, s, **self._code_out(b, s, v),
                                                     **self._v_stats_options(index, v, b, s))
        with _on(side_k):
            if calibrate:  # the run's first step: K's centre from this step's K, then frozen (on k's own chain:
                # only k's codes and the attention read it; written straight into the calibration's rows)
                k_half = ops.qk_norm_rope(k, attn.norm_k.weight, *rope, s, heads, eps)
                self.parallel.sequence_mean(k_half.unflatten(0, (b, s)), out=cal.k_centre[index])  # size 1: torch.mean
                torch.add(self.k_bound[index], cal.k_centre[index].abs().amax(), out=cal.k_amax[index, 0])
                torch.div(cal.k_amax[index, 0], cal.fp8_max, out=cal.k_scale[index, 0])  # quant.py's rule (a true
                # division: a CPU-scalar divisor would be a multiplication by its reciprocal on the GPU)
            k8 = ops.qk_norm_rope(k, attn.norm_k.weight, *rope, s, heads, eps, fp8_amax=cal.k_amax[index],
                                  centre=cal.k_centre[index], **self._code_out(b, s, k))
        q8 = ops.qk_norm_rope(q, attn.norm_q.weight, *rope, s, heads, eps, fp8_amax=self.q_amax[index],
                              **self._code_out(b, s, q))
        if main is not None:
            main.wait_stream(side_v)
            main.wait_stream(side_k)
        with _on(side_k):  # side_k is past k's codes; it waits for V's centre
            if side_k is not None:
                side_k.wait_stream(side_v)
            o_bias = o_projection_bias(v_centre, attn.to_out[0].weight, attn.to_out[0].bias)  # [B, D]
        sq, sk = self.q_scale[index], cal.k_scale[index]
        q8, k8, v8 = (t.view(b, s, heads, -1) for t in (q8, k8, v8))
        rows_a = self.split_rows(b, s, heads)
        if rows_a is not None:
            return self._attention_tail_overlap(index, rows_a, q8, k8, v8, sq, sk, sv, o_bias[0], x, mods, next_mods,
                                                ffn_amax, main, side_tail, side_k)
        o_proj = self.linears[index]["o"]

        def codes_call(q8, k8, v8):  # per-tensor scales: the same on every rank (static bounds, all-reduced V stats)
            return self.backend.codes_call(q8, k8, v8, sq, sk, sv, out_dtype=self.dtype, **self._attention_kw)

        if self.fp8_attention_requant:  # 16-bit (o - c) codes with a static scale: |o - c| <= max|v - c| * (1 + 2^-4)
            # (each row of P sums to 1 before its e4m3 rounding; bf16 output rounding on top), so 448 * 1.125 sv
            # bounds it and the quantization needs no amax pass
            o_c = self.parallel.attention(codes_call, q8, k8, v8)  # 16-bit (o - c)
            o_in = Fp8Activation.of(ops.quant_static(o_c.view(b * s, -1), sv, O_AMAX_PER_V_SCALE))
        else:  # codes of (o - c) / sv
            o_codes = self.parallel.attention(codes_call, q8, k8, v8)
            o_in = Fp8Activation(o_codes.view(b * s, -1), sv.view(1, 1).expand(b * s, 1).contiguous())
        if main is not None:
            main.wait_stream(side_k)
        if b == 1:  # one batch: b_o + W_o c is the GEMM's bias (added in its fp32 epilogue, no extra pass)
            o = o_proj(o_in, bias=o_bias[0])
        else:  # the GEMM's bias is one row for all batches: b_o + W_o c per batch after it
            o = o_proj(o_in, bias=torch.zeros_like(o_bias[0]))
            o.view(b, s, -1).add_(o_bias.unsqueeze(1))
        return self._rowwise_rest(index, x, o, mods, next_mods, ffn_amax, s)

    def _attention_tail_overlap(self, index: int, rows_a: int, q8, k8, v8, sq, sk, sv, o_bias, x, mods, next_mods,
                                ffn_amax, main, side_tail, side_k):
        """One batch, FlashAttention-3: query rows [0, rows_a) (whole waves of tiles) and [rows_a, S) (the partial
        last wave) as two attention calls, each followed by the rest of the block on its own rows (everything after
        the attention is row-wise: `_rowwise_rest`), the next norm's outputs written into row slices of shared
        tensors. With `concurrent` the second chain runs on a side stream: its attention's few tiles share the GPU
        with the first rows' O projection, norms and FFN instead of leaving most SMs idle. Each query row's attention
        is the same computation either way; the GEMMs run at two row counts (cuBLAS may pick other kernels for them
        than for one call, so the result is close to, not necessarily equal to, the unsplit block's)."""
        m, d = x.shape
        next_fp8 = next_mods[2]
        if next_fp8:
            out = Fp8Activation(torch.empty((m, d), dtype=torch.float8_e4m3fn, device=x.device),
                                torch.empty((m, 1), dtype=torch.float32, device=x.device))
        else:
            out = torch.empty((m, d), dtype=self.dtype, device=x.device)
        side = side_tail  # the first rows' chain stays on the current stream (see _streams)
        if main is not None:
            side.wait_stream(main)  # q's codes (k's and V's: main waited on both)
        chunks = ((slice(0, rows_a), None), (slice(rows_a, m), side))
        # both attention calls first (the second's tiles start as the first's CTAs leave), then the row-wise rest
        attn_out = []
        for rows, stream in chunks:
            with _on(stream):
                attn_out.append(self.backend.codes_call(q8[:, rows], k8, v8, sq, sk, sv, out_dtype=self.dtype))
        o_proj = self.linears[index]["o"]
        for (rows, stream), o_c in zip(chunks, attn_out):
            with _on(stream):
                if main is not None:
                    (stream or main).wait_stream(side_k)  # b_o + W_o c
                n = rows.stop - rows.start
                o_in = Fp8Activation.of(self.ops.quant_static(o_c.view(n, d), sv, O_AMAX_PER_V_SCALE))
                o = o_proj(o_in, bias=o_bias)
                rows_out = out.rows(rows) if next_fp8 else out[rows]
                self._rowwise_rest(index, x[rows], o, mods, next_mods, ffn_amax, n, out=rows_out)
        if main is not None:
            main.wait_stream(side)
        return out

    def _rowwise_rest(self, index: int, x: torch.Tensor, o: torch.Tensor, mods: torch.Tensor, next_mods: tuple,
                      ffn_amax: torch.Tensor | None, s: int, out=None):
        """Everything in a block after the attention's O projection o, on rows x (updated in place): x += gate * o
        fused with the FFN's adaLN, the FFN, x += c_gate * f fused with the next norm -> that norm's output (fp8:
        codes and row scales; into `out` when given). Every step is row-wise (s = tokens per batch of these rows)."""
        ops, eps = self.ops, self.config.eps
        n2 = self.linear_method.wrap(ops.gate_residual_adaln(x, o, mods[2], mods[3], mods[4], s, eps, fp8=self.fp8))
        lin = self.linears[index]
        if self.fp8:
            if self.fused_ffn1:  # the GELU codes straight from ff1's epilogue (the 16-bit hidden is never written)
                h8 = lin["ff1"].gelu_quant(n2, self.ff1_bias[index], ffn_amax)
            else:
                h8 = Fp8Activation.of(ops.quant_static(lin["ff1"](n2), ffn_amax, gelu=True))
            f = lin["ff2"](h8)
        else:
            f = lin["ff2"](lin["ff1"].gelu(n2))
        next_shift, next_scale, next_fp8 = next_mods
        kw = {} if out is None else ({"out": out.codes, "out_scale": out.row_scale} if next_fp8 else {"out": out})
        n = ops.gate_residual_adaln(x, f, mods[5], next_shift, next_scale, s, eps, fp8=next_fp8, **kw)
        return Fp8Activation.of(n) if next_fp8 else n

    def _block(self, index: int, x: torch.Tensor, n_in, mods: torch.Tensor, next_mods: tuple, rope, shape,
               calibrate: bool, ffn_amax: torch.Tensor | None):
        """One block on the residual stream x [M, D] (updated in place). n_in: this block's normalized input (fp8: e4m3
        codes and row scales), written by the previous block's last kernel; mods [6, B, D]; next_mods: (shift, scale,
        fp8) of the norm that reads this block's output (the next block's, or norm_out's); ffn_amax [1] (fp8: the
        GELU output's bound). Returns that next normalized input: each gated residual add is fused with the adaLN
        that follows it (adaln.gate_residual_adaln), so x is read once per add + norm."""
        ops, blk = self.ops, self.model.blocks[index]
        b, s, heads = shape
        eps = self.config.eps
        attn = blk.attn1
        q, k, v = self.linears[index]["qkv"](n_in).chunk(3, dim=1)  # column slices: row stride 3D, read in place
        if self.fp8_attention:
            return self._attention_fp8(index, q, k, v, rope, shape, calibrate, x, mods, next_mods, ffn_amax)
        q = ops.qk_norm_rope(q, attn.norm_q.weight, *rope, s, heads, eps)
        k = ops.qk_norm_rope(k, attn.norm_k.weight, *rope, s, heads, eps)
        o = self.parallel.attention(partial(self.attention, **self._attention_kw), q.view(b, s, heads, -1),
                                    k.view(b, s, heads, -1), v.unflatten(1, (heads, -1)).view(b, s, heads, -1))
        o = self.linears[index]["o"](self.linear_method.prepare(o.reshape(b * s, -1), ops))
        return self._rowwise_rest(index, x, o, mods, next_mods, ffn_amax, s)

    @torch.no_grad()
    def forward_step(self, hidden_states: torch.Tensor, cond: Conditioning, step: int,
                     calibrate: bool | None = None) -> torch.Tensor:
        """One denoise step's transformer call: [B, in, T, H, W] -> [B, out, T, H, W], conditioning of `step`.
        calibrate: whether this step writes the 8-bit attention's per-run K constants (default: step 0 does, later
        steps read them; a graph of one later step reads step `step` of a one-step `Conditioning.slot`)."""
        calibrate = step == 0 if calibrate is None else calibrate
        model = self.model
        grid = model.post_patch_grid(hidden_states.shape)
        rope = model.rope(grid, hidden_states.device)
        b = hidden_states.shape[0]
        s_all = grid[0] * grid[1] * grid[2]
        layout, rope = self._token_layout(grid, hidden_states.device, rope)
        self._attention_kw = {} if layout is None else {"layout": layout}
        x = model.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
        if layout is not None:  # a sparse backend: cube order until proj_out (every op but the attention is row-wise)
            x = layout.permute(x)
        # sequence parallel: this rank's tokens and their RoPE rows from here to proj_out (size 1: all of them)
        x = self.parallel.shard_tokens(x)
        rope, s = self.parallel.shard_rope(rope), x.shape[1]
        x = x.reshape(b * s, -1).contiguous()
        shape = (b, s, self.config.num_attention_heads)
        if self.fp8 and cond.ffn_amax is None:
            raise ValueError("an FP8 FastTransformer's forward_step needs a Conditioning from an FP8 transformer's "
                             "conditioning() (it carries the FFN's static quantization bounds)")
        mods, final = cond.block_mods[step], cond.final_mods[step]
        eps, n_blocks = self.config.eps, len(model.blocks)
        n = self.linear_method.wrap(self.ops.adaln_modulate(x, mods[0][0], mods[0][1], s, eps, fp8=self.fp8))
        for i in range(n_blocks):
            # the norm after this block: the next block's (fp8 codes in the fast mode), or norm_out's (model dtype)
            next_mods = (mods[i + 1][0], mods[i + 1][1], self.fp8) if i + 1 < n_blocks else (final[0], final[1], False)
            n = self._block(i, x, n, mods[i], next_mods, rope, shape, calibrate=calibrate,
                            ffn_amax=None if cond.ffn_amax is None else cond.ffn_amax[step, i])
        out = model.proj_out(n).view(b, s, -1)
        if layout is not None:
            out = layout.restore(out)
        return model.unpatchify(self.parallel.gather_tokens(out, s_all), grid)

    # ------------------------------------------------------------------------------------------------------------------
    # The step's kernel launches, for compiling them ahead (fastremover/fast/precompile.py)

    @torch.no_grad()
    def launch_kernels(self, hidden_shape: tuple, device: torch.device) -> None:
        """Call each fused-kernel op (`self.ops`, the fused FFN1 GEMM) that `forward_step` of a [B, in, T, H, W] input
        calls at its first step (which also calibrates K's centre), with tensors of the same shapes, dtypes, strides
        and storage offsets on `device` (the meta device: nothing is computed), and nothing else (no GEMM, no
        attention, no torch op). fastremover/fast/precompile.py records these launches to compile them before the
        run; tests/kernels/test_precompile.py checks the calls against forward_step's. Keep the two in step.
        Nothing for a sequence-parallel run or a sparse backend (their launches compile when they run)."""
        if self.parallel.is_parallel or self.backend.token_layout is not None:
            return
        ops, cfg, eps = self.ops, self.config, self.config.eps
        grid = self.model.post_patch_grid(hidden_shape)
        b, s = hidden_shape[0], grid[0] * grid[1] * grid[2]
        heads, d, n_blocks = cfg.num_attention_heads, cfg.num_attention_heads * cfg.attention_head_dim, len(
            self.model.blocks)

        def empty(*shape, dtype=self.dtype):
            return torch.empty(shape, dtype=dtype, device=device)

        def like(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device=device)

        f32 = torch.float32
        rope = (empty(s, cfg.attention_head_dim // 2, dtype=f32), empty(s, cfg.attention_head_dim // 2, dtype=f32))
        x = empty(b * s, d)
        mods_all, final = empty(1, n_blocks, 6, b, d, dtype=f32)[0], empty(1, 2, b, d, dtype=f32)[0]
        ffn_amax = empty(1, n_blocks, 1, dtype=f32)[0] if self.fp8 else None
        cal = self._new_calibration(b, device, make=torch.empty) if self.fp8_attention else None
        counters = None
        n = ops.adaln_modulate(x, mods_all[0][0], mods_all[0][1], s, eps, fp8=self.fp8)
        for i in range(n_blocks):
            mods = mods_all[i]
            next_mods = (mods_all[i + 1][0], mods_all[i + 1][1], self.fp8) if i + 1 < n_blocks else (
                final[0], final[1], False)
            attn = self.model.blocks[i].attn1
            q, k, v = empty(b * s, 3 * d).chunk(3, dim=1)
            amax_i = None if ffn_amax is None else ffn_amax[i]
            if not self.fp8_attention:
                ops.qk_norm_rope(q, like(attn.norm_q.weight), *rope, s, heads, eps)
                ops.qk_norm_rope(k, like(attn.norm_k.weight), *rope, s, heads, eps)
                self.linear_method.prepare(empty(b * s, d), ops)  # the O projection's input
                self._launch_rowwise_rest(i, x, mods, next_mods, amax_i, s, empty)
                continue
            v_options = {}
            if self.fused_v_stats:
                if counters is None:
                    counters = self._new_v_counters(v, b, s, make=torch.empty)
                v_options = {"fused_finalize": True, "counter": counters[i]}
            _, sv, _ = ops.quant_centred(v, s, **v_options)
            ops.qk_norm_rope(k, like(attn.norm_k.weight), *rope, s, heads, eps)  # K's centre (the first step)
            ops.qk_norm_rope(k, like(attn.norm_k.weight), *rope, s, heads, eps, fp8_amax=cal.k_amax[i],
                             centre=cal.k_centre[i])
            ops.qk_norm_rope(q, like(attn.norm_q.weight), *rope, s, heads, eps, fp8_amax=like(self.q_amax[i]))
            rows_a = self.split_rows(b, s, heads)
            if rows_a is not None:  # _attention_tail_overlap
                out = (empty(b * s, d, dtype=torch.float8_e4m3fn), empty(b * s, 1, dtype=f32)) if next_mods[2] \
                    else empty(b * s, d)
                for rows in (slice(0, rows_a), slice(rows_a, b * s)):
                    m = rows.stop - rows.start
                    ops.quant_static(empty(m, d), sv, O_AMAX_PER_V_SCALE)
                    rows_out = (out[0][rows], out[1][rows]) if next_mods[2] else out[rows]
                    self._launch_rowwise_rest(i, x[rows], mods, next_mods, amax_i, m, empty, out=rows_out)
                continue
            if self.fp8_attention_requant:
                ops.quant_static(empty(b * s, d), sv, O_AMAX_PER_V_SCALE)
            self._launch_rowwise_rest(i, x, mods, next_mods, amax_i, s, empty)

    def _launch_rowwise_rest(self, index: int, x, mods, next_mods, ffn_amax, s: int, empty, out=None) -> None:
        """`_rowwise_rest`'s fused-kernel calls (see launch_kernels); the GEMMs' outputs are `empty` tensors."""
        ops, eps = self.ops, self.config.eps
        m, d = x.shape
        ops.gate_residual_adaln(x, empty(m, d), mods[2], mods[3], mods[4], s, eps, fp8=self.fp8)
        if self.fp8:
            lin = self.linears[index]["ff1"]
            if self.fused_ffn1:  # Fp8Linear.gelu_quant's kernel call
                from fastremover.fast.kernels.gemm_fp8 import gemm_fp8_gelu_quant

                meta = x.device
                gemm_fp8_gelu_quant(empty(m, d, dtype=torch.float8_e4m3fn), empty(m, 1, dtype=torch.float32),
                                    torch.empty(lin.codes.shape, dtype=lin.codes.dtype, device=meta),
                                    torch.empty(lin.scale.shape, dtype=lin.scale.dtype, device=meta),
                                    torch.empty(self.ff1_bias[index].shape, dtype=self.ff1_bias[index].dtype,
                                                device=meta), ffn_amax)
            else:
                ops.quant_static(empty(m, lin.out_features), ffn_amax, gelu=True)
        next_shift, next_scale, next_fp8 = next_mods
        kw = {} if out is None else ({"out": out[0], "out_scale": out[1]} if next_fp8 else {"out": out})
        ops.gate_residual_adaln(x, empty(m, d), mods[5], next_shift, next_scale, s, eps, fp8=next_fp8, **kw)
