"""`sparse-sta` and `sparse-vsa`: tile-sparse attention on the block-sparse Triton kernel
(fastremover/fast/kernels/block_sparse_attention.py), the tokens in cube order with the key tiles of each query tile
from a static sliding window (`sparse-sta`) or VSA's coarse top-k selection (`sparse-vsa`); see
fastremover/ops/attention/sparse_layout.py for the order, the tiles and the masks. `sparse-sta-cudnn` and
`sparse-vsa-cudnn`: the same masks over 128-token tiles (4x4x8 cubes) on cuDNN's FP8 attention with paged K/V
(fastremover/ops/attention/cudnn_sparse.py): the fast mode only, a Hopper GPU with cudnn-frontend; about twice as
fast as the Triton kernel there. Each backend is its own kernel and tile size, so an explicit choice always runs
what it names (no fallback between them: their results differ).

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

import re
from functools import partial

from fastremover.errors import FastRemoverError
from fastremover.ops.attention import registry
from fastremover.ops.attention.registry import AttentionBackend, register

DEFAULT_KEEP = 0.25
SOURCES = {"sparse-sta": "sta", "sparse-vsa": "vsa-topk", "sparse-sta-cudnn": "sta", "sparse-vsa-cudnn": "vsa-topk"}
CUDNN_CUBE = (4, 4, 8)  # 128-token tiles: cuDNN's FP8 query tile height (cudnn_sparse.TILE)


def parse_window(value) -> tuple[int, int, int]:
    """`--attention-window T,H,W` (or TxHxW, or a sequence of three) -> (T, H, W), each a whole number >= 1;
    FastRemoverError otherwise."""
    parts = list(value) if isinstance(value, (tuple, list)) else re.split(r"[,x]", str(value).strip())
    try:
        window = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        window = ()
    if len(window) != 3 or min(window) < 1 or any(isinstance(p, (bool, float)) for p in parts):
        raise FastRemoverError(f"--attention-window {value!r}: give three positive whole numbers T,H,W (tiles of "
                               "4x4x4 tokens per axis), e.g. 3,5,5")
    return window


def check_options(backend: str, keep, window) -> None:
    """FastRemoverError (one line) for sparse options out of range, or given to a backend that has none (`auto`
    never picks a sparse backend)."""
    name = registry.canonical(backend) if backend != "auto" else "auto"
    if keep is not None:
        if name not in SOURCES:
            raise FastRemoverError(f"--attention-keep applies to the sparse attention backends ({', '.join(SOURCES)})"
                                   f", not to --attention {backend}")
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
            raise FastRemoverError(f"--attention-keep {keep!r}: must be a fraction in (0, 1]")
    if window is not None:
        if SOURCES.get(name) != "sta":
            raise FastRemoverError(f"--attention-window applies to --attention sparse-sta / sparse-sta-cudnn, not "
                                   f"{backend}")
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


def _layout_for(source: str, cube: tuple[int, int, int] | None = None):
    def token_layout(grid, device, options=None):
        """The SparseLayout of a token grid (options: the config's AttentionOptions, or None for the defaults)."""
        from fastremover.ops.attention.sparse_layout import CUBE, SparseLayout, SparseOptions

        keep = getattr(options, "keep", None)
        window = getattr(options, "window", None) if source == "sta" else None  # (T, H, W) or None
        return SparseLayout(grid, device, SparseOptions(source, DEFAULT_KEEP if keep is None else float(keep),
                                                        window, cube or CUBE))

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


def _register(name: str, label: str, *, call, codes_call, validator, modes: tuple[str, ...],
              cube: tuple[int, int, int] | None = None, code_rows=None) -> AttentionBackend:
    """Register one sparse backend: its mask source from SOURCES, opt-in in `modes` (priority -100: `auto` never
    picks it), e4m3 codes in and out in the fast mode."""
    return register(AttentionBackend(
        name=name, label=label, call=call, validate=partial(validator, name=name),
        priority={mode: -100 for mode in modes}, precision="8bit", takes_codes=True, codes_call=codes_call,
        output="fp8-codes", token_layout=_layout_for(SOURCES[name], cube), code_rows=code_rows,
        announce_if_skipped=False,
    ))


_TRITON_KERNEL = dict(call=sparse_call, codes_call=sparse_codes, validator=validate, modes=("exact", "fast"))
STA = _register("sparse-sta", "sliding-tile sparse attention", **_TRITON_KERNEL)
VSA = _register("sparse-vsa", "VSA-style top-k sparse attention", **_TRITON_KERNEL)


# ----------------------------------------------------------------------------------------------------------------------
# The cuDNN paged-attention kernel (fast mode only)


def cudnn_validate(device, dtype=None, shape=None, *, name: str = "sparse attention (cuDNN)") -> list[str]:
    """Reasons it cannot run: a CUDA GPU on which cuDNN's FP8 attention builds a paged graph (Hopper or newer,
    cudnn-frontend installed, a recent cuDNN), the fast mode's e4m3 codes (dtype float8_e4m3fn; any other dtype is
    the exact mode, which this backend does not run), a head dim that is a multiple of 16 up to 128."""
    reasons = []
    if device.type != "cuda":
        return [f"{name} needs a CUDA GPU (cuDNN's FP8 attention)"]
    from fastremover.ops.attention import cudnn_sparse

    why = cudnn_sparse.supported(device)
    if why is not None:
        reasons.append(f"{name}: cuDNN's paged FP8 attention does not run here ({why})")
    import torch

    if dtype is not None and dtype != torch.float8_e4m3fn:
        reasons.append(f"{name} runs the fast mode's e4m3 codes only (--mode fast)")
    if shape is not None and (shape[-1] % 16 or shape[-1] > 128):
        reasons.append(f"{name} needs a head dim that is a multiple of 16 up to 128; this model has {shape[-1]}")
    return reasons


def cudnn_sparse_codes(q8, k8, v8, sq, sk, sv, out_dtype=None, *, layout=None):
    """e4m3 codes (per-tensor scales; V centred by the caller; storages of whole tiles: `code_rows`) -> e4m3 codes
    of (o - c) / sv."""
    from fastremover.ops.attention.cudnn_sparse import tile_sparse_fp8

    _needs_layout(layout)
    kv_idx, kv_cnt = layout.lists(q8, k8)
    return tile_sparse_fp8(q8, k8, v8, sq, sk, sv, kv_idx, kv_cnt, layout.tile)


def cudnn_sparse_call(q, k, v, *, layout=None):
    """16-bit q, k, v [1, S, H, D] in the layout's cube order -> o (quantized to per-tensor e4m3 codes, K and V
    centred, as the fast transformer does; the stand-alone entry, tests and tools)."""
    from fastremover.ops.attention.cudnn_sparse import padded_codes
    from fastremover.ops.attention.quantize import add_v_mean, quantize_qkv

    _needs_layout(layout)
    q8, k8, v8, sq, sk, sv, v_mean = quantize_qkv(q, k, v, smooth_k=True, smooth_v=True)
    q8, k8, v8 = (padded_codes(t, layout.tile) for t in (q8, k8, v8))
    o8 = cudnn_sparse_codes(q8, k8, v8, sq, sk, sv, layout=layout)
    return add_v_mean(o8.to(q.dtype).mul_(sv.view(())), v_mean)


def code_rows(tokens: int, layout) -> int:
    """Rows of one batch's q/k/v codes the cuDNN kernel reads (whole tiles of the layout)."""
    from fastremover.ops.attention.cudnn_sparse import padded_rows

    return padded_rows(tokens, layout.tile)


_CUDNN_KERNEL = dict(call=cudnn_sparse_call, codes_call=cudnn_sparse_codes, validator=cudnn_validate,
                     modes=("fast",), cube=CUDNN_CUBE, code_rows=code_rows)
STA_CUDNN = _register("sparse-sta-cudnn", "sliding-tile sparse attention on cuDNN", **_CUDNN_KERNEL)
VSA_CUDNN = _register("sparse-vsa-cudnn", "VSA-style top-k sparse attention on cuDNN", **_CUDNN_KERNEL)
