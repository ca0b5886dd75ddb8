"""Tile-sparse attention on cuDNN's paged FP8 SDPA (fastremover/ops/attention/cudnn_sparse.py, the `sparse-*-cudnn`
backends).

On the CPU: the page tables, sequence lengths and ragged offsets read through an emulation of cuDNN's paged
addressing (tests/helpers/attention_fakes.emulate_paged) give the masked reference's attention for every list kind,
short last tiles included; the padded-storage contract; the fast transformer allocating its code buffers to whole
tiles for such a backend; the registry's refusals. `gpu`: cuDNN itself against the reference within the Triton
kernel's codes bound, dense bits at keep 1.0, determinism and CUDA-graph capture."""

import math

import pytest
import torch

from fastremover.errors import FastRemoverError
from fastremover.ops.attention import cudnn_sparse
from helpers import attention_fakes

FP8 = torch.float8_e4m3fn


def _layout(grid, source, keep, cube=(4, 4, 8), device="cpu", window=None):
    from fastremover.ops.attention.sparse_layout import SparseLayout, SparseOptions

    return SparseLayout(grid, device, SparseOptions(source, keep, window, cube))


def _random_lists(H, nt, density, gen):
    """Ascending lists with each row's own tile, padded past the count with nt (as select_tiles pads)."""
    mask = torch.rand(1, H, nt, nt, generator=gen) < density
    mask[..., torch.arange(nt), torch.arange(nt)] = True
    cnt = mask.sum(-1).int()
    order = torch.sort(torch.where(mask, torch.arange(nt), nt + torch.arange(nt)), dim=-1).values
    return torch.where(order >= nt, torch.full_like(order, nt), order).int(), cnt


def _reference(q, k, v, idx, cnt, tile):
    from fastremover.fast.kernels.block_sparse_attention import block_sparse_attention_reference

    return block_sparse_attention_reference(q, k, v, idx, cnt, tile_q=tile, tile_k=tile).float()


@pytest.mark.parametrize("grid", [(9, 16, 16), (9, 16, 15), (5, 6, 11)])
@pytest.mark.parametrize("lists", ["vsa", "sta", "random"])
def test_the_tables_address_exactly_the_listed_tiles(grid, lists):
    """Emulating cuDNN's paged read with the tables gives the masked reference attention (fp32) for VSA, STA and
    random lists, at grids whose last tile is whole (2304 tokens) or short (2160, 330): every query row reads its
    own tokens and exactly the keys of its listed tiles (no missing key of the short tile, no padding key)."""
    gen = torch.Generator().manual_seed(sum(grid))
    S, H, D = math.prod(grid), 3, 16
    tile = 128
    nt = -(-S // tile)
    q, k, v = (torch.randn(1, S, H, D, generator=gen) for _ in range(3))
    if lists == "random":
        idx, cnt = _random_lists(H, nt, 0.3, gen)
    else:
        layout = _layout(grid, {"vsa": "vsa-topk", "sta": "sta"}[lists], 0.25, window=(2, 2, 2) if lists == "sta"
                         else None)
        assert layout.tile == tile
        idx, cnt = layout.lists(q, k)
    last = torch.gather(idx.long(), 3, (cnt.long() - 1).unsqueeze(-1)).squeeze(-1)
    if S % tile:
        assert (last == nt - 1).any(), "no row lists the short last tile: the case is not tested"
    page, seq_kv = cudnn_sparse.page_tables(idx, cnt, S, tile)
    seq_q, offsets = cudnn_sparse.seq_q_and_offsets(S, H, D, tile, "cpu")
    assert page.shape == (H * nt, 1, idx.shape[-1], 1) and page.dtype == torch.int32
    padded = [cudnn_sparse.padded_codes(t, tile) for t in (q, k, v)]
    out = attention_fakes.emulate_paged(*padded, page, seq_q, seq_kv, offsets, tile)
    # the reference takes lists padded with a real tile (the kernel's contract): pad with each row's last entry
    pad = torch.arange(idx.shape[-1]) >= cnt.unsqueeze(-1)
    ref_lists = torch.where(pad, last.unsqueeze(-1).to(idx.dtype), idx)
    ref = _reference(q, k, v, ref_lists, cnt, tile)
    assert not out.isnan().any()  # every token of every head written once
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_the_tables_need_the_padded_storage():
    """The paged read of a short last tile goes past S: with codes of exactly S rows the emulation (as cuDNN would)
    reads out of the storage, which as_strided refuses; the real entry refuses such inputs with one line."""
    grid, tile = (9, 16, 15), 128
    S, H, D = math.prod(grid), 2, 16
    q = torch.randn(1, S, H, D)
    idx, cnt = _layout(grid, "vsa-topk", 1.0).lists(q, q)
    page, seq_kv = cudnn_sparse.page_tables(idx, cnt, S, tile)
    seq_q, offsets = cudnn_sparse.seq_q_and_offsets(S, H, D, tile, "cpu")
    with pytest.raises(RuntimeError, match="out of bounds"):
        attention_fakes.emulate_paged(q, q, q, page, seq_q, seq_kv, offsets, tile)
    # whole tiles, but V's padding rows NaN (uninitialized e4m3 codes can be): the masked keys' P = 0 times NaN
    padded = [cudnn_sparse.padded_codes(q, tile) for _ in range(3)]
    assert padded[2].untyped_storage().nbytes() == 2176 * H * D * 4
    torch.zeros(0).set_(padded[2].untyped_storage()).view(2176, H, D)[S:] = float("nan")
    assert attention_fakes.emulate_paged(*padded, page, seq_q, seq_kv, offsets, tile).isnan().any()
    codes = q.to(FP8)
    one = torch.ones(1)
    with pytest.raises(ValueError, match=r"storage holds 2160 rows; the kernel reads 2176 \(whole tiles\)"):
        cudnn_sparse.tile_sparse_fp8(codes, codes, codes, one, one, one, idx, cnt, tile)
    padded = cudnn_sparse.padded_codes(codes, tile)
    with pytest.raises(ValueError, match="CUDA"):  # the storage passes; this CPU has no cuDNN
        cudnn_sparse.tile_sparse_fp8(padded, padded, padded, one, one, one, idx, cnt, tile)
    two = torch.zeros(2, 2176, H, D).to(FP8)[:, :S]
    with pytest.raises(ValueError, match="one batch only"):
        cudnn_sparse.tile_sparse_fp8(two, two, two, one, one, one, idx, cnt, tile)


def test_offsets_are_int32_and_refuse_what_overflows():
    seq_q, offsets = cudnn_sparse.seq_q_and_offsets(32760, 12, 128, 128, "cpu")
    assert seq_q.shape == (12 * 256, 1, 1, 1) and int(seq_q.view(12, 256)[0, -1]) == 32760 - 255 * 128
    assert offsets.dtype == torch.int32 and int(offsets[-1]) == 256 * 128 * 12 * 128
    assert int(offsets[1]) == 128 * 12 * 128 and int(offsets[256]) == 128  # entry (0, 1): head 1 of tile 0
    with pytest.raises(ValueError, match="exceed int32 offsets"):
        cudnn_sparse.seq_q_and_offsets(1_400_000, 12, 128, 128, "cpu")


def test_the_fast_transformer_hands_a_code_rows_backend_whole_tiles():
    """Fast mode, fp32 tiny model, a 9 x 4 x 10 grid (tiles of 64: the last one short): a backend with `code_rows`
    (the emulated cuDNN contract) gets q/k/v codes in storages of whole tiles and agrees with the Triton kernel's
    sparse-sta on the same window; the same fake without `code_rows` gets exact-length storages, which the paged
    read cannot take."""
    from fastremover.config import AttentionOptions
    from fastremover.fast.transformer_fast import FastTransformer
    from fastremover.models.loading import random_init_
    from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
    from fastremover.ops.attention import sparse

    config = RemoverTransformerConfig(num_attention_heads=2, attention_head_dim=32, ffn_dim=64, num_layers=1,
                                      freq_dim=32)
    model = random_init_(RemoverTransformer(config), 5).eval()
    x = torch.randn(1, 48, 9, 8, 20, generator=torch.Generator().manual_seed(6))  # grid 9 x 4 x 10: 360 tokens
    seen = []

    def codes(q8, k8, v8, sq, sk, sv, out_dtype=None, *, layout=None):
        width = q8.shape[2] * q8.shape[3]
        seen.append(q8.untyped_storage().nbytes() // width)
        for t in (q8, k8, v8):  # the padding rows are zero (garbage could be an e4m3 NaN)
            pad = torch.empty(0, dtype=FP8).set_(t.untyped_storage())[t.shape[1] * width:]
            assert (pad.float() == 0).all()
        return attention_fakes.fake_paged_codes(q8, k8, v8, sq, sk, sv, layout=layout)

    layout = sparse._layout_for("sta")
    outs = {}
    with attention_fakes.registered("test-paged", codes_call=codes, output="fp8-codes", token_layout=layout,
                                    code_rows=sparse.code_rows):
        for name in ("test-paged", "sparse-sta"):
            fast = FastTransformer(model, linear_method="fp8-rowwise", attention=name, use_triton=False,
                                   attention_options=AttentionOptions(name, None, "1,1,2"))
            cond = fast.conditioning(torch.tensor([999.0]), batch=1)
            outs[name] = fast.forward_step(x, cond, 0).float()
    assert seen and set(seen) == {384}  # 360 tokens in tiles of 64
    scale = outs["sparse-sta"].abs().max()
    assert (outs["test-paged"] - outs["sparse-sta"]).abs().max() / scale < 3e-2
    with attention_fakes.registered("test-paged-unpadded", codes_call=codes, output="fp8-codes",
                                    token_layout=layout):
        fast = FastTransformer(model, linear_method="fp8-rowwise", attention="test-paged-unpadded",
                               use_triton=False, attention_options=AttentionOptions("test-paged-unpadded", None))
        cond = fast.conditioning(torch.tensor([999.0]), batch=1)
        with pytest.raises(RuntimeError, match="out of bounds"):
            fast.forward_step(x, cond, 0)


def test_the_cudnn_backends_are_fast_mode_only_and_refuse_the_cpu():
    from fastremover.ops.attention import registry, sparse

    cpu = torch.device("cpu")
    for name in ("sparse-vsa-cudnn", "sparse-sta-cudnn"):
        with pytest.raises(FastRemoverError, match="needs a CUDA GPU"):
            registry.runnable(name, cpu)
        with pytest.raises(FastRemoverError, match="not available in the exact mode .*; use --mode fast$"):
            registry.resolve(name, "exact", cpu)
        assert registry.get(name).code_rows is not None
        sparse.check_options(name, 0.25, None)
    sparse.check_options("sparse-sta-cudnn", 0.25, "2,2,2")
    with pytest.raises(FastRemoverError, match="--attention-window applies to"):
        sparse.check_options("sparse-vsa-cudnn", None, "2,2,2")
    assert sparse.cudnn_validate(cpu, dtype=torch.float16) == ["sparse attention (cuDNN) needs a CUDA GPU "
                                                               "(cuDNN's FP8 attention)"]
    layout = registry.get("sparse-vsa-cudnn").token_layout((21, 30, 52), cpu)
    assert layout.tile == 128 and registry.get("sparse-vsa").token_layout((21, 30, 52), cpu).tile == 64


# ----------------------------------------------------------------------------------------------------------------------
# GPU


def _codes(grid, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    S, H, D = math.prod(grid), 12, 128
    x = [torch.randn(1, S, H, D, device="cuda", generator=gen) for _ in range(3)]
    x[1] = x[1] - x[1].mean(1, keepdim=True)
    x[2] = x[2] - x[2].mean(1, keepdim=True) + 0.3
    scales = tuple((t.abs().amax() / 448).reshape(1) for t in x)
    return [(t / s).to(FP8) for t, s in zip(x, scales)], scales


@pytest.mark.gpu
@pytest.mark.parametrize("grid", [(9, 16, 16), (9, 16, 15)])
@pytest.mark.parametrize("keep", [1.0, 0.25])
def test_gpu_tile_sparse_fp8_within_the_codes_bound(grid, keep):
    from fastremover.fast.kernels import block_sparse_attention as bsa
    from fastremover.ops.attention.cudnn_fp8 import sdpa_fp8

    if cudnn_sparse.supported(torch.device("cuda")) is not None:
        pytest.skip(f"cuDNN's paged FP8 attention does not run here: {cudnn_sparse.supported(torch.device('cuda'))}")
    (q, k, v), scales = _codes(grid, 3)
    S = q.shape[1]
    idx, cnt = _layout(grid, "vsa-topk", keep, device="cuda").lists(q, k)
    padded = [cudnn_sparse.padded_codes(t, 128) for t in (q, k, v)]
    out = cudnn_sparse.tile_sparse_fp8(*padded, *scales, idx, cnt, 128)
    again = cudnn_sparse.tile_sparse_fp8(*padded, *scales, idx, cnt, 128)
    assert out.shape == (1, S, 12, 128) and torch.equal(out, again)
    ref = bsa.block_sparse_attention_reference(q, k, v, idx, cnt, tile_q=128, tile_k=128, scales=scales)
    bound = bsa.reference_bound(v, cnt, tile_q=128, tile_k=128, scales=scales, chain_acc=True)
    err = (out.float() * scales[2] - ref.float() * scales[2]).abs()
    assert (err <= bound).all(), float((err / bound).max())
    if keep == 1.0:  # every tile kept: dense cuDNN's bits
        assert torch.equal(out, sdpa_fp8(q, k, v, *scales))


@pytest.mark.gpu
def test_gpu_tile_sparse_fp8_is_captured_in_a_cuda_graph():
    if cudnn_sparse.supported(torch.device("cuda")) is not None:
        pytest.skip("cuDNN's paged FP8 attention does not run here")
    grid = (9, 16, 15)
    (q, k, v), scales = _codes(grid, 4)
    layout = _layout(grid, "vsa-topk", 0.25, device="cuda")
    padded = [cudnn_sparse.padded_codes(t, 128) for t in (q, k, v)]

    def run():
        idx, cnt = layout.lists(padded[0], padded[1])
        return cudnn_sparse.tile_sparse_fp8(*padded, *scales, idx, cnt, 128)

    from fastremover.timing import capture_graph

    eager = run()
    graph, captured = capture_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
