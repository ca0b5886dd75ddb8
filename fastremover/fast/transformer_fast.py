"""The Remover DiT on fused kernels: the same weights and math as `models/transformer.py`, fewer passes over memory.

Per block (M = B*S tokens, D = 1536, activations token-major [M, D]):
    n      = adaln_modulate(x, shift, scale)            LayerNorm (fp32 stats) + adaLN in one pass [-> fp8 + row scales]
    q,k,v  = linear(n)                                  exact: three GEMMs; fast: one fused [D, 3D] FP8 GEMM
    q,k    = qk_norm_rope(q), qk_norm_rope(k)           RMSNorm across heads + 3D RoPE in one pass, [B,S,H,Dh] layout
    o      = attention(q, k, v); linear(o)              backend from fast/attention.py; with the fp8 backend in the
                                                        fast mode, cuDNN's FP8 output codes feed the FP8 O projection
                                                        directly (per-tensor scale broadcast to rows); fp8-fa3 and
                                                        fp8-flash3 outputs are requantized per row; V's mean (V is
                                                        centred) rides in the O projection's bias
    x      = gate_residual(x, o, gate)                  in place, fp32 math
    n2     = adaln_modulate(x, c_shift, c_scale)
    f      = linear(gelu_tanh(linear(n2)))              fp8: GELU fused with the row-wise quantization of its output
    x      = gate_residual(x, f, c_gate)
Everything that depends only on the timestep (time embedding, every block's modulation rows, the final norm's rows)
is precomputed for all steps by `conditioning()`, so a denoise step is pure device work and can be graph-captured.
`fp8=False` is the `exact` mode (no quantization); `fp8=True` is the `fast` mode (W8A8 e4m3 linears).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.fast.attention import get_backend, quantize_qkv
from fastremover.fast.cudnn_sdpa import sdpa_fp8
from fastremover.fast.flash3_attention import flash3_fp8_codes
from fastremover.fast.flashinfer_attention import fa3_fp8_codes
from fastremover.fast.fp8 import Fp8Linear
from fastremover.models.transformer import RemoverTransformer


def kernel_ops(use_triton: bool) -> SimpleNamespace:
    """The fused ops: Triton kernels, or their eager references (same math, for devices without Triton)."""
    from fastremover.fast.kernels import adaln, qk_norm_rope, quant, residual

    if use_triton:
        return SimpleNamespace(
            adaln_modulate=adaln.adaln_modulate,
            qk_norm_rope=qk_norm_rope.qk_norm_rope,
            gate_residual=residual.gate_residual,
            quant_rowwise=quant.quant_fp8_rowwise,
            gelu_quant=quant.gelu_tanh_quant_fp8,
        )
    return SimpleNamespace(
        adaln_modulate=adaln.adaln_modulate_reference,
        qk_norm_rope=qk_norm_rope.qk_norm_rope_reference,
        gate_residual=residual.gate_residual_reference,
        quant_rowwise=quant.quant_fp8_rowwise_reference,
        gelu_quant=quant.gelu_tanh_quant_fp8_reference,
    )


def gelu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x @ weight.T + bias). On CUDA one cuBLASLt GEMM with the GELU_BIAS epilogue (torch's
    `_addmm_activation`): the tanh-GELU is applied to the fp32 accumulator before the single rounding to x.dtype,
    where eager rounds the GEMM output first and then runs a separate GELU pass (so results differ by an ulp-level
    rounding, not by formula). Elsewhere: the eager composition."""
    if x.is_cuda and x.dim() == 2:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def _fused_linear(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs side by side (weights and biases concatenated)."""
    first = linears[0]
    fused = nn.Linear(first.in_features, sum(l.out_features for l in linears), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([l.weight for l in linears]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([l.bias for l in linears]))
    return fused


@dataclass
class Conditioning:
    """Per-step tensors that depend only on the timesteps (precomputed once per run / graph)."""

    block_mods: torch.Tensor  # [N, L, 6, B, D] fp32: shift, scale, gate, c_shift, c_scale, c_gate per block
    final_mods: torch.Tensor  # [N, 2, B, D] fp32: shift, scale of norm_out


class FastTransformer(nn.Module):
    def __init__(self, model: RemoverTransformer, *, fp8: bool = False, attention: str = "sdpa",
                 use_triton: bool | None = None):
        super().__init__()
        self.model = model  # eager module: weights, config, rope tables, condition embedder
        self.config = model.config
        device = model.proj_out.weight.device
        self.dtype = model.proj_out.weight.dtype
        self.fp8 = fp8
        self.use_triton = device.type == "cuda" if use_triton is None else use_triton
        self.ops = kernel_ops(self.use_triton)
        self.attention_name = attention
        self.attention = get_backend(attention, device)
        if not fp8:
            # exact mode: q/k/v as one GEMM on the concatenated weights (one 4608-wide GEMM instead of three)
            self.qkv = nn.ModuleList(_fused_linear(b.attn1.to_q, b.attn1.to_k, b.attn1.to_v) for b in model.blocks)
        # fp8 attention whose codes go straight into the FP8 O projection (no dequantize / requantize pass)
        self.fp8_attention_codes = fp8 and attention == "fp8"
        # FlashInfer's FA3 FP8 kernel (fp16 out) and FlashAttention-3's (bf16 out) write 16-bit (o - m): requantized per
        # row for the O projection, V's mean in the projection's bias (requantizing o itself, mean included, would
        # spend the e4m3 codes' range on the mean)
        self.fp8_attention_requant = fp8 and attention in ("fp8-fa3", "fp8-flash3")
        if fp8:
            # Quantize every block linear once: q/k/v as one fused GEMM (per-output-channel scales, so the fused
            # weight's codes and scales are exactly the three separate ones), out/ffn their own.
            self.fp8_blocks = nn.ModuleList(
                nn.ModuleDict({
                    "qkv": Fp8Linear(_fused_linear(b.attn1.to_q, b.attn1.to_k, b.attn1.to_v), self.dtype),
                    "o": Fp8Linear(b.attn1.to_out[0], self.dtype),
                    "ff1": Fp8Linear(b.ffn.net[0].proj, self.dtype), "ff2": Fp8Linear(b.ffn.net[2], self.dtype),
                })
                for b in model.blocks
            )

    def describe(self) -> dict:
        return {"fused_kernels": "triton" if self.use_triton else "eager-reference", "fp8_linears": self.fp8,
                "attention": self.attention_name}

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
        return Conditioning(torch.stack(block_mods).contiguous(), torch.stack(final_mods).contiguous())

    def _block(self, index: int, x: torch.Tensor, mods: torch.Tensor, rope, shape) -> torch.Tensor:
        """x [M, D] residual stream (updated in place); mods [6, B, D]."""
        ops, blk = self.ops, self.model.blocks[index]
        b, s, heads = shape
        eps = self.config.eps
        attn = blk.attn1
        if self.fp8:
            lin = self.fp8_blocks[index]
            qa, sa = ops.adaln_modulate(x, mods[0], mods[1], s, eps, fp8=True)
            q, k, v = lin["qkv"](qa, sa).chunk(3, dim=1)  # column slices: row stride 3D, read in place
        else:
            n = ops.adaln_modulate(x, mods[0], mods[1], s, eps)
            q, k, v = self.qkv[index](n).chunk(3, dim=1)
        q = ops.qk_norm_rope(q, attn.norm_q.weight, *rope, s, heads, eps)
        k = ops.qk_norm_rope(k, attn.norm_k.weight, *rope, s, heads, eps)
        if self.fp8_attention_codes or self.fp8_attention_requant:
            # V centred over the sequence (smooth_v): cuDNN's FP8 P @ V then sums zero-mean terms, which its
            # reduced-precision accumulator keeps (see fast/attention.py). attn(v) = attn(v - m) + m since each row
            # of P sums to 1, so the O projection adds W_o m per batch (a [B, D] GEMV in the model dtype); with one
            # batch it rides in the GEMM's bias (a broadcast add over [S, D] cost 4.6 ms per W2 step).
            q8, k8, v8, sq, sk, sv, v_mean = quantize_qkv(
                *(t.unflatten(1, (heads, -1)).view(b, s, heads, -1) for t in (q, k, v)), smooth_v=True)
            if self.fp8_attention_requant:  # 16-bit (o - m), requantized per row
                if self.attention_name == "fp8-fa3":
                    o_m = fa3_fp8_codes(q8, k8, v8, sq, sk, sv, out_dtype=self.dtype)
                else:
                    o_m = flash3_fp8_codes(q8, k8, v8, sq, sk, sv)  # bf16
                o_in = ops.quant_rowwise(o_m.view(b * s, -1))
            else:  # codes of (o - m) / sv
                o_in = (sdpa_fp8(q8, k8, v8, sq, sk, sv).view(b * s, -1), sv.view(1, 1).expand(b * s, 1).contiguous())
            o_proj = self.fp8_blocks[index]["o"]
            if b == 1:  # one batch: b_o + W_o m is the GEMM's bias (added in its fp32 epilogue, no extra pass)
                w_m = F.linear(v_mean.to(self.dtype), attn.to_out[0].weight, attn.to_out[0].bias)  # [1, D]
                o = o_proj(*o_in, bias=w_m[0])
            else:  # the GEMM's bias is one row for all batches: add W_o m per batch after it
                o = o_proj(*o_in)
                o.view(b, s, -1).add_(F.linear(v_mean.to(o.dtype), attn.to_out[0].weight).unsqueeze(1))
        else:
            o = self.attention(q.view(b, s, heads, -1), k.view(b, s, heads, -1),
                               v.unflatten(1, (heads, -1)).view(b, s, heads, -1))
            o = o.reshape(b * s, -1)
            o = self.fp8_blocks[index]["o"](*ops.quant_rowwise(o)) if self.fp8 else F.linear(o, attn.to_out[0].weight, attn.to_out[0].bias)
        x = ops.gate_residual(x, o, mods[2], s, inplace=True)
        if self.fp8:
            lin = self.fp8_blocks[index]
            h = lin["ff1"](*ops.adaln_modulate(x, mods[3], mods[4], s, eps, fp8=True))
            f = lin["ff2"](*ops.gelu_quant(h))
        else:
            n2 = ops.adaln_modulate(x, mods[3], mods[4], s, eps)
            ff = blk.ffn
            h = gelu_linear(n2, ff.net[0].proj.weight, ff.net[0].proj.bias)
            f = F.linear(h, ff.net[2].weight, ff.net[2].bias)
        return ops.gate_residual(x, f, mods[5], s, inplace=True)

    @torch.no_grad()
    def forward_step(self, hidden_states: torch.Tensor, cond: Conditioning, step: int) -> torch.Tensor:
        """One denoise step's transformer call: [B, in, T, H, W] -> [B, out, T, H, W], conditioning of `step`."""
        model = self.model
        grid = model.post_patch_grid(hidden_states.shape)
        rope = model.rope(grid, hidden_states.device)
        b = hidden_states.shape[0]
        s = grid[0] * grid[1] * grid[2]
        x = model.patch_embedding(hidden_states).flatten(2).transpose(1, 2).reshape(b * s, -1).contiguous()
        shape = (b, s, self.config.num_attention_heads)
        mods = cond.block_mods[step]
        for i in range(len(model.blocks)):
            x = self._block(i, x, mods[i], rope, shape)
        final = cond.final_mods[step]
        y = self.ops.adaln_modulate(x, final[0], final[1], s, self.config.eps)
        return model.unpatchify(model.proj_out(y).view(b, s, -1), grid)
