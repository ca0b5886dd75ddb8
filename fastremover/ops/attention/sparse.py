"""`sparse-sta` and `sparse-vsa`: tile-sparse attention on the block-sparse Triton kernel
(fastremover/fast/kernels/block_sparse_attention.py), the tokens in cube order with the key tiles of each query tile
from a static sliding window (`sparse-sta`) or VSA's coarse top-k selection (`sparse-vsa`); see
fastremover/ops/attention/sparse_layout.py for the order, the tiles and the masks.

Opt-in only (no `auto` ever picks them: they change the result). `keep` (config `attention.keep`, flag
`--attention-keep`, default 0.25) is the fraction of key tiles each query tile attends to; `sparse-sta` derives its
window from it unless `attention.window` (`--attention-window T,H,W`, in cubes) is given. The released Remover was not
trained with sparse attention: run `fastremover verify --attention sparse-vsa --attention-keeps ...` on your
checkpoint and clip first (docs/performance.md).

Backend capabilities: `token_layout(grid, device, options)` gives the transformer the layout it permutes its tokens
with and passes back as `layout=` to `call` (16-bit q/k/v, the exact mode) and `codes_call` (the fast mode's e4m3
codes; the output is e4m3 codes of (o - c) / sv, straight into the FP8 O projection, as cuDNN's).
"""

from __future__ import annotations

from functools import partial

from fastremover.config import parse_window
from fastremover.errors import FastRemoverError
from fastremover.ops.attention.registry import AttentionBackend, register

DEFAULT_KEEP = 0.25
SOURCES = {"sparse-sta": "sta", "sparse-vsa": "vsa-topk"}


def check_options(backend: str, keep, window) -> None:
    """FastRemoverError (one line) for sparse options out of range, or given to a backend that has none (`auto`
    never picks a sparse backend)."""
    from fastremover.ops.attention import registry

    name = registry.canonical(backend) if backend != "auto" else "auto"
    if keep is not None:
        if name not in SOURCES:
            raise FastRemoverError(f"--attention-keep applies to the sparse attention backends ({', '.join(SOURCES)})"
                                   f", not to --attention {backend}")
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
            raise FastRemoverError(f"--attention-keep {keep!r}: must be a fraction in (0, 1]")
    if window is not None:
        if name != "sparse-sta":
            raise FastRemoverError(f"--attention-window applies to --attention sparse-sta, not {backend}")
        parse_window(window)


def validate(device, dtype=None, shape=None, *, name: str = "sparse attention") -> list[str]:
    """Reasons it cannot run: the Triton kernel needs a CUDA GPU with Triton (or, on the CPU, Triton's interpreter:
    TRITON_INTERPRET=1 when the kernel module was imported; tests), fp16 / bf16 activations or (dtype
    float8_e4m3fn) the fast mode's e4m3 codes, and a head dim the kernel compiles for (shape: (heads, head_dim)):
    a power of two 16..256, 32..256 for codes (Triton's FP8 tensor-core dot takes K >= 32; the kernel refuses
    smaller head dims instead of zero-padding them, see its module docstring). `name`: the backend, for the
    reasons."""
    reasons = []
    try:
        from fastremover.fast.kernels import block_sparse_attention as bsa
        from fastremover.fast.kernels._common import interpreting
    except ImportError as exc:  # no Triton
        return [f"sparse attention needs Triton ({exc})"]
    if device.type == "cuda":
        import torch

        if torch.cuda.get_device_capability(device) < (8, 0):
            reasons.append("sparse attention needs an sm_80 or newer GPU")
    elif not interpreting(bsa._block_sparse_attn_kernel):
        reasons.append("sparse attention needs a CUDA GPU (its Triton kernel)")
    codes = dtype == bsa.FP8
    if dtype is not None and not codes:
        import torch

        if dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"sparse attention runs fp16 or bf16 models, not {str(dtype).replace('torch.', '')}")
    if shape is not None and shape[-1] not in bsa.head_dims(codes):
        head_dim = shape[-1]
        if codes and head_dim in bsa.head_dims(False):
            reasons.append(f"{name} needs a head dim >= {bsa.MIN_DOT_K[True]} for the fast mode's e4m3 codes "
                           f"(Triton's FP8 tensor-core dot takes K >= {bsa.MIN_DOT_K[True]}); this model has "
                           f"{head_dim} (--mode exact runs it in 16 bits)")
        else:
            reasons.append(f"{name} needs a head dim in {bsa.head_dims(codes)}; this model has {head_dim}")
    return reasons


def _layout_for(source: str):
    def token_layout(grid, device, options=None):
        """The SparseLayout of a token grid (options: the config's AttentionOptions, or None for the defaults)."""
        from fastremover.ops.attention.sparse_layout import SparseLayout, SparseOptions

        keep = getattr(options, "keep", None)
        window = getattr(options, "window", None) if source == "sta" else None  # (T, H, W) or None
        return SparseLayout(grid, device, SparseOptions(source, DEFAULT_KEEP if keep is None else float(keep),
                                                        window))

    return token_layout


def _needs_layout(layout) -> None:
    if layout is None:
        raise ValueError("sparse attention needs the token layout (layout=...): the fast transformer passes it; "
                         "stand-alone, build one with token_layout(grid, device, options)")


def sparse_call(q, k, v, *, layout=None):
    """16-bit q, k, v [B, S, H, D] in the layout's cube order -> o [B, S, H, D]."""
    from fastremover.fast.kernels.block_sparse_attention import block_sparse_attention

    _needs_layout(layout)
    kv_idx, kv_cnt = layout.lists(q, k)
    return block_sparse_attention(q, k, v, kv_idx, kv_cnt, tile_q=layout.tile, tile_k=layout.tile)


def sparse_codes(q8, k8, v8, sq, sk, sv, out_dtype=None, *, layout=None):
    """e4m3 codes (per-tensor scales; V centred by the caller) -> e4m3 codes of (o - c) / sv."""
    from fastremover.fast.kernels.block_sparse_attention import FP8, block_sparse_attention

    _needs_layout(layout)
    kv_idx, kv_cnt = layout.lists(q8, k8)
    scales = tuple(s.reshape(1) for s in (sq, sk, sv))
    return block_sparse_attention(q8, k8, v8, kv_idx, kv_cnt, tile_q=layout.tile, tile_k=layout.tile,
                                  scales=scales, out_dtype=FP8)


STA = register(AttentionBackend(
    name="sparse-sta", label="sliding-tile sparse attention", call=sparse_call,
    validate=partial(validate, name="sparse-sta"),
    priority={"exact": -100, "fast": -100}, precision="8bit", takes_codes=True, codes_call=sparse_codes,
    output="fp8-codes", token_layout=_layout_for("sta"), announce_if_skipped=False,
))
VSA = register(AttentionBackend(
    name="sparse-vsa", label="VSA-style top-k sparse attention", call=sparse_call,
    validate=partial(validate, name="sparse-vsa"),
    priority={"exact": -100, "fast": -100}, precision="8bit", takes_codes=True, codes_call=sparse_codes,
    output="fp8-codes", token_layout=_layout_for("vsa-topk"), announce_if_skipped=False,
))
