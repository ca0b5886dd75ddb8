"""RemovalPipeline: the one object the CLI, the Python API and the server call.

Data path (upstream MiniMax-Remover order, REFERENCE §1, per window):
    frames uint8 + mask bool (media io)
    -> preprocess: dilate the mask (L1 diamond, = scipy binary_dilation); split the clip into overlapping windows
       (`fastremover.windows`); per window, the frames it shares with the previous window are that window's output,
       with their mask cleared (known content the model continues from); pick the crop (the whole frame, or a box
       around the window's mask); frames to [-1,1], fit the run size (native: pad bottom/right to multiples of 16; or
       an explicit WxH: bilinear resize, mask re-binarized), pad the frame count to 4k+1 by repeating the last frame
    -> VAE encode twice (posterior mode): masked = frames*(1-mask), and 2*mask-1; both normalized
    -> denoise: noise ~ randn [1,16,T,H/8,W/8] from torch.Generator(device).manual_seed(seed);
       each step the transformer sees cat([x, masked_lat, mask_lat]) and the scheduler steps x
    -> VAE decode of denormalized x, one latent frame at a time (`fastremover.vae_api.VideoVAE`: the pipeline's
       only way to its VAE); each chunk of pixels goes on at once through the steps below, all of them per frame
    -> crop padding, resize back to the source size, paste the crop back
    -> composite: pixels outside the dilated mask are copied from the input (feathered inside the mask for crops);
       shared frames are cross-faded linearly from the previous window's output to this one's
The `classic` backend replaces encode/denoise/decode with the weightless fill of `fastremover.classic`.
A clip of at most one window, without a crop, takes exactly the single-pass path (bit-identical to the reference order).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from fastremover.classic import classic_remove
from fastremover.errors import FastRemoverError
from fastremover.masks import composite, dilate_masks
from fastremover.config import AttentionOptions, EngineConfig, LinearOptions, ResolvedEngine, VAEOptions
from fastremover.fast.engine import MODES, build  # noqa: F401  (MODES: re-exported for the CLI)
from fastremover.options import SIZE_MULTIPLE, RunOptions, parse_size
from fastremover.models.loading import RemoverModels, load_models
from fastremover.schedulers import DEFAULT_SCHEDULE
from fastremover.timing import StageTimer
from fastremover.windows import (
    Box,
    Window,
    ceil_4k1,
    choose_crop,
    STREAM_PREFETCH,
    default_overlap,
    crossfade_weights,
    plan_windows,
    usable_window_length,
)

if TYPE_CHECKING:
    from fastremover.stream import ResumeStore

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
WEIGHTS = ("dense", "nvfp4", "nvfp4-w4a4")
# A crop's output is pasted back with a ramp up to this wide inside the mask: the model saw less of the scene, so its
# colours may drift a little from the surroundings (see crop_feather for the cap).
CROP_FEATHER = 4

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def crop_feather(dilate: int) -> int:
    """Width of the crop's paste-back ramp for a mask dilated by `dilate` (L1) pixels: at most CROP_FEATHER, and narrow
    enough that the ramp lies on the dilation ring only, so no pixel of the object itself is blended back in.

    An object pixel's nearest unmasked pixel is more than `dilate` away in L1, so at least (dilate + 1) / sqrt(2) in
    the Euclidean distance the ramp uses; the ramp is fully opaque from feather + 1 on.
    """
    return max(0, min(CROP_FEATHER, math.floor((dilate + 1) / math.sqrt(2) - 1)))


def stream_prefetch(options: RunOptions, model: bool) -> int:
    """Frames `remove_stream` reads (decoded, masks dilated) ahead of the windows by default: with a model, one
    window's new frames, so the next window's input is ready when the current one ends; for the classic fill (which
    is CPU-bound itself) at most STREAM_PREFETCH."""
    usable = usable_window_length(options.window)
    overlap = default_overlap(options.window) if options.overlap is None else options.overlap
    new = max(1, usable - overlap)
    return new if model else min(STREAM_PREFETCH, new)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class WindowRun:
    """What one window ran on: recorded in the result so callers (and tests) can see the geometry used."""

    start: int  # frames [start, stop) of the clip
    stop: int
    overlap: int  # leading frames shared with the previous window (conditioned on its output, cross-faded)
    box: Box | None  # (y0, y1, x0, x1) the model ran on, None = the whole frame
    run_hw: tuple[int, int] | None  # (H, W) of the model's input after fitting (None for classic or a skipped window)
    ran: bool  # False when nothing was masked in the window's new frames


@dataclass
class RemovalResult:
    frames: np.ndarray  # uint8 [F,H,W,3] at the source size: the final output (composited unless disabled)
    mask: np.ndarray  # bool [F,H,W] the dilated mask that was removed
    # uint8 [F,H,W,3] decoded model output before compositing (the crop pasted into the input); None if the model did
    # not run, and for more than one window (it would be a second copy of a long video)
    generated: np.ndarray | None = None
    # final denoised latents (fp32, CPU), for fidelity checks; only for a single full-frame window (otherwise there is
    # no one latent tensor of the whole clip)
    latents: torch.Tensor | None = None
    # decoded [1,3,F',H',W'] at the run size, before any crop/composite (keep_pixels; single full-frame window only)
    pixels: torch.Tensor | None = None
    timer: StageTimer = field(default_factory=StageTimer)
    ran_model: bool = False
    notes: list[str] = field(default_factory=list)
    windows: list[WindowRun] = field(default_factory=list)  # per window: frames, overlap, crop box, run size


@dataclass
class StreamResult:
    """What `RemovalPipeline.remove_stream` did (the frames themselves went to its `emit`)."""

    timer: StageTimer = field(default_factory=StageTimer)
    num_frames: int = 0
    height: int = 0
    width: int = 0
    ran_model: bool = False
    notes: list[str] = field(default_factory=list)
    windows: list[WindowRun] = field(default_factory=list)
    resumed_windows: int = 0  # windows rebuilt from the resume store instead of run
    any_masked: bool = False
    all_masked: bool = True
    # seconds the window loop spent inside `emit` (with an ordered writer behind it: the write time it did not hide)
    emit_s: float = 0.0


@dataclass
class Prepared:
    """Model-ready tensors for one clip plus the geometry needed to undo the fitting."""

    frames: torch.Tensor  # [1,3,F',H',W'] in [-1,1], run dtype
    mask: torch.Tensor  # [1,3,F',H',W'] in {0,1}, run dtype
    num_frames: int  # F before padding to 4k+1
    source_hw: tuple[int, int]
    run_hw: tuple[int, int]
    resized: bool  # explicit size (resize back at the end) vs native (crop the padding)
    rounding: str = "round"  # decoded pixels to uint8: "round" or "truncate" (RunOptions.rounding)


def _frames_to_tensor(frames: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 [F,H,W,3] -> fp32 [1,3,F,H,W] in [-1,1] (upstream: x/127.5 - 1)."""
    x = torch.from_numpy(frames).to(device)
    return (x.permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5) - 1.0


def _resize_video(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of [1,C,F,H,W] per frame (upstream: F.interpolate(mode='bilinear'), align_corners=False)."""
    b, c, f, _, _ = x.shape
    y = F.interpolate(x.permute(0, 2, 1, 3, 4).reshape(b * f, c, *x.shape[-2:]), size=hw, mode="bilinear")
    return y.reshape(b, f, c, *hw).permute(0, 2, 1, 3, 4)


def _pad_frames_4k1(x: torch.Tensor) -> torch.Tensor:
    """Repeat the last frame so the count is 4k+1 (the VAE's causal chunking drops frames otherwise)."""
    f = x.shape[2]
    target = ceil_4k1(f)
    if target == f:
        return x
    return torch.cat([x, x[:, :, -1:].expand(-1, -1, target - f, -1, -1)], dim=2)


def _to_uint8(x: torch.Tensor, rounding: str = "round") -> np.ndarray:
    """[1,3,F,H,W] in [-1,1] -> uint8 [F,H,W,3], rounded (or with rounding="truncate" truncated, as the released
    pipeline's export does: (x * 0.5 + 0.5).clamp(0, 1) in x's dtype, then float32 * 255 cast to uint8)."""
    return _to_uint8_async(x, rounding).result()


class _HostFrames:
    """uint8 [F,H,W,3] frames on their way to the host: `result()` waits for the copy and returns them as a numpy
    array of their own (not pinned memory, which goes back to torch's host cache for the next chunk)."""

    def __init__(self, frames: torch.Tensor):
        self._event = None
        if frames.device.type == "cuda":
            self._host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
            self._host.copy_(frames, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(frames.device))
        else:
            self._host = frames.cpu()

    def result(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
            return self._host.numpy().copy()
        return self._host.numpy()


def _to_uint8_async(x: torch.Tensor, rounding: str = "round") -> _HostFrames:
    """`_to_uint8` with the device -> host copy left running (same ops, so the same bytes)."""
    if rounding == "truncate":
        y = ((x[0] * 0.5 + 0.5).clamp(0, 1).float() * 255).floor().to(torch.uint8)
    else:
        y = ((x[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return _HostFrames(y.permute(1, 2, 3, 0).contiguous())


class RemovalPipeline:
    """Object removal with MiniMax-Remover (or the weightless classic fill), one instance per loaded model."""

    def __init__(
        self,
        models: RemoverModels | None,
        *,
        device: str | None = None,
        precision: str | None = None,
        mode: str = "auto",
        attention: str = "auto",
        vae_precision: str = "auto",
        weights: str = "dense",
        force_w4a4: bool = False,
        config: EngineConfig | None = None,
    ):
        """config: the engine's input (fastremover/config.py); without it one is built from the keyword arguments and
        the environment's overrides (`EngineConfig.with_env`). weights (config.linears.weights): the transformer block
        linears as stored: "dense", "nvfp4" (packed 4-bit weights, W4A16) or "nvfp4-w4a4" (activations quantized too;
        refused on full-frame windows unless force_w4a4). NVFP4 runs in the eager mode (the fused transformer reads
        dense weights): an explicit exact / fast mode is an error. `self.config` is the ResolvedEngine: what runs."""
        if config is None:
            config = EngineConfig(device=device, precision=precision, mode=mode, attention=AttentionOptions(attention),
                                  linears=LinearOptions(weights=weights, force_w4a4=force_w4a4),
                                  vae=VAEOptions(vae_precision)).with_env()
        self.engine_config = config
        self.weights, self.force_w4a4 = config.linears.weights, config.linears.force_w4a4
        self.device = torch.device(config.device or default_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise FastRemoverError("--device cuda: no CUDA GPU is available here; use --device cpu")
        precision = config.precision or ("fp16" if self.device.type == "cuda" else "fp32")
        self.dtype = PRECISIONS[precision]
        self.models = models
        self.closed = False
        engine = build(models, config, self.device, self.dtype, precision)
        self.denoiser = engine.denoiser
        self.vae = engine.vae  # a VideoVAE: the eager one or a FastWanVAE, chosen with the mode (engine.build)
        self.config: ResolvedEngine = engine.resolved

    @classmethod
    def from_model(
        cls,
        model: str = "classic",
        *,
        preset: str = "minimax-remover",
        weights_seed: int = 0,
        device: str | None = None,
        precision: str | None = None,
        mode: str = "auto",
        attention: str = "auto",
        vae_precision: str = "auto",
        weights: str = "dense",
        force_w4a4: bool = False,
        config: EngineConfig | None = None,
    ) -> "RemovalPipeline":
        """`model`: "classic" (no weights), "random" (preset config, deterministic random weights), a checkpoint dir
        or a Hugging Face Hub id "ORG/NAME[@REVISION]" (fastremover.models.hub: the local cache, else downloaded)."""
        models = None if model == "classic" else load_models(model, preset, weights_seed)
        return cls(models, device=device, precision=precision, mode=mode, attention=attention,
                   vae_precision=vae_precision, weights=weights, force_w4a4=force_w4a4, config=config)

    def _begin(self, options: RunOptions | None, timer: StageTimer | None):
        """A request's validated options, its explicit size (None for native) and its timer."""
        if self.closed:
            raise RuntimeError("this RemovalPipeline was closed; build a new one")
        options = options or RunOptions()
        options.validate()
        return options, parse_size(options.size), timer or StageTimer(self.device)

    def close(self) -> None:
        """Release the models, the denoiser's captured graphs and the GPU memory they hold. The pipeline cannot run
        afterwards."""
        self.denoiser = self.vae = self.models = None
        self.closed = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "RemovalPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------------------------
    # Stages

    def prepare(self, frames: np.ndarray, mask: np.ndarray, size: tuple[int, int] | None) -> Prepared:
        """uint8 frames + dilated bool mask at the source size -> model-ready tensors at the run size."""
        h, w = frames.shape[1:3]
        x = _frames_to_tensor(frames, self.device)
        m = torch.from_numpy(mask).to(self.device).float()[None, None].expand(1, 3, -1, -1, -1)
        if size is None:
            run_hw = (-(-h // SIZE_MULTIPLE) * SIZE_MULTIPLE, -(-w // SIZE_MULTIPLE) * SIZE_MULTIPLE)
            pad = (0, run_hw[1] - w, 0, run_hw[0] - h)
            if any(pad):
                x = F.pad(x[0], pad, mode="replicate")[None]
                m = F.pad(m, pad, value=0.0)
        else:
            run_hw = (size[1], size[0])
            x = _resize_video(x, run_hw)
            m = (_resize_video(m, run_hw) > 0).float()
        return Prepared(
            frames=_pad_frames_4k1(x).to(self.dtype),
            mask=_pad_frames_4k1(m).to(self.dtype),
            num_frames=frames.shape[0],
            source_hw=(h, w),
            run_hw=run_hw,
            resized=size is not None,
        )

    @torch.no_grad()
    def encode(self, prep: Prepared, progress: Progress | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized latents of the masked video and of the mask video (as 2*mask-1): the VAE's `encode_removal`
        (`fastremover.vae_api.VideoVAE`: tiled when its own memory model says one call does not fit; the fast VAE
        forms both inputs chunk by chunk, as one batch of 2 when memory allows)."""
        report = (lambda done, total: progress("vae_encode", done, total)) if progress else None
        return self.vae.encode_removal(prep.frames, prep.mask, report)

    @torch.no_grad()
    def denoise(
        self,
        masked_latents: torch.Tensor,
        mask_latents: torch.Tensor,
        steps: int,
        seed: int,
        progress: Progress | None = None,
        schedule: str = DEFAULT_SCHEDULE,
    ) -> torch.Tensor:
        """The denoised latents from seeded noise, `steps` steps of the checkpoint's scheduler with `schedule`
        (fastremover.schedulers.SCHEDULES)."""
        generator = torch.Generator(self.device).manual_seed(seed)
        noise = torch.randn(masked_latents.shape, generator=generator, device=self.device, dtype=self.dtype)
        return self.denoiser(noise, masked_latents, mask_latents, steps, progress, schedule=schedule)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        """Normalized latents -> decoded [1,3,F',H',W'] at the run size (`decode_iter`'s chunks concatenated)."""
        return torch.cat(list(self.decode_iter(latents, progress)), dim=2)

    def decode_iter(self, latents: torch.Tensor, progress: Progress | None = None) -> Iterator[torch.Tensor]:
        """The decode one latent frame at a time: pixel chunks [1,3,k,H',W'] in order, each as soon as the VAE has
        it (`VideoVAE.decode_latents_iter`: a tiled decode gives them after its last tile)."""
        report = (lambda done, total: progress("vae_decode", done, total)) if progress else None
        return self.vae.decode_latents_iter(latents, report)

    def finish(self, pixels: torch.Tensor, prep: Prepared) -> np.ndarray:
        """Decoded [1,3,F',H',W'] -> uint8 [F,H,W,3] at the source size (drop frame padding, crop or resize back)."""
        return self.finish_chunk(pixels, prep, 0)

    def finish_chunk(self, chunk: torch.Tensor, prep: Prepared, start: int) -> np.ndarray:
        """`finish` of the decoded frames [start, start + k) (chunk [1,3,k,H',W']): uint8 [k',H,W,3], k' = the
        frames of them before the padding to 4k+1 (possibly 0). Per frame the same ops as `finish` of the whole
        video, so the same bytes."""
        return self.finish_chunk_async(chunk, prep, start).result()

    def finish_chunk_async(self, chunk: torch.Tensor, prep: Prepared, start: int) -> "_HostFrames":
        """`finish_chunk` with its device -> host copy still running: `.result()` waits for it and gives the frames.
        On a GPU the work queued after this call (the next chunk's decode) runs while the host waits for or
        composites these frames."""
        x = chunk[:, :, : max(0, prep.num_frames - start)]
        if x.shape[2] == 0:
            return _HostFrames(torch.empty((0, *prep.source_hw, 3), dtype=torch.uint8))
        if prep.resized:
            x = _resize_video(x.float(), prep.source_hw)
        else:
            x = x[..., : prep.source_hw[0], : prep.source_hw[1]]
        return _to_uint8_async(x, prep.rounding)

    # ------------------------------------------------------------------------------------------------------------------
    # The whole request

    def remove(
        self,
        frames: np.ndarray,
        mask: np.ndarray,
        options: RunOptions | None = None,
        *,
        progress: Progress | None = None,
        timer: StageTimer | None = None,
        keep_pixels: bool = False,
    ) -> RemovalResult:
        """Remove the masked object. frames: uint8 [F,H,W,3]; mask: bool [F,H,W] (undilated), same F, H, W.

        Any F: the clip is processed in overlapping windows of `options.window` frames (one window if it is not
        longer), each on the whole frame or on a crop around the mask (`options.crop`); `result.windows` says which.
        progress(stage, done, total) is called with "window" (0 first, then after each window) and "denoise" (after
        each step of each window).
        keep_pixels: also return the decoded video at the run size before cropping/compositing (for fidelity checks;
        single full-frame window only).
        """
        options, size, timer = self._begin(options, timer)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise FastRemoverError(f"frames must be uint8 [F,H,W,3], got {frames.dtype} {list(frames.shape)}")
        if mask.shape != frames.shape[:3]:
            raise FastRemoverError(f"mask shape {list(mask.shape)} does not match the video {list(frames.shape[:3])}")
        notes: list[str] = []
        if options.frame_tail == "drop" and usable_window_length(len(frames)) < len(frames):
            kept = usable_window_length(len(frames))
            notes.append(_dropped_tail_note(len(frames) - kept))
            frames, mask = frames[:kept], mask[:kept]

        with timer.stage("preprocess"):
            dilated = dilate_masks(mask.astype(bool), options.dilate)
        if not dilated.any():
            notes.append("the mask is empty: nothing to remove, the output is the input")
            return RemovalResult(frames=frames.copy(), mask=dilated, timer=timer, notes=notes)
        if dilated.all():
            notes.append("the mask covers every pixel: the whole video is regenerated, nothing of the input is kept")

        windows = plan_windows(len(frames), options.window, options.overlap)
        if len(windows) > 1 and usable_window_length(options.window) != options.window:
            notes.append(f"--window {options.window}: using {usable_window_length(options.window)} frames per window "
                         "(the VAE works in 4k+1 frames)")
        # An explicit --size resizes the whole frame: a crop would be a different geometry, so auto means off then.
        crop_mode = "off" if size is not None else options.crop

        out = frames.copy()  # the output, written window by window
        runs: list[WindowRun] = []
        generated = latents = pixels = None  # set for a single window only (see RemovalResult)
        if progress:
            progress("window", 0, len(windows))
        for index, win in enumerate(windows):
            span = slice(win.start, win.stop)
            # Latents and decoded pixels describe the whole clip only for one full-frame window.
            run, filled = self._run_window(out[span], frames[span], dilated[span], win, options, timer, progress,
                                           crop_mode=crop_mode, clip_all_masked=bool(dilated.all()),
                                           keep_whole=len(windows) == 1, keep_pixels=keep_pixels)
            runs.append(run)
            if filled is not None and len(windows) == 1:
                generated, latents, pixels = filled.frames, filled.latents, filled.pixels
            if progress:
                progress("window", index + 1, len(windows))

        ran_model = self.models is not None and any(run.ran for run in runs)
        return RemovalResult(
            frames=out,
            mask=dilated,
            generated=generated if ran_model else None,
            latents=latents,
            pixels=pixels,
            timer=timer,
            ran_model=ran_model,
            notes=notes,
            windows=runs,
        )

    def remove_stream(
        self,
        pairs: Iterable[tuple[np.ndarray, np.ndarray]],
        emit: Callable[[np.ndarray], None],
        options: RunOptions | None = None,
        *,
        progress: Progress | None = None,
        timer: StageTimer | None = None,
        store: "ResumeStore | None" = None,
        total_frames: int = 0,
        prefetch: int | None = None,
        trace: Trace | None = None,
    ) -> "StreamResult":
        """`remove` for a clip that arrives frame by frame, in memory bounded by one window.

        pairs: (frame uint8 [H,W,3], mask bool [H,W] undilated) in order (e.g. `stream.open_clip(...).pairs`).
        emit(frame): called once per output frame, in order, as soon as no later window can change it (the frames
        a window shares with the next one wait for its cross-fade). The frames are the ones `remove` returns for the
        stacked clip, bit for bit. The last window's frames are emitted as its VAE decode produces them (per latent
        frame, after their composite and cross-fade), so an encoder behind `emit` works while the rest decodes.
        The input is read, and the masks thresholded and dilated, in a background thread up to `prefetch` frames
        ahead; default: with a model, one window's new frames (`stream_prefetch`), so the next window's input is
        decoded and preprocessed while the current one runs; the classic fill, at most STREAM_PREFETCH.
        trace(event, index): see `Trace` (tests and profiling).

        store: a `stream.ResumeStore`: each finished window of a clip of more than one window is saved in it, and
        windows it already holds (a resumed run) are rebuilt from it instead of run.
        total_frames: the clip's length if known (for progress only; 0 = unknown). progress gets "window" (done,
        windows planned from total_frames, at least done) and "frames" (frames handed to `emit`, total_frames; 0 when
        unknown or exceeded).
        """
        from fastremover.stream import Prefetch, fingerprint_frames
        from fastremover.windows import next_window, window_lookahead

        options, size, timer = self._begin(options, timer)
        crop_mode = "off" if size is not None else options.crop
        usable = usable_window_length(options.window)
        depth = stream_prefetch(options, self.models is not None) if prefetch is None else prefetch

        tail = _DropTail(pairs) if options.frame_tail == "drop" else None

        def prepared():
            for i, (frame, mask) in enumerate(tail if tail is not None else pairs):
                if frame.ndim != 3 or frame.shape[-1] != 3 or frame.dtype != np.uint8:
                    raise FastRemoverError(f"frames must be uint8 [H,W,3], got {frame.dtype} {list(frame.shape)}")
                if mask.shape != frame.shape[:2]:
                    raise FastRemoverError(f"mask shape {list(mask.shape)} does not match the frame "
                                           f"{list(frame.shape[:2])}")
                item = frame, dilate_masks(np.asarray(mask, bool)[None], options.dilate)[0]
                if trace is not None:
                    trace("read", i)
                yield item

        # Frames [base, base + len(inputs)) of the clip: input, dilated mask, output so far (None: the input).
        inputs: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        outs: list[np.ndarray | None] = []
        base = 0
        ended = False
        result = StreamResult(timer=timer)
        source = Prefetch(prepared(), depth, name="fastremover-read")

        def fill(count: int) -> None:
            nonlocal ended
            while not ended and base + len(inputs) < count:
                t = time.perf_counter()
                item = next(source, None)  # waits only when decoding is behind the windows
                timer.wall_s["read"] = timer.wall_s.get("read", 0.0) + time.perf_counter() - t
                if item is None:
                    ended = True
                    break
                frame, dilated = item
                if inputs and frame.shape != inputs[0].shape:
                    raise FastRemoverError("the video changes resolution mid-stream; re-encode it at one resolution")
                inputs.append(frame)
                masks.append(dilated)
                outs.append(None)
                result.any_masked |= bool(dilated.any())
                result.all_masked &= bool(dilated.all())

        emitted = 0  # frames [0, emitted) of the clip went to `emit`

        def hand_out(frame: np.ndarray) -> None:
            nonlocal emitted
            t = time.perf_counter()
            emit(frame)
            result.emit_s += time.perf_counter() - t
            if trace is not None:
                trace("emit", emitted)
            emitted += 1
            if progress:  # total 0: unknown (no count in the container, or the count was short)
                progress("frames", emitted, total_frames if total_frames >= emitted else 0)

        def emit_final(window_out: np.ndarray, first: int, start: int, count: int) -> None:
            """Frames [start, start + count) of the last window (clip frames first + ...) are final: emit them."""
            for j in range(start, start + count):
                if first + j >= emitted:
                    hand_out(window_out[j])

        def release(upto: int) -> None:
            nonlocal base
            while base < upto:
                out = outs.pop(0)
                frame = inputs.pop(0)
                masks.pop(0)
                if base >= emitted:  # (the last window's frames went out as they were decoded)
                    hand_out(frame if out is None else out)
                base += 1

        planned = len(plan_windows(total_frames, options.window, options.overlap)) if total_frames > 0 else 0
        if progress:
            progress("window", 0, planned)
        try:
            prev: Window | None = None
            finished = 0
            index = 0
            while True:
                fill(window_lookahead(prev, options.window, options.overlap))
                win = next_window(prev, base + len(inputs), ended, options.window, options.overlap)
                if win is None:
                    break
                if index == 0:
                    single = ended and win.stop == base + len(inputs)
                    result.height, result.width = inputs[0].shape[:2]
                    if store is not None:
                        if single:  # nothing to resume in a run of one window
                            store.clear()
                            store = None
                        else:
                            first = fingerprint_frames(inputs[:4] + masks[:4])
                            finished = store.start(first)
                            if store.note:
                                result.notes.append(store.note)
                            if finished:
                                result.notes.append(f"--resume: continued after {finished} finished windows (their "
                                                    "output rebuilt from the saved state)")
                    if not single and usable != options.window:
                        result.notes.append(f"--window {options.window}: using {usable} frames per window "
                                            "(the VAE works in 4k+1 frames)")
                release(win.start)
                span = slice(win.start - base, win.stop - base)
                frames_w = np.stack(inputs[span])
                dilated_w = np.stack(masks[span])
                # The buffers now hold views of the stacks, so each frame is in memory once, not twice.
                inputs[span], masks[span] = list(frames_w), list(dilated_w)
                out_w = np.stack([f if o is None else o for f, o in zip(inputs[span], outs[span])])
                if index < finished:  # a resumed run: this window's output is in the store
                    record = store.windows[index]
                    if (record["start"], record["stop"], record["overlap"]) != (win.start, win.stop, win.overlap):
                        raise RuntimeError(f"saved window {index} is {record}, the plan {win}")
                    out_w = store.load(index, frames_w)
                    box = tuple(record["box"]) if record["box"] is not None else None
                    run_hw = tuple(record["run_hw"]) if record["run_hw"] is not None else None
                    run = WindowRun(win.start, win.stop, win.overlap, box, run_hw, record["ran"])
                else:
                    # Whether the whole clip is masked is known only at its end; until then, "every frame so far".
                    clip_all_masked = result.all_masked and ended
                    # The last window: no later window changes its frames, so each goes out as soon as it is
                    # composited and cross-faded (frames before win.start went out in release above).
                    last = ended and win.stop == base + len(inputs)
                    run, _ = self._run_window(out_w, frames_w, dilated_w, win, options, timer, progress,
                                              crop_mode=crop_mode, clip_all_masked=clip_all_masked,
                                              on_final=partial(emit_final, out_w, win.start) if last else None,
                                              trace=trace, index=index)
                    if store is not None:
                        store.save(index, {"start": win.start, "stop": win.stop, "overlap": win.overlap,
                                           "box": run.box, "run_hw": run.run_hw, "ran": run.ran}, out_w, frames_w)
                # Per frame: None where the output is the input, else its own copy (views would keep the whole
                # window's array alive as long as any of its frames waits for the next window). Frames already
                # emitted (the last window's, as they were decoded) are never read again: nothing to keep.
                outs[span] = [None if win.start + j < emitted or np.array_equal(o, f) else o.copy()
                              for j, (o, f) in enumerate(zip(out_w, frames_w))]
                del out_w, frames_w, dilated_w
                result.windows.append(run)
                index += 1
                prev = win
                if progress:
                    progress("window", index, max(index, planned))
            release(base + len(inputs))
        finally:
            source.close()
        assert emitted == base, (emitted, base)
        if tail is not None and tail.dropped:
            result.notes.append(_dropped_tail_note(tail.dropped))
        result.num_frames = base
        result.resumed_windows = finished
        result.ran_model = self.models is not None and any(run.ran for run in result.windows)
        if not result.any_masked:
            result.notes.append("the mask is empty: nothing to remove, the output is the input")
        elif result.all_masked:
            result.notes.append("the mask covers every pixel: the whole video is regenerated, nothing of the input "
                                "is kept")
        return result

    def _run_window(
        self,
        out: np.ndarray,
        frames: np.ndarray,
        dilated: np.ndarray,
        win: Window,
        options: RunOptions,
        timer: StageTimer,
        progress: Progress | None,
        *,
        crop_mode: str,
        clip_all_masked: bool,
        keep_whole: bool = False,
        keep_pixels: bool = False,
        on_final: Callable[[int, int], None] | None = None,
        trace: "Trace | None" = None,
        index: int = 0,
    ) -> tuple[WindowRun, "_Filled | None"]:
        """Run one window and write its result into `out` in place.

        `out`, `frames`, `dilated`: the window's frames [win.start, win.stop) of the output so far (the input where
        no earlier window wrote), of the input and of the dilated mask. The first `win.overlap` frames are shared with
        the previous window: they enter as known content (its output, mask cleared) and are cross-faded.
        `clip_all_masked`: every pixel of the whole clip is masked (the classic fill is then allowed on a fully
        masked window, and refuses it itself).
        The model's output is finished, composited and cross-faded chunk by chunk, as the VAE decodes it (one chunk
        per latent frame; every step is per frame, so the bytes are those of the whole window at once).
        on_final(start, count): called after frames [start, start + count) of the window are written into `out`
        (the caller knows whether they are final). trace / index: events for `remove_stream`'s trace."""
        size = parse_size(options.size)
        with timer.stage("preprocess"):
            # Frames shared with the previous window enter as known content: its output, with the mask cleared,
            # so the model continues from what it already generated instead of inventing it again.
            # (`out` itself, not a copy, which would be one more window of frames in memory: nothing writes `out`
            # before the composite below, and the fills return new arrays.)
            window_frames = out
            window_mask = dilated.copy()
            window_mask[: win.overlap] = False
            # The box only needs to hold what is still to be generated (the shared frames are known already).
            box = choose_crop(window_mask, crop_mode)
        if self.weights == "nvfp4-w4a4" and box is None and window_mask.any() and not self.force_w4a4:
            from fastremover.fast.nvfp4_linear import check_w4a4_allowed

            check_w4a4_allowed(crop_active=False, force=False)  # FastRemoverError: full frames collapse (FlashRT)
        if not window_mask.any():  # nothing new to remove: `out` already holds the input / previous output
            return WindowRun(win.start, win.stop, win.overlap, None, None, ran=False), None
        if self.models is None and window_mask.all() and not clip_all_masked:
            raise FastRemoverError(
                f"frames {win.start}..{win.stop - 1} are masked entirely: the classic remover has nothing to "
                "fill them from inside one window; use a larger --window or a diffusion model (--model PATH)"
            )
        feather = crop_feather(options.dilate) if box is not None else 0

        def sink(start: int, filled_frames: np.ndarray) -> None:
            """Frames [start, start + k) of the window filled by the model: composite and write them into `out`."""
            stop = start + len(filled_frames)
            with timer.stage("composite"):
                # Against the input and the real mask: shared frames take this window's model pixels inside the
                # mask too, so the cross-fade blends the two windows' pixels there.
                if options.composite:
                    window_out = composite(frames[start:stop], filled_frames, dilated[start:stop], feather=feather)
                else:
                    window_out = filled_frames
                _write_frames(out, window_out, start, win.overlap)
            if on_final is not None:
                on_final(start, stop - start)

        whole_clip = keep_whole and box is None
        filled = self._fill_window(window_frames, window_mask, box, size, options, timer, progress, sink,
                                   keep_frames=keep_whole, keep_latents=whole_clip,
                                   keep_pixels=whole_clip and keep_pixels, trace=trace, index=index)
        return WindowRun(win.start, win.stop, win.overlap, box, filled.run_hw, ran=True), filled

    def _fill_window(
        self,
        frames: np.ndarray,
        mask: np.ndarray,
        box: Box | None,
        size: tuple[int, int] | None,
        options: RunOptions,
        timer: StageTimer,
        progress: Progress | None,
        sink: Callable[[int, np.ndarray], None],
        keep_frames: bool = False,
        keep_latents: bool = False,
        keep_pixels: bool = False,
        trace: "Trace | None" = None,
        index: int = 0,
    ) -> "_Filled":
        """One window's frames (uint8 [F,H,W,3]) with the pixels of `mask` filled in by the model (or the classic
        fill), on the whole frame or only inside `box` (the rest of the frame is `frames` unchanged), handed to
        `sink(start, filled frames [start, start + k))` in order: the model's chunk by chunk as the VAE decodes them,
        the classic fill's at once. `frames` may be written by `sink` behind the chunk it was given (each chunk
        reads only its own frames). keep_frames: also return all filled frames (`_Filled.frames`)."""
        if box is not None:
            y0, y1, x0, x1 = box
            with timer.stage("preprocess"):
                frames_in = np.ascontiguousarray(frames[:, y0:y1, x0:x1])
                mask_in = np.ascontiguousarray(mask[:, y0:y1, x0:x1])
        else:
            frames_in, mask_in = frames, mask
        kept: list[np.ndarray] = []

        def paste(start: int, part: np.ndarray) -> np.ndarray:
            if box is None:
                return part
            with timer.stage("composite"):
                whole = frames[start : start + len(part)].copy()
                whole[:, y0:y1, x0:x1] = part
            return whole

        def hand(start: int, part: np.ndarray) -> None:
            if keep_frames:
                kept.append(part)
            sink(start, part)

        if self.models is None:
            with timer.stage("classic"):
                part = classic_remove(frames_in, mask_in)
            hand(0, paste(0, part))
            filled = _Filled(None, run_hw=None)
        else:
            with timer.stage("preprocess"):
                prep = self.prepare(frames_in, mask_in, size)
                prep.rounding = options.rounding
            with timer.stage("vae_encode"):
                masked_latents, mask_latents = self.encode(prep, progress)
            with timer.stage("denoise"):
                latents = self.denoise(masked_latents, mask_latents, options.steps, options.seed, progress,
                                       schedule=options.schedule)
            del masked_latents, mask_latents
            pixels: list[torch.Tensor] = []
            if trace is not None:
                trace("decode", index)
            chunks = self.decode_iter(latents, progress)
            start = 0  # decoded frames so far (the padding to 4k+1 included)
            # One chunk of lookahead: chunk i's conversion and device -> host copy are queued, then chunk i+1's
            # decode, and only then does the host wait for chunk i and composite it, while the GPU decodes.
            pending: tuple[int, _HostFrames] | None = None
            while True:
                with timer.stage("vae_decode"):
                    chunk = next(chunks, None)
                queued = None
                if chunk is not None:
                    with timer.stage("composite"):
                        if keep_pixels:
                            pixels.append(chunk.float().cpu())
                        queued = start, self.finish_chunk_async(chunk, prep, start)
                        start += chunk.shape[2]
                        del chunk
                if pending is not None:
                    with timer.stage("composite"):
                        part = pending[1].result()
                    if len(part):
                        hand(pending[0], paste(pending[0], part))
                if queued is None:
                    break
                pending = queued
            if trace is not None:
                trace("decoded", index)
            filled = _Filled(
                None,
                prep.run_hw,
                latents=latents.float().cpu() if keep_latents else None,
                pixels=torch.cat(pixels, dim=2) if keep_pixels else None,
            )
        if keep_frames:
            filled.frames = np.concatenate(kept) if len(kept) > 1 else kept[0]
        return filled


def _dropped_tail_note(count: int) -> str:
    return (f"--frame-tail drop: the last {count} frame{'s' if count > 1 else ''} of the clip were dropped (the "
            "released pipeline encodes 4k+1 frames and drops the rest)")


class _DropTail:
    """The items of `pairs` but the last 1-3 when their count is not 4k+1 (frame_tail "drop"), holding back at most 3:
    an item at index 4k is always kept, the ones after it only once index 4(k+1) arrives. `dropped` counts the rest
    once the iteration ended."""

    def __init__(self, pairs: Iterable):
        self.pairs, self.dropped = pairs, 0

    def __iter__(self):
        held = []
        for i, pair in enumerate(self.pairs):
            held.append(pair)
            if i % 4 == 0:
                yield from held
                held.clear()
        self.dropped = len(held)


#: remove_stream's trace: trace(event, index) with ("read", frame) from the reader thread once a frame and its
#: dilated mask are ready, ("decode", window) / ("decoded", window) around a window's VAE decode, ("emit", frame)
#: as a frame is handed to `emit`.
Trace = Callable[[str, int], None]


@dataclass
class _Filled:
    """One window's model (or classic) output at the window's frame size, plus what the model ran on."""

    frames: np.ndarray | None  # uint8 [F,H,W,3], when kept (keep_frames)
    run_hw: tuple[int, int] | None  # the model's input (H, W) after fitting; None for classic
    latents: torch.Tensor | None = None
    pixels: torch.Tensor | None = None


def _write_window(clip: np.ndarray, window_frames: np.ndarray, win: Window) -> None:
    """Write one window's frames into the whole clip. The frames it shares with the previous window are cross-faded
    linearly from what `clip` holds there (the previous window's output) to the new frames, so neither window's
    content switches abruptly."""
    _write_frames(clip[win.start : win.stop], window_frames, 0, win.overlap)


def _write_frames(window: np.ndarray, frames: np.ndarray, start: int, overlap: int) -> None:
    """Write frames [start, start + k) of a window into `window` (the clip's frames of that window): frames before
    `overlap` (shared with the previous window) are cross-faded from what `window` holds there, the rest copied."""
    weights = crossfade_weights(overlap)
    for j, frame in enumerate(frames):
        i = start + j
        if i < overlap:
            old = window[i].astype(np.float32)
            # old + w * (new - old) is exactly `old` wherever both agree (e.g. every pixel outside the mask).
            window[i] = np.rint(old + weights[i] * (frame.astype(np.float32) - old)).astype(np.uint8)
        else:
            window[i] = frame


def warn(message: str) -> None:
    print(f"fastremover: {message}", file=sys.stderr)
