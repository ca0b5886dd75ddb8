"""cuDNN's FP8 scaled-dot-product attention (`graph.sdpa_fp8` of the cudnn-frontend Python package), wrapped.

    o = softmax(attn_scale * (q * dq) @ (k * dk)^T) @ (v * dv)        q, k, v float8_e4m3fn [B, S, H, D]

q/k/v codes and their per-tensor dequantization factors (dq, dk, dv: fp32 device tensors, so nothing ever syncs
with the host) go in; the softmax probabilities P are quantized inside cuDNN to e4m3 with the fixed scale
`P_SCALE` (P <= 1, so codes use the top of the e4m3 range); o comes out as e4m3 codes of o * scale_o. On Hopper that
is the only choice: cuDNN (9.19, frontend 1.16) builds fp16/bf16 output for FP8 SDPA only on Blackwell ("only
supported on cuDNN 9.13.0 and newer" + sm_100), so `out_dtype` defaults to FP8 and `supported()` probes what this
device builds. The natural output scale is 1 / descale_v: every output row is a convex combination of v's rows, so
|o| <= amax|v| = 448 * descale_v and the codes can never overflow.

Strides: q/k/v/o are passed to cuDNN as [B, H, S, D] with the strides of our token-major [B, S, H, D] tensors, so no
transpose is ever materialized. One graph is built per (shape, strides, dtypes, device) and cached (the MAX_GRAPHS
most recently used; a captured CUDA graph keeps the ones it recorded, fastremover/lru.py); building costs
~0.1-1 s, executing is one kernel. The cuDNN handle is bound to torch's current stream on every call, so the call is
CUDA-graph capturable like any other kernel launch.

The package is optional (`pip install nvidia-cudnn-frontend`); `available()` says whether it imports and can build
an FP8 graph on this device, and the registry only offers the backend when it can. torch and cudnn are imported on
first use, so the registry (and the CLI's flag checks) load this module without them.

The registry entry at the end: `cudnn-fp8` (alias `fp8`) quantizes q/k/v to per-tensor e4m3 codes with K and V
centred (ops/attention/quantize.py) and hands its FP8 output (codes of (o - c) / sv) straight to the fast
transformer's FP8 O projection.
"""

from __future__ import annotations

import functools
import math
import threading

from fastremover.lru import LRUCache, used
from fastremover.ops.attention.quantize import add_v_mean, needs_cuda, quantize_qkv
from fastremover.ops.attention.registry import AttentionBackend, register
from fastremover.timing import phase

MAX_GRAPHS = 16  # built graphs kept (per shape: one fp8 and one half graph, or cudnn_sparse's paged graph; the
# denoiser keeps 4 captured shapes)
P_SCALE = 448.0  # scale_s: P in [0, 1] -> codes in [0, 448]; descale_s = 1 / P_SCALE (a power-of-two-free constant)


def _cudnn():
    import cudnn  # noqa: PLC0415 - optional dependency

    return cudnn


@functools.lru_cache(maxsize=None)
def import_error() -> str | None:
    """None when cudnn-frontend imports, else why not."""
    try:
        _cudnn()
    except Exception as exc:  # ImportError, or a missing libcudnn
        return f"{type(exc).__name__}: {exc}"
    return None


_handles: dict[int, object] = {}
_lock = threading.Lock()


def _handle(device: torch.device):
    import torch

    cudnn = _cudnn()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _handles:
            with torch.cuda.device(index):
                _handles[index] = cudnn.create_handle()
    return _handles[index]


def _bhsd(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Dims and strides of a [B, S, H, D] tensor as cuDNN's [B, H, S, D]."""
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride()
    return [b, h, s, d], [sb, sh, ss, sd]


def _dtype(cudnn, dtype: "torch.dtype"):
    import torch

    return {
        torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3,
        torch.float16: cudnn.data_type.HALF,
        torch.bfloat16: cudnn.data_type.BFLOAT16,
        torch.float32: cudnn.data_type.FLOAT,
    }[dtype]


def _build(g, device: torch.device, all_plans: bool = False):
    """Validate and build a graph whose inputs/outputs are declared: (graph, workspace, number of built plans).

    Only the heuristics' first choice is built for real runs: picking the fastest of several plans by timing could
    pick differently in another process and change the output bits (runs must be reproducible). all_plans=True is
    for tools/bench_attention.py's plan survey."""
    import torch

    cudnn = _cudnn()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL if all_plans else cudnn.build_plan_policy.HEURISTICS_CHOICE)
    plans = g.get_execution_plan_count() if all_plans else 1
    size = max([g.get_workspace_size()] + [g.get_workspace_size_plan_at_index(i) for i in range(plans)])
    return g, torch.empty(max(1, size), dtype=torch.uint8, device=device), plans


class _Graph:
    """A built graph (self.graph, .workspace, .handle, .plans) and how it runs on torch's current stream."""

    def _execute(self, pack: dict, device: torch.device, plan: int | None) -> None:
        """The heuristics' plan (plan None), or plan number `plan` (tools/bench_attention.py's survey)."""
        import torch

        cudnn = _cudnn()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(device).cuda_stream)
        if plan is None:
            self.graph.execute(pack, self.workspace, handle=self.handle)
        else:
            self.graph.execute_plan_at_index(pack, self.workspace, plan, handle=self.handle)


class _Fp8Graph(_Graph):
    """One built cuDNN graph for fixed shapes/strides/dtypes."""

    def __init__(self, q, k, v, o_shape_stride, out_dtype: torch.dtype, attn_scale: float, device: torch.device,
                 all_plans: bool = False):
        import torch

        cudnn = _cudnn()
        self.handle = _handle(device)
        g = cudnn.pygraph(
            io_data_type=cudnn.data_type.FP8_E4M3,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=self.handle,
        )
        fp8 = cudnn.data_type.FP8_E4M3

        def tensor(name, t):
            dim, stride = _bhsd(t)
            return g.tensor(name=name, dim=dim, stride=stride, data_type=fp8)

        def scalar(name):
            return g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)

        self.q, self.k, self.v = tensor("q", q), tensor("k", k), tensor("v", v)
        self.dq, self.dk, self.dv = scalar("descale_q"), scalar("descale_k"), scalar("descale_v")
        self.ds, self.ss, self.so = scalar("descale_s"), scalar("scale_s"), scalar("scale_o")
        o, _stats, amax_s, amax_o = g.sdpa_fp8(
            q=self.q, k=self.k, v=self.v,
            descale_q=self.dq, descale_k=self.dk, descale_v=self.dv,
            descale_s=self.ds, scale_s=self.ss, scale_o=self.so,
            is_inference=True, attn_scale=attn_scale, use_causal_mask=False, name="sdpa_fp8",
        )
        dim, stride = o_shape_stride
        o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(_dtype(cudnn, out_dtype))
        amax_s.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        self.o, self.amax_s, self.amax_o = o, amax_s, amax_o
        self.graph, self.workspace, self.plans = _build(g, device, all_plans)
        self.amax_buf = torch.empty(2, dtype=torch.float32, device=device)
        self.p_scale = torch.full((1,), P_SCALE, dtype=torch.float32, device=device)
        self.p_descale = torch.full((1,), 1.0 / P_SCALE, dtype=torch.float32, device=device)
        self.one = torch.ones(1, dtype=torch.float32, device=device)

    def run(self, q, k, v, dq, dk, dv, out, scale_o, plan: int | None = None):
        pack = {
            self.q: q, self.k: k, self.v: v, self.dq: dq, self.dk: dk, self.dv: dv,
            self.ds: self.p_descale, self.ss: self.p_scale, self.so: self.one if scale_o is None else scale_o,
            self.o: out, self.amax_s: self.amax_buf[0:1], self.amax_o: self.amax_buf[1:2],
        }
        self._execute(pack, q.device, plan)
        return out


_graphs: LRUCache = LRUCache(MAX_GRAPHS)
_graphs_lock = threading.Lock()


def _cached(key: tuple, build) -> "_Graph":
    """The graph of `key` from the bounded cache, built on a miss; marked in use for a CUDA graph being recorded."""
    with _graphs_lock:
        graph = _graphs.get(key)
    if graph is None:
        with phase("cudnn_graphs"):
            graph = build()
        with _graphs_lock:
            _graphs.put(key, graph)
    used(graph)
    return graph


def _key(q, k, v, out, attn_scale):
    return (q.device, q.shape, q.stride(), k.stride(), v.stride(), out.stride(), out.dtype, attn_scale)


def sdpa_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    *,
    out_dtype: "torch.dtype | None" = None,
    scale_o: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    attn_scale: float | None = None,
) -> torch.Tensor:
    """FP8 attention. q, k, v float8_e4m3fn [B, S, H, D] (unit stride in D), descales fp32 [1] on the device.

    Returns o [B, S, H, D] contiguous in `out_dtype` (float8_e4m3fn: codes of o * scale_o, scale_o a fp32 [1] device
    tensor, default 1 / descale_v (see the module docstring); fp16/bf16: real values, Blackwell only). out_dtype None:
    float8_e4m3fn."""
    import torch

    fp8 = torch.float8_e4m3fn
    out_dtype = fp8 if out_dtype is None else out_dtype
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != fp8 or t.ndim != 4 or t.stride(-1) != 1 or t.device.type != "cuda":
            raise ValueError(f"sdpa_fp8: {name} must be a CUDA float8_e4m3fn [B, S, H, D] tensor with unit stride in D")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"sdpa_fp8: q/k/v shapes differ: {list(q.shape)} {list(k.shape)} {list(v.shape)}")
    if out_dtype == fp8 and scale_o is None:
        scale_o = torch.reciprocal(descale_v)
    if attn_scale is None:
        attn_scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    key = _key(q, k, v, out, attn_scale)
    graph = _cached(key, lambda: _Fp8Graph(q, k, v, _bhsd(out), out.dtype, attn_scale, q.device))
    return graph.run(q, k, v, descale_q, descale_k, descale_v, out, scale_o)


@functools.lru_cache(maxsize=None)
def supported(device_index: int, out_dtype: "torch.dtype | None" = None) -> str | None:
    """None when an FP8 graph with `out_dtype` output (None: float8_e4m3fn) builds and runs on this device, else why
    not."""
    import torch

    fp8 = torch.float8_e4m3fn
    out_dtype = fp8 if out_dtype is None else out_dtype
    why = import_error()
    if why:
        return why
    device = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "cuDNN FP8 attention needs Hopper (sm_90) or newer"
    try:
        x = torch.randn(1, 256, 2, 128, device=device).to(fp8)
        one = torch.ones(1, device=device)
        sdpa_fp8(x, x, x, one, one, one, out_dtype=out_dtype, scale_o=one if out_dtype == fp8 else None)
        torch.cuda.synchronize(device)
    except Exception as exc:  # cudnnGraphNotSupportedError, RuntimeError, ...
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


# ----------------------------------------------------------------------------------------------------------------------
# The backend


def fp8_cudnn(q, k, v, *, smooth_k: bool = True, smooth_v: bool = True):
    q8, k8, v8, sq, sk, sv, *v_mean = quantize_qkv(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v)
    o8 = sdpa_fp8(q8, k8, v8, sq, sk, sv)  # codes of o / sv (Hopper writes FP8 output)
    return add_v_mean(o8.to(q.dtype).mul_(sv.view(())), v_mean[0] if v_mean else None)


def codes(q8, k8, v8, sq, sk, sv, out_dtype=None):
    return sdpa_fp8(q8, k8, v8, sq, sk, sv)


def validate(device, dtype=None, shape=None) -> list[str]:
    if device.type != "cuda":
        return needs_cuda(device, "attention backend cudnn-fp8")
    import torch

    why = supported(device.index if device.index is not None else torch.cuda.current_device())
    return [] if why is None else [f"cuDNN FP8 attention is not available: {why}"]


BACKEND = register(AttentionBackend(
    name="cudnn-fp8", label="cuDNN FP8 attention", aliases=("fp8",), call=fp8_cudnn, validate=validate,
    priority={"exact": 2, "fast": 30}, precision="8bit", takes_codes=True, codes_call=codes, output="fp8-codes",
))
