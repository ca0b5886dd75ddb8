"""Tile-sparse FP8 attention on cuDNN's SDPA through paged K/V caches (the `sparse-vsa-cudnn` / `sparse-sta-cudnn`
backends, fastremover/ops/attention/sparse.py).

    o8 = tile_sparse_fp8(q8, k8, v8, sq, sk, sv, kv_idx, kv_cnt, tile)      e4m3 codes [1, S, H, D] -> codes

The lists are those of the block-sparse Triton kernel (fastremover/fast/kernels/block_sparse_attention.py): query
tile i of head h attends to key tiles kv_idx[0, h, i, :kv_cnt[0, h, i]], ascending, the sequence's short last tile
(if any) always a row's last entry. cuDNN's FP8 SDPA takes a page table per batch entry, so each (head, query tile)
becomes one batch entry of one head and its kept key tiles its pages (page size = tile):

  * entries b = h * NT + i (NT = cdiv(S, tile); head-major, so the CTAs running together read one head's K / V);
  * Q and O by ragged offsets, in elements: entry (h, i) starts at i * tile * H * D + h * D and its token t lies
    t * H * D further, i.e. the token-major [S, H, D] codes as they are, no copy;
  * K and V as a container of overlapping pages with a page stride of D: page j * tile * H + h is tile j of head h
    (token t of it H * D further on: the same memory again);
  * seq_len_q = tile (the last tile: its short length), seq_len_kv = kv_cnt * tile less the missing keys of the
    short last key tile when the row lists it (its last entry, so the padding mask drops exactly those).

Memory contract: cuDNN reads whole pages and whole query tiles, so the codes' storage must extend to
`padded_rows(S, tile)` rows, and the rows past S of K and V must hold finite codes (zeros): the padding mask gives
their keys P = 0, but P @ V still multiplies V's rows, and 0 x NaN is NaN (an e4m3 NaN is one byte in 128 of
uninitialized memory). The fast transformer allocates its code buffers so, the padding zeroed
(AttentionBackend.code_rows); `tile_sparse_fp8` raises ValueError for a shorter storage (the padding's values it
cannot check without reading them back). Rows past S of the output are not written (ragged O). One batch only
(ValueError otherwise). No host sync: the tables are device ops, the graph is CUDA-graph capturable like
`cudnn_fp8`'s.

Numerics: cuDNN's FP8 SDPA (closed source): P quantized to e4m3 with the fixed scale `cudnn_fp8.P_SCALE`, fp32
softmax statistics, codes of o / sv out (scale_o = 1 / sv, the same output contract as the Triton kernel's codes).
Held, on the GPU, to the Triton kernel's codes bound with chained accumulation (`reference_bound(...,
chain_acc=True)`) against the fp32 masked reference (tests/kernels/test_cudnn_sparse.py); with every tile kept it
gives dense `cudnn_fp8.sdpa_fp8`'s bits (measured, asserted there). The tables and the addressing are checked on the
CPU by an emulation of the paged read (the same test file).

Tiles of 128 tokens (4x4x8 cubes) suit cuDNN's 128-row query tiles; at 64 each entry fills half a tile and the
kernel takes about twice as long (docs/performance.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from fastremover.ops.attention import cudnn_fp8 as cf

if TYPE_CHECKING:
    import torch

TILE = 128  # tokens per tile (4x4x8 cubes): cuDNN's FP8 query tile height


def padded_rows(tokens: int, tile: int) -> int:
    """Rows of one batch's q/k/v codes the kernel reads: `tokens` rounded up to whole tiles."""
    return -(-tokens // tile) * tile


def _check_codes(name: str, t: "torch.Tensor", rows: int) -> None:
    import torch

    if t.dtype != torch.float8_e4m3fn or t.ndim != 4:
        raise ValueError(f"tile_sparse_fp8: {name} must be float8_e4m3fn codes [1, S, H, D]")
    b, s, h, d = t.shape
    if b != 1:
        raise ValueError(f"tile_sparse_fp8: one batch only (the paged lists are per head and query tile), got {b}")
    if t.stride()[1:] != (h * d, d, 1):
        raise ValueError(f"tile_sparse_fp8: {name} must be token-major with rows of H*D contiguous codes, got strides "
                         f"{t.stride()}")
    have = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    if have < rows * h * d:
        raise ValueError(f"tile_sparse_fp8: {name}'s storage holds {have // (h * d)} rows; the kernel reads {rows} "
                         "(whole tiles): allocate the codes with padded_rows(S, tile) rows and pass the first S")
    if t.device.type != "cuda":
        raise ValueError(f"tile_sparse_fp8: {name} must be on a CUDA device (cuDNN's FP8 attention)")


def page_tables(kv_idx: "torch.Tensor", kv_cnt: "torch.Tensor", tokens: int, tile: int
                ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(page table [H * NT, 1, J, 1], seq_len_kv [H * NT, 1, 1, 1]), int32 on the lists' device, from kv_idx
    [1, H, NT, J] / kv_cnt [1, H, NT] (any strides: STA's lists are shared views). Entries past a row's count
    (select_tiles pads with NT) are clamped to a real page."""
    import torch

    _, H, NT, J = kv_idx.shape
    short = tokens - (NT - 1) * tile  # tokens of the last tile
    idx, cnt = kv_idx[0], kv_cnt[0]
    heads = torch.arange(H, device=idx.device, dtype=torch.int32).view(H, 1, 1)
    page = torch.clamp(idx, max=NT - 1).to(torch.int32).mul_(tile * H).add_(heads)
    last = torch.gather(idx, 2, (cnt - 1).to(torch.int64).unsqueeze(-1)).squeeze(-1)
    seq_kv = cnt.to(torch.int32) * tile - (last == NT - 1).to(torch.int32) * (tile - short)
    return page.reshape(H * NT, 1, J, 1), seq_kv.reshape(H * NT, 1, 1, 1)


def seq_q_and_offsets(tokens: int, heads: int, head_dim: int, tile: int, device) -> tuple:
    """(seq_len_q [H * NT, 1, 1, 1], ragged offsets [H * NT + 1, 1, 1, 1]), int32: the constant half of the tables."""
    import torch

    NT = -(-tokens // tile)
    seq_q = torch.full((heads, NT), tile, dtype=torch.int32, device=device)
    seq_q[:, -1] = tokens - (NT - 1) * tile
    i = torch.arange(NT, device=device, dtype=torch.int64).view(1, NT)
    h = torch.arange(heads, device=device, dtype=torch.int64).view(heads, 1)
    if NT * tile * heads * head_dim >= 2 ** 31:
        raise ValueError(f"tile_sparse_fp8: {tokens} tokens x {heads * head_dim} exceed int32 offsets")
    off = (i * (tile * heads * head_dim) + h * head_dim).reshape(-1)
    end = off.new_full((1,), NT * tile * heads * head_dim)
    offsets = torch.cat([off, end]).to(torch.int32)
    return seq_q.reshape(heads * NT, 1, 1, 1), offsets.reshape(heads * NT + 1, 1, 1, 1)


class _PagedGraph(cf._Graph):
    """One built graph for (tokens, heads, head dim, tile, list width J) and its constant tables (kept in
    cudnn_fp8's bounded graph cache, run on torch's current stream as its graphs are)."""

    def __init__(self, tokens: int, H: int, D: int, tile: int, J: int, attn_scale: float, device):
        import torch

        cudnn = cf._cudnn()
        NT = -(-tokens // tile)
        B = H * NT
        self.handle = cf._handle(device)
        g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        fp8, i32, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.INT32, cudnn.data_type.FLOAT
        qdims, qstrides = [B, 1, tile, D], [D, D, H * D, 1]  # entry starts come from the ragged offsets
        kdims, kstrides = [NT * tile * H, 1, tile, D], [D, D, H * D, 1]  # overlapping pages

        def tensor(name, dims, strides, dtype):
            return g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)

        def scalar(name):
            return tensor(name, [1, 1, 1, 1], [1, 1, 1, 1], f32)

        self.q = tensor("q", qdims, qstrides, fp8)
        self.k = tensor("k", kdims, kstrides, fp8)
        self.v = tensor("v", kdims, kstrides, fp8)
        self.page = tensor("page_table", [B, 1, J, 1], [J, J, 1, 1], i32)
        self.seq_q = tensor("seq_len_q", [B, 1, 1, 1], [1, 1, 1, 1], i32)
        self.seq_kv = tensor("seq_len_kv", [B, 1, 1, 1], [1, 1, 1, 1], i32)
        self.q_off = tensor("q_ragged_offset", [B + 1, 1, 1, 1], [1, 1, 1, 1], i32)
        self.o_off = tensor("o_ragged_offset", [B + 1, 1, 1, 1], [1, 1, 1, 1], i32)
        self.q.set_ragged_offset(self.q_off)
        self.dq, self.dk, self.dv = scalar("descale_q"), scalar("descale_k"), scalar("descale_v")
        self.ds, self.ss, self.so = scalar("descale_s"), scalar("scale_s"), scalar("scale_o")
        o, _stats, amax_s, amax_o = g.sdpa_fp8(
            q=self.q, k=self.k, v=self.v, descale_q=self.dq, descale_k=self.dk, descale_v=self.dv,
            descale_s=self.ds, scale_s=self.ss, scale_o=self.so, is_inference=True, attn_scale=attn_scale,
            use_padding_mask=True, seq_len_q=self.seq_q, seq_len_kv=self.seq_kv,
            paged_attention_k_table=self.page, paged_attention_v_table=self.page,
            paged_attention_max_seq_len_kv=J * tile, name="sdpa_fp8_tile_sparse")
        o.set_output(True).set_dim(qdims).set_stride(qstrides).set_data_type(fp8)
        o.set_ragged_offset(self.o_off)
        for t in (amax_s, amax_o):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.o, self.amax_s, self.amax_o = o, amax_s, amax_o
        self.graph, self.workspace, _ = cf._build(g, device)
        self.seq_q_t, self.offsets = seq_q_and_offsets(tokens, H, D, tile, device)
        self.amax = torch.empty(2, dtype=torch.float32, device=device)
        self.p_scale = torch.full((1,), cf.P_SCALE, dtype=torch.float32, device=device)
        self.p_descale = torch.full((1,), 1.0 / cf.P_SCALE, dtype=torch.float32, device=device)

    def run(self, q8, k8, v8, out, page, seq_kv, dq, dk, dv, scale_o) -> None:
        pack = {self.q: q8, self.k: k8, self.v: v8, self.o: out, self.page: page, self.seq_q: self.seq_q_t,
                self.seq_kv: seq_kv, self.q_off: self.offsets, self.o_off: self.offsets,
                self.dq: dq, self.dk: dk, self.dv: dv, self.ds: self.p_descale, self.ss: self.p_scale,
                self.so: scale_o, self.amax_s: self.amax[0:1], self.amax_o: self.amax[1:2]}
        self._execute(pack, q8.device, None)


def tile_sparse_fp8(q8, k8, v8, sq, sk, sv, kv_idx, kv_cnt, tile: int, *, attn_scale: float | None = None):
    """Codes of o / sv [1, S, H, D] (a view of a buffer of padded_rows(S, tile) rows) for e4m3 codes q8, k8, v8
    [1, S, H, D] whose storages hold padded_rows(S, tile) rows (k8's and v8's past S zero), per-tensor
    dequantization scales sq, sk, sv (fp32 on the device) and the lists kv_idx [1, H, NT, J], kv_cnt [1, H, NT]
    (module docstring)."""
    import torch

    _, S, H, D = q8.shape
    NT = -(-S // tile)
    rows = padded_rows(S, tile)
    for name, t in (("q8", q8), ("k8", k8), ("v8", v8)):
        _check_codes(name, t, rows)
        if t.shape != q8.shape:
            raise ValueError(f"tile_sparse_fp8: q/k/v shapes differ: {list(q8.shape)} {list(t.shape)}")
    if kv_idx.ndim != 4 or kv_idx.shape[:3] != (1, H, NT) or tuple(kv_cnt.shape) != (1, H, NT):
        raise ValueError(f"tile_sparse_fp8: lists {list(kv_idx.shape)} / {list(kv_cnt.shape)} do not match "
                         f"[1, {H}, {NT}, J] / [1, {H}, {NT}] ({S} tokens in tiles of {tile})")
    J = kv_idx.shape[-1]
    scale = D ** -0.5 if attn_scale is None else float(attn_scale)
    key = ("tile-sparse", q8.device, S, H, D, tile, J, scale)
    graph = cf._cached(key, lambda: _PagedGraph(S, H, D, tile, J, scale, q8.device))
    page, seq_kv = page_tables(kv_idx, kv_cnt, S, tile)
    out = torch.empty((rows, H, D), dtype=torch.float8_e4m3fn, device=q8.device)
    scales = tuple(s.reshape(1) for s in (sq, sk, sv))
    graph.run(q8, k8, v8, out, page.contiguous(), seq_kv.contiguous(), *scales, torch.reciprocal(scales[2]))
    return out[:S].unsqueeze(0)


def padded_codes(t: "torch.Tensor", tile: int) -> "torch.Tensor":
    """A copy of [1, S, H, D] codes in a storage of padded_rows(S, tile) rows, the padding zero (the stand-alone
    call's inputs)."""
    import torch

    _, S, H, D = t.shape
    buf = torch.empty((padded_rows(S, tile), H, D), dtype=t.dtype, device=t.device)
    buf[:S].copy_(t[0])
    buf[S:].zero_()
    return buf[:S].unsqueeze(0)


def supported(device: "torch.device") -> str | None:
    """None when a tile-sparse FP8 graph builds and runs on this CUDA device, else why not (cached per device)."""
    import torch

    return _supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> str | None:
    import torch

    why = cf.supported(index)
    if why is None:
        try:
            dev = torch.device("cuda", index)
            S, H, D, T = 2 * TILE - 16, 1, 128, TILE  # a short last tile
            codes = [padded_codes(torch.randn(1, S, H, D, device=dev).to(torch.float8_e4m3fn), T) for _ in range(3)]
            idx = torch.tensor([[[[0, 1], [1, 1]]]], dtype=torch.int32, device=dev)
            cnt = torch.tensor([[[2, 1]]], dtype=torch.int32, device=dev)
            one = torch.ones(1, device=dev)
            tile_sparse_fp8(*codes, one, one, one, idx, cnt, T)
            torch.cuda.synchronize(dev)
        except Exception as exc:  # cudnnGraphNotSupportedError (an older cuDNN), RuntimeError, ...
            text = str(exc).strip()
            why = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return why
