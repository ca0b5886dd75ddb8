"""The fast VAE's conv dispatch: which implementation runs each conv (`ConvDispatch`), and the causal streams.

A conv runs as one of:
* torch's F.conv3d / F.conv2d, or the same call through a checked cuDNN plan (`fastremover.fast.cudnn_conv.ConvPlans`,
  torch's bits; `conv_plans`), the bias added by the conv, by `residual.add_bias_` after the bias-free conv (CUDA:
  ATen's conv-then-add_ bit for bit at memory speed), or deferred to the consuming kernel (`fuse_bias`, `deferred`);
* a 3x3x3 causal conv in row stripes (`stripe_mib`, 1-frame steps of large frames);
* the FP8 conv3d kernel (`fastremover.fast.kernels.conv3d_fp8`, precision "fp8"): with a dynamic activation scale
  (it reads the fp16 cached frames itself) or a static one (the producing norm writes e4m3 codes into the stream
  buffer; its epilogue may add the residual);
* the sub-pixel nearest-2x + 3x3 conv (`fastremover.fast.kernels.upsample_conv`, the decoder's upsamplers).
The NVFP4 VAE convs (`--weights nvfp4`) are an eager-VAE feature (fast/nvfp4_conv.py); this VAE converts any conv's
weight to its dense layout once.

Causal caches: each causal conv keeps its last 2 input frames in a 2-slot ring (`Stream`); per chunk its input is
assembled in one buffer [older, newer cached frame, the n new frames] that the producer (`Fill`: the fused norm +
SiLU kernel, or a copy) writes directly, together with the cache's new frames (see the package docstring).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.errors import FastRemoverError
from fastremover.fast.vae.convert import CL2, CL3, FP8, ConvWeights, VAEWeights
from fastremover.models.vae import CACHE_T, CausalConv3d

FP8_MODULE = "fastremover.fast.kernels.conv3d_fp8"


def fp8_conv_available() -> bool:
    """True when the FP8 implicit-GEMM conv3d module is part of this installation."""
    try:
        return importlib.util.find_spec(FP8_MODULE) is not None
    except (ImportError, ValueError):
        return False


def load_fp8(device: torch.device):
    """The FP8 conv3d module for precision "fp8", or a FastRemoverError saying why it cannot run here."""
    if not fp8_conv_available():
        raise FastRemoverError(
            "vae precision fp8: the FP8 conv3d kernel (fastremover.fast.kernels.conv3d_fp8) is not available in "
            "this build; use --vae-precision auto (fp16)"
        )
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise FastRemoverError("vae precision fp8 needs a CUDA GPU with FP8 tensor cores (sm_89 or newer)")
    return importlib.import_module(FP8_MODULE)


def load_upconv(device: torch.device, dtype: torch.dtype):
    """The sub-pixel upsample conv module where it runs (CUDA sm_90+, fp16/bf16), else None."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from fastremover.fast.kernels import upsample_conv
    except ImportError:
        return None
    return upsample_conv if upsample_conv.available(device) else None


def load_conv_plans(device: torch.device, dtype: torch.dtype, conv_plans: bool | str):
    """The cuDNN plan chooser of the convs (fast/cudnn_conv.py: torch's bits, faster plans where cuDNN has them),
    or None: "auto" uses it where it can run (CUDA, fp16/bf16, cudnn-frontend) unless
    FASTREMOVER_CUDNN_CONV_PLANS=0; True raises where it cannot; False: torch's convs."""
    from fastremover.env import kernel_tuning
    from fastremover.fast import cudnn_conv

    if conv_plans not in ("auto", True, False):
        raise ValueError(f"conv_plans must be 'auto', True or False, got {conv_plans!r}")
    why = cudnn_conv.available(device, dtype)
    if conv_plans is True and why is not None:
        raise FastRemoverError(f"conv_plans=True: {why}")
    if conv_plans is False or why is not None or (conv_plans == "auto" and not kernel_tuning().cudnn_conv_plans):
        return None
    return cudnn_conv.ConvPlans(device)


class Fill:
    """The producer of a causal conv's new input frames: `write(src, view, tail)` puts src (norm+SiLU of it, or a
    copy) into view and, if tail is given, its last frames into tail. Called with rows=(lo, hi) it produces only
    those rows (striped convs). `release()` drops src, so the producer's input can be freed before the conv
    allocates its output (the caller drops its own reference first)."""

    def __init__(self, src, write, rows_ok: bool = True, norm: nn.Module | None = None):
        self.src, self.write, self.rows_ok, self.norm = src, write, rows_ok, norm

    def __call__(self, view, tail=None, rows: tuple | None = None, **kw) -> None:
        """kw: quant_scale= for a norm fill writing e4m3 codes (static-scale FP8 convs)."""
        src = self.src if rows is None else self.src[:, :, :, rows[0] : rows[1]]
        self.write(src, view, tail, **kw)

    def release(self) -> None:
        self.src = None


def copy_fill(src: torch.Tensor) -> Fill:
    """A Fill that copies src (conv_in of the decoder, time_conv)."""

    def write(x, view, tail):
        view.copy_(x)
        if tail is not None:  # the cache may leave out the zero padding channels
            tail.copy_(x[:, : tail.shape[1], x.shape[2] - tail.shape[2] :])

    return Fill(src, write)


class Stream:
    """What the causal modules remember between chunks of one encode/decode call (the fast twin of CausalCache):
    the last frames of each conv's input stream, keyed by the eager module, and which modules have run."""

    def __init__(self):
        self.cache: dict[nn.Module, torch.Tensor] = {}
        self.older: dict[nn.Module, int] = {}  # causal convs: which cache slot holds the older frame
        self.visited: set = set()

    def first_visit(self, module: nn.Module) -> bool:
        if module in self.visited:
            return False
        self.visited.add(module)
        return True


def frames_2d(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W] channels-last (a view when x is channels_last_3d-contiguous)."""
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 3, 4, 1).reshape(b * t, h, w, c).permute(0, 3, 1, 2)


def frames_5d(y: torch.Tensor, b: int) -> torch.Tensor:
    """[B*T, C, H, W] channels-last -> [B, C, T, H, W] channels-last-3d (a view)."""
    n, c, h, w = y.shape
    if not y.is_contiguous(memory_format=CL2):
        y = y.contiguous(memory_format=CL2)
    return y.view(b, n // b, c, h, w).transpose(1, 2)


def empty_cl3(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=CL3)


@contextlib.contextmanager
def cudnn_benchmark(on: bool | None):
    """torch.backends.cudnn.benchmark = on for the block (None: leave it as it is)."""
    if on is None:
        yield
        return
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


class ConvDispatch:
    """Runs the converted convs (`weights`) on device / dtype: see the module docstring for the paths.

    add_bias / pad_copy: `residual.add_bias_` / `pad_copy_` or their eager references. bias_kernel: the convs' own
    bias adds as the bias-free conv + add_bias (CUDA with the Triton kernels), else inside the conv. plans: a
    `ConvPlans` or None. fp8: the conv3d_fp8 module (precision "fp8") or None. upconv: the upsample_conv module or None.
    """

    def __init__(self, weights: VAEWeights, device: torch.device, dtype: torch.dtype, *,
                 add_bias: Callable, pad_copy: Callable, bias_kernel: bool, plans=None, fp8=None,
                 fp8_precise_acc: bool = False, fuse_bias: bool = True, stripe_mib: float | None = None,
                 upconv=None):
        self.weights, self.device, self.dtype = weights, device, dtype
        self.add_bias, self.pad_copy, self.bias_kernel, self.plans = add_bias, pad_copy, bias_kernel, plans
        self.fp8, self.fp8_precise_acc, self.fuse_bias = fp8, fp8_precise_acc, fuse_bias
        self.stripe_mib, self.upconv = stripe_mib, upconv

    def __getitem__(self, module: nn.Module) -> ConvWeights:
        return self.weights.conv[module]

    def deferred(self, conv: nn.Module) -> torch.Tensor | None:
        """The bias a fuse_bias consumer adds for `conv` (which then runs without it), or None: the conv adds its own.
        Only call sites whose consumer is a bias-aware kernel ask (`defer=True`); FP8 convs add theirs in-kernel."""
        c = self.weights.conv[conv]
        if not self.fuse_bias or c.fp8 is not None:
            return None
        return c.bias

    def conv_b(self, conv_fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args) -> torch.Tensor:
        """conv_fn(x, weight, bias, *args) (F.conv2d / F.conv3d); on CUDA with our kernels the bias is added by
        `add_bias_` after the bias-free conv: the same bits as ATen's cuDNN path (conv, then `out.add_(bias)`), one
        pass at memory speed instead of torch's strided add on a channels-last output."""
        if bias is not None and not self.bias_kernel:
            return conv_fn(x, weight, bias, *args)
        if self.plans is not None and conv_fn in (F.conv2d, F.conv3d):
            y = self.plans.conv(x, weight, *args)  # torch's bits (cudnn_conv's contract)
        else:
            y = conv_fn(x, weight, None, *args)
        return y if bias is None else self.add_bias(y, bias)

    def conv3d(self, x: torch.Tensor, c: ConvWeights, keep_bias: bool = True) -> torch.Tensor:
        y = self.conv_b(F.conv3d, x, c.weight, c.bias if keep_bias else None, c.stride, c.padding)
        # cuDNN keeps channels-last; some CPU conv paths return NCDHW for tiny shapes
        return y if y.is_contiguous(memory_format=CL3) else y.contiguous(memory_format=CL3)

    def pointwise(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.conv3d(x, self.weights.conv[conv])

    def causal(self, conv: CausalConv3d, st: Stream, n: int, bchw: tuple, fill, defer: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """The causal conv `conv` on the next n frames of its input stream; fill(view, tail) writes those frames
        into `view` [B, C, n, H, W] and, when `tail` is given, the last tail.shape[2] of them into `tail` too.
        defer=True: the caller's consumer adds `self.deferred(conv)` (when not None), so the conv leaves it out.

        The cache is 2 slots; `st.older[conv]` says which holds the older frame. A chunk of n >= 2 frames rewrites
        both slots in order; a 1-frame chunk overwrites only the older slot (which then becomes the newer one), so
        there is never a cache-to-cache copy."""
        c = self.weights.conv[conv]
        front = c.front
        if front != CACHE_T:
            raise AssertionError(f"causal conv with {front} front frames")
        static = c.act_scale is not None  # a static-scale FP8 conv: e4m3 buffer and cache (causal_fp8_static)
        if residual is not None and not static:
            raise AssertionError("only a static-scale FP8 conv adds a residual in its epilogue")
        b, ch, h, w = bchw
        kw = dict(device=self.device, dtype=FP8 if static else self.dtype, memory_format=CL3)
        # The cache keeps the real channels only (cc < ch when the input carries zero padding, `pad_channels`): the
        # padding would cost a third more cache memory at the padded level for zeros. The FP8 kernel reads the cache
        # itself, at the input's width.
        padded = ch != conv.in_channels and ch == self.weights.width(conv.in_channels, conv)
        cc = conv.in_channels if padded and c.fp8 is None else ch
        cache = st.cache.get(conv)
        if cache is None:  # zeros (zero e4m3 codes) before the first frame
            cache = st.cache[conv] = torch.empty((b, cc, front, h, w), **kw).zero_()
            st.older[conv] = 0
        older = st.older[conv]
        if static:
            return self.causal_fp8_static(conv, c, st, cache, older, n, bchw, fill, residual)
        if c.fp8 is not None:
            return self.causal_fp8(conv, c, st, cache, older, n, bchw, fill)
        keep_bias = not (defer and self.deferred(conv) is not None)
        stripes = self.stripes(b * ch * h * w, h) if n == 1 and fill.rows_ok and c.padding[1] == 1 else 1
        if stripes > 1:
            return self.causal_striped(conv, c, st, cache, older, bchw, fill, stripes, keep_bias)
        buf = torch.empty((b, ch, front + n, h, w), **kw)
        self.fill_stream(conv, st, buf, cache, older, n, fill, pad=cc < ch)
        fill.release()  # the producer's input may be freed before the conv allocates its output
        return self.conv3d(buf, c, keep_bias)

    def fill_stream(self, conv, st: Stream, buf: torch.Tensor, cache: torch.Tensor, older: int, n: int, fill,
                    pad: bool = False, **fill_kw) -> None:
        """buf [B, C, 2 + n, H, W] = [older cached frame, newer cached frame, the n new frames written by `fill`,
        which also writes the last of them into the cache]; then the slots rotate (see `causal`). pad: the cache
        leaves out buf's zero padding channels (written as zeros). fill_kw: passed to fill (quant_scale=)."""
        front = cache.shape[2]
        if pad:  # the older slot first, zeros in the padding channels
            self.pad_copy(buf[:, :, :front], cache, older)
        elif older == 0:
            buf[:, :, :front].copy_(cache)
        else:
            buf[:, :, :1].copy_(cache[:, :, 1:])
            buf[:, :, 1:front].copy_(cache[:, :, :1])
        if n >= front:
            fill(buf[:, :, front:], cache, **fill_kw)
            st.older[conv] = 0
        else:
            fill(buf[:, :, front:], cache[:, :, older : older + 1], **fill_kw)
            st.older[conv] = 1 - older

    def stripes(self, frame_elements: int, rows: int) -> int:
        """How many row stripes a 1-frame conv step of this size runs in (1: none); see `stripe_mib`."""
        if self.stripe_mib is None:
            return 1
        frame_bytes = frame_elements * (torch.finfo(self.dtype).bits // 8)
        target = self.stripe_mib * 2**20
        if frame_bytes <= 2 * target:
            return 1
        return max(1, min(-(-frame_bytes // int(target)), rows // 8))

    def causal_striped(self, conv, c: ConvWeights, st: Stream, cache, older: int, bchw: tuple, fill: Fill,
                       stripes: int, keep_bias: bool = True) -> torch.Tensor:
        """A 1-frame step of a 3x3x3 causal conv in horizontal stripes, so the 3-frame input buffer is never whole.

        Stripe [r0, r1) convolves rows [r0-1, r1+1) of (older, newer, new) frames (zero rows at the image border)
        with no H padding and is copied into the output. The new frame replaces the older cache slot row by row;
        row r1-1 is written by the next stripe, which still reads the old one as its top halo."""
        b, ch, h, w = bchw
        kw = dict(device=self.device, dtype=self.dtype, memory_format=CL3)
        bounds = [round(k * h / stripes) for k in range(stripes + 1)]
        y = None
        done = 0  # rows [0, done) of the new frame are in the cache already
        for r0, r1 in zip(bounds[:-1], bounds[1:]):
            lo, hi = max(r0 - 1, 0), min(r1 + 1, h)
            top, bottom = int(r0 == 0), int(r1 == h)
            buf = torch.empty((b, ch, 3, top + hi - lo + bottom, w), **kw)
            if top:
                buf[:, :, :, :1].zero_()
            if bottom:
                buf[:, :, :, -1:].zero_()
            body = buf[:, :, :, top : top + hi - lo]
            # the older slot first; zeros in the padding channels when the cache leaves them out (cc < ch)
            cc = cache.shape[1]
            self.pad_copy(body[:, :, :2], cache[:, :, :, lo:hi], older)
            fill(body[:, :, 2:], None, rows=(lo, hi))
            end = h if r1 == h else r1 - 1
            cache[:, :, older : older + 1, done:end].copy_(body[:, :cc, 2:, done - lo : end - lo])
            done = end
            ys = self.conv_b(F.conv3d, buf, c.weight, c.bias if keep_bias else None, c.stride, (0, 0, c.padding[2]))
            del buf, body
            if y is None:
                y = torch.empty((b, ys.shape[1], 1, h, w), **kw)
            y[:, :, :, r0:r1].copy_(ys)
            del ys
        fill.release()
        st.older[conv] = 1 - older
        return y

    def causal_fp8(self, conv, c: ConvWeights, st: Stream, cache, older: int, n: int, bchw: tuple, fill):
        """FP8 conv3d kernel: it reads the cached frames and the new ones itself (no buffer); prev must be in order."""
        b, ch, h, w = bchw
        if older == 1:
            cache = st.cache[conv] = cache[:, :, [1, 0]].contiguous(memory_format=CL3)
            st.older[conv] = 0
        x = torch.empty((b, ch, n, h, w), device=self.device, dtype=self.dtype, memory_format=CL3)
        fill(x, None)
        fill.release()
        y = self.fp8.causal_conv3d_fp8(cache, x, c.fp8[0], c.fp8[1], c.bias,  # cache: zeros before frame 0
                                       precise_acc=self.fp8_precise_acc)
        if not y.is_contiguous(memory_format=CL3):
            y = y.contiguous(memory_format=CL3)
        if n >= CACHE_T:
            cache.copy_(x[:, :, n - CACHE_T :])
        else:  # [newer cached frame, x] (two disjoint slots: no overlap)
            cache[:, :, :1].copy_(cache[:, :, 1:])
            cache[:, :, 1:].copy_(x)
        return y

    def causal_fp8_static(self, conv, c: ConvWeights, st: Stream, cache, older: int, n: int, bchw: tuple,
                          fill: Fill, residual: torch.Tensor | None = None) -> torch.Tensor:
        """FP8 conv with a static activation scale (`static_act_scale`): the producing norm + SiLU writes e4m3 codes
        straight into the stream buffer [older, newer cached frame, n new frames] and into the e4m3 cache (its tail),
        and the TMA kernel reads that buffer: no amax pass, no quantization pass, and half the bytes of fp16 frames.
        The cache slots rotate as in `causal`."""
        if fill.norm is None or fill.norm is not c.act_norm:
            raise AssertionError("a static FP8 activation scale must come from the norm that writes the conv input")
        b, ch, h, w = bchw
        if cache.dtype != FP8 or cache.shape[1] != ch:
            raise AssertionError("a static-scale FP8 conv needs its e4m3 cache at the input's width")
        buf = torch.empty((b, ch, CACHE_T + n, h, w), device=self.device, dtype=FP8, memory_format=CL3)
        self.fill_stream(conv, st, buf, cache, older, n, fill, quant_scale=c.act_scale)
        fill.release()
        return self.fp8.conv3d_fp8_stream(buf, CACHE_T, c.fp8[0], c.fp8[1], c.bias, c.act_scale, self.dtype,
                                          precise_acc=self.fp8_precise_acc, residual=residual)

    def upsample2x(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """nearest 2x then the 3x3 conv `conv`, per frame of x [B, C, T, H, W]: one sub-pixel conv (`upconv`) where
        the conv has phase weights, else F.interpolate + the conv, in row stripes for large frames (`stripe_mib`)."""
        b = x.shape[0]
        c_w = self.weights.conv[conv]
        frames = frames_2d(x)
        n, c, h, w = frames.shape
        stripes = self.stripes(n * c * 4 * h * w, 2 * h)
        if stripes == 1 and c_w.phase is not None:  # nearest 2x + 3x3 conv as one sub-pixel conv
            if not frames.is_contiguous(memory_format=CL2) or frames.data_ptr() % 16:  # TMA needs both
                frames = frames.clone(memory_format=CL2)
            return frames_5d(self.upconv.upsample_conv2x(frames, c_w.phase, c_w.bias), b)
        if stripes == 1:
            up = F.interpolate(frames, scale_factor=2.0, mode="nearest-exact")  # exact in the model dtype
            del frames
            if not up.is_contiguous(memory_format=CL2):
                up = up.contiguous(memory_format=CL2)
            return frames_5d(self.conv_b(F.conv2d, up, c_w.weight, c_w.bias, c_w.stride, c_w.padding), b)
        # in row stripes: upsampled rows [lo, hi) are input rows [lo // 2, (hi - 1) // 2] repeated
        big_h = 2 * h
        bounds = [round(k * big_h / stripes) for k in range(stripes + 1)]
        y = None
        for r0, r1 in zip(bounds[:-1], bounds[1:]):
            lo, hi = max(r0 - 1, 0), min(r1 + 1, big_h)
            i0, i1 = lo // 2, (hi - 1) // 2 + 1
            up = F.interpolate(frames[:, :, i0:i1], scale_factor=2.0, mode="nearest-exact")
            top, bottom = int(r0 == 0), int(r1 == big_h)
            buf = torch.empty((n, c, top + hi - lo + bottom, 2 * w), device=x.device, dtype=x.dtype,
                              memory_format=CL2)
            if top:
                buf[:, :, :1].zero_()
            if bottom:
                buf[:, :, -1:].zero_()
            buf[:, :, top : top + hi - lo].copy_(up[:, :, lo - 2 * i0 : hi - 2 * i0])
            del up
            ys = self.conv_b(F.conv2d, buf, c_w.weight, c_w.bias, c_w.stride, (0, c_w.padding[1]))
            del buf
            if y is None:
                y = torch.empty((n, ys.shape[1], big_h, 2 * w), device=x.device, dtype=x.dtype, memory_format=CL2)
            y[:, :, r0:r1].copy_(ys)
            del ys
        return frames_5d(y, b)
