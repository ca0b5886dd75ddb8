"""The FP8 linears' GEMM through cuBLASLt directly (ctypes), with the algorithm picked for a zero-byte workspace.

    y[m, n] = (sum_k a[m, k] * w[n, k]) * a_scale[m] * w_scale[n] + bias[n]          (a, w: e4m3; y: fp16/bf16)

This is what `torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale, bias=bias, out_dtype=...,
use_fast_accum=...)` does on Hopper, set up the way ATen sets it up (cuBLASLt, compute fp32, A = w transposed, B = a,
D column-major [N, M] = y row-major [M, N], both scales CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F, epilogue BIAS, the
same fast-accumulation flag, the scale and bias pointers set before the heuristic query - unset, cuBLASLt 13.1 answers
CUBLAS_STATUS_INVALID_VALUE) with one difference: the heuristic is asked for algorithms that need NO workspace.

Why: ATen offers cuBLASLt a 1 MiB workspace, and at the DiT's shapes the heuristic then returns nvjet kernels with a
dynamic tile scheduler whose counters cuBLASLt zeroes with a memset before every call. Inside the W1 CUDA graph a
memset node costs about 4 us of idle GPU before it and 5 us between it and the GEMM; three of the five GEMMs of every
block carry one: ~0.3 ms of a 28 ms step (bench/results/step-timeline-w1-*.json). With no workspace the heuristic
returns the same tile shapes with a static scheduler (`..._ssched_...`), no memset, and the kernels alone are as fast
or faster (bench/results/gemm-memsets-*.json). `CUBLASLT_WORKSPACE_SIZE=0` would do the same, but for every cuBLASLt
call of the process (the reference model's GEMMs included); this module does it for our FP8 linears only.

Only the tile scheduler differs (same tile shapes, same k-loop), so the products are the very same bits as
`torch._scaled_mm`'s: tests/kernels/test_cublaslt.py checks that with torch.equal on the GPU at the W1 / W2 shapes on fresh
random inputs (passed on an H200, cuBLASLt 13.1; bench/results/cublaslt-probe-*.json also covers no bias and fp32
promotion), so falling back to `torch._scaled_mm` changes the speed, not the output.

`unavailable_reason(device)` says why the path cannot run (not CUDA, not sm_90, no cuBLASLt >= 12.9 with outer-vector
scaling in this process); `Fp8Linear` then uses `torch._scaled_mm`.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from fastremover.lru import LRUCache, used
from fastremover.timing import phase

FP8 = torch.float8_e4m3fn
MAX_PLANS = 64  # plans kept (per run shape: the block's 4 GEMMs, a few pointer alignments; a captured CUDA graph keeps
# the plans it recorded, fastremover/lru.py)

# cudaDataType_t / cublasComputeType_t / cublasLt enums (cublasLt.h, library_types.h; ABI-stable values)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 2, 14, 28
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM, DESC_BIAS_DATA_TYPE = 17, 18, 25, 26
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_OUTER_VEC_32F = 3
EPILOGUE_DEFAULT, EPILOGUE_BIAS = 1, 4
PREF_MAX_WORKSPACE_BYTES = 1
PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}
MIN_VERSION = 120900  # outer-vector (row-wise) FP8 scaling: cuBLAS 12.9
OUT_TYPES = {torch.float16: CUDA_R_16F, torch.bfloat16: CUDA_R_16BF}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_cublaslt_path() -> str | None:
    """The libcublasLt this process already has mapped (torch's own), so we call the very library ATen calls."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        return None
    return None


class _Lib:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        for name, args in {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, i32
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], sz
        self.lib, self.path = lib, path
        self.version = int(lib.cublasLtGetVersion())
        self.handles: dict[int, ctypes.c_void_p] = {}

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status} (library {self.path}, version "
                               f"{self.version})")

    def handle(self, index: int) -> ctypes.c_void_p:  # called under _lib_lock
        h = self.handles.get(index)
        if h is None:
            h = ctypes.c_void_p()
            with torch.cuda.device(index):
                self.check(self.lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
            self.handles[index] = h
        return h


_lib_lock = threading.Lock()
_lib: _Lib | None = None


def _library() -> _Lib:
    global _lib
    with _lib_lock:
        if _lib is None:
            torch.cuda.current_blas_handle()  # makes ATen load (and map) its cuBLAS / cuBLASLt
            path = _loaded_cublaslt_path()
            if path is None:
                raise RuntimeError("no libcublasLt is mapped in this process")
            _lib = _Lib(path)
        return _lib


@functools.lru_cache(maxsize=None)
def unavailable_reason(device_type: str, device_index: int | None = None) -> str | None:
    """None when `scaled_mm` can run on this device, else why not (the caller falls back to torch._scaled_mm)."""
    if device_type != "cuda":
        return f"device {device_type}: cuBLASLt FP8 GEMMs need a CUDA GPU"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    index = torch.cuda.current_device() if device_index is None else device_index
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return f"sm_{major}{minor}: this path is tuned and tested on sm_90 (Hopper) only"
    try:
        lib = _library()
    except (OSError, RuntimeError, AttributeError) as e:
        return f"cuBLASLt could not be loaded through ctypes: {e}"
    if lib.version < MIN_VERSION:
        return f"cuBLASLt {lib.version} has no outer-vector FP8 scaling (needs >= {MIN_VERSION})"
    return None


def _alignment(ptr: int) -> int:
    a = 256
    while ptr % a:
        a //= 2
    return a


class _Plan:
    """Descriptors + the chosen algorithm for one (M, N, K, out dtype, bias, fast_accum, alignments) problem."""

    def __init__(self, lib: _Lib, handle, m: int, n: int, k: int, out_type: int, has_bias: bool, fast_accum: bool,
                 aligns: tuple[int, int, int], pointers: tuple, *, max_workspace: int = 0, align_prefs: bool = True):
        """pointers: (w_scale, a_scale, bias) data pointers, set before the heuristic query as ATen does (cuBLASLt
        validates the outer-vector scale setup there); max_workspace / align_prefs exist for the probe experiment."""
        self.lib = lib
        L = lib.lib
        self.desc = ctypes.c_void_p()
        lib.check(L.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                  "MatmulDescCreate")
        self._set(DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        self._set(DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        self._set(DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
        self._set(DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
        self._set(DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0))
        self.has_bias = has_bias
        if has_bias:
            self._set(DESC_EPILOGUE, ctypes.c_uint32(EPILOGUE_BIAS))
            self._set(DESC_BIAS_DATA_TYPE, ctypes.c_int32(out_type))
        # column-major views: A = w as [K, N] (ld K, op T -> [N, K]), B = a as [K, M] (ld K), C = D = y as [N, M]
        self.layouts = []
        for dtype, rows, cols, ld in ((CUDA_R_8F_E4M3, k, n, k), (CUDA_R_8F_E4M3, k, m, k), (out_type, n, m, n)):
            lay = ctypes.c_void_p()
            lib.check(L.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld), "MatrixLayoutCreate")
            self.layouts.append(lay)
        self.a_layout, self.b_layout, self.d_layout = self.layouts
        self.set_pointers(*pointers)
        pref = ctypes.c_void_p()
        lib.check(L.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(max_workspace)  # the point of this module: 0, algorithms without a memset
            lib.check(L.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                      "PreferenceSetAttribute")
            if align_prefs:  # the pointers' actual alignment (the default assumes 256 bytes; row slices may have less)
                for key, align in zip(("A", "B", "C", "D"), (*aligns, aligns[2])):
                    v = ctypes.c_uint32(align)
                    lib.check(L.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MIN_ALIGNMENT[key], ctypes.byref(v),
                                                                     4), "PreferenceSetAttribute")
            result, count = _HeuristicResult(), ctypes.c_int(0)
            lib.check(L.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a_layout, self.b_layout, self.d_layout,
                                                       self.d_layout, pref, 1, ctypes.byref(result),
                                                       ctypes.byref(count)), "MatmulAlgoGetHeuristic")
        finally:
            L.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1 or result.state != 0:
            raise RuntimeError(f"cuBLASLt has no workspace-free FP8 algorithm for M={m} N={n} K={k}")
        self.algo = result.algo
        self.workspace_size = int(result.workspaceSize)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        # the descriptor carries the per-call pointers: setting them and launching must not interleave across threads
        self.lock = threading.Lock()

    def _set(self, attr: int, value) -> None:
        status = self.lib.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value))
        self.lib.check(status, f"MatmulDescSetAttribute({attr})")

    def set_pointers(self, w_scale_ptr: int, a_scale_ptr: int, bias_ptr: int | None) -> None:
        self._set(DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale_ptr))
        self._set(DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale_ptr))
        if self.has_bias:
            self._set(DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr))

    def run(self, handle, a: torch.Tensor, w: torch.Tensor, a_scale, w_scale, bias, y: torch.Tensor, stream: int,
            workspace: torch.Tensor | None = None):
        ws_ptr = None if workspace is None else ctypes.c_void_p(workspace.data_ptr())
        ws_size = 0 if workspace is None else workspace.numel()
        with self.lock:
            # the descriptor holds the scale / bias pointers: set per call (host-side state read by cublasLtMatmul)
            self.set_pointers(w_scale.data_ptr(), a_scale.data_ptr(), bias.data_ptr() if bias is not None else None)
            status = self.lib.lib.cublasLtMatmul(
                handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a_layout,
                ctypes.c_void_p(a.data_ptr()), self.b_layout, ctypes.byref(self.beta), None, self.d_layout,
                ctypes.c_void_p(y.data_ptr()), self.d_layout, ctypes.byref(self.algo), ws_ptr, ws_size,
                ctypes.c_void_p(stream),
            )
        self.lib.check(status, "cublasLtMatmul")

    def __del__(self):
        """Destroy the descriptors (an evicted plan that no captured graph keeps)."""
        try:
            L = self.lib.lib
            for lay in getattr(self, "layouts", ()):
                L.cublasLtMatrixLayoutDestroy(lay)
            if getattr(self, "desc", None):
                L.cublasLtMatmulDescDestroy(self.desc)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
            pass


_plans: LRUCache[_Plan] = LRUCache(MAX_PLANS)


def _check(a, w, a_scale, w_scale, bias, out_dtype, out) -> tuple[int, int, int]:
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != FP8 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D float8_e4m3fn tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    m, k = a.shape
    n, kw = w.shape
    if kw != k:
        raise ValueError(f"a [M, K] = {tuple(a.shape)} and w [N, K] = {tuple(w.shape)} disagree on K")
    if k % 16 or n % 16:
        raise ValueError(f"K and N must be multiples of 16 for FP8 cuBLASLt GEMMs, got K={k}, N={n}")
    if out_dtype not in OUT_TYPES:
        raise ValueError(f"out_dtype must be float16 or bfloat16, got {out_dtype}")
    for name, t, numel in (("a_scale", a_scale, m), ("w_scale", w_scale, n)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != numel
                or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 tensor of {numel} elements, got "
                             f"{getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")
    if bias is not None and (bias.dtype != out_dtype or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] {out_dtype} tensor, got {bias.dtype} {tuple(bias.shape)}")
    if out is not None and (out.dtype != out_dtype or tuple(out.shape) != (m, n) or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{m}, {n}] {out_dtype} tensor, got {out.dtype} {tuple(out.shape)}")
    devices = {t.device for t in (a, w, a_scale, w_scale, bias, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return m, n, k


def scaled_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, *, fast_accum: bool = True,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """y = (a @ w.T) * a_scale * w_scale.T + bias in out_dtype; a [M, K], w [N, K] e4m3 row-major, a_scale [M, 1],
    w_scale [1, N] (or [N]) fp32, bias [N] in out_dtype or None. Raises RuntimeError where `unavailable_reason`."""
    m, n, k = _check(a, w, a_scale, w_scale, bias, out_dtype, out)
    reason = unavailable_reason(a.device.type, a.device.index)
    if reason is not None:
        raise RuntimeError(f"cublaslt.scaled_mm: {reason}; use torch._scaled_mm")
    y = out if out is not None else torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return y
    lib = _library()
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    aligns = (_alignment(w.data_ptr()), _alignment(a.data_ptr()), _alignment(y.data_ptr()))
    key = (index, m, n, k, out_dtype, bias is not None, fast_accum, aligns)
    with _lib_lock:
        handle = lib.handle(index)
        plan = _plans.get(key)
        if plan is None:
            pointers = (w_scale.data_ptr(), a_scale.data_ptr(), bias.data_ptr() if bias is not None else None)
            with phase("cublaslt_plans"):
                plan = _Plan(lib, handle, m, n, k, OUT_TYPES[out_dtype], bias is not None, fast_accum, aligns,
                             pointers)
            _plans.put(key, plan)
    used(plan)
    plan.run(handle, a, w, a_scale, w_scale, bias, y, torch.cuda.current_stream(a.device).cuda_stream)
    return y
