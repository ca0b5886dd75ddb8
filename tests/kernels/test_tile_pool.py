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
                                            (130, 32, True)])
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
    if extreme:  # the bound of the exactness argument: sums of 64 values of 448 in magnitude
        assert want.max() >= 400 and got.max() <= 448


def test_tile_means_refuse_what_the_bound_does_not_cover():
    from fastremover.fast.kernels.tile_pool import available, tile_means_fp8

    x = random_codes((1, 128, 2, 32), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="tile must be a power of two <= 64"):
        tile_means_fp8(x, 128)
    with pytest.raises(ValueError, match="tile must be a power of two"):
        tile_means_fp8(x, 48)
    with pytest.raises(ValueError, match="D must be a power of two"):
        tile_means_fp8(random_codes((1, 128, 2, 48), torch.Generator().manual_seed(0)), 64)
    with pytest.raises(ValueError, match="dtype"):
        tile_means_fp8(x.to(torch.float16), 64)
    assert not available(x, 128) and not available(x.to(torch.float16), 64)


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
        assert torch.equal(tile_means_fp8(x, 64), sl.tile_means_torch(x, 64))
    layout = sl.SparseLayout((21, 30, 52), "cuda", sl.SparseOptions("vsa-topk", 0.25))
    scores = torch.einsum("bqhd,bkhd->bhqk", sl.tile_means(q, 64), sl.tile_means(k, 64))
    keys = sl.ordered_keys(scores.masked_fill(layout._forced, float("inf")))
    assert torch.equal(sl.top_indices(keys, layout.count, "topk"), sl.top_indices(keys, layout.count, "sort"))
