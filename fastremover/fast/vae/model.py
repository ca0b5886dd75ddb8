"""`FastWanVAE`: the fast Wan 2.1 VAE assembled from its parts (see the package docstring), behind the pipeline's
`fastremover.engine.vae.VideoVAE` interface, with its memory model (`memory_bytes`) and the policies that depend on the
frame size (`frames_per_step`, `pair_fits`); `build_vae` picks it or the eager VAE for an engine mode.

    convert.py   the weights in the fast layout (channel padding, tap head, FP8 / sub-pixel weights)
    conv.py      which conv implementation runs (torch / cuDNN plans / bias kernel / FP8 / sub-pixel / row stripes)
                 and the causal streams
    blocks.py    the residual, attention, mid and resample blocks
    encoder.py   the encoder, chunk by chunk
    decoder.py   the decoder, latent frame by latent frame, and its tap head
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import torch

from fastremover.config import VAE_PRECISIONS, FastVAEOptions
from fastremover.errors import FastRemoverError
from fastremover.fast.vae.blocks import Blocks
from fastremover.fast.vae.conv import ConvDispatch, cudnn_benchmark, load_conv_plans, load_fp8, load_upconv
from fastremover.fast.vae.convert import (
    FP8_ENCODER_MAX_CHANNELS,
    FP8_MAX_CHANNELS,
    PAD_CHANNELS,
    RGB_PAD,
    VAEWeights,
    convert,
)
from fastremover.fast.vae.decoder import Decoder
from fastremover.fast.vae.encoder import Encoder, FrameSource, Progress, n_chunks
from fastremover.models.vae import CACHE_T, ENCODE_CHUNK_FRAMES, Resample, ResidualBlock, WanVAE
from fastremover.engine.vae import VideoVAE

KERNELS = ("auto", "triton", "torch")
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
# bytes of this package's torch-reference path on the meta device (which allocates what the CUDA path allocates,
# plus the reference norm's fp32 temporaries in 16-bit dtypes) at steps 1, 2 and 4; tests/parity/test_video_vae.py.
_WORKING_UNITS = {("encode", True): (7.5, 13.0), ("encode", False): (5.25, 10.0),
                  ("decode", True): (10.0, 3.5), ("decode", False): (7.0, 3.5)}


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
    """Channels-last Wan VAE with fused norms and copy-free causal caches (see the package docstring,
    fastremover/fast/vae/__init__.py).

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
    decoder's conv_out as per-tap partial sums (see `Decoder.head`). stripe_mib: run 1-frame causal-conv steps and
    2x upsamplings whose frame is larger than twice this many MiB in row stripes of about this size (None: never;
    lower peak memory for more, smaller kernels; see `ConvDispatch.causal_striped`). cudnn_benchmark: set
    torch.backends.cudnn.benchmark during the calls (None: leave it as it is). fuse_bias: run residual blocks' conv1 /
    conv2 and the attention proj without bias and add it inside the norm / residual-add kernel that reads their output
    (see the package docstring); bit-identical to False (CPU tests, and on the H200
    tests/parity/test_vae_fast.py::test_gpu_fuse_bias_is_bit_exact_w2_chunk and `python tools/bench_vae.py --fuse-bias`),
    and 7 % faster there at W2, so on by default. precise_norm: run the norm kernel with precise=True
    (per-element IEEE divisions, bit-exact to the eager ops given its denominators; H200: 0.47 vs 0.125 ms per
    full-resolution call) instead of its fast-math default (within a few ulps of eager on ~1e-4 of the elements, see
    fastremover/fast/kernels/vae_norm.py); no effect with kernels="torch" (the eager reference either way).
    pad_channels: store c-channel activations with c > pad_channels and not a multiple of it zero-padded to the next
    multiple (see the package docstring); None: 64 on CUDA (96 -> 128) unless precision is fp8, 0 (never) elsewhere.
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
        self.vae = vae
        self.config = vae.config
        self.device = torch.device(device) if device is not None else vae.device
        self.dtype = dtype or vae.dtype
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kernels = ("triton" if self.device.type == "cuda" else "torch") if kernels == "auto" else kernels
        self.precision = "fp16" if precision == "auto" else precision
        upconv = None
        if options.upsample_conv != "eager":
            upconv = load_upconv(self.device, self.dtype)
            if upconv is None and options.upsample_conv == "subpixel":
                raise FastRemoverError("upsample_conv='subpixel' needs the sub-pixel conv kernel: an sm_90+ GPU, "
                                       "fp16/bf16")
        fp8 = load_fp8(self.device) if self.precision == "fp8" else None
        # options: what was asked with every "auto" / None that does not depend on the frame size resolved
        o = self.options = self._resolve(options, fp8, upconv)
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
        plans = load_conv_plans(self.device, self.dtype, o.conv_plans)
        self.weights: VAEWeights = convert(
            vae, self.device, self.dtype, pad_rgb=o.pad_rgb, pad_channels=o.pad_channels, pad_encoder=o.pad_encoder,
            tap_head=o.tap_head, fp8=fp8, fp8_static=o.fp8_scales == "static", fp8_max_channels=o.fp8_max_channels,
            fp8_encoder_max_channels=o.fp8_encoder_max_channels, upconv=upconv)
        # The convs' own bias adds (those fuse_bias cannot defer): on CUDA, the bias-free conv + our row kernel, the
        # bits of ATen's conv-then-add_ (its cuDNN path) without its slow strided add. Elsewhere the conv adds it.
        self.convs = ConvDispatch(
            self.weights, self.device, self.dtype, add_bias=add_bias_fn, pad_copy=pad_copy_fn,
            bias_kernel=self.kernels == "triton" and self.device.type == "cuda", plans=plans, fp8=fp8,
            fp8_precise_acc=o.fp8_precise_acc, fuse_bias=o.fuse_bias, stripe_mib=o.stripe_mib, upconv=upconv)
        self.blocks = Blocks(self.weights, self.convs, norm_fn, add_fn, precise_norm=o.precise_norm)
        self.encoder = Encoder(vae, self.blocks)
        self.decoder = Decoder(vae, self.blocks, self.weights.head_taps)

    def _resolve(self, o: FastVAEOptions, fp8, upconv) -> FastVAEOptions:
        """o with pad_rgb, pad_channels, fp8_scales (precision fp8), fp8_encoder_max_channels and upsample_conv
        resolved for this device, dtype and precision."""
        cuda = self.device.type == "cuda"
        pad_channels = o.pad_channels
        if pad_channels is None:  # FP8 convs: 128 wide they lose to the unpadded 96 (W2: 2.05 vs 1.93 s)
            pad_channels = PAD_CHANNELS if cuda and fp8 is None else 0
        fp8_scales, enc_max = o.fp8_scales, o.fp8_encoder_max_channels
        if fp8 is not None:
            tma = fp8.tma_available(self.device)
            if fp8_scales == "static" and not tma:
                raise FastRemoverError("fp8_scales='static' needs the TMA FP8 conv kernel (an sm_90+ GPU)")
            if fp8_scales == "auto":
                fp8_scales = "static" if tma else "dynamic"
            if enc_max is None and fp8_scales == "dynamic":
                # the deeper encoder levels only paid with the TMA kernel and static scales (with per-call amax and
                # quantization passes the pointer kernel lost to cuDNN fp16 at 192 / 384 channels)
                enc_max = FP8_MAX_CHANNELS
        return replace(o, pad_rgb=cuda if o.pad_rgb is None else bool(o.pad_rgb), pad_channels=pad_channels,
                       fp8_scales=fp8_scales,
                       fp8_encoder_max_channels=FP8_ENCODER_MAX_CHANNELS if enc_max is None else enc_max,
                       upsample_conv="subpixel" if upconv is not None else "eager")

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
        o, fp8 = self.options, self.convs.fp8 is not None
        name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        return (f"fast-{'fp8' if fp8 else name}" + ("" if o.fuse_bias else "+unfused-bias")
                + ("+precise-norm" if o.precise_norm else "")
                + ("+precise-acc" if fp8 and o.fp8_precise_acc else "")
                + (f"+max{o.fp8_max_channels}ch" if fp8 and o.fp8_max_channels != FP8_MAX_CHANNELS else "")
                + (f"+enc{o.fp8_encoder_max_channels}ch" if fp8
                   and o.fp8_encoder_max_channels != (FP8_ENCODER_MAX_CHANNELS if o.fp8_scales == "static"
                                                      else FP8_MAX_CHANNELS) else "")
                + ("+dynamic-scales" if fp8 and o.fp8_scales == "dynamic" else "")
                + ("+eager-upsample" if self.device.type == "cuda" and o.upsample_conv == "eager" else "")
                + ("+torch-conv-plans" if self.device.type == "cuda" and self.convs.plans is None else ""))

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
        if self.options.pair != "auto":
            return bool(self.options.pair)
        if self.device.type != "cuda":
            return False
        need = self.encode_bytes(2 * batch, height, width)
        if need > float(self.options.pair_budget_gib) * 2**30:
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
                biggest = max(biggest, self.weights.width(block.conv2.out_channels, block.conv2) * h * w)
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
        setting, default = ((self.options.encode_frames, AUTO_ENCODE_FRAMES) if op == "encode"
                            else (self.options.decode_frames, AUTO_DECODE_FRAMES))
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
        with cudnn_benchmark(self.options.cudnn_benchmark):
            for _ in self._decode(z, progress, out):
                pass
        return out

    @torch.no_grad()
    def decode_iter(self, z: torch.Tensor, progress: Progress | None = None) -> Iterator[torch.Tensor]:
        """`decode` one latent frame at a time: yields each latent frame's pixels ([B, C, 1, H, W], then 4 frames
        each) as soon as they are decoded, in new tensors; the same computation as `decode` (only the destination
        of the head's writes differs), so the chunks concatenated are `decode(z)` bit for bit."""
        z = self._decode_input(z)
        with cudnn_benchmark(self.options.cudnn_benchmark):
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
        An upper bound checked against live tensor bytes of the torch-reference path (tests/parity/test_video_vae.py); not
        seen: cuDNN workspaces and the allocator's rounding, which `choose_tiling`'s margin is for."""
        from fastremover.engine.tiling import _cache_elements

        if op not in ("encode", "decode"):
            raise ValueError(f"op must be 'encode' or 'decode', got {op!r}")
        cfg = self.config
        es = torch.finfo(self.dtype).bits // 8
        sc, tc = cfg.spatial_compression, cfg.temporal_compression
        lat_frames = (frames - 1) // tc + 1
        out_frames = 1 + (lat_frames - 1) * tc
        c_full = self.weights.width(cfg.base_dim * cfg.dim_mult[0],
                                    self.vae.encoder.conv_in if op == "encode" else self.vae.decoder.conv_out)
        a, b = _WORKING_UNITS[(op, self.dtype in (torch.float16, torch.bfloat16))]
        step = self.frames_per_step(op, height, width)
        if op == "encode":
            step = min(step or ENCODE_CHUNK_FRAMES, ENCODE_CHUNK_FRAMES)
            area, lat_area = height * width, (height // sc) * (width // sc)
            c_in = RGB_PAD if self.options.pad_rgb else cfg.in_channels
            caches = _cache_elements(cfg, "encode", height, width) + 2 * (c_in - cfg.in_channels) * area
            working = (a * step + b) * c_full * area
            outputs = cfg.z_dim * (lat_frames + 2) * lat_area  # the latents + one chunk's [mu | log_var]
            return int(batch * es * (caches + working + outputs))
        lh, lw = height // sc, width // sc
        area = lh * sc * lw * sc
        step = min(step or tc, tc)
        caches = _cache_elements(cfg, "decode", lh, lw)
        if self.options.tap_head:  # two fp32 partial sums of out_channels, not 2 cached frames of conv_out's input
            caches += (2 * cfg.out_channels * 4 / es - 2 * cfg.base_dim * cfg.dim_mult[0]) * area
        working = (a * step + b) * c_full * area
        outputs = cfg.out_channels * (out_frames + tc) * area + cfg.z_dim * lat_frames * lh * lw
        return int(batch * es * (caches + working + outputs))

    # ------------------------------------------------------------------------------------------------------------------
    # Encode / decode through the parts

    def _encode_two(self, both, first, second, n, f, h, w, progress):
        if self.pair_fits(n, f, h, w):
            z = self._encode(both, 2 * n, f, h, w, progress)
            return z[:n], z[n:]
        total = 2 * n_chunks(f)

        def half(offset):
            return (lambda done, _t: progress(offset + done, total)) if progress else None

        za = self._encode(first, n, f, h, w, half(0))
        zb = self._encode(second, n, f, h, w, half(total // 2))
        return za, zb

    def _encode(self, source: FrameSource, b: int, f: int, h: int, w: int, progress: Progress | None):
        with cudnn_benchmark(self.options.cudnn_benchmark):
            return self.encoder.encode(source, b, f, h, w, self.frames_per_step("encode", h, w), progress)

    def _decode(self, z: torch.Tensor, progress: Progress | None, out: torch.Tensor | None) -> Iterator[torch.Tensor]:
        sc = self.config.spatial_compression
        step = self.frames_per_step("decode", z.shape[3] * sc, z.shape[4] * sc)  # None: whole chunks
        return self.decoder.decode(z, step, progress, out)
