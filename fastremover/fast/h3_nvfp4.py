"""NVFP4 blocks for the MiniMax-H3 decoder: the eager op-by-op path, the fused path, tiers, tile batching, CUDA graphs.

Every linear of a block (to_q, to_k, to_v, to_out.0, ff.net.0.proj, ff.net.2) becomes W4A4 NVFP4 (the project's format,
fastremover/fast/nvfp4.py): the weight is quantized once with its own global scale; the activation is quantized per
call with a STATIC per-tensor global scale (`input_scale`, calibrated once, see `calibrate`), so quantizing a row
never depends on other rows - the property that makes tile batching bit-identical. Activations are bf16, the residual
stream fp32. One block, op by op (every line is one rounding; `bf16(.)` = round to nearest even to bf16):

    n1  = bf16(fl(fl(h * rstd(h)) * gamma1))                      rstd(x) = rsqrt_ieee(fl(fl(sumsq(x) * 1/D) + eps))
    xq  = nvfp4(n1, s_qkv)                                         one quantization shared by q, k and v
    q,k,v = gemm(xq, Wq), gemm(xq, Wk), gemm(xq, Wv)              bf16 [M, D], no bias yet
    q   = bf16(q + bq) per head -> bf16(fl(q * rstd_head(q)))     (same for k; q/k RMSNorm has no weight)
          RoPE on the first R dims: bf16(bf16(q_r * cos) + bf16(rot(q_r) * sin)), cos/sin as bf16 tables
    v   = bf16(v + bv)
    a   = SDPA(q, k, v)                                            bf16, per tile (batch entry)
    o   = gemm(nvfp4(a, s_out), Wo)
    h   = fl(h + fl(fp32(bf16(o + bo)) * scale1))                  the product rounds before the add (no FMA)
    n2  = bf16(fl(fl(h * rstd(h)) * gamma2)); u = gemm(nvfp4(n2, s_ff1), W1)      u = [value | gate], bf16 [M, 2F]
    g   = bf16(u_gate + b_gate); silu = bf16(g / (1 + exp(-g))); val = bf16(u_value + b_value)
    o2  = gemm(nvfp4(bf16(val * silu), s_ff2), W2)
    h   = fl(h + fl(fp32(bf16(o2 + b2)) * scale2))

`sumsq` has a fixed summation order, ATen's CUDA RMSNorm tree (its vectorized row kernel): T = min(128, D/4) lanes;
lane t sums the squares of columns 4Tk + 4t + i for k = 0, 1, ... and i = 0..3 in that order; lanes are combined by
warp shuffle-down trees (lane t += lane t + off, off = 16, 8, 4, 2, 1 within each warp of 32), then the warp sums by
the same tree. Two deliberate differences from ATen's kernel, both so that one definition holds on every device and
in the Triton interpreter: each square is rounded before it is added (ATen's compiled loop contracts it into an FMA),
and rsqrt is the IEEE one, fl(1 / fl(sqrt(v))) (ATen's CUDA kernel uses rsqrt.approx). `rsqrt_ieee` computes it with
torch.rsqrt on the CPU (which is exactly that there) and torch.reciprocal(torch.sqrt(.)) on CUDA (IEEE sqrt and
division; CUDA's torch.rsqrt is the approximate instruction).

gemm(xq, W) = bf16(fl(fl32(sum_k unit(xq)[m, k] * unit(W)[n, k]) * alpha)), unit = e2m1 * e4m3 block scale (exact in
bf16), alpha = fl(alpha_x * alpha_w). On the CPU the sum is exact (int64: unit * 2^10 is an integer), so it is
independent of the order and of M. On an sm_90 GPU both operands are dequantized to their exact bf16 unit values
(the weight per call, into a transient [N, K] buffer: only the packed weight stays resident) and multiplied by the
project's Triton unit GEMM (kernels/nvfp4.unit_gemm) at its shape's fixed config: fp32 accumulation in an order that
depends on K only, so again independent of M, and the same bits as the W4A16 GEMM (which decodes the weight tile in
its K loop, at a third of the speed at these shapes) on the same units (Hopper has no FP4 tensor cores: this
emulates W4A4 numerics with 16-bit MMAs).
Other GPUs: cuBLAS fp32 on the units (no tile-batching guarantee there).

The fused path (kernels/h3_fused.py) computes the same values with three Triton kernels around the GEMMs and the
attention: residual_norm_quantize (a block's last residual + the next block's norm1 + quantize in one pass, and the
attention residual + norm2 + quantize), qkv_epilogue, swiglu_quantize; the attention output is quantized with
kernels/nvfp4.quantize_nvfp4. The references of those kernels are the *_reference functions here, which the eager
block calls, so "eager" and "the kernels' references" are one code path.

`Nvfp4BlockStack(decoder, tier=..., fused=..., cuda_graphs=...)` is the decoder's `blocks` callable: the tier's
blocks in NVFP4; `freeze()` drops the decoder's dense block weights so only packed weights + scales stay resident.
With cuda_graphs (CUDA and the fused path only: the eager quantizer makes small host-to-device copies, which a
capture refuses) a call of at most `graph_max_rows` token rows replays a CUDA graph captured for its shape (bounded
LRU cache); inputs are copied into the graph's static buffers, the output is copied out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.fast import nvfp4 as ref
from fastremover.lru import LRUCache
from fastremover.models.h3_decoder import H3Block, H3DecoderConfig, H3VideoDecoder, tier_blocks

BF16 = torch.bfloat16
LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
UNIT_SHIFT = 10  # unit(x) * 2^10 is an integer: e2m1 * 2 in 0..12, e4m3 * 2^9 an integer (2^-9 = its least value)


# ----------------------------------------------------------------------------------------------------------------------
# Rounding helpers and the references of the fused kernels


def rsqrt_ieee(v: torch.Tensor) -> torch.Tensor:
    """fp32 fl(1 / fl(sqrt(v))) with IEEE sqrt and division, on any device (see the module docstring)."""
    if v.device.type == "cuda":
        return torch.reciprocal(torch.sqrt(v))
    return torch.rsqrt(v)


def _halving_tree(s: torch.Tensor) -> torch.Tensor:
    """[..., L] (L a power of two) -> [...]: lane t += lane t + L/2, then L/4, ... (warp shuffle-down order)."""
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    return s[..., 0]


def sumsq_reference(x: torch.Tensor) -> torch.Tensor:
    """[..., W] fp32 -> [...] fp32 sum of squares in the fixed order of the module docstring."""
    from fastremover.fast.kernels.h3_fused import norm_lanes  # the kernel's lane layout

    w = x.shape[-1]
    t = norm_lanes(w)
    xs = x.float().unflatten(-1, (w // (4 * t), t, 4))
    acc = torch.zeros(xs.shape[:-3] + (t,), dtype=torch.float32, device=x.device)
    for k in range(xs.shape[-3]):
        for i in range(4):
            e = xs[..., k, :, i]
            acc = acc + e * e
    lanes = min(t, 32)
    per_warp = _halving_tree(acc.unflatten(-1, (t // lanes, lanes)))
    return _halving_tree(per_warp)


def rstd_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., W] -> [..., 1] rsqrt_ieee(fl(fl(sumsq * fl(1/W)) + eps))."""
    inv_w = torch.tensor(1.0 / x.shape[-1], dtype=torch.float32).item()
    return rsqrt_ieee(sumsq_reference(x) * inv_w + eps)[..., None]


def rms_norm_bf16_reference(h: torch.Tensor, gamma: torch.Tensor | None, eps: float) -> torch.Tensor:
    """bf16(fl(fl(h * rstd) * gamma)) (no gamma: bf16(fl(h * rstd))); h fp32 or bf16 [..., W]."""
    x = h.float()
    y = x * rstd_reference(x, eps)
    if gamma is not None:
        y = y * gamma.float()
    return y.to(BF16)


def residual_norm_quantize_reference(h: torch.Tensor, residual=None, norm=None, *, reciprocal: str = "exact"):
    """The reference of kernels/h3_fused.residual_norm_quantize, h fp32 [M, D]:
    residual (o bf16 [M, D], bias bf16 [D], scale fp32 [D]): h = fl(h + fl(fp32(bf16(o + bias)) * scale));
    norm (gamma fp32 [D], eps, global_sf [1]): also returns nvfp4(bf16(fl(fl(h * rstd) * gamma))).
    Returns (h, Nvfp4Tensor or None); h is a new tensor (the kernel updates it in place)."""
    if residual is not None:
        o, bias, scale = residual
        h = h + (o + bias).float() * scale
    q = None
    if norm is not None:
        gamma, eps, gsf = norm
        q = ref.quantize_reference(rms_norm_bf16_reference(h, gamma, eps), gsf, reciprocal=reciprocal)
    return h, q


def qkv_epilogue_reference(q, k, v, bq, bk, bv, cos, sin, heads: int, eps: float):
    """The reference of kernels/h3_fused.qkv_epilogue: q, k, v bf16 [M, D] (GEMM outputs, no bias), biases bf16 [D],
    cos/sin bf16 [S, R] (M = B * S, row m is token m % S) -> q, k, v bf16 [M, H, Dh] with q/k biased, RMS-normalized
    per head (bf16(fl(x * rstd))) and rotated on their first R dims (bf16(bf16(x_r * cos) + bf16(rot(x_r) * sin)))."""
    m, d = q.shape
    s = cos.shape[0]
    reps = m // s
    c, sn = cos.repeat(reps, 1)[:, None, :], sin.repeat(reps, 1)[:, None, :]
    r = cos.shape[-1]

    def qk(x, b):
        x = (x + b).view(m, heads, d // heads)
        x = rms_norm_bf16_reference(x, None, eps)
        xr = x[..., :r]
        x1, x2 = xr.chunk(2, dim=-1)
        return torch.cat([xr * c + torch.cat([-x2, x1], dim=-1) * sn, x[..., r:]], dim=-1)

    return qk(q, bq), qk(k, bk), (v + bv).view(m, heads, d // heads)


def swiglu_reference(u: torch.Tensor, bias: torch.Tensor, exp=torch.exp) -> torch.Tensor:
    """u bf16 [M, 2F] (value first) + bias bf16 [2F] -> bf16 [M, F] = bf16(bf16(u_v + b_v) * bf16(g / (1 + exp(-g)))),
    g = bf16(u_g + b_g) (fp32 arithmetic). `exp` is the fp32 exponential (tests pass the interpreter's)."""
    f = u.shape[-1] // 2
    value = u[:, :f] + bias[:f]
    g = (u[:, f:] + bias[f:]).float()
    silu = (g / (1 + exp(-g))).to(BF16)
    return value * silu


def swiglu_quantize_reference(u, bias, global_sf, *, reciprocal: str = "exact", exp=torch.exp) -> ref.Nvfp4Tensor:
    """The reference of kernels/h3_fused.swiglu_quantize: nvfp4(swiglu_reference(u, bias))."""
    return ref.quantize_reference(swiglu_reference(u, bias, exp), global_sf, reciprocal=reciprocal)


# ----------------------------------------------------------------------------------------------------------------------
# The W4A4 GEMM


def _sm90(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.get_device_capability(t.device) == (9, 0)


def nvfp4_gemm(xq: ref.Nvfp4Tensor, wq: ref.Nvfp4Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """bf16 [M, N] = bf16(fl(fl32(sum_k unit(x) unit(w)) * alpha)); alpha [1] fp32 = fl(alpha_x * alpha_w). The sum is
    exact on the CPU, the Triton unit GEMM's fp32 accumulation on sm_90, cuBLAS fp32 elsewhere (module docstring)."""
    if xq.packed.device.type == "cpu":
        xi = (ref.unit_weight(xq) * 2.0 ** UNIT_SHIFT).to(torch.int64)
        wi = (ref.unit_weight(wq) * 2.0 ** UNIT_SHIFT).to(torch.int64)
        acc = (xi @ wi.t()).to(torch.float32) * 2.0 ** (-2 * UNIT_SHIFT)
        return (acc * alpha).to(BF16)
    if _sm90(xq.packed):
        from fastremover.fast.kernels.nvfp4 import unit_gemm, unit_weight_nvfp4

        # exact bf16 units from the Triton dequantizer (no host-to-device copies: graph-capturable)
        return unit_gemm(unit_weight_nvfp4(xq, BF16), unit_weight_nvfp4(wq, BF16), alpha)
    return ((ref.unit_weight(xq) @ ref.unit_weight(wq).t()) * alpha).to(BF16)


class H3Nvfp4Linear(nn.Module):
    """A frozen linear as NVFP4 weight (packed, swizzled scales, global scale), bf16 bias, static input global scale
    and the GEMM's alpha = fl(alpha_x * alpha_w); all buffers."""

    def __init__(self, linear: nn.Linear, input_scale: torch.Tensor):
        super().__init__()
        w = linear.weight.detach().float()
        q = ref.quantize_reference(w)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("packed", q.packed)
        self.register_buffer("scales", q.scales)
        self.register_buffer("global_scale", q.global_scale)
        self.register_buffer("bias", linear.bias.detach().to(BF16).clone())
        self.register_buffer("input_scale", input_scale.float().reshape(1).clone())
        self.register_buffer("alpha", ref.alpha_of(self.input_scale) * ref.alpha_of(q.global_scale))

    def weight_nvfp4(self) -> ref.Nvfp4Tensor:
        return ref.Nvfp4Tensor(self.packed, self.scales, self.global_scale)


class H3Nvfp4Block(nn.Module):
    """One decoder block with NVFP4 linears; `forward_eager` is the op-by-op path of the module docstring."""

    def __init__(self, block: H3Block, cfg: H3DecoderConfig, input_scales: dict[str, torch.Tensor]):
        super().__init__()
        self.heads, self.eps, self.dim, self.ffn = cfg.num_heads, cfg.norm_eps, cfg.dim, cfg.ffn_dim
        for n in ("scale1", "scale2"):
            self.register_buffer(n, getattr(block, n).detach().float().clone())
        self.register_buffer("gamma1", block.norm1.weight.detach().float().clone())
        self.register_buffer("gamma2", block.norm2.weight.detach().float().clone())
        a, f = block.attn, block.ff
        qkv_scale = input_scales["attn.qkv"]
        self.to_q = H3Nvfp4Linear(a.to_q, qkv_scale)
        self.to_k = H3Nvfp4Linear(a.to_k, qkv_scale)
        self.to_v = H3Nvfp4Linear(a.to_v, qkv_scale)
        self.to_out = H3Nvfp4Linear(a.to_out[0], input_scales["attn.to_out.0"])
        self.ff1 = H3Nvfp4Linear(f.net[0].proj, input_scales["ff.net.0.proj"])
        self.ff2 = H3Nvfp4Linear(f.net[2], input_scales["ff.net.2"])

    def _attention(self, q3, k3, v3, b, s):
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q3, k3, v3))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * s, self.dim)

    def forward_eager(self, h: torch.Tensor, rope16: tuple[torch.Tensor, torch.Tensor], b: int, s: int
                      ) -> torch.Tensor:
        """h fp32 [M = b * s, D] -> the new h (a new tensor)."""
        gemm = nvfp4_gemm
        _, xq = residual_norm_quantize_reference(h, None, (self.gamma1, self.eps, self.to_q.input_scale))
        q, k, v = (gemm(xq, lin.weight_nvfp4(), lin.alpha) for lin in (self.to_q, self.to_k, self.to_v))
        q3, k3, v3 = qkv_epilogue_reference(q, k, v, self.to_q.bias, self.to_k.bias, self.to_v.bias, *rope16,
                                            self.heads, self.eps)
        a = self._attention(q3, k3, v3, b, s)
        o = gemm(ref.quantize_reference(a, self.to_out.input_scale), self.to_out.weight_nvfp4(), self.to_out.alpha)
        h, nq = residual_norm_quantize_reference(h, (o, self.to_out.bias, self.scale1),
                                                 (self.gamma2, self.eps, self.ff1.input_scale))
        u = gemm(nq, self.ff1.weight_nvfp4(), self.ff1.alpha)
        hq = swiglu_quantize_reference(u, self.ff1.bias, self.ff2.input_scale)
        o2 = gemm(hq, self.ff2.weight_nvfp4(), self.ff2.alpha)
        h, _ = residual_norm_quantize_reference(h, (o2, self.ff2.bias, self.scale2), None)
        return h

    def forward_fused(self, h: torch.Tensor, xq: ref.Nvfp4Tensor, rope16, b: int, s: int, next_norm
                      ) -> ref.Nvfp4Tensor | None:
        """The fused path on a contiguous fp32 h [M, D] updated IN PLACE. xq: this block's quantized norm1 output
        (made by the previous call); next_norm: (gamma, eps, input_scale) of the next block's norm1, or None.
        Returns the next block's xq (or None)."""
        from fastremover.fast.kernels import h3_fused as K
        from fastremover.fast.kernels.nvfp4 import quantize_nvfp4

        gemm = nvfp4_gemm
        q, k, v = (gemm(xq, lin.weight_nvfp4(), lin.alpha) for lin in (self.to_q, self.to_k, self.to_v))
        q3, k3, v3 = K.qkv_epilogue(q, k, v, self.to_q.bias, self.to_k.bias, self.to_v.bias, *rope16,
                                    heads=self.heads, eps=self.eps)
        a = self._attention(q3, k3, v3, b, s)
        o = gemm(quantize_nvfp4(a, self.to_out.input_scale), self.to_out.weight_nvfp4(), self.to_out.alpha)
        nq = K.residual_norm_quantize(h, (o, self.to_out.bias, self.scale1),
                                      (self.gamma2, self.eps, self.ff1.input_scale))
        u = gemm(nq, self.ff1.weight_nvfp4(), self.ff1.alpha)
        hq = K.swiglu_quantize(u, self.ff1.bias, self.ff2.input_scale)
        o2 = gemm(hq, self.ff2.weight_nvfp4(), self.ff2.alpha)
        return K.residual_norm_quantize(h, (o2, self.ff2.bias, self.scale2), next_norm)


# ----------------------------------------------------------------------------------------------------------------------
# Calibration, the block stack, memory


@torch.no_grad()
def calibrate(decoder: H3VideoDecoder, z_window: torch.Tensor, indices: list[int]
              ) -> dict[int, dict[str, torch.Tensor]]:
    """Static activation global scales from one dense eager window: per block, 2688 / amax of the inputs of the qkv
    linears (one shared scale), to_out.0, ff.net.0.proj and ff.net.2 (nvfp4.global_scale_of)."""
    amax: dict[int, dict[str, torch.Tensor]] = {i: {} for i in indices}
    hooks = []
    for i in indices:
        blk = decoder.decoder.transformer_blocks[i]
        for key, mod in (("attn.qkv", blk.attn.to_q), ("attn.to_out.0", blk.attn.to_out[0]),
                         ("ff.net.0.proj", blk.ff.net[0].proj), ("ff.net.2", blk.ff.net[2])):
            def hook(_m, args, i=i, key=key):
                a = args[0].detach().float().abs().amax()
                amax[i][key] = torch.maximum(amax[i].get(key, a), a)
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        decoder.decode_window(z_window, 1, decoder.decoder.eager_blocks(indices))
    finally:
        for hk in hooks:
            hk.remove()
    return {i: {k: ref.global_scale_of(v.reshape(1)) for k, v in d.items()} for i, d in amax.items()}


@dataclass
class _Graph:
    graph: object
    h_in: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    out: torch.Tensor


class Nvfp4BlockStack(nn.Module):
    """The tier's blocks in NVFP4 as the decoder's `blocks` callable (see the module docstring)."""

    def __init__(self, decoder: H3VideoDecoder, input_scales: dict[int, dict[str, torch.Tensor]], *,
                 tier: str | None = None, fused: bool = False, cuda_graphs: bool = False, graph_max_rows: int = 8192,
                 max_graphs: int = 8):
        super().__init__()
        cfg = decoder.cfg
        self.indices = tier_blocks(cfg.num_layers, tier)
        missing = [i for i in self.indices if i not in input_scales]
        if missing:
            raise ValueError(f"no calibrated input scales for blocks {missing}")
        self.blocks = nn.ModuleList(
            [H3Nvfp4Block(decoder.decoder.transformer_blocks[i], cfg, input_scales[i]) for i in self.indices])
        self.decoder_ref = [decoder]  # not a submodule: its weights are not ours
        self.fused, self.cuda_graphs, self.graph_max_rows = fused, cuda_graphs, graph_max_rows
        self.graphs: LRUCache[_Graph] = LRUCache(max_graphs)
        self.graph_replays = 0

    def freeze(self) -> "Nvfp4BlockStack":
        """Drop the decoder's dense block weights (all of them: the tier's are packed here, the others are skipped):
        afterwards only packed weights + scales (+ biases, norm weights, layer scales) stay resident for the blocks."""
        dec = self.decoder_ref[0].decoder
        dec.transformer_blocks = nn.ModuleList([nn.Identity() for _ in dec.transformer_blocks])
        return self

    def _run(self, h3: torch.Tensor, cos16: torch.Tensor, sin16: torch.Tensor) -> torch.Tensor:
        b, s, d = h3.shape
        h = h3.reshape(b * s, d).float().contiguous().clone()
        rope16 = (cos16, sin16)
        if not self.fused:
            for blk in self.blocks:
                h = blk.forward_eager(h, rope16, b, s)
            return h.view(b, s, d)
        from fastremover.fast.kernels import h3_fused as K

        first = self.blocks[0]
        xq = K.residual_norm_quantize(h, None, (first.gamma1, first.eps, first.to_q.input_scale))
        for j, blk in enumerate(self.blocks):
            nxt = self.blocks[j + 1] if j + 1 < len(self.blocks) else None
            next_norm = None if nxt is None else (nxt.gamma1, nxt.eps, nxt.to_q.input_scale)
            xq = blk.forward_fused(h, xq, rope16, b, s, next_norm)
        return h.view(b, s, d)

    def __call__(self, h3: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos16, sin16 = rope[0].to(BF16).contiguous(), rope[1].to(BF16).contiguous()
        rows = h3.shape[0] * h3.shape[1]
        if not (self.cuda_graphs and self.fused and h3.is_cuda and rows <= self.graph_max_rows):
            return self._run(h3, cos16, sin16)
        key = (tuple(h3.shape), tuple(cos16.shape), h3.dtype, h3.device)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(h3, cos16, sin16)
            self.graphs.put(key, g)
        g.h_in.copy_(h3)
        g.cos.copy_(cos16)
        g.sin.copy_(sin16)
        g.graph.replay()
        self.graph_replays += 1
        return g.out.clone()

    def _capture(self, h3, cos16, sin16) -> _Graph:
        h_in, c, s = h3.clone(), cos16.clone(), sin16.clone()
        side = torch.cuda.Stream(h3.device)
        side.wait_stream(torch.cuda.current_stream(h3.device))
        with torch.cuda.stream(side):
            self._run(h_in, c, s)  # compiles the kernels outside the capture
        torch.cuda.current_stream(h3.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(h_in, c, s)
        return _Graph(graph, h_in, c, s, out)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of `module` (each storage counted once)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def block_linear_bytes(cfg: H3DecoderConfig, blocks: int | None = None) -> dict:
    """Weights of the block linears at `cfg`: fp32 dense bytes against NVFP4 packed + swizzled scales + global scale."""
    d, f = cfg.dim, cfg.ffn_dim
    shapes = [(d, d)] * 4 + [(2 * f, d), (d, f)]
    n = cfg.num_layers if blocks is None else blocks
    dense = sum(o * i for o, i in shapes) * 4 * n
    packed = 0
    for o, i in shapes:
        mp, cp = ref.padded_scale_shape(o, i)
        packed += o * i // 2 + mp * cp + 4
    return {"blocks": n, "dense_fp32_bytes": dense, "nvfp4_bytes": packed * n}


def build_nvfp4_stack(decoder: H3VideoDecoder, calibration_window: torch.Tensor, *, tier: str | None = None,
                      fused: bool = False, cuda_graphs: bool = False, freeze: bool = True) -> Nvfp4BlockStack:
    """Calibrate on one window, quantize the tier's blocks, optionally freeze: the stack for decoder.decode(blocks=)."""
    indices = tier_blocks(decoder.cfg.num_layers, tier)
    scales = calibrate(decoder, calibration_window, indices)
    stack = Nvfp4BlockStack(decoder, scales, tier=tier, fused=fused, cuda_graphs=cuda_graphs)
    stack.to(calibration_window.device)
    return stack.freeze() if freeze else stack
