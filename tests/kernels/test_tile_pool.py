"""VSA's coarse pooling of e4m3 codes in one kernel (fastremover/fast/kernels/tile_pool.py) and the top-k methods of
its selection (sparse_layout.top_indices): both give exactly the torch path's results (torch.equal).

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before the kernel module is
imported); the `gpu` test runs the compiled kernel at W2's shape."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
FP8 = torch.float8_e4m3fn


def random_codes(shape, gen, device=DEV, extreme=False) -> torch.Tensor:
    """Finite e4m3 codes (NaN codes 0x7f / 0xff excluded); `extreme`: positive, mostly 448 with the rest down to
    the smallest subnormal 2^-9 (sums near 64 * 448 that need all of fp32's 24 bits)."""
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    bits = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits)
    if extreme:
        bits = torch.where(torch.rand(shape, generator=gen) < 0.9, 0x7E, bits & 0x7F)
        bits = torch.where(bits == 0x7F, 0x01, bits)
    return bits.to(torch.uint8).view(FP8).to(device)


@pytest.mark.parametrize("S,tile,extreme", [(200, 64, False), (256, 64, True), (77, 16, False), (5, 64, False),
                                            (130, 32, True), (300, 128, False), (256, 128, True), (200, 128, True)])
def test_tile_means_of_codes_equal_the_torch_path(S, tile, extreme):
    from fastremover.fast.kernels.tile_pool import tile_means_fp8
    from fastremover.ops.attention.sparse_layout import tile_means_torch

    gen = torch.Generator().manual_seed(S * tile)
    B, H, D = 2, 3, 32
    wide = random_codes((B, S, 2 * H, D), gen, extreme=extreme)
    x = wide[:, :, H:]  # a view with the strides of one of q / k / v in a fused qkv
    got = tile_means_fp8(x, tile)
    want = tile_means_torch(x.cpu(), tile)
    assert got.shape == (B, -(-S // tile), H, D)
    assert torch.equal(got.cpu(), want)
    if extreme:  # the bound of the exactness argument: sums of 64 (128) values of 448 in magnitude
        assert want.max() >= 400 and got.max() <= 448


def test_tile_means_of_128_codes_round_their_exact_sum_once():
    """Tiles of 128 codes, most of them 448 and a few small ones: the exact sums need more than fp32's 24 bits, and
    torch's fp32 reduction of such a tile rounds differently from the exact sum's one rounding (searched for below).
    The kernel (an exact int32 sum) and the torch path (fp64) both give that one rounding, divided by 128."""
    from fastremover.fast.kernels.tile_pool import tile_means_fp8
    from fastremover.ops.attention.sparse_layout import tile_means_torch

    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(400):
        x = torch.full((128,), 448.0)
        k = int(torch.randint(1, 60, (1,), generator=gen))
        small = torch.tensor([2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -8])[torch.randint(0, 3, (k,), generator=gen)]
        x[torch.randperm(128, generator=gen)[:k]] = small
        exact = x.double().sum().float()
        if x.sum(dtype=torch.float32) != exact:  # fp32 reduction order matters for this tile
            rows.append(x)
        if len(rows) == 8:
            break
    assert len(rows) == 8
    x = torch.stack(rows).T.reshape(1, 128, 8, 1).expand(1, 128, 8, 16).to(FP8)  # 8 heads, one tile each
    want = (torch.stack(rows).double().sum(1).float() / 128).view(1, 1, 8, 1).expand(1, 1, 8, 16)
    assert torch.equal(tile_means_torch(x, 128), want)
    assert torch.equal(tile_means_fp8(x.contiguous().to(DEV), 128).cpu(), want)


def test_tile_means_refuse_what_the_bound_does_not_cover():
    from fastremover.fast.kernels.tile_pool import available, tile_means_fp8

    x = random_codes((1, 256, 2, 32), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="tile must be a power of two <= 128"):
        tile_means_fp8(x, 256)
    with pytest.raises(ValueError, match="tile must be a power of two"):
        tile_means_fp8(x, 48)
    with pytest.raises(ValueError, match="D must be a power of two"):
        tile_means_fp8(random_codes((1, 128, 2, 48), torch.Generator().manual_seed(0)), 64)
    with pytest.raises(ValueError, match="dtype"):
        tile_means_fp8(x.to(torch.float16), 64)
    assert not available(x, 256) and not available(x.to(torch.float16), 64) and available(x, 128) == (
        x.is_cuda or INTERPRET)


def test_top_index_methods_agree_on_ties():
    """"sort" gives topk's indices in topk's order for distinct keys, also where many scores tie (equal tiles)."""
    from fastremover.ops.attention.sparse_layout import ordered_keys, top_indices

    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(-3, 4, (2, 3, 40, 96), generator=gen).float() / 4  # 7 values: ties everywhere
    scores[..., :5] = float("inf")  # forced tiles
    keys = ordered_keys(scores)
    for width in (1, 7, 24, 96):
        a, b = top_indices(keys, width, "topk"), top_indices(keys, width, "sort")
        assert torch.equal(a, b), width
    with pytest.raises(ValueError, match="unknown top-k method"):
        top_indices(keys, 3, "heap")


@pytest.mark.gpu
def test_gpu_tile_means_and_selection_at_w2_equal_the_torch_path():
    if INTERPRET:
        pytest.skip("needs a CUDA GPU (this process runs the interpreter)")
    from fastremover.fast.kernels.tile_pool import tile_means_fp8
    from fastremover.ops.attention import sparse_layout as sl

    gen = torch.Generator().manual_seed(2)
    S, H, D = 21 * 30 * 52, 12, 128
    qkv = random_codes((1, S, 3 * H, D), gen, device="cuda")
    q, k = qkv[:, :, :H], qkv[:, :, H:2 * H]
    for x in (q, k):
        for tile in (64, 128):
            assert torch.equal(tile_means_fp8(x, tile), sl.tile_means_torch(x, tile))
    layout = sl.SparseLayout((21, 30, 52), "cuda", sl.SparseOptions("vsa-topk", 0.25))
    scores = torch.einsum("bqhd,bkhd->bhqk", sl.tile_means(q, 64), sl.tile_means(k, 64))
    keys = sl.ordered_keys(scores.masked_fill(layout._forced, float("inf")))
    assert torch.equal(sl.top_indices(keys, layout.count, "topk"), sl.top_indices(keys, layout.count, "sort"))
