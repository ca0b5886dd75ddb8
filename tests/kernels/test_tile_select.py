"""VSA's tile selection in one pass (fastremover/fast/kernels/tile_select.py): the same lists as the torch path
(sparse_layout.select_tiles_torch), torch.equal, including ties, forced tiles, +-inf and NaN scores and short rows.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before the kernel module is
imported); the `gpu` tests run the compiled kernel at W2's and W3's tile counts and inside a CUDA graph."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"


def case(B, H, NQ, NK, width, gen, ties=False, specials=False, device=DEV):
    if ties:  # few distinct values: ties everywhere, broken by the lower index
        scores = torch.randint(-3, 4, (B, H, NQ, NK), generator=gen).float() / 4
    else:
        scores = torch.randn((B, H, NQ, NK), generator=gen)
    if specials:
        flat = scores.view(-1)
        pick = torch.randperm(flat.numel(), generator=gen)[:12]
        flat[pick[:3]] = float("inf")
        flat[pick[3:6]] = float("-inf")
        flat[pick[6:9]] = float("nan")
        flat[pick[9:]] = -0.0
    forced = torch.rand((NQ, NK), generator=gen) < 2.0 / NK
    forced[:, 0] = True  # at least one forced tile per row
    low = forced.sum(1).clamp(max=width)
    counts = (low + (torch.rand(NQ, generator=gen) * (width - low + 1)).long()).clamp(1, width).to(torch.int32)
    return scores.to(device), forced.to(device), counts.to(device)


@pytest.mark.parametrize("B,H,NQ,NK,width,ties,specials", [
    (1, 2, 7, 37, 9, False, False),
    (2, 3, 5, 64, 64, True, False),   # width = NK: every tile may be kept
    (1, 1, 9, 100, 1, True, True),    # one tile per row
    (1, 2, 4, 130, 40, False, True),  # NK just above a power of two
    (1, 1, 3, 1, 1, False, False),    # one key tile
])
def test_selection_equals_the_torch_path(B, H, NQ, NK, width, ties, specials):
    from fastremover.fast.kernels.tile_select import select_tiles
    from fastremover.ops.attention.sparse_layout import select_tiles_torch

    gen = torch.Generator().manual_seed(NK * 7 + width)
    scores, forced, counts = case(B, H, NQ, NK, width, gen, ties, specials)
    got = select_tiles(scores, forced, counts, width)
    want = select_tiles_torch(scores.cpu(), forced.cpu(), counts.cpu(), width)
    assert got.shape == (B, H, NQ, width) and got.dtype == torch.int32
    assert torch.equal(got.cpu(), want)
    # what the lists mean: counts[i] distinct ascending tiles that include every forced one, then NK
    flat = got.cpu().reshape(-1, NQ, width)
    for i, c in enumerate(counts.cpu().tolist()):
        kept = flat[:, i, :c]
        assert (kept[:, 1:] > kept[:, :-1]).all() and (flat[:, i, c:] == NK).all()
        must = forced[i].cpu().nonzero().flatten()
        if len(must) <= c:
            assert all(set(must.tolist()) <= set(r.tolist()) for r in kept)


def test_selection_refuses_what_it_does_not_cover():
    from fastremover.fast.kernels.tile_select import MAX_TILES, available, select_tiles

    gen = torch.Generator().manual_seed(0)
    scores, forced, counts = case(1, 1, 4, 16, 4, gen)
    with pytest.raises(ValueError, match="width must be in"):
        select_tiles(scores, forced, counts, 17)
    with pytest.raises(ValueError, match="contiguous"):
        select_tiles(scores.transpose(2, 3).contiguous().transpose(2, 3), forced, counts, 4)
    with pytest.raises(ValueError, match="forced must have shape"):
        select_tiles(scores, forced[:, :8], counts, 4)
    with pytest.raises(ValueError, match="dtype"):
        select_tiles(scores.half(), forced, counts, 4)
    wide = torch.zeros((1, 1, 1, MAX_TILES + 1), device=DEV)
    assert not available(wide, 4) and available(scores, 4)


def test_vsa_lists_use_the_same_selection_on_every_path():
    """The layout's lists (the kernel where it runs, else torch) equal the torch selection of the same scores."""
    from fastremover.ops.attention import sparse_layout as sl

    gen = torch.Generator().manual_seed(5)
    layout = sl.SparseLayout((3, 8, 12), DEV, sl.SparseOptions("vsa-topk", 0.3))
    S = layout.order.tokens
    q, k = (torch.randn((1, S, 2, 32), generator=gen).to(DEV) for _ in range(2))
    idx, _ = layout.lists(q, k)
    scores = torch.einsum("bqhd,bkhd->bhqk", sl.tile_means(q, layout.tile), sl.tile_means(k, layout.tile))
    want = sl.select_tiles_torch(scores, layout._forced, layout._cnt[0, 0], layout.count)
    assert torch.equal(idx, want)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", [(21, 30, 52), (21, 45, 80)], ids=["w2", "w3"])
def test_gpu_selection_at_real_tile_counts_equals_the_torch_path_and_captures(grid):
    if INTERPRET:
        pytest.skip("needs a CUDA GPU (this process runs the interpreter)")
    from fastremover.fast.kernels.tile_select import select_tiles
    from fastremover.ops.attention import sparse_layout as sl

    layout = sl.SparseLayout(grid, "cuda", sl.SparseOptions("vsa-topk", 0.25))
    n = layout.order.n_tiles
    gen = torch.Generator().manual_seed(n)
    scores = torch.randn((1, 12, n, n), generator=gen).cuda()
    src = scores[..., 3::7].clone()
    scores[..., : 7 * src.shape[-1] : 7] = src  # some exact ties (column 7j takes column 7j + 3's scores)
    counts, forced = layout._cnt[0, 0], layout._forced
    want = sl.select_tiles_torch(scores, forced, counts, layout.count)
    assert torch.equal(select_tiles(scores, forced, counts, layout.count), want)
    out = select_tiles(scores, forced, counts, layout.count)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_tiles(scores, forced, counts, layout.count)
    scores.copy_(torch.randn(scores.shape, generator=gen).cuda())
    graph.replay()
    assert torch.equal(out, sl.select_tiles_torch(scores, forced, counts, layout.count))
