"""The fast Wan 2.1 VAE: channels-last 3D end to end, fused RMS norm + SiLU, causal caches without concatenation.

`FastWanVAE(vae)` runs the same math as `fastremover.models.vae.WanVAE` (whose weights it takes, converted once to
channels-last on the target device/dtype), chunk by chunk exactly as the eager model does (encode: frame 0, then 4
frames; decode: one latent frame, also as an iterator, `decode_iter`), behind the pipeline's
`fastremover.engine.vae.VideoVAE` interface with its own memory model (`memory_bytes`, which the tiling plan uses), with
these changes:

* Layout: every activation is channels-last ([B, C, T, H, W] with NDHWC memory; per-frame 2-D work on [B*T, C, H, W]
  channels-last views of it), and so is every weight, so cuDNN never converts layouts around a conv. The 3-channel
  ends (encoder conv_in, decoder conv_out) are zero-padded to 8 channels on CUDA (`pad_rgb`), a width cuDNN's NHWC
  tensor-core kernels take; the padding adds exact zeros.
* Channel padding (`pad_channels`, 64 on CUDA unless precision="fp8"): an activation whose channel count is above 64 and not a
  multiple of it is stored zero-padded to the next multiple - in Wan 2.1 the decoder's 96-channel full-resolution
  level and head run as 128 channels. Why: cuDNN's fp16 channels-last conv runs the 96-channel 3x3x3 convs at ~280
  TFLOP/s against ~620 at 192/384; the same conv with input and output zero-padded to 128 takes 1.034 vs 1.419 ms (4
  frames of 480x832) and 0.585 vs 0.748 ms (3 frames), although it does (128/96)^2 = 1.78x the FLOPs
  (bench/results/cudnn-conv-half-pad128-*.json). How: conv weights get zero rows/columns (an attention block's
  q | k | v and an upsampler's two time halves padded group by group), norms a zero gamma and the real C in their
  sqrt(C) (`vae_rms_norm(channels=)`), so the padding channels hold exact zeros all the way and add exact zeros to
  every sum (tests/test_vae_fast.py checks the padded input of every causal conv3d); the video and latent ends keep
  their widths.
  The causal caches keep the real channels only: the norm kernel writes its tail 96 wide, and `residual.pad_copy_`
  puts the cached frames into the front of the 128-wide conv buffer with zeros behind, in one pass (0.100 ms at the W2
  decode shape; its eager reference, torch's roll + strided copy + zero fill, takes 2.29 ms). Torch's strided copies
  + fill, used first, had eaten the whole gain: decode 0.935 vs 0.936 s unpadded (vae-w2-pad-compactcache-*.json). Padded caches
  would cost a third more cache memory for zeros: the decode's peak went from 56 % to 65 % of the reference's, over
  issue #6's 60 %. Only the decoder is padded by default (`pad_encoder=True` pads the encoder too): the encoder's
  gain (~50 ms) needs its 2-frame steps, whose wider transients put the encode's peak over 60 % as well
  (bench/results/vae-w2-pad-ef*-*.json). H200, W2 (bench/results/vae-w2-pad-r3-*-999f070.json, 3 repeats): decode
  0.961 -> 0.904 s, total 2.054 -> 1.998 s, peak 59.3 % of the reference's, PSNR unchanged (65.97 dB). Not
  bit-identical to pad_channels=0 on the GPU only because cuDNN picks another algorithm for the wider conv. Off in
  FP8 mode: the FP8 kernel is slower at 128 channels than at 96 (W2 2.05 vs 1.93 s).
* Norms: `fastremover.fast.kernels.vae_norm` (one pass, fp32 statistics, same rounding points as eager) on CUDA, in
  its fast-math mode in every engine mode (a reciprocal per pixel and tl.sigmoid: 0.565 -> 0.125 ms per
  full-resolution call on the H200, within 3 ulps of eager or below one ulp of the frame's largest output, on
  ~1e-4 of the elements; `precise_norm=True` for the bit-exact-given-the-denominator mode); the eager reference of that
  module elsewhere (`kernels="torch"`).
* Causal caches: each causal conv keeps only its last 2 input frames ([B, C, 2, H, W], zeros before the first frame,
  the same frames the eager `CausalCache` hands out). Per chunk the conv's input is assembled in one buffer
  [B, C, 2+n, H, W]: the 2 cached frames are copied to its front, the producer (the fused norm + SiLU kernel, or a
  copy for conv_in / time_conv) writes the n new frames directly behind them and, in the same pass, the last 2 of them
  into the cache (a 1-frame chunk overwrites only the older of the 2 cache slots: a ring, no cache-to-cache copy);
  cuDNN convolves the whole buffer with spatial padding only. No torch.cat, no separate F.pad, no
  clone of the tail. The buffers are transient (the caching allocator recycles them), so memory holds 2 frames per
  conv, like the eager cache, not 2+n.
* Memory: the full-resolution levels (encoder level 0; decoder's last two levels and its head) run
  `encode_frames` (2) / `decode_frames` (1) frames at a time (decode_frames "auto", the default: whole chunks for
  small frames on CUDA, where the short kernels of the 1-frame loop wait on the CPU's launches; see
  SMALL_FRAME_PIXELS): every causal conv is a stream, so splitting a chunk in
  time changes nothing but the size of the transient activations (the decoder splits inside the last upsampler
  before those levels, between its temporal and spatial part, so the frames waiting are small ones). A conv's
  producer input is released before the conv allocates its output; residual adds are in place; the last residual
  block before a spatial downsample writes straight into the zero-padded input of the stride-2 conv (no F.pad copy).
  The decoder's conv_out (3 outputs from 96 channels) keeps two small fp32 partial sums instead of caching 2 wide
  input frames (`_decoder_head`).
  Measured on the CPU with a live-tensor counter (base_dim 16, 240x416, 13 frames; activations only, diffusers'
  AutoencoderKLWan in bf16 = 100 %): encode (two passes) 54 %, decode 59 % (decode_frames=1; 69 % at 2, 81 % at 4;
  57 % with row stripes, `stripe_mib`). The 2-frame caches alone are ~43 % of diffusers' decode peak (and the
  output video 5 %), so the decode cannot go much lower with cuDNN convs; a batch-2 encode doubles the caches
  (108 %), which is why `pair="auto"` keeps W2-sized clips on two passes.
* Encode of the masked video and the mask video as one batch of 2 (`encode_pair`, `encode_removal_inputs`) when
  `pair` allows it; the mask video 2*mask-1 and masked = frames*(1-mask) are formed per chunk inside the conv_in
  buffer (same fp16 ops as the pipeline's, so the same bits), not as two extra full videos.
* No fp32 round trips: nearest upsampling, clamping, padding and the cache copies are exact in the model dtype.
* The convs' own bias adds that cannot be deferred (below) run as the bias-free conv + `residual.add_bias_` on CUDA:
  ATen's conv-then-`add_(bias)` bit for bit, one pass at memory speed instead of torch's strided add.
* Deferred conv biases (`fuse_bias=True`, the default): ATen's cuDNN path runs every
  `F.conv3d/conv2d(x, w, bias)` as the bias-free conv followed by `out.add_(bias)`, a [1, C, 1, 1, 1] broadcast add
  that takes torch's slow strided kernel on channels-last tensors (W2 on the H200: 180 ms of the encode, 101 ms of
  the decode). Where a conv's output has exactly one consumer and that consumer is one of our kernels, the conv runs
  without bias and the consumer adds it with the same rounding (fp32 add, RNE to the dtype) before its own math:
  a residual block's conv1 (-> norm2 + SiLU, `vae_norm`'s `bias=`), its conv2 and the attention block's proj (->
  the residual add, `add_frames`' `bias=`: two roundings, as the two eager adds). The result is bit-identical to
  fuse_bias=False wherever the conv itself is deterministic (tests/test_vae_fast.py: the CPU with a conv that
  composes like cuDNN's, and a GPU test at a W2 chunk). H200, W2: bit-identical, 2.549 -> 2.381 s (1.07x) for both
  encodes + the decode (bench/results/vae-w2-fusebias-*.json). Not deferred: FP8 convs (their kernel adds the bias itself); conv_in, the
  resample convs and time_conv, whose outputs feed a residual block's norm1 AND its shortcut (or a copy), so the
  biased values would have to be written anyway; and the rest (conv_shortcut, to_qkv, conv_out / the tap head, the
  quant convs). At W2 that defers about 75 % of the encode's and 83 % of the decode's bias-add elements (counted
  with a shape-only run; if the add's time scales with its size, ~135 + ~85 ms of the 180 + 101 ms).

Numerics: not bit-identical to the eager module (cuDNN picks other algorithms for channels-last, the norm's sum
of squares is added in another order, and its default fast mode rounds step 3 and the SiLU differently), but the same
function at fp16/bf16 precision; tests/test_vae_fast.py checks CPU fp32 agreement with WanVAE and the GPU test
PSNR >= 45 dB at the real size.

FP8 (`precision="fp8"`): the 3x3x3 causal convs of the residual blocks where `fp8_pays` (every encoder level, the
decoder's 96-channel level: `fp8_encoder_max_channels` / `fp8_max_channels`) go to
`fastremover.fast.kernels.conv3d_fp8`, weights quantized once by its `quantize_conv_weight`; everything else stays in
the model dtype. With the TMA kernel (sm_90+), `fp8_scales="static"`: a residual block's conv reads a norm + SiLU
output, which is bounded, so its activation scale is fixed at load (`static_act_scale`); the norm kernel writes e4m3
codes of that scale straight into the conv's stream buffer [older, newer cached frame, new frames] and into an e4m3
cache, and `conv3d_fp8_stream` convolves the buffer, adding conv2's shortcut in its epilogue (no amax pass, no
quantization pass, no residual add). `fp8_scales="dynamic"` (the only choice without the TMA kernel): one scale per
call from the amax of the conv's input, `causal_conv3d_fp8(prev, x, ...)` (it reads the fp16 cached frames and the new
ones itself). Without that module fp8 raises a FastRemoverError.

Upsampling (`upsample_conv`): on sm_90+ in fp16/bf16 the decoder's nearest 2x + 3x3 conv runs as one sub-pixel conv
(`fastremover.fast.kernels.upsample_conv`: four 2x2 convs of the low-resolution frames with summed weights, written
interleaved by TMA stores; 2.25x fewer FLOPs, no upsampled tensor). Not bit-identical to the eager pair (the summed
weights are rounded once to the dtype); within the bound its tests assert.

`python tools/bench_vae.py` (not shipped) compares this VAE with diffusers' AutoencoderKLWan (the reference) at the W2
size on a CUDA GPU: per-stage time and peak memory, PSNR of the decoded video, cosine of the latents.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.config import VAE_PRECISIONS, FastVAEOptions
from fastremover.errors import FastRemoverError
from fastremover.models.vae import (
    CACHE_T,
    ENCODE_CHUNK_FRAMES,
    AttentionBlock,
    CausalConv3d,
    MidBlock,
    Resample,
    ResidualBlock,
    UpBlock,
    WanVAE,
)
from fastremover.engine.vae import VideoVAE

CL3 = torch.channels_last_3d
CL2 = torch.channels_last
FP8_MAX_CHANNELS = FastVAEOptions().fp8_max_channels  # the decoder's 96-channel full-resolution level (fp8_pays)
FP8_ENCODER_MAX_CHANNELS = 384  # default fp8_encoder_max_channels: every level of the encoder (see fp8_pays)
FP8 = torch.float8_e4m3fn
KERNELS = ("auto", "triton", "torch")
FP8_MODULE = "fastremover.fast.kernels.conv3d_fp8"
RGB_PAD = 8  # conv_in / conv_out channel padding on CUDA
PAD_CHANNELS = 64  # default pad_channels on CUDA: activations of 96 channels are stored as 128
# decode_frames "auto" (the default): on CUDA, frames of at most SMALL_FRAME_PIXELS run the decoder's
# full-resolution levels in whole chunks, larger ones AUTO_DECODE_FRAMES at a time (memory: the W2 peak bar). At small
# frames the many short kernels of the 1-frame decode loop leave the GPU waiting on the CPU's launches (H200, W1
# 432x240: 0.255 s of CPU time for a 0.255 s decode, whole chunks 0.195 s, experiments/w1_decode_gap.py; in
# the W1 pipeline the decode stage went from 0.41-0.55 s to 0.20-0.21 s), and whole chunks cost little memory in
# absolute terms there. encode_frames "auto" is AUTO_ENCODE_FRAMES at every size: whole-chunk encodes at W1 gained
# nothing with the batch-2 encode (0.241 -> 0.236 s) and lost without it (0.257 -> 0.333 s; vae-w1-auto-*.json). On
# the CPU (no launch overhead to hide) "auto" is the memory-bounded steps at every size. Whole chunks are the same
# math as 1-frame steps but not the same bits (cuDNN picks other algorithms for other frame counts), and `stripe_mib`
# (row stripes of 1-frame steps) then has no 1-frame decode steps to stripe.
SMALL_FRAME_PIXELS = 160 * 1024  # W1's 432x240 = 103,680 px; W2's 832x480 = 399,360 px
AUTO_ENCODE_FRAMES = 2
AUTO_DECODE_FRAMES = 1
# memory_bytes: the transient tensors of the full-resolution level at the peak, in elements of C x H x W (C: that
# level's padded width) = a * frames per step + b, per (op, 16-bit dtype). Fitted as upper bounds to live tensor
# bytes of this module's torch-reference path on the meta device (which allocates what the CUDA path allocates,
# plus the reference norm's fp32 temporaries in 16-bit dtypes) at steps 1, 2 and 4; tests/test_video_vae.py.
_WORKING_UNITS = {("encode", True): (7.5, 13.0), ("encode", False): (5.25, 10.0),
                  ("decode", True): (10.0, 3.5), ("decode", False): (7.0, 3.5)}

Progress = Callable[[int, int], None]
# write(start, stop, out): put input frames [start, stop) of the encoder's input stream(s) into out [B, 3, n, H, W]
FrameSource = Callable[[int, int, torch.Tensor], None]


def fp8_pays(cin: int, cout: int, max_channels: int = FP8_MAX_CHANNELS) -> bool:
    """Which 3x3x3 causal convs the FP8 kernel runs: both channel counts in [64, max_channels]. The lower end keeps
    the latent-facing convs (the decoder's conv_in from 16 channels, the encoder's conv_out to 32) in fp16. The
    defaults (FP8_MAX_CHANNELS for the decoder, FP8_ENCODER_MAX_CHANNELS for the encoder) come from one H200 bench
    run at W2 (bench/results/vae-w2-fp8-levels-*-fbd9551.json, where the limit applied to encoder and decoder alike;
    PSNR of the decoded video against the reference VAE's, both decoding the reference latents):
        levels on FP8      96 ch: 43.3 dB, decode 0.77 s    up to 192: 39.5 dB, 0.80 s    all: 32.6 dB, 0.81 s
    the deeper decoder levels put many more convs in series and were no faster (the 1-frame steps of the small
    levels), so the decoder keeps only its full-resolution level in FP8; the total's gain there (1.61 -> 1.60 ->
    1.54 s) came from the encoder. The encoder's error shows in the round trip (its own latents through its own
    decoder): 34.4 dB with its 96-channel level in FP8, 32.0 dB with all of it, for 0.12 s (1.51 -> 1.39 s;
    bench/results/vae-w2-fp8-roundtrip-*-4a9689c.json)."""
    return 64 <= min(cin, cout) and max(cin, cout) <= max_channels


def _load_upconv(device: torch.device, dtype: torch.dtype):
    """The sub-pixel upsample conv module where it runs (CUDA sm_90+, fp16/bf16), else None."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from fastremover.fast.kernels import upsample_conv
    except ImportError:
        return None
    return upsample_conv if upsample_conv.available(device) else None


def static_act_scale(gamma: torch.Tensor, channels: int) -> float:
    """A static e4m3 activation scale for the output of the VAE's channel RMS norm + SiLU, which is bounded:
    |F.normalize(x)_c| <= 1, so |norm_c| <= sqrt(C) |gamma_c| and |silu(v)| <= max(v, 0.2785) (SiLU's minimum is
    -0.2785). bound = max(sqrt(C) max|gamma| (1 + 2^-5), 0.28): the margin covers the norm kernel's four roundings
    to the dtype (each at most 2^-8 relative in bf16, 2^-11 in fp16); the scale is bound / 448, so no code can
    overflow (the conversion saturates anyway). Against a per-chunk amax scale it only costs precision below the e4m3 normal
    range (|v| < bound 2^-6 / 448, about 3.5e-4 at bound 10), where the codes' absolute error stays below
    bound 2^-9 / 448 (subnormal spacing)."""
    g = float(gamma.detach().float().abs().max())
    bound = max(channels**0.5 * g * (1 + 2.0**-5), 0.28)
    return bound / 448.0


def fp8_conv_available() -> bool:
    """True when the FP8 implicit-GEMM conv3d module is part of this installation."""
    try:
        return importlib.util.find_spec(FP8_MODULE) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class _Conv:
    """A conv's weights in the fast layout, and how to call it."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: tuple
    padding: tuple  # the conv's own (spatial) padding; causal time padding comes from the cache
    front: int = 0  # cached frames in front of each chunk (2 for the 3-tap causal convs, 0 otherwise)
    fp8: tuple | None = None  # (weight_q, weight_scale) for the FP8 conv kernel
    # FP8 convs fed by a norm + SiLU: its static activation scale (see `static_act_scale`) and that norm module
    act_scale: torch.Tensor | None = None
    act_norm: nn.Module | None = None
    phase: torch.Tensor | None = None  # an upsampler's conv: its sub-pixel phase weights (upsample_conv.phase_weights)


class _Fill:
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


class _Stream:
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


def _frames_2d(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W] channels-last (a view when x is channels_last_3d-contiguous)."""
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 3, 4, 1).reshape(b * t, h, w, c).permute(0, 3, 1, 2)


def _frames_5d(y: torch.Tensor, b: int) -> torch.Tensor:
    """[B*T, C, H, W] channels-last -> [B, C, T, H, W] channels-last-3d (a view)."""
    n, c, h, w = y.shape
    if not y.is_contiguous(memory_format=CL2):
        y = y.contiguous(memory_format=CL2)
    return y.view(b, n // b, c, h, w).transpose(1, 2)


def _empty_cl3(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=CL3)


@contextlib.contextmanager
def _cudnn_benchmark(on: bool | None):
    if on is None:
        yield
        return
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


def build_vae(vae: WanVAE, mode: str, device: torch.device, dtype: torch.dtype, precision: str = "auto",
              options: FastVAEOptions = FastVAEOptions()):
    """The VideoVAE the pipeline runs for an (already resolved) engine mode: (vae, description).

    eager mode, or no CUDA GPU: the eager `WanVAE` moved to device/dtype, as an `engine.vae.EagerVideoVAE` ("eager");
    exact/fast on CUDA: a `FastWanVAE` (its description, e.g. "fast-fp16"; the eager module stays where it is, so its
    weights are not held twice on the GPU; `options`: its switches). precision "fp8" needs the fast VAE: a clear
    error otherwise."""
    if precision not in VAE_PRECISIONS:
        raise FastRemoverError(f"--vae-precision {precision!r}: choose one of {list(VAE_PRECISIONS)}")
    device = torch.device(device)
    if mode == "eager" or device.type != "cuda":
        if precision == "fp8":
            why = "the eager mode" if mode == "eager" else "no CUDA GPU"
            raise FastRemoverError(f"--vae-precision fp8 needs the fast VAE (a CUDA GPU and --mode exact or fast; "
                                   f"here: {why})")
        from fastremover.engine.vae import EagerVideoVAE

        eager = EagerVideoVAE(vae, device, dtype)
        return eager, eager.describe()
    fast = FastWanVAE(vae, device=device, dtype=dtype, precision=precision, options=options)
    return fast, fast.describe()


class FastWanVAE(VideoVAE):
    """Channels-last Wan VAE with fused norms and copy-free causal caches (see the module docstring).

    vae: a loaded `WanVAE` (any device/dtype; its weights are copied once to `device`/`dtype`, channels-last; the
    module itself is not changed). precision: "auto" / "fp16" (the model dtype everywhere) or "fp8" (FP8 3x3x3 causal
    convs; needs fastremover.fast.kernels.conv3d_fp8 and an sm_89+ GPU). kernels: "auto" (Triton on CUDA, the torch
    reference elsewhere), "triton" (also the interpreter on the CPU), "torch".
    options (`fastremover.config.FastVAEOptions`, `EngineConfig.vae.fast`): the switches below; the defaults are what
    the engine runs, tools and tests set the others.
    encode_frames / decode_frames: frames per step of the full-resolution levels (encoder level 0; decoder's last
    two levels and head); None: whole chunks. Fewer frames: lower peak memory, a few more cache copies. "auto"
    (default): encode 2; decode whole chunks for small frames on CUDA, else 1 (see SMALL_FRAME_PIXELS and
    `frames_per_step`).
    pair / pair_budget_gib: encode_pair / encode_removal_inputs as one batch of 2 ("auto": see `pair_fits`), True,
    or False (two passes). pad_rgb: zero-pad the 3-channel convs to 8 channels (default: on CUDA). tap_head: the
    decoder's conv_out as per-tap partial sums (see `_decoder_head`). stripe_mib: run 1-frame causal-conv steps and
    2x upsamplings whose frame is larger than twice this many MiB in row stripes of about this size (None: never;
    lower peak memory for more, smaller kernels; see `_causal_striped`). cudnn_benchmark: set
    torch.backends.cudnn.benchmark during the calls (None: leave it as it is). fuse_bias: run residual blocks' conv1 /
    conv2 and the attention proj without bias and add it inside the norm / residual-add kernel that reads their output
    (see the module docstring); bit-identical to False (CPU tests, and on the H200
    tests/test_vae_fast.py::test_gpu_fuse_bias_is_bit_exact_w2_chunk and `python tools/bench_vae.py --fuse-bias`), and 7 % faster there at W2, so on by default. precise_norm: run the norm kernel with precise=True
    (per-element IEEE divisions, bit-exact to the eager ops given its denominators; H200: 0.47 vs 0.125 ms per
    full-resolution call) instead of its fast-math default (within a few ulps of eager on ~1e-4 of the elements, see
    fastremover/fast/kernels/vae_norm.py); no effect with kernels="torch" (the eager reference either way).
    pad_channels: store c-channel activations with c > pad_channels and not a multiple of it zero-padded to the next
    multiple (see the module docstring); None: 64 on CUDA (96 -> 128) unless precision is fp8, 0 (never) elsewhere.
    pad_encoder: pad the encoder too (default: the decoder only; the encoder's padded 2-frame steps cost memory).
    fp8_precise_acc: with precision fp8, the conv kernel's precise_acc (promote the tensor cores' partial sums to fp32
    every K chunk, see conv3d_fp8). Off by default: at W2 (H200, both in one bench run,
    bench/results/vae-w2-fp8-acc-2026-11-30-7cb1b77.json) the FP8 VAE took 1.830 s without promotion against
    1.914 s with it, at the same 43.30 dB (min frame 40.15 vs 40.09 dB); per conv the error grows from ~1.3e-4 to
    ~6.8e-4 of the sum of absolute products (bound 2^-9, GPU tests), cosine vs fp16 unchanged (0.99930).
    fp8_max_channels: with precision fp8, the widest conv (channels) the FP8 kernel runs (`fp8_pays`; default 128,
    the decoder's 96-channel level); fp8_encoder_max_channels: the same for the encoder (default: all of it, 384,
    with static scales; 128 with dynamic ones).
    upsample_conv: the decoder's upsamplers (nearest 2x, then a 3x3 conv). "auto" (default): the sub-pixel kernel
    (fastremover.fast.kernels.upsample_conv: four 2x2 convs of the low-resolution frames, 2.25x fewer FLOPs, no
    upsampled tensor) on an sm_90+ GPU in fp16/bf16, else "eager" (F.interpolate + cuDNN). Row-striped steps
    (stripe_mib) stay eager.
    fp8_scales: with precision fp8, the activation scales. "static" (what "auto" picks where the TMA kernel runs):
    a residual block's conv reads a norm + SiLU output, which is bounded, so its scale is fixed at load
    (`static_act_scale`) and the norm writes e4m3 codes straight into the conv's stream buffer and cache; "dynamic":
    one scale per conv call from the amax of its input (an amax pass and a quantization pass per call; the only
    choice without the TMA kernel, and for convs not fed by a norm).
    conv_plans: the convs through `fastremover.fast.cudnn_conv.ConvPlans` (per conv signature, a cuDNN plan that
    gives torch's output bit for bit where one is faster, checked on the first call; else torch's call). "auto"
    (default): where it can run (CUDA, fp16/bf16, cudnn-frontend installed) unless FASTREMOVER_CUDNN_CONV_PLANS=0;
    True: raise where it cannot; False: torch's convs. The same bits either way.
    """

    def __init__(self, vae: WanVAE, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 precision: str = "auto", kernels: str = "auto", options: FastVAEOptions = FastVAEOptions()):
        if precision not in VAE_PRECISIONS:
            raise FastRemoverError(f"vae precision {precision!r}: choose one of {list(VAE_PRECISIONS)}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r}: choose one of {KERNELS}")
        o = self.options = options
        self.vae = vae
        self.config = vae.config
        self.device = torch.device(device) if device is not None else vae.device
        self.dtype = dtype or vae.dtype
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kernels = ("triton" if self.device.type == "cuda" else "torch") if kernels == "auto" else kernels
        self.encode_frames = o.encode_frames
        self.decode_frames = o.decode_frames
        self.pair = o.pair
        self.pair_budget_gib = float(o.pair_budget_gib)
        self.pad_rgb = (self.device.type == "cuda") if o.pad_rgb is None else bool(o.pad_rgb)
        self.tap_head = bool(o.tap_head)
        self.stripe_mib = o.stripe_mib
        self._head_taps = None
        self.cudnn_benchmark = o.cudnn_benchmark
        self.fuse_bias = bool(o.fuse_bias)
        self.precise_norm = bool(o.precise_norm)
        self.precision = "fp16" if precision == "auto" else precision
        pad_channels = o.pad_channels
        if pad_channels is None:  # FP8 convs: 128 wide they lose to the unpadded 96 (W2: 2.05 vs 1.93 s)
            pad_channels = PAD_CHANNELS if self.device.type == "cuda" and self.precision != "fp8" else 0
        self.pad_channels = pad_channels
        self.pad_encoder = bool(o.pad_encoder)
        self.fp8_precise_acc = bool(o.fp8_precise_acc)
        self.fp8_max_channels = o.fp8_max_channels
        fp8_encoder_max_channels = o.fp8_encoder_max_channels
        self.fp8_encoder_max_channels = (FP8_ENCODER_MAX_CHANNELS if fp8_encoder_max_channels is None
                                         else fp8_encoder_max_channels)
        fp8_scales = self.fp8_scales = o.fp8_scales
        upsample_conv = o.upsample_conv
        self._upconv = None
        if upsample_conv != "eager":
            self._upconv = _load_upconv(self.device, self.dtype)
            if self._upconv is None and upsample_conv == "subpixel":
                raise FastRemoverError("upsample_conv='subpixel' needs the sub-pixel conv kernel: an sm_90+ GPU, "
                                       "fp16/bf16")
        self.upsample_conv = "subpixel" if self._upconv is not None else "eager"
        self._encoder_modules: set = set()
        self._norm_channels: dict[nn.Module, int] = {}  # norms whose input carries padding: their real C
        self._fp8 = None
        self.fp8_convs = 0
        if self.precision == "fp8":
            self._fp8 = self._load_fp8()
            tma = self._fp8.tma_available(self.device)
            if fp8_scales == "static" and not tma:
                raise FastRemoverError("fp8_scales='static' needs the TMA FP8 conv kernel (an sm_90+ GPU)")
            self.fp8_scales = "static" if fp8_scales == "auto" and tma else (
                "dynamic" if fp8_scales == "auto" else fp8_scales)
            if fp8_encoder_max_channels is None and self.fp8_scales == "dynamic":
                # the deeper encoder levels only paid with the TMA kernel and static scales (with per-call amax and
                # quantization passes the pointer kernel lost to cuDNN fp16 at 192 / 384 channels)
                self.fp8_encoder_max_channels = FP8_MAX_CHANNELS
        if self.kernels == "triton":
            from fastremover.fast.kernels.residual import add_bias_ as add_bias_fn
            from fastremover.fast.kernels.residual import add_frames as add_fn
            from fastremover.fast.kernels.residual import pad_copy_ as pad_copy_fn
            from fastremover.fast.kernels.vae_norm import vae_rms_norm as norm_fn
        else:
            from fastremover.fast.kernels.residual import add_bias_reference_ as add_bias_fn
            from fastremover.fast.kernels.residual import add_frames_reference as add_fn
            from fastremover.fast.kernels.residual import pad_copy_reference_ as pad_copy_fn
            from fastremover.fast.kernels.vae_norm import vae_rms_norm_reference as norm_fn
        self._norm_fn = norm_fn
        self._add_fn = add_fn  # y += shortcut on channels-last views (torch's add takes its slow strided path there)
        # The convs' own bias adds (those fuse_bias cannot defer): on CUDA, the bias-free conv + our row kernel, the
        # bits of ATen's conv-then-add_ (its cuDNN path) without its slow strided add. Elsewhere the conv adds it.
        self._bias_kernel = self.kernels == "triton" and self.device.type == "cuda"
        self.conv_plans = self._conv_plans(o.conv_plans)
        self._add_bias = add_bias_fn
        self._pad_copy = pad_copy_fn  # a real-width cache into the front of a padded conv input buffer
        self._conv: dict[nn.Module, _Conv] = {}
        self._gamma: dict[nn.Module, torch.Tensor] = {}
        with torch.no_grad():
            self._convert()

    # ------------------------------------------------------------------------------------------------------------------
    # Setup

    def _conv_plans(self, conv_plans: bool | str):
        """The cuDNN plan chooser of the convs (fast/cudnn_conv.py: torch's bits, faster plans where cuDNN has them),
        or None: "auto" uses it where it can run (CUDA, fp16/bf16, cudnn-frontend) unless
        FASTREMOVER_CUDNN_CONV_PLANS=0; True raises where it cannot; False: torch's convs."""
        from fastremover.env import kernel_tuning
        from fastremover.fast import cudnn_conv

        if conv_plans not in ("auto", True, False):
            raise ValueError(f"conv_plans must be 'auto', True or False, got {conv_plans!r}")
        why = cudnn_conv.available(self.device, self.dtype)
        if conv_plans is True and why is not None:
            raise FastRemoverError(f"conv_plans=True: {why}")
        if conv_plans is False or why is not None or (conv_plans == "auto" and not kernel_tuning().cudnn_conv_plans):
            return None
        return cudnn_conv.ConvPlans(self.device)

    def _load_fp8(self):
        if not fp8_conv_available():
            raise FastRemoverError(
                "vae precision fp8: the FP8 conv3d kernel (fastremover.fast.kernels.conv3d_fp8) is not available in "
                "this build; use --vae-precision auto (fp16)"
            )
        if self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) < (8, 9):
            raise FastRemoverError("vae precision fp8 needs a CUDA GPU with FP8 tensor cores (sm_89 or newer)")
        return importlib.import_module(FP8_MODULE)

    def _t(self, t: torch.Tensor | None, fmt=None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.detach().to(device=self.device, dtype=self.dtype)
        return t.contiguous(memory_format=fmt) if fmt is not None else t.contiguous()

    def _convert(self) -> None:
        vae = self.vae
        self._encoder_modules = set(vae.encoder.modules()) | {vae.quant_conv}
        for m in vae.modules():
            if isinstance(m, CausalConv3d):
                self._conv[m] = _Conv(self._t(m.weight, CL3), self._t(m.bias), tuple(m.stride), m.space_padding,
                                      m.front_frames)
            elif isinstance(m, nn.Conv2d):
                self._conv[m] = _Conv(self._t(m.weight, CL2), self._t(m.bias), tuple(m.stride), tuple(m.padding))
            elif hasattr(m, "gamma") and hasattr(m, "scale"):  # RMSNorm
                gamma = self._t(m.gamma).reshape(-1)
                c, wide = gamma.numel(), self._width(gamma.numel(), m)
                if wide != c:  # zero gamma on the padding channels keeps them zero
                    gamma = torch.cat([gamma, gamma.new_zeros(wide - c)])
                    self._norm_channels[m] = c
                self._gamma[m] = gamma
        if self.pad_rgb:
            conv_in = self._conv[vae.encoder.conv_in]
            if conv_in.weight.shape[1] < RGB_PAD:
                w = conv_in.weight.new_zeros(conv_in.weight.shape[0], RGB_PAD, *conv_in.weight.shape[2:])
                w[:, : conv_in.weight.shape[1]] = conv_in.weight
                conv_in.weight = w.contiguous(memory_format=CL3)
            conv_out = self._conv[vae.decoder.conv_out]
            if conv_out.weight.shape[0] < RGB_PAD:
                w = conv_out.weight.new_zeros(RGB_PAD, *conv_out.weight.shape[1:])
                w[: conv_out.weight.shape[0]] = conv_out.weight
                b = conv_out.bias.new_zeros(RGB_PAD)
                b[: conv_out.bias.shape[0]] = conv_out.bias
                conv_out.weight, conv_out.bias = w.contiguous(memory_format=CL3), b
        grouped = set()  # convs whose outputs are equal groups, each padded on its own (never again as one block)
        for m in vae.modules():
            if isinstance(m, AttentionBlock):  # q, k, v each padded: [3c, c] -> [3W, W], chunk i at rows i*W..
                self._pad_conv(m.to_qkv, parts=3)
                grouped.add(m.to_qkv)
            elif isinstance(m, Resample) and m.mode == "upsample3d":  # [frame 2i | frame 2i+1] channel halves
                self._pad_conv(m.time_conv, parts=2)
                grouped.add(m.time_conv)
        # the video and latent ends keep their channel counts (their tensors come from / go to the caller)
        keep_in = {vae.encoder.conv_in, vae.decoder.conv_in, vae.quant_conv, vae.post_quant_conv}
        keep_out = {vae.encoder.conv_out, vae.decoder.conv_out, vae.quant_conv, vae.post_quant_conv}
        for m in self._conv:
            if m not in grouped:
                self._pad_conv(m, keep_in=m in keep_in, keep_out=m in keep_out)
        if self.tap_head:
            # decoder conv_out as one conv2d giving the three temporal taps' partial outputs (see _decoder_head)
            conv = vae.decoder.conv_out
            c_out, c_in = conv.out_channels, self._width(conv.in_channels, conv)
            cp = RGB_PAD if self.pad_rgb and c_out < RGB_PAD else c_out
            w = conv.weight.detach().new_zeros(3, cp, c_in, 3, 3)
            w[:, :c_out, : conv.in_channels] = conv.weight.detach().permute(2, 0, 1, 3, 4)  # [tap, out, in, kh, kw]
            weight = w.reshape(3 * cp, c_in, 3, 3).to(self.device, self.dtype)
            bias = self._t(conv.bias).float().view(1, c_out, 1, 1, 1)
            self._head_taps = (weight.contiguous(memory_format=CL2), bias, cp)
        # quant_conv: only mu (the first z_dim outputs) is ever used
        q = self._conv[vae.quant_conv]
        z = self.config.z_dim
        q.weight, q.bias = q.weight[:z].contiguous(memory_format=CL3), q.bias[:z].contiguous()
        if self._fp8 is not None:
            # a residual block's convs read norm + SiLU outputs: bounded, so a static scale (fp8_scales "static")
            feeds = {r.conv1: r.norm1 for r in vae.modules() if isinstance(r, ResidualBlock)}
            feeds.update({r.conv2: r.norm2 for r in vae.modules() if isinstance(r, ResidualBlock)})
            static = self.fp8_scales == "static"
            for m, c in self._conv.items():
                if (isinstance(m, CausalConv3d) and tuple(m.kernel_size) == (3, 3, 3) and tuple(m.stride) == (1, 1, 1)
                        and m.front_frames == CACHE_T and c.weight.shape[1] == self._width(m.in_channels, m)
                        and self._fp8.supported(*c.weight.shape[1::-1])
                        and fp8_pays(*c.weight.shape[1::-1], self.fp8_encoder_max_channels
                                     if m in self._encoder_modules else self.fp8_max_channels)):
                    c.fp8 = tuple(self._fp8.quantize_conv_weight(c.weight))
                    if static and m in feeds:
                        norm = feeds[m]
                        scale = static_act_scale(self._gamma[norm], self._norm_channels.get(norm, m.in_channels))
                        c.act_scale = torch.full((1,), scale, dtype=torch.float32, device=self.device)
                        c.act_norm = norm
            self.fp8_convs = sum(c.fp8 is not None for c in self._conv.values())
        if self.upsample_conv == "subpixel":
            for m in vae.modules():
                if isinstance(m, Resample) and m.mode.startswith("up"):
                    c = self._conv[m.resample[1]]
                    if self._upconv.supported(c.weight.shape[1], c.weight.shape[0]):
                        c.phase = self._upconv.phase_weights(c.weight, self.dtype)

    def _width(self, c: int, module: nn.Module | None = None) -> int:
        """The stored channel count of a c-channel activation (of `module`'s): c rounded up to a multiple of
        pad_channels when c is larger than pad_channels and not a multiple of it (96 -> 128 at the default 64), else c;
        always c in the encoder unless pad_encoder."""
        m = self.pad_channels
        if not m or c <= m or c % m == 0 or (module in self._encoder_modules and not self.pad_encoder):
            return c
        return -(-c // m) * m

    def _pad_conv(self, module: nn.Module, parts: int = 1, keep_in: bool = False, keep_out: bool = False) -> None:
        """Zero-pad a conv's weight (output and input channels) and bias to the stored widths: the padding outputs
        are exact zeros, and the padding inputs (zeros) meet zero weights. parts: the output channels are that many
        equal groups (an attention block's q | k | v), each padded on its own. keep_in / keep_out: leave that side."""
        c = self._conv[module]
        w = c.weight
        out_c, in_c = w.shape[0] // parts, w.shape[1]
        po = out_c if keep_out else self._width(out_c, module)
        pi = in_c if keep_in else self._width(in_c, module)
        if (po, pi) == (out_c, in_c):
            return
        padded = w.new_zeros(parts * po, pi, *w.shape[2:])
        bias = c.bias.new_zeros(parts * po) if c.bias is not None else None
        for i in range(parts):
            padded[i * po : i * po + out_c, :in_c] = w[i * out_c : (i + 1) * out_c]
            if bias is not None:
                bias[i * po : i * po + out_c] = c.bias[i * out_c : (i + 1) * out_c]
        c.weight = padded.contiguous(memory_format=CL3 if w.dim() == 5 else CL2)
        c.bias = bias

    # ------------------------------------------------------------------------------------------------------------------
    # Public API (WanVAE's)

    @property
    def latents_mean(self) -> torch.Tensor:
        return self.vae.latents_mean

    @property
    def latents_std(self) -> torch.Tensor:
        return self.vae.latents_std

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.normalize(z)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.denormalize(z)

    def describe(self) -> str:
        """E.g. "fast-fp16", "fast-bf16", "fast-fp8" (what the pipeline's EngineConfig.vae shows); "+unfused-bias" is
        appended with fuse_bias=False, "+precise-norm" with precise_norm=True (neither the default)."""
        name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        return (f"fast-{'fp8' if self._fp8 is not None else name}" + ("" if self.fuse_bias else "+unfused-bias")
                + ("+precise-norm" if self.precise_norm else "")
                + ("+precise-acc" if self._fp8 is not None and self.fp8_precise_acc else "")
                + (f"+max{self.fp8_max_channels}ch" if self._fp8 is not None
                   and self.fp8_max_channels != FP8_MAX_CHANNELS else "")
                + (f"+enc{self.fp8_encoder_max_channels}ch" if self._fp8 is not None
                   and self.fp8_encoder_max_channels != (FP8_ENCODER_MAX_CHANNELS if self.fp8_scales == "static"
                                                         else FP8_MAX_CHANNELS) else "")
                + ("+dynamic-scales" if self._fp8 is not None and self.fp8_scales == "dynamic" else "")
                + ("+eager-upsample" if self.device.type == "cuda" and self.upsample_conv == "eager" else "")
                + ("+torch-conv-plans" if self.device.type == "cuda" and self.conv_plans is None else ""))

    def _check_video(self, x: torch.Tensor, what: str = "x") -> None:
        c = self.config.in_channels
        if x.ndim != 5 or x.shape[1] != c:
            raise ValueError(f"encode expects {what} [B, {c}, F, H, W], got {list(x.shape)}")
        if x.shape[2] < 1:
            raise ValueError("encode needs at least one frame")

    @torch.no_grad()
    def encode(self, x: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        """Video [B, in_channels, F, H, W] in [-1, 1] -> posterior mode (mu) [B, z_dim, T, H/8, W/8] (as WanVAE)."""
        self._check_video(x)
        x = x.to(self.device, self.dtype)
        b, _, f, h, w = x.shape
        return self._encode(lambda s, e, out: out.copy_(x[:, :, s:e]), b, f, h, w, progress)

    @torch.no_grad()
    def encode_pair(
        self, a: torch.Tensor, b: torch.Tensor, progress: Progress | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """encode(a), encode(b) for two videos of the same shape; one batch of 2 when `pair` allows."""
        self._check_video(a, "a")
        if a.shape != b.shape:
            raise ValueError(f"encode_pair needs two videos of one shape, got {list(a.shape)} and {list(b.shape)}")
        a, b = a.to(self.device, self.dtype), b.to(self.device, self.dtype)
        n = a.shape[0]

        def both(s, e, out):
            out[:n].copy_(a[:, :, s:e])
            out[n:].copy_(b[:, :, s:e])

        return self._encode_two(both, lambda s, e, o: o.copy_(a[:, :, s:e]), lambda s, e, o: o.copy_(b[:, :, s:e]),
                                n, *a.shape[2:], progress)

    @torch.no_grad()
    def encode_removal_inputs(
        self, frames: torch.Tensor, mask: torch.Tensor, progress: Progress | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's two encodes: (encode(frames * (1 - mask)), encode(2 * mask - 1)), unnormalized.

        Both inputs are formed chunk by chunk in the conv_in buffer with the pipeline's own fp16 ops (so the same
        values), never as two more full-length videos."""
        self._check_video(frames, "frames")
        if mask.shape != frames.shape:
            raise ValueError(f"mask {list(mask.shape)} must match frames {list(frames.shape)}")
        frames, mask = frames.to(self.device, self.dtype), mask.to(self.device, self.dtype)
        n = frames.shape[0]

        def masked(s, e, out):
            torch.mul(frames[:, :, s:e], 1 - mask[:, :, s:e], out=out)

        def mask_video(s, e, out):
            torch.sub(2 * mask[:, :, s:e], 1.0, out=out)

        def both(s, e, out):
            masked(s, e, out[:n])
            mask_video(s, e, out[n:])

        return self._encode_two(both, masked, mask_video, n, *frames.shape[2:], progress)

    def pair_fits(self, batch: int, frames: int, height: int, width: int) -> bool:
        """Whether encode_pair / encode_removal_inputs run as one batch: always for pair=True, never for False.
        "auto" (CUDA only): when the doubled encode working set (`encode_bytes`) is at most `pair_budget_gib` and a
        third of the free GPU memory. The 2 GiB default batches W1-sized clips (240x432: ~1.1 GiB) but not W2
        (480x832: ~4.4 GiB), where a batch of 2 doubles every causal cache and the encode's peak would exceed the
        two-pass reference's instead of staying near half of it; set pair=True (or a larger budget) to trade that
        memory for fewer, larger kernels."""
        if self.pair != "auto":
            return bool(self.pair)
        if self.device.type != "cuda":
            return False
        need = self.encode_bytes(2 * batch, height, width)
        if need > self.pair_budget_gib * 2**30:
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return 3 * need <= free

    def encode_bytes(self, batch: int, height: int, width: int) -> int:
        """Rough working set of an encode: the causal caches (2 frames of every causal conv's input, all levels) plus
        the transient activations of the largest level (about 4 times a conv input buffer at encode_frames)."""
        elt = torch.finfo(self.dtype).bits // 8
        enc = self.vae.encoder
        h, w = height, width
        cache = CACHE_T * RGB_PAD * h * w
        biggest = 0
        for block in [*enc.down_blocks, *enc.mid_block.resnets]:
            if isinstance(block, ResidualBlock):
                cache += CACHE_T * (block.conv1.in_channels + block.conv2.in_channels) * h * w  # caches: real widths
                biggest = max(biggest, self._width(block.conv2.out_channels, block.conv2) * h * w)
            elif isinstance(block, Resample):
                h, w = h // 2, w // 2
        cache += CACHE_T * enc.conv_out.in_channels * h * w
        step = self.frames_per_step("encode", height, width)
        step = min(step or ENCODE_CHUNK_FRAMES, ENCODE_CHUNK_FRAMES)
        return batch * elt * (cache + 4 * (step + CACHE_T) * biggest)

    def frames_per_step(self, op: str, height: int, width: int) -> int | None:
        """Frames per step of the full-resolution levels for an `op` ("encode" / "decode") of height x width frames:
        encode_frames / decode_frames, with "auto" resolved (see SMALL_FRAME_PIXELS). None: whole chunks."""
        if op not in ("encode", "decode"):
            raise ValueError(f"frames_per_step: op must be 'encode' or 'decode', got {op!r}")
        setting, default = ((self.encode_frames, AUTO_ENCODE_FRAMES) if op == "encode"
                            else (self.decode_frames, AUTO_DECODE_FRAMES))
        if setting != "auto":
            return setting
        small = self.device.type == "cuda" and height * width <= SMALL_FRAME_PIXELS
        return None if op == "decode" and small else default

    @torch.no_grad()
    def decode(self, z: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        """Latents [B, z_dim, T, h, w] -> video [B, out_channels, 1 + 4(T-1), 8h, 8w] in [-1, 1] (as WanVAE)."""
        z = self._decode_input(z)
        b, _, t_lat, h, w = z.shape
        sc = self.config.spatial_compression
        out = z.new_empty(b, self.config.out_channels, 1 + (t_lat - 1) * self.config.temporal_compression,
                          h * sc, w * sc)  # NCDHW contiguous, like WanVAE
        with _cudnn_benchmark(self.cudnn_benchmark):
            for _ in self._decode(z, progress, out):
                pass
        return out

    @torch.no_grad()
    def decode_iter(self, z: torch.Tensor, progress: Progress | None = None) -> Iterator[torch.Tensor]:
        """`decode` one latent frame at a time: yields each latent frame's pixels ([B, C, 1, H, W], then 4 frames
        each) as soon as they are decoded, in new tensors; the same computation as `decode` (only the destination
        of the head's writes differs), so the chunks concatenated are `decode(z)` bit for bit."""
        z = self._decode_input(z)
        with _cudnn_benchmark(self.cudnn_benchmark):
            yield from self._decode(z, progress, None)

    def _decode_input(self, z: torch.Tensor) -> torch.Tensor:
        if z.ndim != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"decode expects [B, {self.config.z_dim}, T, h, w], got {list(z.shape)}")
        if z.shape[2] < 1:
            raise ValueError("decode needs at least one latent frame")
        return z.to(self.device, self.dtype)

    def memory_bytes(self, op: str, frames: int, height: int, width: int, batch: int = 1) -> int:
        """Modelled peak tensor bytes of one untiled `encode` / `decode` of this VAE (its settings: padding, frames
        per step, tap head), from its code:
            caches   every causal conv's 2 cached input frames at the real width (1 per downsample3d), the tap
                     head's two fp32 partial sums instead of conv_out's cache
            working  the full-resolution level's transients: (a * frames per step + b) tensors of C x H x W, C the
                     level's padded width (`_WORKING_UNITS`, fitted upper bounds)
            outputs  encode: the latents (+ one chunk's); decode: the output video, the post-quant latents and
                     one latent frame's chunk
        An upper bound checked against live tensor bytes of the torch-reference path (tests/test_video_vae.py); not
        seen: cuDNN workspaces and the allocator's rounding, which `choose_tiling`'s margin is for."""
        from fastremover.engine.tiling import _cache_elements

        if op not in ("encode", "decode"):
            raise ValueError(f"op must be 'encode' or 'decode', got {op!r}")
        cfg = self.config
        es = torch.finfo(self.dtype).bits // 8
        sc, tc = cfg.spatial_compression, cfg.temporal_compression
        lat_frames = (frames - 1) // tc + 1
        out_frames = 1 + (lat_frames - 1) * tc
        c_full = self._width(cfg.base_dim * cfg.dim_mult[0],
                             self.vae.encoder.conv_in if op == "encode" else self.vae.decoder.conv_out)
        a, b = _WORKING_UNITS[(op, self.dtype in (torch.float16, torch.bfloat16))]
        step = self.frames_per_step(op, height, width)
        if op == "encode":
            step = min(step or ENCODE_CHUNK_FRAMES, ENCODE_CHUNK_FRAMES)
            area, lat_area = height * width, (height // sc) * (width // sc)
            c_in = RGB_PAD if self.pad_rgb else cfg.in_channels
            caches = _cache_elements(cfg, "encode", height, width) + 2 * (c_in - cfg.in_channels) * area
            working = (a * step + b) * c_full * area
            outputs = cfg.z_dim * (lat_frames + 2) * lat_area  # the latents + one chunk's [mu | log_var]
            return int(batch * es * (caches + working + outputs))
        lh, lw = height // sc, width // sc
        area = lh * sc * lw * sc
        step = min(step or tc, tc)
        caches = _cache_elements(cfg, "decode", lh, lw)
        if self.tap_head:  # two fp32 partial sums of out_channels instead of 2 cached frames of conv_out's input
            caches += (2 * cfg.out_channels * 4 / es - 2 * cfg.base_dim * cfg.dim_mult[0]) * area
        working = (a * step + b) * c_full * area
        outputs = cfg.out_channels * (out_frames + tc) * area + cfg.z_dim * lat_frames * lh * lw
        return int(batch * es * (caches + working + outputs))

    # ------------------------------------------------------------------------------------------------------------------
    # Encode

    def _encode_two(self, both, first, second, n, f, h, w, progress):
        if self.pair_fits(n, f, h, w):
            z = self._encode(both, 2 * n, f, h, w, progress)
            return z[:n], z[n:]
        total = 2 * self._n_chunks(f)

        def half(offset):
            return (lambda done, _t: progress(offset + done, total)) if progress else None

        za = self._encode(first, n, f, h, w, half(0))
        zb = self._encode(second, n, f, h, w, half(total // 2))
        return za, zb

    @staticmethod
    def _n_chunks(f: int) -> int:
        return (f - 1) // ENCODE_CHUNK_FRAMES + 1

    def _encode(self, source: FrameSource, b: int, f: int, h: int, w: int, progress: Progress | None):
        n_chunks = self._n_chunks(f)
        bounds = [(0, 1)] + [(1 + ENCODE_CHUNK_FRAMES * i, 1 + ENCODE_CHUNK_FRAMES * (i + 1))
                             for i in range(n_chunks - 1)]
        st = _Stream()
        out = None
        with _cudnn_benchmark(self.cudnn_benchmark):
            for i, (s, e) in enumerate(bounds):
                mu = self._encode_chunk(source, s, e, b, h, w, st)
                if out is None:
                    out = mu.new_empty(b, mu.shape[1], n_chunks, *mu.shape[3:])  # NCDHW contiguous, like WanVAE
                out[:, :, i : i + 1].copy_(mu)
                del mu
                if progress:
                    progress(i + 1, n_chunks)
        return out

    def _encode_chunk(self, source, s, e, b, h, w, st):
        enc = self.vae.encoder
        blocks = list(enc.down_blocks)
        # Level 0 (full resolution, up to and including its Resample) runs encode_frames at a time when that Resample
        # is spatial only (Wan 2.1); its quarter-size outputs are gathered for level 1.
        first = next((i for i, m in enumerate(blocks) if isinstance(m, Resample)), None)
        step = self.frames_per_step("encode", h, w)
        split = first is not None and blocks[first].mode == "downsample2d" and step is not None
        if split and e - s > step:
            head, blocks = blocks[: first + 1], blocks[first + 1 :]
            x = None
            for s0 in range(s, e, step):
                s1 = min(e, s0 + step)
                y = self._blocks(head, self._conv_in(source, s0, s1, b, h, w, st), st)
                if x is None:
                    x = _empty_cl3(y, (b, y.shape[1], e - s, *y.shape[3:]))
                x[:, :, s0 - s : s1 - s].copy_(y)
                del y
        else:
            x = self._conv_in(source, s, e, b, h, w, st)
        x = self._blocks(blocks, x, st)
        x = self._mid(enc.mid_block, x, st)
        x = self._head(enc.norm_out, enc.conv_out, x, st)
        return self._pointwise(self.vae.quant_conv, x)

    def _blocks(self, blocks: list, x: torch.Tensor, st: _Stream) -> torch.Tensor:
        """The encoder's flat list of residual blocks and Resamples. A residual block right before a downsample
        writes its result into the zero-padded input of the downsample's stride-2 conv."""
        padded = False
        for i, block in enumerate(blocks):
            if isinstance(block, ResidualBlock):
                nxt = blocks[i + 1] if i + 1 < len(blocks) else None
                padded = isinstance(nxt, Resample) and nxt.mode.startswith("down")
                x = self._resblock(block, x, st, padded_out=padded)
            elif isinstance(block, Resample):
                x = self._resample(block, x, st, padded=padded)
                padded = False
            else:
                raise TypeError(f"unexpected block {type(block).__name__}")
        return x

    def _conv_in(self, source: FrameSource, s: int, e: int, b: int, h: int, w: int, st: _Stream) -> torch.Tensor:
        conv = self.vae.encoder.conv_in
        c_in = self._conv[conv].weight.shape[1]
        c_src = self.config.in_channels

        def write(_src, view, tail):
            if c_in > c_src:
                view[:, c_src:].zero_()
            source(s, e, view[:, :c_src])
            if tail is not None:  # the cache may leave out the zero padding channels
                tail.copy_(view[:, : tail.shape[1], view.shape[2] - tail.shape[2] :])

        return self._causal(conv, st, e - s, (b, c_in, h, w), _Fill(None, write, rows_ok=False))

    # ------------------------------------------------------------------------------------------------------------------
    # Decode

    def _decode(self, z: torch.Tensor, progress: Progress | None, out: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """Decode z (on device, in dtype) one latent frame at a time, yielding each latent frame's pixels: views of
        `out` (the whole video, written in place) or, with out=None, new tensors."""
        dec = self.vae.decoder
        z = self._pointwise(self.vae.post_quant_conv, z.contiguous(memory_format=CL3))
        st = _Stream()
        b, _, t_lat, h, w = z.shape
        c_out = self.config.out_channels
        total = 1 + (t_lat - 1) * self.config.temporal_compression
        sc = self.config.spatial_compression
        blocks = list(dec.up_blocks)
        # The last two levels and the head run decode_frames at a time. The split is made inside the last upsampler
        # before them, between its temporal and its spatial part, so the frames waiting are the small ones.
        split_at = max(0, len(blocks) - 2)
        pre = blocks[split_at - 1] if split_at else None
        pending = pre.upsamplers[0] if pre is not None and pre.upsamplers is not None else None
        frame = 0
        frames_per_step = self.frames_per_step("decode", h * sc, w * sc)  # None: whole chunks
        for i in range(t_lat):
            zi = z[:, :, i : i + 1]
            x = self._causal(dec.conv_in, st, 1, (b, zi.shape[1], h, w), self._copy_fill(zi))
            del zi
            x = self._mid(dec.mid_block, x, st)
            for block in blocks[: max(0, split_at - 1)]:
                x = self._up_block(block, x, st)
            if pre is not None:
                for r in pre.resnets:
                    x = self._resblock(r, x, st)
                if pending is not None:
                    x = self._resample_up_time(pending, x, st)
            n = x.shape[2]
            step = min(frames_per_step or n, n)
            pieces = [x[:, :, s0 : s0 + step] for s0 in range(0, n, step)] if step < n else [x]
            del x
            first = frame
            parts = []
            while pieces:
                y = pieces.pop(0)
                if pending is not None:
                    y = self._resample_space(pending, y)
                for block in blocks[split_at:]:
                    y = self._up_block(block, y, st)
                k = y.shape[2]
                dst = out[:, :, frame : frame + k] if out is not None else y.new_empty(b, c_out, k, *y.shape[3:])
                self._decoder_head(y, st, dst)
                parts.append(dst)
                frame += k
                del y, dst
            if out is not None:
                yield out[:, :, first:frame]
            else:
                yield parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            del parts
            if progress:
                progress(i + 1, t_lat)
        assert frame == total, (frame, total)

    # ------------------------------------------------------------------------------------------------------------------
    # Blocks

    def _norm(self, x: torch.Tensor, norm: nn.Module, silu: bool, out=None, tail=None, bias=None,
              quant_scale=None) -> torch.Tensor:
        """bias: a bias deferred from the conv that produced x (`_deferred`): normalize x + bias. The norm runs in its
        default fast-math mode unless precise_norm (the keyword is only passed then, like bias). quant_scale: write
        e4m3 codes of that scale (out and tail e4m3)."""
        kw = {"precise": True} if self.precise_norm else {}
        if bias is not None:
            kw["bias"] = bias
        if quant_scale is not None:
            kw["quant_scale"] = quant_scale
        if norm in self._norm_channels:
            kw["channels"] = self._norm_channels[norm]
        return self._norm_fn(x, self._gamma[norm], silu=silu, out=out, tail=tail, **kw)

    def _norm_fill(self, x: torch.Tensor, norm: nn.Module, bias: torch.Tensor | None = None) -> "_Fill":
        return _Fill(x, lambda src, view, tail, **kw: self._norm(src, norm, True, out=view, tail=tail, bias=bias,
                                                                 **kw), norm=norm)

    def _add(self, y: torch.Tensor, s: torch.Tensor, out=None, bias=None) -> torch.Tensor:
        """y + s (in place, or into out); bias: deferred from the conv that produced y, added to y first."""
        return self._add_fn(y, s, out=out, **({} if bias is None else {"bias": bias}))

    def _deferred(self, conv: nn.Module) -> torch.Tensor | None:
        """The bias a fuse_bias consumer adds for `conv` (which then runs without it), or None: the conv adds its own.
        Only call sites whose consumer is a bias-aware kernel ask (`defer=True`); FP8 convs add theirs in-kernel."""
        c = self._conv[conv]
        if not self.fuse_bias or c.fp8 is not None:
            return None
        return c.bias

    @staticmethod
    def _copy_fill(src: torch.Tensor) -> "_Fill":
        def write(x, view, tail):
            view.copy_(x)
            if tail is not None:  # the cache may leave out the zero padding channels
                tail.copy_(x[:, : tail.shape[1], x.shape[2] - tail.shape[2] :])

        return _Fill(src, write)

    def _conv_b(self, conv_fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args) -> torch.Tensor:
        """conv_fn(x, weight, bias, *args) (F.conv2d / F.conv3d); on CUDA with our kernels the bias is added by
        `add_bias_` after the bias-free conv: the same bits as ATen's cuDNN path (conv, then `out.add_(bias)`), one
        pass at memory speed instead of torch's strided add on a channels-last output."""
        if bias is not None and not self._bias_kernel:
            return conv_fn(x, weight, bias, *args)
        if self.conv_plans is not None and conv_fn in (F.conv2d, F.conv3d):
            y = self.conv_plans.conv(x, weight, *args)  # torch's bits (cudnn_conv's contract)
        else:
            y = conv_fn(x, weight, None, *args)
        return y if bias is None else self._add_bias(y, bias)

    def _conv3d(self, x: torch.Tensor, c: _Conv, keep_bias: bool = True) -> torch.Tensor:
        y = self._conv_b(F.conv3d, x, c.weight, c.bias if keep_bias else None, c.stride, c.padding)
        # cuDNN keeps channels-last; some CPU conv paths return NCDHW for tiny shapes
        return y if y.is_contiguous(memory_format=CL3) else y.contiguous(memory_format=CL3)

    def _pointwise(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self._conv3d(x, self._conv[conv])

    def _causal(self, conv: CausalConv3d, st: _Stream, n: int, bchw: tuple, fill, defer: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The causal conv `conv` on the next n frames of its input stream; fill(view, tail) writes those frames
        into `view` [B, C, n, H, W] and, when `tail` is given, the last tail.shape[2] of them into `tail` too.
        defer=True: the caller's consumer adds `self._deferred(conv)` (when not None), so the conv leaves it out.

        The cache is 2 slots; `st.older[conv]` says which holds the older frame. A chunk of n >= 2 frames rewrites
        both slots in order; a 1-frame chunk overwrites only the older slot (which then becomes the newer one), so
        there is never a cache-to-cache copy."""
        c = self._conv[conv]
        front = c.front
        if front != CACHE_T:
            raise AssertionError(f"causal conv with {front} front frames")
        static = c.act_scale is not None  # a static-scale FP8 conv: e4m3 buffer and cache (_causal_fp8_static)
        if residual is not None and not static:
            raise AssertionError("only a static-scale FP8 conv adds a residual in its epilogue")
        b, ch, h, w = bchw
        kw = dict(device=self.device, dtype=FP8 if static else self.dtype, memory_format=CL3)
        # The cache keeps the real channels only (cc < ch when the input carries zero padding, `pad_channels`): the
        # padding would cost a third more cache memory at the padded level for zeros. The FP8 kernel reads the cache
        # itself, at the input's width.
        padded = ch != conv.in_channels and ch == self._width(conv.in_channels, conv)
        cc = conv.in_channels if padded and c.fp8 is None else ch
        cache = st.cache.get(conv)
        if cache is None:  # zeros (zero e4m3 codes) before the first frame
            cache = st.cache[conv] = torch.empty((b, cc, front, h, w), **kw).zero_()
            st.older[conv] = 0
        older = st.older[conv]
        if static:
            return self._causal_fp8_static(conv, c, st, cache, older, n, bchw, fill, residual)
        if c.fp8 is not None:
            return self._causal_fp8(conv, c, st, cache, older, n, bchw, fill)
        keep_bias = not (defer and self._deferred(conv) is not None)
        stripes = self._stripes(b * ch * h * w, h) if n == 1 and fill.rows_ok and c.padding[1] == 1 else 1
        if stripes > 1:
            return self._causal_striped(conv, c, st, cache, older, bchw, fill, stripes, keep_bias)
        buf = torch.empty((b, ch, front + n, h, w), **kw)
        self._fill_stream(conv, st, buf, cache, older, n, fill, pad=cc < ch)
        fill.release()  # the producer's input may be freed before the conv allocates its output
        return self._conv3d(buf, c, keep_bias)

    def _fill_stream(self, conv, st: _Stream, buf: torch.Tensor, cache: torch.Tensor, older: int, n: int, fill,
                     pad: bool = False, **fill_kw) -> None:
        """buf [B, C, 2 + n, H, W] = [older cached frame, newer cached frame, the n new frames written by `fill`,
        which also writes the last of them into the cache]; then the slots rotate (see `_causal`). pad: the cache
        leaves out buf's zero padding channels (written as zeros). fill_kw: passed to fill (quant_scale=)."""
        front = cache.shape[2]
        if pad:  # the older slot first, zeros in the padding channels
            self._pad_copy(buf[:, :, :front], cache, older)
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

    def _stripes(self, frame_elements: int, rows: int) -> int:
        """How many row stripes a 1-frame conv step of this size runs in (1: none); see `stripe_mib`."""
        if self.stripe_mib is None:
            return 1
        frame_bytes = frame_elements * (torch.finfo(self.dtype).bits // 8)
        target = self.stripe_mib * 2**20
        if frame_bytes <= 2 * target:
            return 1
        return max(1, min(-(-frame_bytes // int(target)), rows // 8))

    def _causal_striped(self, conv, c: _Conv, st: _Stream, cache, older: int, bchw: tuple, fill: _Fill,
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
            self._pad_copy(body[:, :, :2], cache[:, :, :, lo:hi], older)
            fill(body[:, :, 2:], None, rows=(lo, hi))
            end = h if r1 == h else r1 - 1
            cache[:, :, older : older + 1, done:end].copy_(body[:, :cc, 2:, done - lo : end - lo])
            done = end
            ys = self._conv_b(F.conv3d, buf, c.weight, c.bias if keep_bias else None, c.stride, (0, 0, c.padding[2]))
            del buf, body
            if y is None:
                y = torch.empty((b, ys.shape[1], 1, h, w), **kw)
            y[:, :, :, r0:r1].copy_(ys)
            del ys
        fill.release()
        st.older[conv] = 1 - older
        return y

    def _causal_fp8(self, conv, c: _Conv, st: _Stream, cache, older: int, n: int, bchw: tuple, fill):
        """FP8 conv3d kernel: it reads the cached frames and the new ones itself (no buffer); prev must be in order."""
        b, ch, h, w = bchw
        if older == 1:
            cache = st.cache[conv] = cache[:, :, [1, 0]].contiguous(memory_format=CL3)
            st.older[conv] = 0
        x = torch.empty((b, ch, n, h, w), device=self.device, dtype=self.dtype, memory_format=CL3)
        fill(x, None)
        fill.release()
        y = self._fp8.causal_conv3d_fp8(cache, x, c.fp8[0], c.fp8[1], c.bias,  # cache: zeros before frame 0
                                        precise_acc=self.fp8_precise_acc)
        if not y.is_contiguous(memory_format=CL3):
            y = y.contiguous(memory_format=CL3)
        if n >= CACHE_T:
            cache.copy_(x[:, :, n - CACHE_T :])
        else:  # [newer cached frame, x] (two disjoint slots: no overlap)
            cache[:, :, :1].copy_(cache[:, :, 1:])
            cache[:, :, 1:].copy_(x)
        return y

    def _causal_fp8_static(self, conv, c: _Conv, st: _Stream, cache, older: int, n: int, bchw: tuple, fill: _Fill,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
        """FP8 conv with a static activation scale (`static_act_scale`): the producing norm + SiLU writes e4m3 codes
        straight into the stream buffer [older, newer cached frame, n new frames] and into the e4m3 cache (its tail),
        and the TMA kernel reads that buffer: no amax pass, no quantization pass, and half the bytes of fp16 frames.
        The cache slots rotate as in `_causal`."""
        if fill.norm is None or fill.norm is not c.act_norm:
            raise AssertionError("a static FP8 activation scale must come from the norm that writes the conv input")
        b, ch, h, w = bchw
        if cache.dtype != FP8 or cache.shape[1] != ch:
            raise AssertionError("a static-scale FP8 conv needs its e4m3 cache at the input's width")
        buf = torch.empty((b, ch, CACHE_T + n, h, w), device=self.device, dtype=FP8, memory_format=CL3)
        self._fill_stream(conv, st, buf, cache, older, n, fill, quant_scale=c.act_scale)
        fill.release()
        return self._fp8.conv3d_fp8_stream(buf, CACHE_T, c.fp8[0], c.fp8[1], c.bias, c.act_scale, self.dtype,
                                           precise_acc=self.fp8_precise_acc, residual=residual)

    def _resblock(self, m: ResidualBlock, x: torch.Tensor, st: _Stream, padded_out: bool = False) -> torch.Tensor:
        """x + conv2(silu(norm2(conv1(silu(norm1(x)))))). padded_out: return a [B, C, T, H+1, W+1] tensor whose last
        row and column are zero and whose interior holds the result (the input of a downsample's stride-2 conv).
        fuse_bias: conv1's output is read by norm2 only and conv2's by the residual add only, so both biases are
        added there (`_deferred`)."""
        b, c, t, h, w = x.shape
        shortcut = x if isinstance(m.conv_shortcut, nn.Identity) else self._pointwise(m.conv_shortcut, x)
        hid = self._causal(m.conv1, st, t, (b, c, h, w), self._norm_fill(x, m.norm1), defer=True)
        c2 = hid.shape[1]
        fill = self._norm_fill(hid, m.norm2, bias=self._deferred(m.conv1))
        del hid  # freed once the norm has read it, before conv2 allocates its output
        if (not padded_out and self._conv[m.conv2].act_scale is not None and shortcut.dtype == self.dtype
                and shortcut.is_contiguous(memory_format=CL3) and shortcut.data_ptr() % 16 == 0):
            # the FP8 kernel adds the shortcut in its epilogue: the bits of the conv followed by the add below
            return self._causal(m.conv2, st, t, (b, c2, h, w), fill, residual=shortcut)
        y = self._causal(m.conv2, st, t, (b, c2, h, w), fill, defer=True)
        y_bias = self._deferred(m.conv2)
        if not padded_out:
            return self._add(y, shortcut, bias=y_bias)
        out = _empty_cl3(y, (b, c2, t, h + 1, w + 1))
        out[:, :, :, h].zero_()
        out[:, :, :, :h, w].zero_()
        self._add(y, shortcut, out=out[:, :, :, :h, :w], bias=y_bias)
        return out

    def _mid(self, m: MidBlock, x: torch.Tensor, st: _Stream) -> torch.Tensor:
        x = self._resblock(m.resnets[0], x, st)
        x = self._attention(m.attentions[0], x)
        return self._resblock(m.resnets[1], x, st)

    def _attention(self, m: AttentionBlock, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        n = _frames_2d(self._norm(x, m.norm, silu=False))
        qkv_conv = self._conv[m.to_qkv]
        qkv = self._conv_b(F.conv2d, n, qkv_conv.weight, qkv_conv.bias)  # [bt, 3c, h, w] channels-last = [bt, h*w, 3c] memory
        del n
        qkv = qkv.permute(0, 2, 3, 1).reshape(b * t, 1, h * w, 3 * c)  # the eager layout (a view here)
        q, k, v = qkv.chunk(3, dim=-1)
        real = m.to_qkv.in_channels  # a padded input (pad_channels) keeps the real channel count's softmax scale
        a = F.scaled_dot_product_attention(q, k, v, **({} if real == c else {"scale": real**-0.5}))  # [bt, 1, h*w, c]
        del qkv, q, k, v
        a = a.view(b * t, h, w, c).permute(0, 3, 1, 2)  # channels-last view, as eager's transpose+reshape
        proj = self._conv[m.proj]
        proj_bias = self._deferred(m.proj)  # fuse_bias: the residual add adds it (y has no other reader)
        y = self._conv_b(F.conv2d, a, proj.weight, proj.bias if proj_bias is None else None)
        return self._add(_frames_5d(y, b), x, bias=proj_bias)

    def _up_block(self, m: UpBlock, x: torch.Tensor, st: _Stream) -> torch.Tensor:
        for r in m.resnets:
            x = self._resblock(r, x, st)
        if m.upsamplers is not None:
            x = self._resample(m.upsamplers[0], x, st)
        return x

    def _resample(self, m: Resample, x: torch.Tensor, st: _Stream, padded: bool = False) -> torch.Tensor:
        """padded: x is [B, C, T, H+1, W+1] with a zero last row and column (from _resblock(padded_out=True))."""
        x = self._resample_up_time(m, x, st)
        x = self._resample_space(m, x, padded)
        return self._resample_down_time(m, x, st)

    def _resample_up_time(self, m: Resample, x: torch.Tensor, st: _Stream) -> torch.Tensor:
        """upsample3d's temporal part: frames x2 (not on the first chunk, as eager)."""
        if m.mode != "upsample3d" or st.first_visit(m):
            return x
        b, c, t, h, w = x.shape
        y = self._causal(m.time_conv, st, t, (b, c, h, w), self._copy_fill(x))  # [b, 2c, t, h, w]
        del x
        # channels [frame 2i | frame 2i+1] -> frames: memory [b, t, h, w, (2, c)] -> [b, t, 2, h, w, c]
        x = _empty_cl3(y, (b, c, 2 * t, h, w))
        x.permute(0, 2, 3, 4, 1).view(b, t, 2, h, w, c).copy_(
            y.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5))
        return x

    def _resample_space(self, m: Resample, x: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """The per-frame 2-D part: nearest 2x + 3x3 conv, or zero pad right/bottom + 3x3 stride-2 conv."""
        b = x.shape[0]
        conv = self._conv[m.resample[1]]
        if m.mode.startswith("up"):
            frames = _frames_2d(x)
            n, c, h, w = frames.shape
            stripes = self._stripes(n * c * 4 * h * w, 2 * h)
            if stripes == 1 and conv.phase is not None:  # nearest 2x + 3x3 conv as one sub-pixel conv
                if not frames.is_contiguous(memory_format=CL2) or frames.data_ptr() % 16:  # TMA needs both
                    frames = frames.clone(memory_format=CL2)
                return _frames_5d(self._upconv.upsample_conv2x(frames, conv.phase, conv.bias), b)
            if stripes == 1:
                up = F.interpolate(frames, scale_factor=2.0, mode="nearest-exact")  # exact in the model dtype
                del frames
                if not up.is_contiguous(memory_format=CL2):
                    up = up.contiguous(memory_format=CL2)
                return _frames_5d(self._conv_b(F.conv2d, up, conv.weight, conv.bias, conv.stride, conv.padding), b)
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
                ys = self._conv_b(F.conv2d, buf, conv.weight, conv.bias, conv.stride, (0, conv.padding[1]))
                del buf
                if y is None:
                    y = torch.empty((n, ys.shape[1], big_h, 2 * w), device=x.device, dtype=x.dtype,
                                    memory_format=CL2)
                y[:, :, r0:r1].copy_(ys)
                del ys
            return _frames_5d(y, b)
        if not padded:  # ZeroPad2d((0, 1, 0, 1))
            _, c, t, h, w = x.shape
            xp = _empty_cl3(x, (b, c, t, h + 1, w + 1)).zero_()
            xp[:, :, :, :h, :w].copy_(x)
            x = xp
            del xp
        return _frames_5d(self._conv_b(F.conv2d, _frames_2d(x), conv.weight, conv.bias, conv.stride, conv.padding), b)

    def _resample_down_time(self, m: Resample, y: torch.Tensor, st: _Stream) -> torch.Tensor:
        """downsample3d's temporal part: the first chunk passes through (frame 0 -> latent frame 0); later chunks:
        stride-2 conv over [last frame of the previous chunk, this chunk]."""
        if m.mode != "downsample3d":
            return y
        prev = st.cache.get(m)
        if prev is None:
            st.cache[m] = y[:, :, -1:].clone(memory_format=CL3)
            return y
        b, c, t, h, w = y.shape
        buf = _empty_cl3(y, (b, c, 1 + t, h, w))
        buf[:, :, :1].copy_(prev)
        buf[:, :, 1:].copy_(y)
        prev.copy_(y[:, :, -1:])
        del y
        return self._conv3d(buf, self._conv[m.time_conv])

    def _decoder_head(self, x: torch.Tensor, st: _Stream, out: torch.Tensor) -> None:
        """silu(norm_out(x)) -> conv_out -> clamp into `out` (the output video's frames).

        conv_out has only out_channels (3) outputs, so instead of caching 2 frames of its wide input it runs as one
        conv2d per frame giving all three temporal taps' partial outputs P_k (tap-major channels), and keeps two
        small fp32 sums: before frame t, A = P_0(t-2) + P_1(t-1) and B = P_0(t-1) (zeros before the first frame);
        then out(t) = A + P_2(t) + bias, A <- B + P_1(t), B <- P_0(t). The same sum as the causal conv3d, with the
        three partials rounded to the model dtype (the final output is rounded once more, from fp32)."""
        dec = self.vae.decoder
        taps = self._head_taps
        if taps is None:  # plain causal conv path
            y = self._head(dec.norm_out, dec.conv_out, x, st)
            torch.clamp(y[:, : out.shape[1]], -1.0, 1.0, out=out)
            return
        weight, bias, cp = taps
        b, c, t, h, w = x.shape
        xn = self._norm(x, dec.norm_out, silu=True)
        del x
        p = _frames_5d(F.conv2d(_frames_2d(xn), weight, None, padding=1), b)  # [b, 3*cp, t, h, w]
        del xn
        c_out = out.shape[1]
        state = st.cache.get(dec.conv_out)
        if state is None:
            zeros = torch.zeros((b, c_out, 1, h, w), device=self.device, dtype=torch.float32)
            state = st.cache[dec.conv_out] = [zeros, zeros.clone()]
        for j in range(t):
            a_sum, b_sum = state
            pj = p[:, :, j : j + 1]
            o = a_sum + pj[:, 2 * cp : 2 * cp + c_out]
            o += bias
            out[:, :, j : j + 1].copy_(o.clamp_(-1.0, 1.0))  # clamp then round = round then clamp (+-1 exact)
            del o
            state[0] = b_sum.add_(pj[:, cp : cp + c_out])  # A <- B + P_1(t)   (B's storage is reused)
            state[1] = a_sum.copy_(pj[:, :c_out])  # B <- P_0(t)            (A's old storage is reused)

    def _head(self, norm: nn.Module, conv: CausalConv3d, x: torch.Tensor, st: _Stream) -> torch.Tensor:
        b, c, t, h, w = x.shape
        return self._causal(conv, st, t, (b, c, h, w), self._norm_fill(x, norm))
