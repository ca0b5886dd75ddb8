"""Cube order and tile masks for the sparse attention backends (sparse.py): which key tiles each query tile sees.

Cube order. The DiT's tokens (after patchify: latent frames x rows x columns, f-major) are reordered so that every
4 x 4 x 4 cube of the grid is contiguous. Partial cubes at the edges are handled EXACTLY, without padding: the full
cubes come first (in (t, h, w) cube order), then the partial ones (same order), packed back to back. A tile is a
run of `tile = 64` consecutive tokens of that order: a full cube, or a pack of neighbouring partial cubes (W2's grid
21 x 30 x 52: 455 full cubes, then 3640 edge tokens in 57 tiles, the last one 56 tokens long; nothing computed
twice, nothing padded). FastVideo pads each partial cube to 64 slots instead, which at W2 is 22 % more tokens
(6 x 8 x 13 cubes of 64 for 32760 tokens), paid in every tile pass. A tile's geometry is the set of cubes it holds
(one for a full cube, up to eight for a pack of edge cubes); the masks below are defined on cubes: a key tile is kept
for a query tile when one of its cubes lies in the window of one of the query tile's cubes.
The permutation is applied once per transformer call: everything in a DiT block except the attention is row-wise
(norms, linears, the per-token RoPE), so the residual stream runs in cube order from the patch embedding to the
output projection, with RoPE's tables permuted the same way (qk_norm_rope reads table row s for token s, so
permuting rows of x and of the tables together permutes its output exactly: tests/kernels/test_sparse_attention.py checks
torch.equal). Cost: one gather of the patch embedding's output (which replaces the copy it already made) and one of
the output projection's (B, S, 64) result per transformer call, none per layer.

Mask sources (lists sorted ascending, as fastremover.fast.kernels.block_sparse_attention requires):
  * `sta`: a static window of W_t x W_h x W_w tiles around each query tile (Sliding Tile Attention): per axis the
    window covers (W - 1) // 2 cubes before the query cube and W // 2 after, shifted inward at the grid's edges so
    it keeps its width (NATTEN / STA's clamped window). Built once per grid on the host, the same for every batch
    and head.
  * `vsa-topk` (VSA's coarse stage): q and k mean-pooled per tile (fp32), coarse scores q_tile . k_tile per (batch,
    head), and the top `keep` fraction of key tiles per query tile, which always includes the query's own tile and
    its temporal neighbours (the cubes at the same (h, w) one cube earlier and later). All on the device with torch
    ops, no host sync (graph-capturable). Ties are impossible by construction: each score's float bits are mapped to
    an order-preserving integer and extended with the reversed key index, so the keys are distinct int64 values and
    the top-k SET is unique (the lower index wins between equal scores); the kept indices are then sorted. `keep`
    counts the forced tiles: query tile i keeps max(ceil(keep * NK), its forced tiles) key tiles (a pack of edge
    cubes has more neighbours than a full cube; each row's count goes to the kernel).
"""

from __future__ import annotations

import importlib
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

CUBE = (4, 4, 4)


class CubeOrder:
    """The cube-order permutation of a (T, H, W) token grid and which cubes each tile holds (see the module
    docstring).

    perm[i] = the original (f-major) index of the token at cube-order position i; inverse = its inverse. Both are
    int64 tensors on `device`. Host (numpy): `cubes` [NC, 3] each cube's coordinates (partial ones included),
    `incidence` [NT, NC] bool (tile t holds tokens of cube c), `cube_grid` cubes per axis."""

    def __init__(self, grid: tuple[int, int, int], cube: tuple[int, int, int] = CUBE, device="cpu"):
        grid = tuple(int(g) for g in grid)
        cube = tuple(int(c) for c in cube)
        if len(grid) != 3 or min(grid) < 1:
            raise ValueError(f"token grid must be 3 positive sizes (frames, rows, columns), got {grid}")
        if len(cube) != 3 or min(cube) < 1:
            raise ValueError(f"cube must be 3 positive sizes, got {cube}")
        self.grid, self.cube = grid, cube
        self.tile = math.prod(cube)
        self.tokens = math.prod(grid)
        self.cube_grid = tuple(-(-g // c) for g, c in zip(grid, cube))
        t, h, w = np.meshgrid(*(np.arange(g) for g in grid), indexing="ij")
        coords = [a.reshape(-1) for a in (t, h, w)]
        cubes = [a // c for a, c in zip(coords, cube)]
        inner = [a % c for a, c in zip(coords, cube)]
        partial = np.zeros(self.tokens, dtype=bool)
        for a, g, c in zip(cubes, grid, cube):
            partial |= a >= g // c  # this axis' last cube is short
        # lexsort: the last key is the primary one
        perm = np.lexsort((inner[2], inner[1], inner[0], cubes[2], cubes[1], cubes[0], partial))
        self.perm_host = perm
        nt, nh, nw = self.cube_grid
        cube_id = ((cubes[0] * nh + cubes[1]) * nw + cubes[2])[perm]  # each position's cube
        self.cubes = np.stack(np.unravel_index(np.arange(nt * nh * nw), self.cube_grid), axis=1)
        self.n_tiles = -(-self.tokens // self.tile)
        self.incidence = np.zeros((self.n_tiles, nt * nh * nw), dtype=bool)
        self.incidence[np.arange(self.tokens) // self.tile, cube_id] = True
        self.full_cubes = int((~partial).sum()) // self.tile
        device = torch.device(device)
        self.perm = torch.from_numpy(perm).to(device)
        self.inverse = torch.from_numpy(np.argsort(perm)).to(device)

    def permute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Tokens along `dim` from grid order to cube order (a new tensor)."""
        return x.index_select(dim, self.perm)

    def restore(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Tokens along `dim` from cube order back to grid order (a new tensor)."""
        return x.index_select(dim, self.inverse)


def window_mask(order: CubeOrder, before, after, clamp: bool) -> np.ndarray:
    """[NT, NT] bool: query tile i keeps key tile j when a cube of j lies in the window of a cube of i: per axis
    before[a] cubes below the query cube to after[a] above (clamp: shifted inward at the grid's edges, keeping its
    width)."""
    cubes = order.cubes
    keep = np.ones((len(cubes), len(cubes)), dtype=bool)
    for axis in range(3):
        n = order.cube_grid[axis]
        c = cubes[:, axis]
        a, b = c - before[axis], c + after[axis]
        if clamp:
            shift = np.maximum(0, -a) - np.maximum(0, b - (n - 1))
            a, b = np.maximum(a + shift, 0), np.minimum(b + shift, n - 1)
        keep &= (c[None, :] >= a[:, None]) & (c[None, :] <= b[:, None])
    inc = order.incidence.astype(np.float32)
    return (inc @ keep.astype(np.float32) @ inc.T) > 0


def sta_mask(order: CubeOrder, window: tuple[int, int, int]) -> np.ndarray:
    """Sliding Tile Attention's tile mask for a W_t x W_h x W_w window (in cubes), [NT, NT] bool."""
    return window_mask(order, [(w - 1) // 2 for w in window], [w // 2 for w in window], clamp=True)


def forced_mask(order: CubeOrder) -> np.ndarray:
    """VSA's always-kept tiles: the query's own tile and its temporal neighbours, [NT, NT] bool."""
    return window_mask(order, (1, 0, 0), (1, 0, 0), clamp=False)


def sta_window_for_keep(cube_grid: tuple[int, int, int], keep: float) -> tuple[int, int, int]:
    """The window (cubes per axis, each <= the grid's) of about the `keep` fraction of the grid's volume: among the
    windows within 10 % of it, the most even (the smallest spread of the per-axis fractions w / n; then the closest
    volume, then the longer temporal extent); the closest volume if none is within 10 %."""
    total = math.prod(cube_grid)
    windows = list(itertools.product(*(range(1, n + 1) for n in cube_grid)))

    def miss(w):
        return abs(math.prod(w) / total - keep)

    def spread(w):
        rel = [wi / ni for wi, ni in zip(w, cube_grid)]
        return round(max(rel) - min(rel), 12)

    near = [w for w in windows if miss(w) <= 0.1 * keep]
    if not near:
        return min(windows, key=lambda w: (miss(w), spread(w), -w[0]))
    return min(near, key=lambda w: (spread(w), miss(w), -w[0]))


def lists_from_mask(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [NQ, NK] bool mask -> (kv_idx [NQ, J] int32 ascending, padded with the row's last index; kv_cnt [NQ])."""
    cnt = mask.sum(axis=1).astype(np.int32)
    if (cnt < 1).any():
        raise ValueError("every query tile needs at least one key tile")
    J = int(cnt.max())
    idx = np.zeros((mask.shape[0], J), dtype=np.int32)
    for i, row in enumerate(mask):
        kept = np.flatnonzero(row)
        idx[i, :len(kept)] = kept
        idx[i, len(kept):] = kept[-1]
    return idx, cnt


# ----------------------------------------------------------------------------------------------------------------------
# VSA's top-k selection (device, torch ops only)


def tile_means(x: torch.Tensor, tile: int) -> torch.Tensor:
    """[B, S, H, D] (any float dtype or e4m3 codes) -> fp32 means of each run of `tile` tokens, [B, NT, H, D] (the
    last tile averages its own tokens). CUDA e4m3 codes: one Triton pass with the same bits
    (fastremover/fast/kernels/tile_pool.py) where it runs; else `tile_means_torch`."""
    if x.dtype == torch.float8_e4m3fn and x.is_cuda:
        tile_pool = _kernels("tile_pool")
        if tile_pool is not None and tile_pool.available(x, tile):
            return tile_pool.tile_means_fp8(x, tile)
    return tile_means_torch(x, tile)


def _kernels(name: str):
    """The Triton kernel module fastremover.fast.kernels.<name>, or None where Triton is not installed."""
    try:
        return importlib.import_module(f"fastremover.fast.kernels.{name}")
    except ImportError:
        return None


def tile_means_torch(x: torch.Tensor, tile: int) -> torch.Tensor:
    """`tile_means` with torch ops on any device (the reference of the Triton pass). e4m3 codes are summed in fp64
    (exact: multiples of 2^-9 below 2^25 units for tiles of <= 128) and rounded to fp32 once, so the result does not
    depend on the reduction's order; other dtypes are summed in fp32."""
    B, S, H, D = x.shape
    acc = torch.float32
    if x.dtype == torch.float8_e4m3fn:
        x = x.to(torch.float16)  # exact: every e4m3 value is an fp16 value
        acc = torch.float64  # (a sum of <= 64 codes is exact in fp32 too: the same bits as before for such tiles)
    n_full = S // tile
    parts = []

    def total_of(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
        return t.sum(dim, keepdim=keepdim, dtype=acc).to(torch.float32)

    def mean(total: torch.Tensor, count: int) -> torch.Tensor:
        # a tensor divisor: IEEE division on every device (CUDA turns a Python-number divisor into a multiply by
        # its rounded reciprocal, which differs in the last bit for counts that are not powers of two)
        return total / torch.full((), float(count), dtype=torch.float32, device=total.device)

    if n_full:
        parts.append(mean(total_of(x[:, :n_full * tile].reshape(B, n_full, tile, H, D), 2), tile))
    if S % tile:
        parts.append(mean(total_of(x[:, n_full * tile:], 1, keepdim=True), S % tile))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores [..., N] -> distinct int64 keys in the same order, ties broken by the lower index: the float bits
    mapped to an order-preserving int32 (negatives: the magnitude bits flipped), times 2^32, plus N - 1 - index."""
    bits = scores.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    n = scores.shape[-1]
    tie = torch.arange(n - 1, -1, -1, device=scores.device, dtype=torch.int64)
    return ordered * (1 << 32) + tie


TOP_METHODS = ("topk", "sort")


def top_indices(keys: torch.Tensor, width: int, method: str = "topk") -> torch.Tensor:
    """The indices of the `width` largest of distinct int64 keys along the last dim, largest first. "topk": torch's
    top-k (a radix select); "sort": a full descending sort, cut to `width`. With distinct keys both give the same
    indices in the same order (tools/bench_sparse_attention.py times both)."""
    if method == "topk":
        return torch.topk(keys, width, dim=-1, sorted=True).indices
    if method == "sort":
        return torch.sort(keys, dim=-1, descending=True).indices[..., :width]
    raise ValueError(f"unknown top-k method {method!r}; choose from {TOP_METHODS}")


def vsa_lists(q: torch.Tensor, k: torch.Tensor, tile: int, counts: torch.Tensor, width: int,
              forced: torch.Tensor) -> torch.Tensor:
    """Per query tile i and (batch, head), the counts[i] key tiles of highest coarse score, forced tiles first:
    kv_idx [B, H, NQ, width] int32, the first counts[i] entries ascending (the rest NK, unused). q, k [B, S, H, D]
    (codes or 16-bit: the ranking does not depend on a positive scale, nor on a centre subtracted from every key);
    counts [NQ] int32 and forced [NQ, NK] bool on the device; width = max(counts)."""
    qm = tile_means(q, tile).permute(0, 2, 1, 3)  # [B, H, NQ, D]
    km = tile_means(k, tile).permute(0, 2, 3, 1)  # [B, H, D, NK]
    scores = torch.matmul(qm, km)  # [B, H, NQ, NK] fp32
    return select_tiles(scores, forced, counts, width)


def select_tiles(scores: torch.Tensor, forced: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """scores [B, H, NQ, NK] fp32 -> kv_idx [B, H, NQ, width] int32: row i's counts[i] key tiles of highest score
    (forced tiles first; ties to the lower index), ascending, then NK. On CUDA one Triton pass with the same result
    (fastremover/fast/kernels/tile_select.py) where it runs; else `select_tiles_torch`."""
    if scores.is_cuda:
        tile_select = _kernels("tile_select")
        if tile_select is not None and tile_select.available(scores, width):
            return tile_select.select_tiles(scores, forced, counts, width)
    return select_tiles_torch(scores, forced, counts, width)


def select_tiles_torch(scores: torch.Tensor, forced: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """`select_tiles` with torch ops on any device (the reference of the Triton pass)."""
    scores = scores.masked_fill(forced, float("inf"))
    top = top_indices(ordered_keys(scores), width)  # best first
    used = torch.arange(width, device=scores.device) < counts.unsqueeze(-1)
    top = torch.where(used, top, scores.shape[-1])
    return torch.sort(top, dim=-1).values.to(torch.int32)


# ----------------------------------------------------------------------------------------------------------------------
# The layout a transformer call uses


@dataclass(frozen=True)
class SparseOptions:
    source: str  # "sta" | "vsa-topk"
    keep: float
    window: tuple[int, int, int] | None = None  # sta: explicit window (cubes); None: from keep
    cube: tuple[int, int, int] = CUBE


class SparseLayout:
    """One token grid's cube order and tile lists for one mask source: what the fast transformer permutes its tokens
    with (`permute`, `restore`, `rope`) and hands to the sparse backend (`lists`). Every tensor it needs is made
    here, on `device`, so a captured graph only reads them."""

    def __init__(self, grid: tuple[int, int, int], device, options: SparseOptions):
        self.options = options
        self.order = CubeOrder(grid, options.cube, device)
        self.tile = self.order.tile
        n = self.order.n_tiles
        device = torch.device(device)
        if options.source == "sta":
            self.window = tuple(options.window) if options.window else sta_window_for_keep(self.order.cube_grid,
                                                                                         options.keep)
            mask = sta_mask(self.order, self.window)
            idx, cnt = lists_from_mask(mask)
            self._idx = torch.from_numpy(idx).to(device)[None, None]
            self._cnt = torch.from_numpy(cnt).to(device)[None, None]
            self.density = float(mask.mean())
        elif options.source == "vsa-topk":
            self.window = None
            forced = forced_mask(self.order)
            keep_count = math.ceil(options.keep * n - 1e-9)
            counts = np.minimum(n, np.maximum(keep_count, forced.sum(axis=1))).astype(np.int32)
            self.count = int(counts.max())  # the top-k width; each row keeps its own count of them
            self._forced = torch.from_numpy(forced).to(device)
            self._cnt = torch.from_numpy(counts).to(device)[None, None]
            self.density = float(counts.mean() / n)
        else:
            raise ValueError(f"unknown sparse mask source {options.source!r}")

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        return self.order.permute(x, 1)

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        return self.order.restore(x, 1)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables [S, Dh/2] with their rows in cube order."""
        return self.order.permute(cos, 0), self.order.permute(sin, 0)

    def lists(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_idx [B, H, NQ, J], kv_cnt [B, H, NQ]) for this layer's q, k [B, S, H, D] (cube order)."""
        B, S, H, _ = q.shape
        if S != self.order.tokens:
            raise ValueError(f"sparse attention: {S} tokens, but the layout is for {self.order.tokens}")
        n = self.order.n_tiles
        cnt = self._cnt.expand(B, H, n)
        if self.options.source == "sta":
            return self._idx.expand(B, H, *self._idx.shape[2:]), cnt
        return vsa_lists(q, k, self.tile, self._cnt[0, 0], self.count, self._forced), cnt

    def tensors(self) -> tuple:
        """The device tensors a captured graph reads (kept referenced by the graph cache)."""
        return tuple(t for t in (self.order.perm, self.order.inverse, getattr(self, "_idx", None), self._cnt,
                                 getattr(self, "_forced", None)) if t is not None)

    def describe(self) -> dict:
        return {"source": self.options.source, "grid": list(self.order.grid), "cube": list(self.order.cube),
                "tiles": self.order.n_tiles, "keep": self.options.keep, "window": list(self.window) if self.window
                else None, "density": round(self.density, 4)}
