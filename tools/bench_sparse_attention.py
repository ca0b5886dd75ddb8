"""Tile-sparse attention on the GPU: the block-sparse kernel against dense attention at the DiT's shapes.

    python tools/bench_sparse_attention.py [--out PATH] [--quick] [--dtypes fp8]   # one H200 (~5 min per dtype)
    python tools/bench_sparse_attention.py --codegen                   # no GPU: compile every config for sm_90

Rows (12 heads x 128, one batch; W2 = 21 x 30 x 52 = 32760 tokens, W3 = 21 x 45 x 80 = 75600):
  * dense baselines per layer: fp8 = cuDNN's FP8 attention on the same codes (fastremover/ops/attention/cudnn_fp8.py, the
    `cudnn-fp8` backend) where it builds, else torch SDPA in fp16; fp16 = torch SDPA;
  * the block-sparse kernel at keep 1.0 / 0.5 / 0.25 / 0.125 with VSA's lists (fastremover/ops/attention/
    sparse_layout.py, computed from the inputs' pooled scores) and, at 0.25, STA's window lists; per row the kernel
    time, the selection time (pooling, scores, top-k, sort), the kept fraction, effective TFLOP/s and
    `vs_scaled_dense` = kernel time / (kept fraction x dense fp8 time): issue #46 asks <= 1.25 at keep 0.25;
  * tiles of 64 (4x4x4 cubes) and 128 (4x4x8), each with the best config of a small sweep at W2 keep 0.25;
  * the `sparse-*-cudnn` kernel (cuDNN's FP8 attention over paged K/V, 128-token tiles; config `cudnn-paged`):
    the whole call (page tables + kernel) timed in a CUDA graph, as the engine runs it;
  * the cube-order gathers per transformer call (patch embedding output in, proj_out's 64 channels out).
Checks on the GPU: every swept config against the fp32 masked reference within the kernel's stated bound at a
small grid (9 x 16 x 16 tokens) and two calls bit-identical (torch.equal); warp-specialized configs run in a child
process each (an illegal address there would poison this one). JSON to --out (default $OUT, else bench/results),
a short table printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"W2": (21, 30, 52), "W3": (21, 45, 80)}
CHECK_GRID = (9, 16, 16)
HEADS, HEAD_DIM = 12, 128
KEEPS = (1.0, 0.5, 0.25, 0.125)
CUBES = {64: (4, 4, 4), 128: (4, 4, 8)}
# name format: BlockSparseConfig.name (m<BLOCK_M>n<BLOCK_N>w<warps>s<stages>t<tma>ws<warp spec>vt<V transposed>)
SWEEP = {
    64: ["m64n64w4s2t1ws0vt1", "m64n64w4s3t1ws0vt1", "m64n64w4s4t1ws0vt1", "m64n32w4s3t1ws0vt1",
         "m64n64w8s3t1ws0vt1", "m64n64w4s3t0ws0vt1", "m64n64w4s3t1ws0vt0", "m64n64w4s3t1ws1vt1",
         "m64n64w4s3t1ws0vt1ca1", "m64n64w4s2t1ws0vt1ca1", "m64n64w4s4t1ws0vt1ca1", "m64n64w4s3t1ws0vt1lz1",
         "m64n64w4s3t1ws0vt1ca1lz1", "m64n64w4s4t1ws0vt1ca1lz1"],
    128: ["m128n64w8s2t1ws0vt1", "m128n64w8s3t1ws0vt1", "m128n128w8s2t1ws0vt1", "m64n64w4s3t1ws0vt1",
          "m128n64w4s2t1ws1vt1", "m128n128w4s2t1ws1vt1"],
}
QUICK_SWEEP = {64: ["m64n64w4s3t1ws0vt1", "m64n64w4s2t1ws0vt1", "m64n64w4s3t1ws0vt1ca1", "m64n64w4s3t1ws0vt1lz1",
                    "m64n64w4s3t1ws0vt1ca1lz1"],
               128: ["m128n64w8s2t1ws0vt1", "m128n128w8s2t1ws0vt1"]}


def _fp16_name(cfg_name: str) -> str:
    # V transposition, chain_acc and lazy rescaling are for codes only
    return cfg_name.replace("vt1", "vt0").replace("ca1", "").replace("lz1", "")


# ----------------------------------------------------------------------------------------------------------------------
# Inputs


def make_inputs(grid, dtype: str, seed: int = 0):
    """q, k, v [1, S, 12, 128] in cube order with a smooth spatial structure (so pooled scores mean something):
    N(0, 1) plus a per-tile component; fp8: e4m3 codes with per-tensor scales (K and V centred, as the transformer
    feeds them)."""
    import torch

    S = math.prod(grid)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tiles = -(-S // 64)
    shared = torch.randn(3, tiles, 1, HEADS, HEAD_DIM, device="cuda", generator=g)
    x = torch.randn(3, tiles, 64, HEADS, HEAD_DIM, device="cuda", generator=g) + shared
    q, k, v = (t.reshape(1, tiles * 64, HEADS, HEAD_DIM)[:, :S] for t in x)
    k, v = k - k.mean(1, keepdim=True), v - v.mean(1, keepdim=True)
    if dtype == "fp16":
        return tuple(t.half().contiguous() for t in (q, k, v)), None
    scales = []
    codes = []
    for t in (q, k, v):
        s = (t.abs().amax() / 448.0).reshape(1).float()
        codes.append((t / s).to(torch.float8_e4m3fn).contiguous())
        scales.append(s)
    return tuple(codes), tuple(scales)


def layout_for(grid, tile: int, source: str, keep: float):
    from fastremover.ops.attention.sparse_layout import SparseLayout, SparseOptions

    return SparseLayout(grid, "cuda", SparseOptions(source, keep, cube=CUBES[tile]))


# ----------------------------------------------------------------------------------------------------------------------
# One config: correctness at a small grid, then its time at W2 keep 0.25


def check_config(name: str, dtype: str, tile: int) -> dict:
    import torch

    from fastremover.fast.kernels import block_sparse_attention as bsa

    (q, k, v), scales = make_inputs(CHECK_GRID, dtype, seed=1)
    layout = layout_for(CHECK_GRID, tile, "vsa-topk", 0.25)
    idx, cnt = layout.lists(q, k)
    kw = dict(tile_q=tile, tile_k=tile, scales=scales, config=name)
    out = bsa.block_sparse_attention(q, k, v, idx, cnt, **kw)
    again = bsa.block_sparse_attention(q, k, v, idx, cnt, **kw)
    ref = bsa.block_sparse_attention_reference(q, k, v, idx, cnt, tile_q=tile, tile_k=tile, scales=scales)
    bound = bsa.reference_bound(v, cnt, tile_q=tile, tile_k=tile, scales=scales,
                                chain_acc=bsa.BlockSparseConfig.parse(name).chain_acc)
    real = (lambda t: t.float() * scales[2]) if scales else (lambda t: t.float())
    err = (real(out) - real(ref)).abs()
    rel = float((real(out) - real(ref)).norm() / real(ref).norm())
    return {"within_bound": bool((err <= bound).all()), "max_err_over_bound": float((err / bound).max()),
            "rel_l2_vs_reference": rel, "deterministic": bool(torch.equal(out, again))}


def time_config(name: str, dtype: str, tile: int, grid=SHAPES["W2"], keep: float = 0.25) -> dict:
    from fastremover.fast.kernels import block_sparse_attention as bsa
    from fastremover.timing import cuda_time_ms

    (q, k, v), scales = make_inputs(grid, dtype)
    layout = layout_for(grid, tile, "vsa-topk", keep)
    idx, cnt = layout.lists(q, k)
    fn = lambda: bsa.block_sparse_attention(q, k, v, idx, cnt, tile_q=tile, tile_k=tile, scales=scales,  # noqa
                                            config=name)
    fn()
    ms = cuda_time_ms(fn, iters=10, warmup=2)
    S = math.prod(grid)
    flop = 4.0 * S * S * layout.density * HEADS * HEAD_DIM
    return {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1), "kept": round(layout.density, 4)}


def run_one(name: str, dtype: str, tile: int) -> dict:
    row = {"config": name, "dtype": dtype, "tile": tile}
    t0 = time.perf_counter()
    try:
        row.update(check_config(name, dtype, tile))
        row.update(time_config(name, dtype, tile))
    except Exception as exc:  # out of shared memory, a config Triton cannot build, ...
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def run_isolated(name: str, dtype: str, tile: int, timeout: float = 240.0) -> dict:
    cmd = [sys.executable, __file__, "--one", name, "--dtype", dtype, "--tile", str(tile)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"config": name, "dtype": dtype, "tile": tile, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        return {"config": name, "dtype": dtype, "tile": tile, "error": f"child exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def sweep(configs: dict, dtypes) -> tuple[list[dict], dict]:
    """Every config per (dtype, tile): (rows, {(dtype, tile): best config name that passed its checks})."""
    rows, best = [], {}
    for dtype in dtypes:
        for tile, names in configs.items():
            names = names if dtype == "fp8" else list(dict.fromkeys(_fp16_name(n) for n in names))
            # the warp-specialized ones last and in a child process each
            for name in sorted(names, key=lambda n: "ws1" in n):
                row = run_isolated(name, dtype, tile) if "ws1" in name else run_one(name, dtype, tile)
                print(json.dumps(row), flush=True)
                rows.append(row)
                ok = "error" not in row and row["within_bound"] and row["deterministic"]
                if ok and ((dtype, tile) not in best or row["ms"] < best[(dtype, tile)][1]):
                    best[(dtype, tile)] = (name, row["ms"])
    return rows, {key: name for key, (name, _) in best.items()}


# ----------------------------------------------------------------------------------------------------------------------
# The table


def dense_fp8_ms(q8, k8, v8, scales) -> tuple[str, float]:
    import torch

    from fastremover.timing import cuda_time_ms

    try:
        from fastremover.ops.attention.cudnn_fp8 import sdpa_fp8, supported

        why = supported(torch.cuda.current_device())
        if why is None:
            sdpa_fp8(q8, k8, v8, *scales)
            return "cudnn-fp8", cuda_time_ms(lambda: sdpa_fp8(q8, k8, v8, *scales), iters=10)
    except Exception as exc:  # no cudnn-frontend
        print(f"cudnn-fp8 unavailable ({exc}); the dense baseline is SDPA fp16", file=sys.stderr)
    q, k, v = (t.to(torch.float16) for t in (q8, k8, v8))
    return "sdpa-fp16", sdpa_ms(q, k, v)


def sdpa_ms(q, k, v) -> float:
    import torch.nn.functional as F

    from fastremover.timing import cuda_time_ms

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return cuda_time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt), iters=10)


def table_rows(best: dict, shapes: dict, keeps, dtypes) -> list[dict]:
    import torch

    from fastremover.fast.kernels import block_sparse_attention as bsa
    from fastremover.ops.attention.sparse_layout import vsa_lists
    from fastremover.timing import cuda_time_ms

    rows = []
    for shape_name, grid in shapes.items():
        S = math.prod(grid)
        dense_flop = 4.0 * S * S * HEADS * HEAD_DIM
        (q8, k8, v8), scales = make_inputs(grid, "fp8")
        fp8_name, fp8_ms = dense_fp8_ms(q8, k8, v8, scales)
        rows.append({"shape": shape_name, "tokens": S, "kind": "dense", "dtype": "fp8", "backend": fp8_name,
                     "ms": round(fp8_ms, 4), "tflops": round(dense_flop / fp8_ms / 1e9, 1)})
        del q8, k8, v8
        (q, k, v), _ = make_inputs(grid, "fp16")
        f16_ms = sdpa_ms(q, k, v)
        rows.append({"shape": shape_name, "tokens": S, "kind": "dense", "dtype": "fp16", "backend": "sdpa-fp16",
                     "ms": round(f16_ms, 4), "tflops": round(dense_flop / f16_ms / 1e9, 1)})
        del q, k, v
        # the cube-order gathers of one transformer call (fp16 activations, 1536 wide in, 64 out)
        order = layout_for(grid, 64, "sta", 0.25).order
        x, y = torch.randn(1, S, 1536, device="cuda").half(), torch.randn(1, S, 64, device="cuda").half()
        rows.append({"shape": shape_name, "tokens": S, "kind": "permutation",
                     "ms_in": round(cuda_time_ms(lambda: order.permute(x)), 4),
                     "ms_out": round(cuda_time_ms(lambda: order.restore(y)), 4),
                     "ms_plain_copy_in": round(cuda_time_ms(lambda: x.transpose(0, 1).contiguous()), 4)})
        del x, y
        for dtype in dtypes:
            (q, k, v), scales = make_inputs(grid, dtype)
            for tile in CUBES:
                name = best.get((dtype, tile))
                if name is None:
                    continue
                for source, keep in [("vsa-topk", kp) for kp in keeps] + [("sta", 0.25)]:
                    layout = layout_for(grid, tile, source, keep)
                    idx, cnt = layout.lists(q, k)
                    fn = lambda: bsa.block_sparse_attention(q, k, v, idx, cnt, tile_q=tile, tile_k=tile,  # noqa
                                                            scales=scales, config=name)
                    fn()
                    ms = cuda_time_ms(fn, iters=10)
                    row = {"shape": shape_name, "tokens": S, "kind": "sparse", "dtype": dtype, "tile": tile,
                           "source": source, "keep": keep, "kept": round(layout.density, 4), "config": name,
                           "window": list(layout.window) if layout.window else None, "ms": round(ms, 4),
                           "tflops": round(dense_flop * layout.density / ms / 1e9, 1),
                           "vs_scaled_dense": round(ms / (layout.density * fp8_ms), 3),
                           "dense_fp8_backend": fp8_name}
                    if source == "vsa-topk":
                        forced, counts = layout._forced, layout._cnt[0, 0]
                        row["selection_ms"] = round(cuda_time_ms(
                            lambda: vsa_lists(q, k, layout.tile, counts, layout.count, forced), iters=10), 4)
                        row["selection_parts_ms"] = selection_parts_ms(q, k, layout)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
        if "fp8" in dtypes:
            rows += cudnn_paged_rows(shape_name, grid, keeps, fp8_name, fp8_ms)
    return rows


def graph_time_ms(fn, iters: int = 10) -> float:
    """GPU time of fn() per call, captured once in a CUDA graph and replayed (as the engine's denoise runs it: no
    host launch gaps)."""
    from fastremover.timing import capture_graph, cuda_time_ms

    graph, _ = capture_graph(fn)
    return cuda_time_ms(graph.replay, iters=iters)


def cudnn_paged_rows(shape_name: str, grid, keeps, dense_name: str, dense_ms: float) -> list[dict]:
    """`sparse-*-cudnn`'s kernel (fastremover/ops/attention/cudnn_sparse.py: cuDNN's FP8 attention with paged K/V,
    128-token tiles) on the same inputs: per keep the whole call (page tables + kernel) in a CUDA graph, the kernel
    alone, and `vs_scaled_dense` of the whole call. Nothing where cuDNN's paged FP8 graph does not build."""
    import torch

    from fastremover.ops.attention import cudnn_sparse

    why = cudnn_sparse.supported(torch.device("cuda"))
    if why is not None:
        print(f"cudnn paged rows skipped: {why}", file=sys.stderr)
        return []
    S = math.prod(grid)
    dense_flop = 4.0 * S * S * HEADS * HEAD_DIM
    (q, k, v), scales = make_inputs(grid, "fp8")
    padded = [cudnn_sparse.padded_codes(t, cudnn_sparse.TILE) for t in (q, k, v)]
    rows = []
    for source, keep in [("vsa-topk", kp) for kp in keeps] + [("sta", 0.25)]:
        layout = layout_for(grid, cudnn_sparse.TILE, source, keep)
        idx, cnt = layout.lists(q, k)
        call = lambda: cudnn_sparse.tile_sparse_fp8(*padded, *scales, idx, cnt, layout.tile)  # noqa: E731
        ms = graph_time_ms(call)
        tables = lambda: cudnn_sparse.page_tables(idx, cnt, S, layout.tile)  # noqa: E731
        row = {"shape": shape_name, "tokens": S, "kind": "sparse", "dtype": "fp8", "tile": layout.tile,
               "source": source, "keep": keep, "kept": round(layout.density, 4), "config": "cudnn-paged",
               "window": list(layout.window) if layout.window else None, "ms": round(ms, 4),
               "tables_ms": round(graph_time_ms(tables), 4),
               "tflops": round(dense_flop * layout.density / ms / 1e9, 1),
               "vs_scaled_dense": round(ms / (layout.density * dense_ms), 3), "dense_fp8_backend": dense_name}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def selection_parts_ms(q, k, layout) -> dict:
    """VSA's selection (sparse_layout.vsa_lists) stage by stage, each timed alone on its own inputs: the pooling of q
    and of k (codes: the one-pass kernel, and the torch path it replaces), the coarse scores, the forced tiles +
    order-preserving keys, the top-k (torch's top-k, and a full sort: the same indices), the final sort."""
    import torch

    from fastremover.ops.attention.sparse_layout import (ordered_keys, select_tiles, select_tiles_torch, tile_means,
                                                        tile_means_torch, top_indices)
    from fastremover.timing import cuda_time_ms

    tile, width, counts, forced = layout.tile, layout.count, layout._cnt[0, 0], layout._forced
    qm = tile_means(q, tile).permute(0, 2, 1, 3)
    km = tile_means(k, tile).permute(0, 2, 3, 1)
    scores = torch.matmul(qm, km)
    keys = ordered_keys(scores.masked_fill(forced, float("inf")))
    top = torch.topk(keys, width, dim=-1, sorted=True).indices
    used = torch.arange(width, device=q.device) < counts.unsqueeze(-1)
    parts = {"pool_q": lambda: tile_means(q, tile), "pool_k": lambda: tile_means(k, tile),
             "scores": lambda: torch.matmul(qm, km),
             "keys": lambda: ordered_keys(scores.masked_fill(forced, float("inf"))),
             "topk": lambda: top_indices(keys, width, "topk"), "topk_by_sort": lambda: top_indices(keys, width, "sort"),
             "sort": lambda: torch.sort(torch.where(used, top, scores.shape[-1]), dim=-1).values.to(torch.int32),
             # keys + top-k + sort in one Triton pass (what the engine runs on CUDA), and the torch path it replaces
             "select": lambda: select_tiles(scores, forced, counts, width),
             "select_torch": lambda: select_tiles_torch(scores, forced, counts, width)}
    if q.dtype == torch.float8_e4m3fn:
        parts["pool_q_torch"] = lambda: tile_means_torch(q, tile)
    return {name: round(cuda_time_ms(fn, iters=10), 4) for name, fn in parts.items()}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'shape':5} {'dtype':5} {'tile':>4} {'source':8} {'keep':>5} {'kept':>6} {'ms':>8} {'TFLOP/s':>8} "
             f"{'vs k*dense':>10} {'select ms':>9}"]
    for r in rows:
        if r["kind"] == "dense":
            lines.append(f"{r['shape']:5} {r['dtype']:5} {'':>4} {r['backend']:8} {1.0:>5.3f} {1.0:>6.3f} "
                         f"{r['ms']:>8.3f} {r['tflops']:>8.1f}")
        elif r["kind"] == "sparse":
            sel = r.get("selection_ms")
            lines.append(f"{r['shape']:5} {r['dtype']:5} {r['tile']:>4} {r['source'][:8]:8} {r['keep']:>5.3f} "
                         f"{r['kept']:>6.3f} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['vs_scaled_dense']:>10.3f} "
                         f"{(f'{sel:.3f}' if sel is not None else '-'):>9}")
        elif r["kind"] == "permutation":
            lines.append(f"{r['shape']:5} cube-order gathers per transformer call: in {r['ms_in']:.3f} ms "
                         f"(plain copy {r['ms_plain_copy_in']:.3f}), out {r['ms_out']:.3f} ms")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# Offline codegen (no GPU): every config compiled for sm_90


def compile_sm90(name: str, dtype: str, tile: int, grid=SHAPES["W2"], head_dim: int = HEAD_DIM):
    """The kernel compiled for sm_90 with the specialization a real launch at `grid` gets (token-major q/k/[v] rows of
    H*D, VSA's contiguous lists, the count broadcast; integers equal to 1 become constants, multiples of 16 are
    marked so): Triton's CompiledKernel. `head_dim`: D (the model's 128 by default)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastremover.fast.kernels import block_sparse_attention as bsa

    cfg = bsa.BlockSparseConfig.parse(name)
    kern = bsa._block_sparse_attn_kernel
    names = list(kern.arg_names)
    S, H, D = math.prod(grid), HEADS, head_dim
    nq = -(-S // tile)
    fp8 = dtype == "fp8"
    v_t = fp8 and cfg.v_t
    s_pad = -(-S // bsa.SEQ_ALIGN) * bsa.SEQ_ALIGN
    tma = cfg.tma
    count = max(1, nq // 4)
    ints = dict(S=S, H=H, n_k_tiles=nq, sqb=S * H * D, sqs=H * D, sqh=D, q_rb=S if tma else 0, q_rh=0,
                q_ch=D if tma else 0, skb=S * H * D, sks=H * D, skh=D, k_rb=S if tma else 0, k_rh=0,
                k_ch=D if tma else 0, sob=S * H * D, sos=H * D, soh=D, sib=H * nq * count, sih=nq * count,
                sim=count, sij=1, scb=0, sch=0, scm=1)
    if v_t:
        ints.update(svb=H * D * s_pad, svs=1, svh=D * s_pad, svd=s_pad, v_rb=H * D if tma else 0,
                    v_rh=D if tma else 0, v_ch=0)
    else:
        ints.update(svb=S * H * D, svs=H * D, svh=D, svd=1, v_rb=S if tma else 0, v_rh=0, v_ch=D if tma else 0)
    elem = "fp8e4nv" if fp8 else "fp16"
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in ("Q", "K", "V"):
            sig[n] = f"*{elem}"
        elif n == "O":
            sig[n] = f"*{elem}"
        elif n in ("KV_IDX", "KV_CNT"):
            sig[n] = "*i32"
        elif n in ("SQ", "SK", "SV"):
            sig[n] = "*fp32"
        elif n == "qk_mult":
            sig[n] = "fp32"
        elif n in ints:
            val = ints[n]
            if val == 1:
                constexprs[n] = 1
            else:
                sig[n] = "i32"
                if val % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        if sig.get(n, "").startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    if tma:
        sig["Q"] = f"tensordesc<{elem}[{cfg.block_m}, {D}]>"
        sig["K"] = f"tensordesc<{elem}[{cfg.block_n}, {D}]>"
        sig["V"] = f"tensordesc<{elem}[{D}, {cfg.block_n}]>" if v_t else f"tensordesc<{elem}[{cfg.block_n}, {D}]>"
        for n in ("Q", "K", "V"):
            attrs.pop((names.index(n),), None)
    constexprs.update(HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TILE_Q=tile, TILE_K=tile,
                      TAIL=S % tile != 0, FP8=fp8, OUT_FP8=fp8, V_T=v_t, TMA=tma, WARP_SPEC=cfg.warp_spec,
                      CHAIN_ACC=cfg.chain_acc, LAZY=cfg.lazy, INTERPRET=False)
    for n in constexprs:
        sig[n] = "constexpr"
    src = ASTSource(fn=kern, signature={n: sig[n] for n in names}, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def codegen_summary(compiled) -> dict:
    """SASS counts that tell how it will run: MMAs (QGMMA fp8 / HGMMA 16-bit wgmma; HMMA = pre-Hopper mma.sync),
    MUFU.EX2, TMA loads (UTMALDG), cp.async (LDGSTS), shared-memory layout traffic (LDS/STS/LDSM/STSM), spills."""
    import re

    sys.path.insert(0, str(ROOT / "tools"))
    from codegen_check import resource_usage

    try:
        sass = compiled.asm["sass"]
    except Exception as exc:
        return {"error": f"no SASS: {exc}"}
    count = lambda pat: len(re.findall(pat, sass))  # noqa: E731
    return {"resources": resource_usage(compiled), "shared": getattr(compiled.metadata, "shared", None),
            "QGMMA": count(r"\bQGMMA\b"), "HGMMA": count(r"\bHGMMA\b"), "HMMA": count(r"\bHMMA\b"),
            "MUFU.EX2": count(r"MUFU\.EX2"), "UTMALDG": count(r"UTMALDG"), "LDGSTS": count(r"LDGSTS"),
            "LDS": count(r"\bLDS(\.\w+)*\b"), "STS": count(r"\bSTS(\.\w+)*\b"), "LDSM": count(r"\bLDSM\b"),
            "LDL/STL": count(r"\b(LDL|STL)\b"), "instructions": sass.count("\n")}


def codegen_report(configs: dict, dtypes) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for tile, names in configs.items():
            names = names if dtype == "fp8" else list(dict.fromkeys(_fp16_name(n) for n in names))
            for name in names:
                row = {"config": name, "dtype": dtype, "tile": tile}
                t0 = time.perf_counter()
                try:
                    row.update(codegen_summary(compile_sm90(name, dtype, tile)))
                except Exception as exc:
                    msg = str(exc).strip().splitlines()
                    row["error"] = f"{type(exc).__name__}: {msg[-1][:300] if msg else ''}"
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------------


def _out_path(arg: str | None, tag: str) -> Path:
    from fastremover.bench.harness import environment

    if arg and arg.endswith(".json"):
        return Path(arg)
    folder = Path(arg or os.environ.get("OUT") or ROOT / "bench" / "results")
    commit = environment()["commit"][:7]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return folder / f"sparse-attention-{tag}-{stamp}-{commit}.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON file, or a folder for it (default $OUT, else bench/results)")
    ap.add_argument("--quick", action="store_true", help="two configs per tile, W2 only")
    ap.add_argument("--dtypes", default="fp16,fp8", help="comma-separated: fp16, fp8")
    ap.add_argument("--configs", default=None,
                    help="sweep only these config names (comma-separated; tiles 64 and 128 both try them)")
    ap.add_argument("--codegen", action="store_true", help="compile every config for sm_90 offline (no GPU)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one config's row
    ap.add_argument("--dtype", default="fp8", help=argparse.SUPPRESS)
    ap.add_argument("--tile", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not set(dtypes) <= {"fp16", "fp8"}:
        ap.error(f"--dtypes {args.dtypes!r}: choose from fp16, fp8")
    configs = QUICK_SWEEP if args.quick else SWEEP
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        configs = {tile: [n for n in names if tile % int(n.split("n")[0][1:]) == 0] for tile in CUBES}
    if args.codegen:
        if os.environ.get("TRITON_INTERPRET") == "1":
            ap.error("unset TRITON_INTERPRET for --codegen")
        rows = codegen_report(configs, dtypes)
        if args.out:
            path = _out_path(args.out, "codegen")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
            print(f"wrote {path}")
        return 0 if all("error" not in r for r in rows) else 1

    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (use --codegen for the offline compile check)")
    if args.one:
        print(json.dumps(run_one(args.one, args.dtype, args.tile)), flush=True)
        return 0
    from fastremover.bench.harness import script_environment

    started = time.perf_counter()
    sweep_rows, best = sweep(configs, dtypes)
    shapes = {"W2": SHAPES["W2"]} if args.quick else SHAPES
    rows = table_rows(best, shapes, KEEPS, dtypes)
    result = {**script_environment(), "heads": HEADS, "head_dim": HEAD_DIM, "shapes": {k: list(v) for k, v in
              shapes.items()}, "best_configs": {f"{d}/{t}": n for (d, t), n in best.items()}, "sweep": sweep_rows,
              "rows": rows, "wall_s": round(time.perf_counter() - started, 1)}
    path = _out_path(args.out, torch.cuda.get_device_name().replace(" ", "-").lower())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    print("best configs: " + ", ".join(f"{d}/{t}: {n}" for (d, t), n in best.items()))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
