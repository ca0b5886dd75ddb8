"""Cube order and tile masks for the sparse attention backends (sparse.py): which key tiles each query tile sees.

Cube order. The DiT's tokens (after patchify: latent frames x rows x columns, f-major) are reordered so that every
4 x 4 x 4 cube of the grid is contiguous. Partial cubes at the edges are handled EXACTLY, without padding: the full
cubes come first (in (t, h, w) cube order), then the partial ones (same order), packed back to back. A tile is a
run of `tile = 64` consecutive tokens of that order: a full cube, or a pack of neighbouring partial cubes (W2's grid
21 x 30 x 52: 455 full cubes, then 3640 edge tokens in 57 tiles, the last one 56 tokens long; nothing computed
twice, nothing padded). FastVideo pads each partial cube to 64 slots instead, which at W2 is 22 % more tokens
(6 x 8 x 13 cubes of 64 for 32760 tokens), paid in every tile pass. Each tile's geometry is the bounding box of
its cubes in cube coordinates; the masks below are defined on those boxes (a full cube's box is the cube itself).
The permutation is applied once per transformer call: everything in a DiT block except the attention is row-wise
(norms, linears, the per-token RoPE), so the residual stream runs in cube order from the patch embedding to the
output projection, with RoPE's tables permuted the same way (qk_norm_rope reads table row s for token s, so
permuting rows of x and of the tables together permutes its output exactly: tests/test_sparse_attention.py checks
torch.equal). Cost: one gather of the patch embedding's output (which replaces the copy it already made) and one of
the output projection's (B, S, 64) result per transformer call, none per layer.

Mask sources (lists sorted ascending, as fastremover.fast.kernels.block_sparse_attention requires):
  * `sta`: a static window of W_t x W_h x W_w tiles around each query tile (Sliding Tile Attention): per axis the
    window covers (W - 1) // 2 cubes before the query box and W // 2 after, shifted inward at the grid's edges so it
    keeps its width (NATTEN / STA's clamped window); a key tile is kept when its box meets the window on every axis.
    Built once per grid on the host, the same for every batch and head.
  * `vsa-topk` (VSA's coarse stage): q and k mean-pooled per tile (fp32), coarse scores q_tile . k_tile per (batch,
    head), and the top `keep` fraction of key tiles per query tile, which always includes the query's own tile and
    its temporal neighbours (boxes overlapping in h and w, at most one cube apart in t). All on the device with torch
    ops, no host sync (graph-capturable). Ties are impossible by construction: each score's float bits are mapped to
    an order-preserving integer and extended with the reversed key index, so the keys are distinct int64 values and
    the top-k SET is unique (the lower index wins between equal scores); the kept indices are then sorted. `keep`
    counts the forced tiles: a row keeps exactly max(ceil(keep * NK), forced tiles) tiles.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

CUBE = (4, 4, 4)


class CubeOrder:
    """The cube-order permutation of a (T, H, W) token grid and its tiles' boxes (see the module docstring).

    perm[i] = the original (f-major) index of the token at cube-order position i; inverse = its inverse. Both are
    int64 tensors on `device`; `boxes` [n_tiles, 3, 2] int (numpy): per tile and axis the first and last cube
    coordinate it touches; `cube_grid`: cubes per axis (partial ones included)."""

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
        pos_cubes = np.stack([a[perm] for a in cubes], axis=1)  # [S, 3] cube coordinates in cube order
        starts = np.arange(0, self.tokens, self.tile)
        self.n_tiles = len(starts)
        lo = np.minimum.reduceat(pos_cubes, starts, axis=0)
        hi = np.maximum.reduceat(pos_cubes, starts, axis=0)
        self.boxes = np.stack([lo, hi], axis=2)  # [n_tiles, 3, 2]
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
    """[NT, NT] bool: query tile i keeps key tile j when j's box meets, on every axis, the query box widened by
    before[a] cubes below and after[a] above (clamp: shifted inward at the grid's edges, keeping its width)."""
    boxes = order.boxes
    keep = np.ones((order.n_tiles, order.n_tiles), dtype=bool)
    for axis in range(3):
        n = order.cube_grid[axis]
        a = boxes[:, axis, 0] - before[axis]
        b = boxes[:, axis, 1] + after[axis]
        if clamp:
            shift = np.maximum(0, -a) - np.maximum(0, b - (n - 1))
            a, b = np.maximum(a + shift, 0), np.minimum(b + shift, n - 1)
        k_lo, k_hi = boxes[:, axis, 0], boxes[:, axis, 1]
        keep &= (k_lo[None, :] <= b[:, None]) & (k_hi[None, :] >= a[:, None])
    return keep


def sta_mask(order: CubeOrder, window: tuple[int, int, int]) -> np.ndarray:
    """Sliding Tile Attention's tile mask for a W_t x W_h x W_w window (in cubes), [NT, NT] bool."""
    return window_mask(order, [(w - 1) // 2 for w in window], [w // 2 for w in window], clamp=True)


def forced_mask(order: CubeOrder) -> np.ndarray:
    """VSA's always-kept tiles: the query's own tile and its temporal neighbours, [NT, NT] bool."""
    return window_mask(order, (1, 0, 0), (1, 0, 0), clamp=False)


def sta_window_for_keep(cube_grid: tuple[int, int, int], keep: float) -> tuple[int, int, int]:
    """The window (cubes per axis, each <= the grid's) whose volume is the `keep` fraction of the grid's as closely
    as any (ties: the most even relative size over the axes, then the longer temporal extent)."""
    total = math.prod(cube_grid)

    def cost(w):
        rel = [wi / ni for wi, ni in zip(w, cube_grid)]
        return (abs(math.prod(w) / total - keep), round(max(rel) - min(rel), 12), -w[0], -w[1])

    return min(itertools.product(*(range(1, n + 1) for n in cube_grid)), key=cost)


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
    last tile averages its own tokens)."""
    B, S, H, D = x.shape
    if x.dtype == torch.float8_e4m3fn:
        x = x.to(torch.float16)  # exact: every e4m3 value is an fp16 value
    n_full = S // tile
    parts = []
    if n_full:
        parts.append(x[:, :n_full * tile].reshape(B, n_full, tile, H, D).sum(2, dtype=torch.float32) / tile)
    if S % tile:
        parts.append(x[:, n_full * tile:].sum(1, keepdim=True, dtype=torch.float32) / (S % tile))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores [..., N] -> distinct int64 keys in the same order, ties broken by the lower index: the float bits
    mapped to an order-preserving int32 (negatives: the magnitude bits flipped), times 2^32, plus N - 1 - index."""
    bits = scores.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    n = scores.shape[-1]
    tie = torch.arange(n - 1, -1, -1, device=scores.device, dtype=torch.int64)
    return ordered * (1 << 32) + tie


def vsa_lists(q: torch.Tensor, k: torch.Tensor, tile: int, count: int, forced: torch.Tensor) -> torch.Tensor:
    """The `count` key tiles of highest coarse score per query tile and (batch, head), forced tiles first: kv_idx
    [B, H, NQ, count] int32, ascending. q, k [B, S, H, D] (codes or 16-bit: the ranking does not depend on a
    positive scale, nor on a centre subtracted from every key); forced [NQ, NK] bool on the device."""
    qm = tile_means(q, tile).permute(0, 2, 1, 3)  # [B, H, NQ, D]
    km = tile_means(k, tile).permute(0, 2, 3, 1)  # [B, H, D, NK]
    scores = torch.matmul(qm, km)  # [B, H, NQ, NK] fp32
    scores = scores.masked_fill(forced, float("inf"))
    top = torch.topk(ordered_keys(scores), count, dim=-1, sorted=False).indices
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
            self.count = min(n, max(math.ceil(options.keep * n - 1e-9), int(forced.sum(axis=1).max())))
            self._forced = torch.from_numpy(forced).to(device)
            self._cnt = torch.full((1, 1, n), self.count, dtype=torch.int32, device=device)
            self.density = self.count / n
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
        return vsa_lists(q, k, self.tile, self.count, self._forced), cnt

    def tensors(self) -> tuple:
        """The device tensors a captured graph reads (kept referenced by the graph cache)."""
        return tuple(t for t in (self.order.perm, self.order.inverse, getattr(self, "_idx", None), self._cnt,
                                 getattr(self, "_forced", None)) if t is not None)

    def describe(self) -> dict:
        return {"source": self.options.source, "grid": list(self.order.grid), "cube": list(self.order.cube),
                "tiles": self.order.n_tiles, "keep": self.options.keep, "window": list(self.window) if self.window
                else None, "density": round(self.density, 4)}
