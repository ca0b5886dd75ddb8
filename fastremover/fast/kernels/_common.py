"""Shared pieces of the fastremover Triton kernels: interpreter detection, row segmentation, exact rounding helpers.

Every kernel in this package runs in two modes:

* compiled (the target: NVIDIA Hopper), launched with `enable_fp_fusion=False` (no mul+add -> FMA contraction anywhere,
  so every fp32 product is rounded before it is added, like the separate eager kernels do) and
  `enable_reflect_ftz=False` (libdevice and `tl.math.rsqrt` use the non-flush-to-zero variants, like PyTorch's CUDA
  build: `rsqrt.approx.f32` instead of `rsqrt.approx.ftz.f32`);
* interpreted (`TRITON_INTERPRET=1` when the kernel module is imported; CPU tests). The interpreter executes the kernel
  body with numpy, which gets fp32/fp16 arithmetic and fp32->fp16 rounding right, but (Triton 3.9):
    - fp32 -> bf16 casts TRUNCATE instead of rounding to nearest even, and bf16 -> fp32 flushes/mangles bf16 subnormals;
    - fp32 -> float8e4nv casts round half away from zero and drop the mantissa carry (31.6 -> 16.0);
    - `tl.inline_asm_elementwise` and libdevice (`extern_elementwise`) calls raise NotImplementedError.
  So under the interpreter the helpers below replace those casts with integer bit manipulation that reproduces
  PyTorch's software conversions bit for bit (c10::BFloat16 round_to_nearest_even, c10 fp8e4m3fn_from_fp32_value),
  and replace inline asm / libdevice by plain Triton ops. On the GPU the hardware conversions are used
  (`cvt.rn.bf16.f32`, `cvt.rn.satfinite.e4m3x2.f32`, `mul.rn.f32`), which give the same bits for every finite value.

Whether a kernel is interpreted is decided from the kernel object itself (`triton.jit` returns an InterpretedFunction
when TRITON_INTERPRET=1 is set at *import* time of the kernel module); that is the ground truth for which code path
can run, and it cannot disagree with the environment read at call time the way a second `os.environ` lookup can.

Row kernels hold a whole row in registers as two power-of-two segments (see `row_segments`), so a row is read once
and written once, and an 8960-wide row costs 9216 lanes instead of next_power_of_2(8960) = 16384.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastremover.timing import triton_imported

triton_imported()  # Triton's compiles timed as a phase where the engine asked for it (fastremover/timing.py)

MAX_ROW = 16384  # widest row the row kernels accept (registers: <= 32 fp32 values per thread at 16 warps)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-12  # row_scale = max(amax, SCALE_FLOOR) / FP8_MAX
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting(kernel) -> bool:
    """True when `kernel` (a @triton.jit object) runs in the Triton CPU interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old triton
        from fastremover.env import triton_interpret

        return triton_interpret()
    return isinstance(kernel, InterpretedFunction)


def launch_options(kernel) -> dict:
    """Compile options for a launch. The interpreter ignores unknown launch kwargs, but we keep them off anyway."""
    if interpreting(kernel):
        return {}
    if torch.version.hip is not None:  # not a target; the AMD backend has no enable_reflect_ftz option
        return {"enable_fp_fusion": False}
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def tma_available(kernel, device: torch.device) -> bool:
    """A TMA kernel (host-side tensor descriptors) can run `kernel` on `device`: Triton has the descriptors, and the
    device is an sm_90+ GPU or the interpreter runs the kernel."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    if interpreting(kernel):
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def patch_width(w: int, widths: tuple = (64, 32, 16, 8)) -> int:
    """The patch width among `widths` that wastes the fewest columns of a w-wide frame (ties: the wider): 832 -> 64,
    416 -> 32, 208 -> 16, 104 -> 8 (13 patches across each)."""
    return min(widths, key=lambda bw: (triton.cdiv(w, bw) * bw, -bw))


@dataclass(frozen=True)
class PatchConfig:
    """Launch shape of a TMA patch kernel (conv3d_fp8.TmaConfig, upsample_conv.UpConvConfig subclass it, so a
    config's type still says which kernel it is for): a bh x bw pixel patch x (block_n0 + block_n1) output channels
    per program (pow2_split of the column block), num_warps, num_stages."""

    bh: int
    bw: int
    block_n0: int
    block_n1: int
    num_warps: int
    num_stages: int


def pow2_split(width: int) -> tuple[int, int] | None:
    """width = BLOCK_N0 + BLOCK_N1 with powers of two >= 16 (BLOCK_N1 may be 0): 96 -> (64, 32), 192 -> (128, 64);
    None when no such split exists (tl.arange needs power-of-two blocks)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    if pow2(width) and width >= 16:
        return width, 0
    hi = 1 << (width.bit_length() - 1)
    lo = width - hi
    return (hi, lo) if pow2(lo) and lo >= 16 else None


AUTOTUNE_NAMESPACE = "autotune"  # the persistent cache's entries (fastremover/cache.py)
# triton.testing.do_bench's budget per candidate (ms of warm-up, ms of timed repetitions; the median is kept): a
# tuning runs in a user's first process at each new size, so it is short. The kernels tuned here take 0.05-2 ms, so
# 5 ms is 3-100 repetitions (what it saves a first run: docs/performance.md, sessions 25-26).
AUTOTUNE_WARMUP_MS = 1
AUTOTUNE_REP_MS = 5


def _stored_config(stored, cands: list):
    """The candidate a persistent-cache value names ({"type", "config": its fields}), None if none of `cands` is it."""
    if not isinstance(stored, dict):
        return None
    for c in cands:
        if type(c).__name__ == stored.get("type") and dataclasses.is_dataclass(c) \
                and dataclasses.asdict(c) == stored.get("config"):
            return c
    return None


def autotune(cache: dict, key: tuple, cands: list, launch, enabled: bool, what: str, *, device=None,
             persistent="default"):
    """The cached best of `cands` for `key`: the first time, each candidate is launched once (compile) and then timed
    with triton.testing.do_bench (one host sync); candidates out of resources (shared memory) are skipped. Without
    tuning (`enabled` False, or one candidate) the first candidate.

    A tuned choice is also kept in the persistent cache (fastremover/cache.py; `persistent`: a PersistentCache, None
    for none, "default": the process's cache on a CUDA `device`), keyed by `what`, `key` and the device's GPU and
    library versions; a later process takes it from there without timing, if it is still one of `cands` (configs
    change a kernel's speed, never its output)."""
    cfg = cache.get(key)
    if cfg is not None:
        return cfg
    if not enabled or len(cands) == 1:
        cfg = cands[0]
        cache[key] = cfg
        return cfg
    from fastremover.cache import default_cache, environment
    from fastremover.timing import phase

    if persistent == "default":
        persistent = default_cache() if device is not None and torch.device(device).type == "cuda" else None
    stored_key = [what, key]
    if persistent is not None:
        cfg = _stored_config(persistent.get(AUTOTUNE_NAMESPACE, stored_key, environment(device)), cands)
        if cfg is not None:
            cache[key] = cfg
            return cfg
    from triton.testing import do_bench

    best = None
    with phase("autotune"):
        for c in cands:
            try:
                launch(c)  # compile outside the timing
                ms = do_bench(lambda: launch(c), warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, return_mode="median")
            except Exception as e:  # e.g. out of shared memory for this config: skip it
                if "out of resource" not in str(e).lower() and "OutOfResources" not in type(e).__name__:
                    raise
                continue
            if best is None or ms < best[0]:
                best = (ms, c)
    if best is None:
        raise RuntimeError(f"{what}: no candidate config runs for {key}")
    cfg = best[1]
    cache[key] = cfg
    if persistent is not None and dataclasses.is_dataclass(cfg):
        persistent.put(AUTOTUNE_NAMESPACE, stored_key, {"type": type(cfg).__name__, "config": dataclasses.asdict(cfg),
                                                        "ms": best[0]}, environment(device))
    return cfg


def row_segments(n: int) -> tuple[int, int]:
    """Split a row of n columns into a head of HEAD = the largest power of two < n (1 for n == 1) columns and a
    masked tail of TAIL = next_power_of_2(n - HEAD) columns; both power-of-two constexpr block sizes, TAIL <= HEAD.

    1536 -> (1024, 512), 2048 -> (1024, 1024), 8960 -> (8192, 1024): no lane is wasted for the model's widths
    except 256 lanes of the 8960-wide FFN rows."""
    if n < 1:
        raise ValueError(f"row width must be >= 1, got {n}")
    head = 1 if n == 1 else 1 << ((n - 1).bit_length() - 1)
    tail = triton.next_power_of_2(max(n - head, 1))
    return head, tail


def row_num_warps(lanes: int) -> int:
    """4 warps up to 2048 lanes, then one warp per 512 lanes, at most 16."""
    return max(4, min(16, triton.next_power_of_2(lanes) // 512))


# ----------------------------------------------------------------------------------------------------------------------
# Input checks (wrappers raise ValueError with the argument's name)


def check_tensor(name: str, t, *, ndim: int, dtypes: tuple, shape: tuple | None = None,
                 row_strided: bool = False, dims: str = "", contiguous: bool = True) -> None:
    """Type, rank, dtype, shape and layout checks; row_strided=True accepts any stride in dim 0 with the rest
    contiguous (a column slice of a wider row-major matrix); contiguous=False leaves the layout to the caller.
    dims names the axes in the rank message (e.g. " [B, S, H, D]")."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D{dims}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not contiguous:
        return
    if row_strided and t.dim() >= 1 and t[:1].is_contiguous():
        return
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); got strides {t.stride()}")


def check_device(kernel, **tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if not interpreting(kernel):
        bad = {n: str(d) for n, d in devices.items() if d.type != "cuda"}
        if bad:
            raise ValueError(
                f"compiled Triton kernels need CUDA tensors, got {bad}; to run on the CPU set TRITON_INTERPRET=1 "
                "before fastremover.fast.kernels is imported"
            )


def check_tokens_per_batch(tokens_per_batch, m: int, batch: int | None = None) -> None:
    if not isinstance(tokens_per_batch, int) or isinstance(tokens_per_batch, bool) or tokens_per_batch < 1:
        raise ValueError(f"tokens_per_batch must be a positive int, got {tokens_per_batch!r}")
    if m % tokens_per_batch:
        raise ValueError(f"the token count M={m} is not a multiple of tokens_per_batch={tokens_per_batch}")
    if batch is not None and m // tokens_per_batch != batch:
        raise ValueError(
            f"M={m} tokens at tokens_per_batch={tokens_per_batch} make {m // tokens_per_batch} batch rows, "
            f"but the per-batch vectors have {batch} rows"
        )


def check_row_width(name: str, n: int) -> None:
    if not 1 <= n <= MAX_ROW:
        raise ValueError(f"{name} rows must be 1..{MAX_ROW} wide, got {n}")


def check_out(name: str, out, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if out is None:
        return
    check_tensor(name, out, ndim=len(shape), dtypes=(dtype,), shape=shape)
    if out.device != device:
        raise ValueError(f"{name} must be on {device}, got {out.device}")


def into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """For the eager references' `out=` arguments (so they are drop-in replacements for the kernels)."""
    if out is None:
        return result
    out.copy_(result)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def mul_rn(a, b, INTERPRET: tl.constexpr):
    """fp32 a * b rounded to nearest even, never contracted into an FMA with a following add (`mul.rn.f32` is never
    fused by ptxas). The interpreter multiplies with numpy, which never fuses either."""
    if INTERPRET:
        p = a * b
    else:
        p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return p


@triton.jit
def bf16_to_f32(v, INTERPRET: tl.constexpr):
    """A bf16 tensor widened to fp32 exactly: under the interpreter through its bits (bits << 16 is the exact fp32
    value; the interpreter's own cast mangles bf16 subnormals), compiled by the cast."""
    if INTERPRET:
        out = (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        out = v.to(tl.float32)
    return out


@triton.jit
def load_f32(ptrs, mask, INTERPRET: tl.constexpr):
    """Load fp16/bf16/fp32 and widen to fp32 exactly (masked lanes read 0)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        v = bf16_to_f32(tl.load(ptrs, mask=mask, other=0.0), INTERPRET)
    else:
        v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def f32_to_bf16_rne(v, INTERPRET: tl.constexpr):
    """fp32 -> bf16, round to nearest even (c10::BFloat16 semantics; NaN -> 0x7FC0 in the emulation)."""
    if INTERPRET:
        bits = v.to(tl.int32, bitcast=True)
        hi = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        hi = tl.where(v != v, 0x7FC0, hi)
        out = hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(tl.bfloat16)
    return out


@triton.jit
def round_to(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> DTYPE (round to nearest even), returned as the DTYPE tensor."""
    if DTYPE == tl.float32:
        out = v
    elif DTYPE == tl.bfloat16:
        out = f32_to_bf16_rne(v, INTERPRET)
    else:
        out = v.to(DTYPE)
    return out


@triton.jit
def round_through(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> DTYPE -> fp32: the value an eager `.to(DTYPE)` leaves, widened back (exact widening)."""
    if DTYPE == tl.float32:
        out = v
    elif DTYPE == tl.bfloat16:
        out = bf16_to_f32(f32_to_bf16_rne(v, INTERPRET), INTERPRET)
    else:
        out = v.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def f32_to_fp8e4m3_rne(v, INTERPRET: tl.constexpr):
    """fp32 -> float8_e4m3fn, round to nearest even, saturating: |v| > 448 -> +-448, NaN -> NaN.

    Torch's own cast (c10 fp8e4m3fn_from_fp32_value, also used by its CUDA copy kernel) is NOT saturating: values
    in (448, 464) round to 448 but |v| >= 464 becomes NaN. The quantizers here only ever cast y / row_scale with
    |y / row_scale| <= 448 * (1 + 2^-23), which both round to 448, so the two agree on every reachable input; the
    explicit saturation below only makes the kernel well defined outside that range (GPU `cvt...satfinite` does the
    same, so the GPU path leaves the clamp to it: an explicit one cost three instructions per element, a fifth of the
    q/k kernel's)."""
    if INTERPRET:
        v = tl.where(tl.abs(v) > 448.0, tl.where(v > 0, 448.0, -448.0), v)
        # c10 fp8e4m3fn_from_fp32_value, bit for bit
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # normal fp8 range (|v| >= 2^-6): add rounding bias to the fp32 bits, keep exponent+3 mantissa bits
        norm = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        # subnormal fp8 range: let an fp32 add with 2^14 (ulp 2^-9) do the round-to-nearest-even
        sub = (tl.abs(v) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        code = tl.where(mag < (121 << 23), sub, norm)
        code = tl.where(mag >= (1087 << 20), 0x7F, code)  # NaN (and |v| >= 464, unreachable after saturation)
        out = (code | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        out = v.to(tl.float8e4nv)  # cvt.rn.satfinite.e4m3x2.f32: +-inf and |v| > 448 -> +-448, NaN -> NaN
    return out


@triton.jit
def row_scale_of(amax, any_nan):
    """row_scale = max(amax, 1e-12) / 448 (correctly rounded division, like torch's `/`), NaN if the row had a NaN
    (torch's amax propagates NaN; tl.max does not)."""
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    return tl.where(any_nan, float("nan"), scale)


@triton.jit
def inverse_scale_of(amax, any_nan):
    """inv_scale = 448 / max(amax, 1e-12) (correctly rounded division), NaN if the row had a NaN. Codes are y times
    this: one division per row instead of one per element (an IEEE division is ~10 instructions on the GPU)."""
    inv = tl.math.div_rn(448.0, tl.maximum(amax, 1e-12))
    return tl.where(any_nan, float("nan"), inv)


@triton.jit
def store_fp8_row(y0, y1, m0, m1, Q_ROW, c0, c1, RS_PTR, INTERPRET: tl.constexpr):
    """Row-wise fp8 of a row held as two segments: amax (a max: order-free), the row scale to RS_PTR, codes to
    Q_ROW + c (masked).

    One reduction finds both the amax and whether the row holds a NaN: the max of |y|'s bit patterns as int32. For
    non-negative floats the bit order is the value order (+inf = 0x7F800000 above every finite value) and every NaN
    pattern sits above +inf, so the integer max is the float amax unless a NaN is present (a float max plus a NaN
    count took three block reductions, each a shared-memory round trip across the warps)."""
    bits0 = tl.where(m0, y0.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    bits1 = tl.where(m1, y1.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    amax_bits = tl.maximum(tl.max(bits0, axis=0), tl.max(bits1, axis=0))
    any_nan = amax_bits > 0x7F800000
    amax = amax_bits.to(tl.float32, bitcast=True)
    tl.store(RS_PTR, row_scale_of(amax, any_nan))
    inv = inverse_scale_of(amax, any_nan)
    tl.store(Q_ROW + c0, quantize_fp8(y0, inv, INTERPRET), mask=m0)
    tl.store(Q_ROW + c1, quantize_fp8(y1, inv, INTERPRET), mask=m1)


@triton.jit
def quantize_fp8(y, inv_scale, INTERPRET: tl.constexpr):
    """(y * inv_scale) -> fp8: a rounded fp32 product (never fused into anything) then RNE to e4m3 (as torch's
    `(y * inv).to(float8_e4m3fn)`: two roundings)."""
    return f32_to_fp8e4m3_rne(mul_rn(y, tl.broadcast_to(inv_scale, y.shape), INTERPRET), INTERPRET)
