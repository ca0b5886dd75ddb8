"""Tile-sparse attention: the cube order, the block-sparse kernel against its masked reference, the mask sources, the
backends in the fast transformer, and the option checks.

Without a GPU the kernel runs in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1) on tiny shapes; the
`gpu` tests run the compiled kernel at the real shapes (W2: 32760 tokens, 12 heads x 128). The kernel's bound against
`block_sparse_attention_reference` is stated in fastremover/fast/kernels/block_sparse_attention.py
(`reference_bound`)."""

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastremover.errors import FastRemoverError
from helpers import TOOLS

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
FP8 = torch.float8_e4m3fn
W2_GRID = (21, 30, 52)  # 81 frames of 832x480 after the VAE and the 1x2x2 patches: 32760 tokens


def bsa():
    from fastremover.fast.kernels import block_sparse_attention

    return block_sparse_attention


def random_lists(B, H, nq, nk, density, gen, own=True):
    """Random ascending tile lists (each row at least its diagonal tile), J padded with the row's last entry."""
    mask = torch.rand(B, H, nq, nk, generator=gen) < density
    if own:
        mask[..., torch.arange(nq), torch.arange(nq) * nk // nq] = True
    mask[..., 0] |= ~mask.any(-1)
    cnt = mask.sum(-1).int()
    order = torch.sort(torch.where(mask, torch.arange(nk), nk + torch.arange(nk)), dim=-1).values
    idx = torch.where(order >= nk, order.gather(-1, (cnt.long() - 1).unsqueeze(-1)), order).int()
    return idx, cnt


def qkv(shape, dtype, gen, scale=0.05):
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    v = v + 0.5  # an offset: the bound is in |v|, not in its spread
    if dtype == FP8:
        scales = tuple(torch.tensor([scale], device=DEV) for _ in range(3))
        return tuple((t / scale).to(FP8).to(DEV) for t in (q, k, v)), scales
    return tuple(t.to(dtype).to(DEV) for t in (q, k, v)), None


def small(dtype, head_dim=16, tile=16):
    """(head dim, tile) of a small test: e4m3 codes need both >= 32 (Triton's FP8 dot takes K >= 32: K is the head
    dim in q @ k^T, BLOCK_N, which divides the tile, in P @ V)."""
    return (max(head_dim, 32), max(tile, 32)) if dtype == FP8 else (head_dim, tile)


def check_against_reference(q, k, v, idx, cnt, tile_q, tile_k, scales, config=None):
    m = bsa()
    m.check_lists(idx, cnt, -(-q.shape[1] // tile_k))
    out = m.block_sparse_attention(q, k, v, idx, cnt, tile_q=tile_q, tile_k=tile_k, scales=scales, config=config)
    ref = m.block_sparse_attention_reference(q, k, v, idx, cnt, tile_q=tile_q, tile_k=tile_k, scales=scales)
    if isinstance(config, str):
        config = m.BlockSparseConfig.parse(config)
    bound = m.reference_bound(v, cnt, tile_q=tile_q, tile_k=tile_k, scales=scales,
                              chain_acc=None if config is None else config.chain_acc)
    real = (lambda t: t.float() * scales[2]) if scales else (lambda t: t.float())
    err = (real(out) - real(ref)).abs()
    assert out.shape == q.shape and out.dtype == ref.dtype
    assert torch.isfinite(err).all()
    assert (err <= bound).all(), f"max err / bound {(err / bound).max().item():.3f}"
    return out, ref


# ----------------------------------------------------------------------------------------------------------------------
# The kernel against its masked reference


DTYPES = [torch.float16, torch.bfloat16, FP8]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_kernel_random_lists_with_a_ragged_edge(dtype, tma):
    """Random per-(batch, head) lists, S = 100 with 16-token tiles (32 for codes): the last key tile has 4 tokens."""
    m = bsa()
    gen = torch.Generator().manual_seed(1)
    (D, tile), B, S, H = small(dtype), 2, 100, 2
    (q, k, v), scales = qkv((B, S, H, D), dtype, gen)
    nq = nk = -(-S // tile)
    idx, cnt = random_lists(B, H, nq, nk, 0.4, gen)
    cfg = m.BlockSparseConfig(tile, tile, 4, 2, tma=tma, v_t=True)
    check_against_reference(q, k, v, idx.to(DEV), cnt.to(DEV), tile, tile, scales, cfg)


@pytest.mark.parametrize("chain_acc,lazy", [(True, False), (False, True), (True, True)], ids=["ca", "lz", "both"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_codes_variants_stay_within_the_bound(tma, chain_acc, lazy):
    """`chain_acc` (P @ V accumulated into acc inside the MMA chain: the interpreter's dot is exact, so only the GPU
    shows its rounding, the `gpu` test below) and `lazy` (conditional rescaling: the same bound; here with logits
    spread wide, so rows' maxima move by less and by more than tau across the blocks) against the reference."""
    m = bsa()
    gen = torch.Generator().manual_seed(11)
    B, S, H, D, tile = 1, 150, 2, 32, 32
    (q, k, v), scales = qkv((B, S, H, D), FP8, gen, scale=0.01 if lazy else 0.05)
    nq = nk = -(-S // tile)
    idx, cnt = random_lists(B, H, nq, nk, 0.5, gen)
    cfg = m.BlockSparseConfig(tile, tile, 4, 2, tma=tma, v_t=True, chain_acc=chain_acc, lazy=lazy)
    out, _ = check_against_reference(q, k, v, idx.to(DEV), cnt.to(DEV), tile, tile, scales, cfg)
    if lazy:  # p relative to a stale max: other codes than the eager rescaling somewhere (the variant ran)
        plain = m.block_sparse_attention(q, k, v, idx.to(DEV), cnt.to(DEV), tile_q=tile, tile_k=tile, scales=scales,
                                         config=dataclasses.replace(cfg, lazy=False))
        assert not torch.equal(out, plain)


def test_lazy_rescaling_keeps_p_inside_e4m3():
    """The largest p a stale max allows, 2^(8 + tau), is below e4m3's 448 (no saturation), and tau > 0."""
    m = bsa()
    assert 0 < m.LAZY_TAU.value and 2.0 ** (m.P_SHIFT.value + m.LAZY_TAU.value) < 448
    with pytest.raises(ValueError, match="warp specialization"):
        m.BlockSparseConfig(64, 64, 4, 3, warp_spec=True, lazy=True)


def test_config_names_round_trip_with_and_without_chain_acc():
    m = bsa()
    old = m.BlockSparseConfig.parse("m64n64w4s3t1ws0vt1")  # names of earlier runs (committed JSON) still parse
    assert not old.chain_acc and old.name == "m64n64w4s3t1ws0vt1"
    new = m.BlockSparseConfig.parse("m64n64w4s3t1ws0vt1ca1")
    assert new.chain_acc and new.name == "m64n64w4s3t1ws0vt1ca1" and new == dataclasses.replace(old, chain_acc=True)
    both = m.BlockSparseConfig.parse("m64n64w4s3t1ws0vt1ca1lz1")
    assert both == dataclasses.replace(new, lazy=True) and both.name == "m64n64w4s3t1ws0vt1ca1lz1"
    assert m.BlockSparseConfig.parse("m64n64w4s3t1ws0vt1lz1") == dataclasses.replace(old, lazy=True)
    for bad in ("m64n64w4s3t1ws0vt1ca2", "m64n64w4s3t1ws0vt1lz1ca1"):
        with pytest.raises(ValueError, match="ca1, then lz1"):
            m.BlockSparseConfig.parse(bad)
    v = torch.ones(1, 64, 1, 32).to(FP8)
    cnt = torch.full((1, 1, 1), 1, dtype=torch.int32)
    scales = (torch.ones(1),) * 3
    plain = m.reference_bound(v, cnt, tile_q=64, tile_k=64, scales=scales, chain_acc=False)
    chained = m.reference_bound(v, cnt, tile_q=64, tile_k=64, scales=scales, chain_acc=True)
    assert torch.allclose(chained - plain, torch.full_like(plain, 64 * 2.0 ** -19))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp8"])
def test_kernel_tiles_wider_than_its_blocks_and_shared_lists(dtype):
    """32-token tiles walked in 16-key blocks (codes: 64 and 32; two per tile; the short last tile's second block is
    skipped), one list shared by every batch and head (stride-0 views), query blocks of half a tile."""
    m = bsa()
    gen = torch.Generator().manual_seed(2)
    B, S, H, D, tile = 2, 150, 3, 32, 64 if dtype == FP8 else 32
    (q, k, v), scales = qkv((B, S, H, D), dtype, gen)
    nq = nk = -(-S // tile)
    idx, cnt = random_lists(1, 1, nq, nk, 0.5, gen)
    idx, cnt = idx.to(DEV).expand(B, H, nq, -1), cnt.to(DEV).expand(B, H, nq)
    cfg = m.BlockSparseConfig(tile // 2, tile // 2, 4, 2, tma=True, v_t=False)
    check_against_reference(q, k, v, idx, cnt, tile, tile, scales, cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp8"])
def test_every_tile_kept_is_dense_attention(dtype):
    """keep 1.0: every key tile, ascending, is dense attention (torch SDPA on the same, dequantized inputs) within
    the kernel's bound."""
    m = bsa()
    gen = torch.Generator().manual_seed(3)
    (D, tile), B, S, H = small(dtype), 1, 90, 2
    (q, k, v), scales = qkv((B, S, H, D), dtype, gen)
    nq = nk = -(-S // tile)
    idx = torch.arange(nk, dtype=torch.int32, device=DEV).expand(B, H, nq, nk)
    cnt = torch.full((B, H, nq), nk, dtype=torch.int32, device=DEV)
    out = m.block_sparse_attention(q, k, v, idx, cnt, tile_q=tile, tile_k=tile, scales=scales)
    real = [t.float() * s for t, s in zip((q, k, v), scales)] if scales else [t.float() for t in (q, k, v)]
    dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in real)).transpose(1, 2)
    got = out.float() * scales[2] if scales else out.float()
    bound = m.reference_bound(v, cnt, tile_q=tile, tile_k=tile, scales=scales)
    assert ((got - dense).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp8"])
def test_one_tile_per_row_is_attention_within_the_tile(dtype):
    """Each query tile attends to its own tile only: block-diagonal attention, computed here tile by tile."""
    m = bsa()
    gen = torch.Generator().manual_seed(4)
    (D, tile), B, S, H = small(dtype), 1, 70, 2
    (q, k, v), scales = qkv((B, S, H, D), dtype, gen)
    nq = -(-S // tile)
    idx = torch.arange(nq, dtype=torch.int32, device=DEV).view(1, 1, nq, 1).expand(B, H, nq, 1)
    cnt = torch.ones((B, H, nq), dtype=torch.int32, device=DEV)
    out = m.block_sparse_attention(q, k, v, idx, cnt, tile_q=tile, tile_k=tile, scales=scales)
    real = [t.float() * s for t, s in zip((q, k, v), scales)] if scales else [t.float() for t in (q, k, v)]
    got = out.float() * scales[2] if scales else out.float()
    bound = m.reference_bound(v, cnt, tile_q=tile, tile_k=tile, scales=scales)
    for t0 in range(0, S, tile):
        sl = slice(t0, min(S, t0 + tile))
        expect = F.scaled_dot_product_attention(*(t[:, sl].transpose(1, 2) for t in real)).transpose(1, 2)
        assert ((got[:, sl] - expect).abs() <= bound[:, sl]).all()


def test_the_reference_sees_a_wrong_tile():
    """The check is not vacuous: a kernel given one tile more than the reference is far outside the bound."""
    m = bsa()
    gen = torch.Generator().manual_seed(5)
    (q, k, v), _ = qkv((1, 64, 1, 16), torch.float16, gen)
    one = torch.zeros((1, 1, 4, 1), dtype=torch.int32, device=DEV)
    two = torch.tensor([0, 1], dtype=torch.int32, device=DEV).expand(1, 1, 4, 2)
    out = m.block_sparse_attention(q, k, v, two.contiguous(), torch.full((1, 1, 4), 2, dtype=torch.int32,
                                   device=DEV), tile_q=16, tile_k=16)
    ref = m.block_sparse_attention_reference(q, k, v, one, torch.ones((1, 1, 4), dtype=torch.int32, device=DEV),
                                             tile_q=16, tile_k=16)
    bound = m.reference_bound(v, torch.ones((1, 1, 4), dtype=torch.int32), tile_q=16, tile_k=16)
    assert ((out.float() - ref.float()).abs() > bound).any()


def test_kernel_refuses_bad_inputs(raise_value_errors):
    m = bsa()
    q = torch.zeros(1, 32, 2, 16, dtype=torch.float16, device=DEV)
    idx = torch.zeros(1, 2, 2, 1, dtype=torch.int32, device=DEV)
    cnt = torch.ones(1, 2, 2, dtype=torch.int32, device=DEV)
    call = m.block_sparse_attention
    q8 = q.to(FP8)
    w8 = torch.zeros(1, 64, 2, 32, device=DEV).to(FP8)  # codes at the smallest head dim and tile they compile for
    sc = tuple(torch.ones(1, device=DEV) for _ in range(3))
    raise_value_errors([
        (lambda: call(q.float(), q.float(), q.float(), idx, cnt, tile_q=16, tile_k=16), "fp16"),
        (lambda: call(q[..., :12], q[..., :12], q[..., :12], idx, cnt, tile_q=16, tile_k=16), "head dim"),
        (lambda: call(q, q, q, idx, cnt, tile_q=24, tile_k=16), "power of two"),
        (lambda: call(q, q, q, idx.long(), cnt, tile_q=16, tile_k=16), "int32"),
        (lambda: call(q, q, q, idx[:, :, :1], cnt, tile_q=16, tile_k=16), "NQ"),
        (lambda: call(q8, q8, q8, idx, cnt, tile_q=16, tile_k=16), "for e4m3 codes, got 16"),
        (lambda: call(w8, w8, w8, idx, cnt, tile_q=32, tile_k=16), "tile_k >= 32"),
        (lambda: call(w8, w8, w8, idx, cnt, tile_q=32, tile_k=32), "scales"),
        (lambda: call(w8, w8, w8, idx, cnt, tile_q=32, tile_k=32, scales=sc, config="m32n16w4s2t1ws0vt1"),
         "BLOCK_M / BLOCK_N must be >= 16 / 32 (e4m3 codes)"),
        (lambda: call(q, q, q, idx, cnt, tile_q=16, tile_k=16, config="m32n16w4s2t1ws0vt0"), "divide"),
        (lambda: m.BlockSparseConfig.parse("fast"), "config"),
        (lambda: m.check_lists(torch.tensor([[[[1, 0]]]]), torch.tensor([[[2]]]), 2), "ascending"),
        (lambda: m.check_lists(torch.tensor([[[[0]]]]), torch.tensor([[[0]]]), 2), "1..1"),
    ])


# ----------------------------------------------------------------------------------------------------------------------
# Cube order


@pytest.mark.parametrize("grid", [(5, 8, 8), (3, 5, 7), (1, 1, 1), (9, 6, 10), W2_GRID])
def test_cube_order_round_trips_exactly_and_makes_cubes_contiguous(grid):
    from fastremover.ops.attention.sparse_layout import CubeOrder

    order = CubeOrder(grid)
    S = math.prod(grid)
    assert torch.equal(torch.sort(order.perm).values, torch.arange(S))
    x = torch.randn(2, S, 3)
    assert torch.equal(order.restore(order.permute(x)), x)
    assert torch.equal(order.permute(order.restore(x)), x)
    # every full cube is one tile (64 consecutive positions) holding exactly that cube's tokens
    t, h, w = (torch.from_numpy(a.reshape(-1)) for a in np.meshgrid(*(np.arange(g) for g in grid), indexing="ij"))
    cube = torch.stack([t // 4, h // 4, w // 4], 1)[order.perm]
    for i in range(order.full_cubes):
        assert (cube[i * 64:(i + 1) * 64] == cube[i * 64]).all()
    assert order.n_tiles == -(-S // 64)
    per_tile = order.incidence.sum(1)
    assert (per_tile[:order.full_cubes] == 1).all() and (per_tile >= 1).all()
    assert (order.incidence.sum(0) >= 1).all()  # every cube lands in some tile


def test_w2_layout_packs_the_edge_cubes_without_padding():
    from fastremover.ops.attention.sparse_layout import CubeOrder

    order = CubeOrder(W2_GRID)
    assert order.full_cubes == 455 and order.n_tiles == 512  # 32760 = 455 * 64 + 3640 edge tokens in 57 tiles


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_rope_with_permuted_tables_equals_the_permuted_output(use_triton):
    """qk_norm_rope reads table row s for token s: permuting the tokens and the tables together permutes its output
    bit for bit (what lets the fast transformer run in cube order)."""
    from fastremover.fast.kernels import qk_norm_rope as kr
    from fastremover.models.transformer import rope_cos_sin
    from fastremover.ops.attention.sparse_layout import CubeOrder

    grid, heads, hd = (5, 2, 6), 2, 16
    S = math.prod(grid)
    order = CubeOrder(grid, device=DEV)
    assert not torch.equal(order.perm.cpu(), torch.arange(S))
    cos, sin = rope_cos_sin(grid, hd, 64, DEV)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(S, heads * hd, generator=gen).to(DEV, torch.float16)
    weight = (1 + 0.1 * torch.randn(heads * hd, generator=gen)).to(DEV, torch.float16)
    fn = kr.qk_norm_rope if use_triton else kr.qk_norm_rope_reference
    plain = fn(x, weight, cos, sin, S, heads, 1e-6).view(1, S, -1)
    permuted = fn(order.permute(x.view(1, S, -1)).reshape(S, -1), weight, order.permute(cos, 0),
                  order.permute(sin, 0), S, heads, 1e-6).view(1, S, -1)
    assert torch.equal(permuted, order.permute(plain))


# ----------------------------------------------------------------------------------------------------------------------
# Mask sources


def test_sta_windows():
    from fastremover.ops.attention.sparse_layout import CubeOrder, lists_from_mask, sta_mask, sta_window_for_keep

    order = CubeOrder((16, 16, 16))  # 4 x 4 x 4 full cubes
    assert (sta_mask(order, (1, 1, 1)) == np.eye(64, dtype=bool)).all()
    mask = sta_mask(order, (3, 3, 3))
    assert (mask.sum(1) == 27).all()  # clamped at the edges: every window keeps its size
    corner = np.zeros((4, 4, 4), dtype=bool)
    corner[:3, :3, :3] = True
    assert (mask[0] == corner.reshape(-1)).all()  # the corner cube's window is shifted inward
    assert sta_mask(order, (9, 9, 9)).all()
    idx, cnt = lists_from_mask(mask)
    bsa().check_lists(torch.from_numpy(idx)[None, None], torch.from_numpy(cnt)[None, None], 64)
    assert sta_window_for_keep((4, 4, 4), 27 / 64) == (3, 3, 3)
    assert sta_window_for_keep((6, 8, 13), 1.0) == (6, 8, 13)


def vsa_layout(grid, keep, device="cpu"):
    from fastremover.ops.attention.sparse_layout import SparseLayout, SparseOptions

    return SparseLayout(grid, device, SparseOptions("vsa-topk", keep))


def test_vsa_keeps_the_top_tiles_plus_the_forced_ones():
    from fastremover.ops.attention.sparse_layout import forced_mask, tile_means

    layout = vsa_layout((12, 8, 8), 0.5)  # 12 full cubes
    n = layout.order.n_tiles
    assert n == 12 and layout.count == 6
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, 768, 2, 16, generator=gen).half() for _ in range(2))
    idx, cnt = layout.lists(q, k)
    assert idx.shape == (2, 2, n, 6) and (cnt == 6).all()
    bsa().check_lists(idx, cnt, n)
    kept = bsa().expand_lists(idx, cnt, n)
    forced = torch.from_numpy(forced_mask(layout.order))
    assert kept[:, :, forced].all()
    scores = torch.einsum("bqhd,bkhd->bhqk", tile_means(q, 64), tile_means(k, 64)).masked_fill(forced, math.inf)
    # every kept tile scores at least as high as every dropped one
    low_kept = scores.masked_fill(~kept, math.inf).amin(-1)
    high_dropped = scores.masked_fill(kept, -math.inf).amax(-1)
    assert (low_kept >= high_dropped).all()


def test_vsa_keeps_the_keep_fraction_at_w2_and_more_only_where_forced():
    """W2's grid: packs of edge cubes have more temporal neighbours than a full cube, and only those rows keep more
    than ceil(keep * NK) tiles; every row keeps its forced tiles."""
    from fastremover.ops.attention.sparse_layout import forced_mask

    layout = vsa_layout(W2_GRID, 0.125)
    cnt = layout._cnt.flatten()
    forced = forced_mask(layout.order).sum(1)
    assert (cnt == np.maximum(64, forced)).all() and layout.count == int(cnt.max())
    assert layout.density == pytest.approx(cnt.float().mean().item() / 512)


def test_vsa_selection_is_deterministic_with_ties():
    layout = vsa_layout((12, 8, 8), 0.5)
    q = torch.ones(1, 768, 1, 16, dtype=torch.float16)  # every score equal: ties everywhere
    idx, cnt = layout.lists(q, q)
    kept = bsa().expand_lists(idx, cnt, 12)
    from fastremover.ops.attention.sparse_layout import forced_mask

    f = forced_mask(layout.order)
    for i in range(12):  # the forced tiles, then the lowest other indices
        forced = set(np.flatnonzero(f[i]).tolist())
        others = [j for j in range(12) if j not in forced][:int(cnt[0, 0, i]) - len(forced)]
        assert kept[0, 0, i].nonzero().flatten().tolist() == sorted(forced | set(others))
    gen = torch.Generator().manual_seed(8)
    q, k = (torch.randn(2, 768, 2, 16, generator=gen).half() for _ in range(2))
    assert torch.equal(layout.lists(q, k)[0], layout.lists(q.clone(), k.clone())[0])


def test_vsa_ordered_keys_keep_the_float_order():
    from fastremover.ops.attention.sparse_layout import ordered_keys

    x = torch.tensor([[-math.inf, -2.0, -1.0, -0.5, 0.0, 1e-30, 0.5, 2.0, math.inf, 0.5]])
    keys = ordered_keys(x)
    assert (keys[0, 1:9] > keys[0, :8]).all()
    assert keys[0, 6] > keys[0, 9]  # equal scores: the lower index ranks higher
    assert len(set(keys.flatten().tolist())) == keys.numel()


def test_selection_reads_nothing_on_the_host():
    """The whole selection (pooling, scores, top-k, sort) runs on meta tensors, which have no values: any host read
    (.item(), .cpu(), nonzero, a tensor's truth value) would raise there. So it never syncs with the GPU and a CUDA
    graph can capture it (the gpu test captures it)."""
    layout = vsa_layout((9, 8, 8), 0.25, device="meta")
    q = torch.empty(2, 576, 3, 16, device="meta", dtype=FP8)
    idx, cnt = layout.lists(q, q)
    assert idx.shape == (2, 3, layout.order.n_tiles, layout.count) and idx.dtype == torch.int32
    with pytest.raises(RuntimeError):  # the probe works: a host read does fail on meta tensors
        idx.sum().item()


# ----------------------------------------------------------------------------------------------------------------------
# Backends, options and the fast transformer


def test_options_fail_fast_with_one_line():
    from fastremover.config import AttentionOptions, EngineConfig

    good = EngineConfig(attention=AttentionOptions("sparse-sta", 0.3, "3,5,5"))
    assert good.attention.keep == 0.3 and good.attention.window == (3, 5, 5)  # the window's text, parsed
    assert AttentionOptions("sparse-sta", 0.3, [3, 5, 5]) == good.attention  # a list (the config's JSON) too
    for args, words in [
        (("sparse-vsa", 0.0), "(0, 1]"),
        (("sparse-vsa", 1.5), "(0, 1]"),
        (("sdpa", 0.5), "sparse attention backends"),
        (("auto", 0.5), "sparse attention backends"),
        (("sparse-vsa", None, "3,3,3"), "sparse-sta"),
        (("sparse-sta", None, "3,3"), "three positive"),
        (("sparse-sta", None, "3,0,3"), "three positive"),
        (("sparse-sta", None, (3, 2.5, 3)), "three positive"),
    ]:
        with pytest.raises(FastRemoverError, match=words.replace("(", r"\(").replace("]", r"\]")) as info:
            EngineConfig(attention=AttentionOptions(*args))
        assert "\n" not in str(info.value)


def test_cli_flags_reach_the_config_and_bad_ones_exit_2(capsys):
    from fastremover.cli import build_parser, engine_config, main

    args = build_parser().parse_args(["verify", "v.mp4", "--mask", "m.mp4", "--model", "random", "--attention",
                                      "sparse-sta", "--attention-keep", "0.2", "--attention-window", "3,5,5"])
    config = engine_config(args)
    assert (config.attention.backend, config.attention.keep, config.attention.window) == ("sparse-sta", 0.2, (3, 5, 5))
    rc = main(["verify", "v.mp4", "--mask", "m.mp4", "--model", "random", "--attention", "sdpa",
               "--attention-keeps", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "fastremover: error: --attention-keeps needs a sparse --attention" in err
    rc = main(["verify", "v.mp4", "--mask", "m.mp4", "--model", "random", "--attention", "sparse-vsa",
               "--attention-keeps", "0.5,2"])
    assert rc == 2 and "--attention-keeps '0.5,2'" in capsys.readouterr().err


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the kernel (GPU or interpreter)")
def test_sequence_parallelism_refuses_sparse_attention_before_building(monkeypatch):
    """The engine's build refuses a sparse backend for a context of several ranks (the layout permutes the whole
    sequence; the ranks hold slices of it) before it moves or builds anything, not at the first denoise step."""
    from fastremover.config import AttentionOptions, EngineConfig
    from fastremover.engine import build as engine
    from fastremover.models.loading import random_models
    from fastremover.parallel.context import ParallelContext

    monkeypatch.setattr(engine, "resolve_mode", lambda mode, device: (mode, []))  # exact on the interpreter's CPU
    config = EngineConfig(device=DEV, mode="exact", attention=AttentionOptions("sparse-vsa"))
    models = random_models("tiny", 0)
    with pytest.raises(FastRemoverError, match="sequence parallelism"):
        engine.build(models, config, ParallelContext(rank=0, world_size=2))
    assert next(models.transformer.parameters()).dtype == torch.float32  # nothing was moved or cast


def test_validator_reasons():
    from fastremover.ops.attention import get

    backend = get("sparse-vsa")
    assert backend.token_layout is not None and backend.takes_codes and backend.output == "fp8-codes"
    reasons = backend.validate(torch.device(DEV), dtype=torch.float32, shape=(12, 96))
    assert any("fp16 or bf16" in r for r in reasons) and any("head dim" in r for r in reasons)
    assert backend.validate(torch.device(DEV), dtype=torch.float16, shape=(12, 128)) == []
    # the fast mode hands it e4m3 codes: the FP8 dot needs head dim >= 32; 16 bits run 16
    (why,) = backend.validate(torch.device(DEV), dtype=FP8, shape=(2, 16))
    assert why.startswith("sparse-vsa needs a head dim >= 32 for the fast mode's e4m3 codes") and "has 16" in why
    assert backend.validate(torch.device(DEV), dtype=FP8, shape=(2, 32)) == []
    assert backend.validate(torch.device(DEV), dtype=torch.float16, shape=(2, 16)) == []


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the kernel (GPU or interpreter)")
def test_a_head_dim_the_fp8_kernel_cannot_compile_is_refused_before_any_work(monkeypatch):
    """The tiny preset (head dim 16) in the fast mode: the engine's build refuses sparse-vsa in one line before it
    moves or builds anything (the GPU run got a Triton CompilationError at the first attention call), and `verify
    --attention-keeps` refuses it before its first mode runs; the exact mode (16-bit operands) passes the check."""
    from fastremover.bench import sparse_fidelity
    from fastremover.config import AttentionOptions, EngineConfig
    from fastremover.engine import build as engine
    from fastremover.models.loading import random_models

    monkeypatch.setattr(engine, "resolve_mode", lambda mode, device: (mode, []))  # fast / exact on the CPU
    config = EngineConfig(device=DEV, precision="fp16", attention=AttentionOptions("sparse-vsa"))
    models = random_models("tiny", 0)
    assert models.transformer.config.attention_head_dim == 16
    expected = "attention backend 'sparse-vsa' cannot run here: sparse-vsa needs a head dim >= 32 for the fast mode"
    with pytest.raises(FastRemoverError, match=expected) as info:
        engine.build(models, config.with_(mode="fast"))
    assert "\n" not in str(info.value) and "this model has 16 (--mode exact" in str(info.value)
    assert next(models.transformer.parameters()).dtype == torch.float32  # nothing was moved or cast
    engine.resolve(config.with_(mode="exact")).check_model(models.transformer.config)

    def no_work(*args, **kwargs):
        raise AssertionError("a mode ran before the refusal")

    monkeypatch.setattr(sparse_fidelity, "run_engine", no_work)
    monkeypatch.setattr(sparse_fidelity, "RemovalPipeline", no_work)
    with pytest.raises(FastRemoverError, match=expected):  # (no inputs are read before the checks)
        sparse_fidelity.sparse_fidelity(models, None, config, modes=["exact", "fast"], keeps=[1.0])


def test_auto_never_picks_a_sparse_backend():
    from fastremover.ops.attention import registry

    for mode in ("exact", "fast"):
        assert not registry.choose(mode, torch.device("cpu"))[0].startswith("sparse")


TINY_SPARSE = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=1, freq_dim=32)


def _tiny(dtype, seed=11, head_dim=16):
    from fastremover.models.loading import random_init_
    from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig

    config = RemoverTransformerConfig(**{**TINY_SPARSE, "attention_head_dim": head_dim})
    model = random_init_(RemoverTransformer(config), seed).eval()
    return model.to(DEV).to_inference_dtype(dtype)


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the kernel (GPU or interpreter)")
def test_fast_transformer_exact_mode_runs_sparse_attention_in_cube_order():
    """Exact mode, fp16, a 9 x 8 x 8 token grid (9 tiles of 64): sparse-vsa at keep 1.0 is the dense transformer up
    to rounding (tokens in cube order, every tile kept); keep 0.5 attends to fewer tiles and differs."""
    from fastremover.config import AttentionOptions
    from fastremover.fast.transformer_fast import FastTransformer

    model = _tiny(torch.float16)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1, 48, 9, 16, 16, generator=gen).to(DEV, torch.float16)
    outs = {}
    for name, keep in (("sdpa", None), ("sparse-vsa", 1.0), ("sparse-vsa", 0.5)):
        fast = FastTransformer(model, attention=name, use_triton=False,
                               attention_options=AttentionOptions(name, keep))
        cond = fast.conditioning(torch.tensor([700.0], device=DEV), batch=1)
        outs[keep] = fast.forward_step(x, cond, 0).float()
        if keep is not None:
            (layout,) = fast.token_layouts()
            assert layout["tiles"] == 9 and layout["density"] == pytest.approx(5 / 9 if keep < 1 else 1, abs=1e-3)
    dense = outs[None]
    scale = dense.abs().max()
    assert (outs[1.0] - dense).abs().max() / scale < 5e-3
    assert (outs[0.5] - dense).abs().max() / scale > 1e-2  # the mask mattered


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the kernel (GPU or interpreter)")
def test_fast_transformer_fast_mode_feeds_sparse_codes_to_the_fp8_o_projection():
    """Fast mode: the e4m3 codes path (K / V centred, static scales); sparse-sta with a window covering the whole grid
    is the same computation as a dense FP8 backend's (the test fake of cuDNN's contract: codes of o / sv) up to
    rounding and the token order."""
    from fastremover.config import AttentionOptions
    from fastremover.fast.transformer_fast import FastTransformer
    from helpers import attention_fakes

    model = _tiny(torch.float32, head_dim=32)  # the smallest head dim the kernel's FP8 dot compiles for
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(1, 48, 9, 8, 16, generator=gen).to(DEV)  # grid 9 x 4 x 8: 4 cubes + 2 edge cubes in 5 tiles
    with attention_fakes.registered("test-fp8-dense", codes_call=attention_fakes.fake_cudnn_codes, output="fp8-codes"):
        outs = {}
        for name, window in (("test-fp8-dense", None), ("sparse-sta", "9,9,9"), ("sparse-sta", "1,1,1")):
            fast = FastTransformer(model, linear_method="fp8-rowwise", attention=name, use_triton=False,
                                   attention_options=AttentionOptions(name, None, window))
            assert fast.fp8_attention_codes
            cond = fast.conditioning(torch.tensor([999.0], device=DEV), batch=1)
            outs[window] = [fast.forward_step(x, cond, 0).float()]  # (step 0 calibrates K's centre)
    for dense, full, diag in zip(outs[None], outs["9,9,9"], outs["1,1,1"]):
        scale = dense.abs().max()
        assert (full - dense).abs().max() / scale < 3e-2
        assert (diag - dense).abs().max() / scale > (full - dense).abs().max() / scale


def test_kernel_compiles_for_sm90_offline():
    """The kernel compiled for sm_90 with the bundled ptxas (no GPU): the e4m3 path builds with fp8 wgmma (QGMMA),
    TMA loads and no register spills (what the interpreter cannot show: e.g. a non-constexpr global). Subprocess:
    this one imported the kernels for the interpreter."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend (its bundled ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tool = TOOLS / "bench_sparse_attention.py"
    r = subprocess.run([sys.executable, str(tool), "--codegen", "--configs", "m64n64w4s3t1ws0vt1", "--dtypes", "fp8"],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas available for an offline sm_90 compile")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and len(rows) == 2, r.stdout[-2000:] + r.stderr[-2000:]
    for row in rows:
        assert row["QGMMA"] > 0 and row["UTMALDG"] > 0 and row["LDL/STL"] == 0, row


def test_the_kernels_shape_limits_are_the_sm90_compilers():
    """The wrapper's smallest head dim and BLOCK_N per input kind (what it and the registry accept) compile for sm_90
    offline, and one size below them Triton refuses (its tl.dot K limit: 32 for e4m3, 16 for 16 bits), what the
    interpreter never checks. Subprocess: this one imported the kernels for the interpreter."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    script = f"""
import json, sys
sys.path.insert(0, {str(TOOLS)!r})
from bench_sparse_attention import compile_sm90
from fastremover.fast.kernels import block_sparse_attention as bsa
for dtype in ("fp16", "fp8"):
    fp8 = dtype == "fp8"
    d, n = bsa.head_dims(fp8)[0], bsa.MIN_DOT_K[fp8]
    for D, N in ((d, n), (d // 2, 64), (d, n // 2)):
        try:
            compile_sm90(f"m64n{{N}}w4s2t0ws0vt{{int(fp8)}}", dtype, 64, grid=(2, 8, 8), head_dim=D)
            error = None
        except Exception as e:  # the CompilationError; the dot's assertion is in its chain of causes
            error, cause = [], e
            while cause is not None:
                error, cause = error + [str(cause)], cause.__cause__
        print(json.dumps({{"dtype": dtype, "D": D, "N": N, "error": error}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas available for an offline sm_90 compile")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and len(rows) == 6, r.stdout[-2000:] + r.stderr[-2000:]
    for row in rows:
        limit = 32 if row["dtype"] == "fp8" else 16
        if row["D"] >= limit and row["N"] >= limit:
            assert row["error"] is None, row
        else:
            assert row["error"] is not None and any(f"K >= {limit}" in e for e in row["error"]), row
    assert [(r["D"], r["N"]) for r in rows] == [(16, 16), (8, 64), (16, 8), (32, 32), (16, 64), (32, 16)]


# ----------------------------------------------------------------------------------------------------------------------
# GPU (the compiled kernel at the real shapes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=["fp16", "fp8"])
def test_gpu_kernel_matches_the_reference_at_w2(dtype):
    """W2's 32760 tokens, 12 heads x 128, VSA-style lists at keep 0.25 from the pooled scores, against the fp32
    reference."""
    from fastremover.ops.attention.sparse_layout import SparseLayout, SparseOptions

    m = bsa()
    gen = torch.Generator().manual_seed(20)
    layout = SparseLayout(W2_GRID, "cuda", SparseOptions("vsa-topk", 0.25))
    (q, k, v), scales = qkv((1, 32760, 12, 128), dtype, gen, scale=0.02)
    idx, cnt = layout.lists(q, k)
    out = m.block_sparse_attention(q, k, v, idx, cnt, tile_q=64, tile_k=64, scales=scales)
    ref = m.block_sparse_attention_reference(q, k, v, idx, cnt, tile_q=64, tile_k=64, scales=scales)
    bound = m.reference_bound(v, cnt, tile_q=64, tile_k=64, scales=scales)
    real = (lambda t: t.float() * scales[2]) if scales else (lambda t: t.float())
    assert ((real(out) - real(ref)).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [0.25, 1.0])
def test_gpu_codes_variants_stay_within_the_bound_at_w2(keep):
    """`chain_acc` and `lazy` at W2 (32760 tokens, 12 heads x 128): Hopper's FP8 accumulation inside the chain (~14
    bits per addition) and the conditional rescaling held to the bound, at keep 0.25 and with every tile (the most
    additions)."""
    from fastremover.ops.attention.sparse_layout import SparseLayout, SparseOptions

    m = bsa()
    gen = torch.Generator().manual_seed(22)
    layout = SparseLayout(W2_GRID, "cuda", SparseOptions("vsa-topk", keep))
    (q, k, v), scales = qkv((1, 32760, 12, 128), FP8, gen, scale=0.02)
    idx, cnt = layout.lists(q, k)
    # the variants against the eager-rescaling, separate-accumulation config (not config_for's, which the
    # environment may set to a variant)
    base = dataclasses.replace(m.config_for(64, 64, True), chain_acc=False, lazy=False, warp_spec=False)
    plain = m.block_sparse_attention(q, k, v, idx, cnt, tile_q=64, tile_k=64, scales=scales, config=base)
    ref = m.block_sparse_attention_reference(q, k, v, idx, cnt, tile_q=64, tile_k=64, scales=scales)
    for variant in ({"chain_acc": True}, {"lazy": True}, {"chain_acc": True, "lazy": True}):
        cfg = dataclasses.replace(base, **variant)
        out = m.block_sparse_attention(q, k, v, idx, cnt, tile_q=64, tile_k=64, scales=scales, config=cfg)
        bound = m.reference_bound(v, cnt, tile_q=64, tile_k=64, scales=scales, chain_acc=cfg.chain_acc)
        err = (out.float() - ref.float()).abs() * scales[2]
        assert (err <= bound).all(), (variant, f"max err / bound {(err / bound).max().item():.3f}")
        assert not torch.equal(out, plain), variant  # its own rounding: the variant ran


@pytest.mark.gpu
def test_gpu_keep_all_matches_sdpa_at_w2():
    m = bsa()
    gen = torch.Generator().manual_seed(21)
    (q, k, v), _ = qkv((1, 32760, 12, 128), torch.float16, gen)
    idx = torch.arange(512, dtype=torch.int32, device="cuda").expand(1, 12, 512, 512)
    cnt = torch.full((1, 12, 512), 512, dtype=torch.int32, device="cuda")
    out = m.block_sparse_attention(q, k, v, idx, cnt, tile_q=64, tile_k=64)
    dense = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    bound = 2 * m.reference_bound(v, cnt, tile_q=64, tile_k=64)  # both sides round p and o
    assert ((out.float() - dense.float()).abs() <= bound).all()


@pytest.mark.gpu
def test_gpu_selection_and_kernel_capture_in_a_cuda_graph(graph_replays_new_inputs):
    """The VSA selection and the kernel in one captured graph: the replay reads the new q and equals an eager call."""
    from fastremover.ops.attention.sparse_layout import SparseLayout, SparseOptions

    m = bsa()
    layout = SparseLayout((21, 16, 16), "cuda", SparseOptions("vsa-topk", 0.25))
    gen = torch.Generator().manual_seed(22)
    (q, k, v), scales = qkv((1, 21 * 256, 12, 128), FP8, gen)

    def fn(q16, k16, v16):
        q8, k8, v8 = (t.to(FP8) for t in (q16, k16, v16))
        idx, cnt = layout.lists(q8, k8)
        return m.block_sparse_attention(q8, k8, v8, idx, cnt, tile_q=64, tile_k=64, scales=scales)

    q16, k16, v16 = (t.to(torch.float16) for t in (q, k, v))
    replayed = graph_replays_new_inputs(fn, q16, k16, v16)
    assert torch.equal(replayed, fn(q16, k16, v16))


@pytest.mark.gpu
def test_gpu_verify_reports_psnr_per_keep_rate(tmp_path, capsys, monkeypatch):
    """`verify --attention-keeps` end to end on a tiny random model: one row per (mode, keep) with PSNR against the
    same mode's dense run (token grid 5 x 16 x 16: 20 tiles); keep 1.0 (every tile) is closer to dense than 0.25.
    The tiny preset with head dim 32, the smallest the fast mode's FP8 kernel compiles for (tiny's 16 is refused)."""
    import json

    from fastremover.cli import main
    from fastremover.models import loading

    tiny = loading.PRESETS["tiny"]
    monkeypatch.setitem(loading.PRESETS, "tiny-hd32", {**tiny, "transformer": {**tiny["transformer"],
                                                                                "attention_head_dim": 32}})

    assert main(["demo", "-o", str(tmp_path / "d"), "--frames", "17", "--width", "256", "--height", "256",
                 "--quiet"]) == 0
    out = tmp_path / "sparse.json"
    rc = main(["verify", str(tmp_path / "d" / "input.mp4"), "--mask", str(tmp_path / "d" / "mask.mp4"), "--model",
               "random", "--preset", "tiny-hd32", "--steps", "2", "--modes", "exact,fast", "--attention", "sparse-vsa",
               "--attention-keeps", "1,0.25", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["keep"]) for r in rows] == [("exact", 1.0), ("exact", 0.25), ("fast", 1.0), ("fast", 0.25)]
    for full, quarter in (rows[:2], rows[2:]):
        assert full["attention"] == "sparse-vsa" and full["kept_fraction"] == 1.0
        assert full["psnr_mean_db"] > quarter["psnr_mean_db"]
