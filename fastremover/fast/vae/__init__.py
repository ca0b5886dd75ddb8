"""The fast Wan 2.1 VAE: channels-last 3D end to end, fused RMS norm + SiLU, causal caches without concatenation.

`FastWanVAE(vae)` (model.py) runs the same math as `fastremover.models.vae.WanVAE` (whose weights it takes, converted once to
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
  every sum (tests/parity/test_vae_fast.py checks the padded input of every causal conv3d); the video and latent ends keep
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
  input frames (`Decoder.head`).
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
  fuse_bias=False wherever the conv itself is deterministic (tests/parity/test_vae_fast.py: the CPU with a conv that
  composes like cuDNN's, and a GPU test at a W2 chunk). H200, W2: bit-identical, 2.549 -> 2.381 s (1.07x) for both
  encodes + the decode (bench/results/vae-w2-fusebias-*.json). Not deferred: FP8 convs (their kernel adds the bias itself); conv_in, the
  resample convs and time_conv, whose outputs feed a residual block's norm1 AND its shortcut (or a copy), so the
  biased values would have to be written anyway; and the rest (conv_shortcut, to_qkv, conv_out / the tap head, the
  quant convs). At W2 that defers about 75 % of the encode's and 83 % of the decode's bias-add elements (counted
  with a shape-only run; if the add's time scales with its size, ~135 + ~85 ms of the 180 + 101 ms).

Numerics: not bit-identical to the eager module (cuDNN picks other algorithms for channels-last, the norm's sum
of squares is added in another order, and its default fast mode rounds step 3 and the SiLU differently), but the same
function at fp16/bf16 precision; tests/parity/test_vae_fast.py checks CPU fp32 agreement with WanVAE and the GPU test
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

The parts: convert.py (the weights in the fast layout), conv.py (which conv implementation runs, the causal
streams), blocks.py (residual / attention / resample blocks), encoder.py, decoder.py, model.py (`FastWanVAE`,
`build_vae`).

`python tools/bench_vae.py` (not shipped) compares this VAE with diffusers' AutoencoderKLWan (the reference) at the W2
size on a CUDA GPU: per-stage time and peak memory, PSNR of the decoded video, cosine of the latents.
"""

from fastremover.fast.vae.conv import fp8_conv_available
from fastremover.fast.vae.convert import fp8_pays, static_act_scale
from fastremover.fast.vae.model import SMALL_FRAME_PIXELS, FastWanVAE, build_vae

__all__ = ["FastWanVAE", "build_vae", "fp8_conv_available", "fp8_pays", "static_act_scale", "SMALL_FRAME_PIXELS"]
