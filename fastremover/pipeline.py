"""RemovalPipeline: the one object the CLI, the Python API, the service and batch runs call, and its request loop.

One request loop: `remove_stream` runs a clip's windows (`WindowScheduler`) and emits the output frames as they are
final; `remove` collects them for a clip held in memory. The modules come from the engine's build
(fastremover/engine/build.py), which turns an EngineConfig into a denoiser and a VideoVAE; this file has no device or
mode branches.

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
    -> VAE decode of denormalized x, one latent frame at a time (`fastremover.engine.vae.VideoVAE`: the pipeline's
       only way to its VAE); each chunk of pixels goes on at once through the steps below, all of them per frame
    -> crop padding, resize back to the source size, paste the crop back
    -> composite: pixels outside the dilated mask are copied from the input (feathered inside the mask for crops);
       shared frames are cross-faded linearly from the previous window's output to this one's
The `classic` backend replaces encode/denoise/decode with the weightless fill of `fastremover.classic`.
A clip of at most one window, without a crop, takes exactly the single-pass path (bit-identical to the reference order).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from fastremover.config import EngineConfig, ModelSource, ResolvedEngine
from fastremover.errors import FastRemoverError
from fastremover.engine.build import DTYPES, build, resolve_device, resolve_precision
from fastremover.log import logger
from fastremover.masks import composite, dilate_masks
from fastremover.models.loading import RemoverModels, load_models
from fastremover.options import SIZE_MULTIPLE, RunOptions, parse_size
from fastremover.schedulers import DEFAULT_SCHEDULE
from fastremover.timing import StageTimer, finished_work
from fastremover.windows import (
    Box,
    Window,
    ceil_4k1,
    choose_crop,
    crossfade_weights,
    plan_windows,
    stream_prefetch,
    usable_window_length,
)

if TYPE_CHECKING:
    from fastremover.stream import ResumeStore

# A crop's output is pasted back with a ramp up to this wide inside the mask: the model saw less of the scene, so its
# colours may drift a little from the surroundings (see crop_feather for the cap).
CROP_FEATHER = 4

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def load_source(source: ModelSource, config: EngineConfig | None = None) -> RemoverModels | None:
    """The models of a source (None for the classic remover), checked first: the one place a model name becomes
    modules (`models.loading.load_models` turns a name into a checkpoint folder or random weights). Without `config`,
    or where it resolves to the CPU, fp32 on the host; where it resolves to a CUDA device, built there directly in the
    config's model dtype (no fp32 host copy: models/loading.py), as its engine will run them."""
    source.validate()
    if source.kind == "classic":
        return None
    return load_models(source.name, source.preset, source.weights_seed, **_load_place(config))


def _load_place(config: EngineConfig | None) -> dict:
    """load_models' device / dtype for `config`: its CUDA device and model dtype; {} without a config and on the CPU."""
    if config is None:
        return {}
    device = resolve_device(config.device)  # (a CUDA device where none is visible: an error before the load)
    if device.type != "cuda":
        return {}
    return {"device": device, "dtype": DTYPES[resolve_precision(config.precision, device)]}


def crop_feather(dilate: int) -> int:
    """Width of the crop's paste-back ramp for a mask dilated by `dilate` (L1) pixels: at most CROP_FEATHER, and narrow
    enough that the ramp lies on the dilation ring only, so no pixel of the object itself is blended back in.

    An object pixel's nearest unmasked pixel is more than `dilate` away in L1, so at least (dilate + 1) / sqrt(2) in
    the Euclidean distance the ramp uses; the ramp is fully opaque from feather + 1 on.
    """
    return max(0, min(CROP_FEATHER, math.floor((dilate + 1) / math.sqrt(2) - 1)))


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
    # with `keep`, for a clip of one window: see RemovalResult
    generated: np.ndarray | None = None
    latents: torch.Tensor | None = None
    pixels: torch.Tensor | None = None


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
    """[1,3,F,H,W] in [-1,1] -> uint8 [F,H,W,3], rounded (or with rounding="truncate" truncated, as the released
    pipeline's export does: (x * 0.5 + 0.5).clamp(0, 1) in x's dtype, then float32 * 255 cast to uint8), with the
    device -> host copy left running (`.result()` gives the frames)."""
    if rounding == "truncate":
        y = ((x[0] * 0.5 + 0.5).clamp(0, 1).float() * 255).floor().to(torch.uint8)
    else:
        y = ((x[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return _HostFrames(y.permute(1, 2, 3, 0).contiguous())


class RemovalPipeline:
    """Object removal with MiniMax-Remover (or the weightless classic fill), one instance per loaded model.

    Build it from a model source and an engine config (both from fastremover/config.py):

        RemovalPipeline.from_model("random", preset="tiny", config=EngineConfig(mode="exact"))
        RemovalPipeline.from_model(ModelSource("/path/to/minimax-remover"), config=EngineConfig(device="cuda:1"))
        RemovalPipeline(models, EngineConfig(device="cpu"))     # models already loaded (None: the classic fill)

    Without a config, the defaults with the environment's overrides (`EngineConfig.from_env`). `self.config` is the
    ResolvedEngine (what runs), `self.plan` the engine's plan. `parallel`: this process's ParallelContext when it is
    one rank of a sequence-parallel run (the engine's build makes the parallel denoiser and VAE; ranks other than 0
    call `follow()`)."""

    def __init__(self, models: RemoverModels | None, config: EngineConfig | None = None, *, parallel=None):
        self.engine_config = config if config is not None else EngineConfig.from_env()
        self.models = models
        self.closed = False
        self.engine = build(models, self.engine_config, parallel)
        self.plan = self.engine.plan
        self.device, self.dtype = self.plan.device, self.plan.dtype
        self.denoiser = self.engine.denoiser
        self.vae = self.engine.vae  # a VideoVAE: the eager one or a FastWanVAE, chosen with the mode (engine.build)
        self.config: ResolvedEngine = self.engine.resolved

    @classmethod
    def from_model(cls, model: ModelSource | str = "classic", *, preset: str | None = None,
                   weights_seed: int | None = None, config: EngineConfig | None = None,
                   parallel=None) -> "RemovalPipeline":
        """`model`: a ModelSource, or its name - "classic" (no weights), "random" (the `preset` config with
        deterministic random weights from `weights_seed`), a checkpoint folder or a Hugging Face Hub id
        "ORG/NAME[@REVISION]" (fastremover.models.hub: the local cache, else downloaded). On a CUDA device the weights
        are built there directly, in the model dtype (`load_source`)."""
        config = config if config is not None else EngineConfig.from_env()
        return cls(load_source(ModelSource.of(model, preset=preset, weights_seed=weights_seed), config), config,
                   parallel=parallel)

    def follow(self) -> None:
        """A rank other than 0 of a parallel run: run the stages rank 0's requests announce, until it stops."""
        self.engine.follow()

    def stop(self) -> None:
        """Rank 0 of a parallel run: release the other ranks' `follow()` (nothing in one process)."""
        self.engine.stop()

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
        (`fastremover.engine.vae.VideoVAE`: tiled when its own memory model says one call does not fit; the fast VAE
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

    def planned_shapes(self, num_frames: int, height: int, width: int, options: RunOptions) -> list[tuple]:
        """The run shapes (frames after the padding to 4k+1, height, width of the model's input) of the windows of a
        num_frames x height x width clip run on the whole frame (no crop), as `prepare` fits them."""
        size = parse_size(options.size)
        if size is None:
            hw = (-(-height // SIZE_MULTIPLE) * SIZE_MULTIPLE, -(-width // SIZE_MULTIPLE) * SIZE_MULTIPLE)
        else:
            hw = (size[1], size[0])
        wins = plan_windows(num_frames, options.window, options.overlap, options.shape_buckets)
        return list(dict.fromkeys((ceil_4k1(w.stop - w.start), *hw) for w in wins))

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

        The frames `remove_stream` emits for this clip, collected (the one request loop): any F, in overlapping
        windows of `options.window` frames (one window if it is not longer), each on the whole frame or on a crop
        around the mask (`options.crop`); `result.windows` says which. progress(stage, done, total) is called with
        "window" (0 first, then after each window), "denoise" (after each step of each window), the VAE's stages and
        "frames". For a clip of one window the result also holds the model's output before compositing
        (`generated`) and, for a full-frame window, the final latents; keep_pixels: also the decoded video at the run
        size before cropping/compositing (for fidelity checks).
        """
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise FastRemoverError(f"frames must be uint8 [F,H,W,3], got {frames.dtype} {list(frames.shape)}")
        if mask.shape != frames.shape[:3]:
            raise FastRemoverError(f"mask shape {list(mask.shape)} does not match the video {list(frames.shape[:3])}")
        out = np.empty_like(frames)
        dilated = np.empty(frames.shape[:3], bool)
        count = 0

        def collect_mask(frame_mask: np.ndarray) -> None:
            dilated[count] = frame_mask  # (called just before its frame goes to `collect`)

        def collect(frame: np.ndarray) -> None:
            nonlocal count
            out[count] = frame
            count += 1

        result = self.remove_stream(zip(frames, mask), collect, options, progress=progress, timer=timer,
                                    total_frames=len(frames), emit_mask=collect_mask, keep=True,
                                    keep_pixels=keep_pixels, prefetch=0)
        assert count == result.num_frames, (count, result.num_frames)  # fewer than len(frames): frame_tail drop
        return RemovalResult(frames=out[:count], mask=dilated[:count],
                             generated=result.generated if result.ran_model else None, latents=result.latents,
                             pixels=result.pixels, timer=result.timer, ran_model=result.ran_model,
                             notes=result.notes, windows=result.windows)

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
        emit_mask: Callable[[np.ndarray], None] | None = None,
        keep: bool = False,
        keep_pixels: bool = False,
    ) -> "StreamResult":
        """The request loop: remove the masked object from a clip that arrives frame by frame, in memory bounded by
        one window (`remove` collects what this emits; the CLI, the service and batch runs stream files through it).

        pairs: (frame uint8 [H,W,3], mask bool [H,W] undilated) in order (e.g. `stream.open_clip(...).pairs`).
        emit(frame): called once per output frame, in order, as soon as no later window can change it (the frames
        a window shares with the next one wait for its cross-fade). The last window's frames are emitted as its VAE
        decode produces them (per latent frame, after their composite and cross-fade), so an encoder behind `emit`
        works while the rest decodes. emit_mask(mask): each frame's dilated mask, just before its frame is emitted.
        The input is read, and the masks checked and dilated, in a background thread up to `prefetch` frames
        ahead; default: with a model, one window's new frames (`stream_prefetch`), so the next window's input is
        decoded and preprocessed while the current one runs; the classic fill, at most STREAM_PREFETCH; 0: no thread
        (the frames are read as the windows need them).
        trace(event, index): see `Trace` (tests and profiling).

        store: a `stream.ResumeStore`: each finished window of a clip of more than one window is saved in it, and
        windows it already holds (a resumed run) are rebuilt from it instead of run.
        total_frames: the clip's length if known (for progress only; 0 = unknown). progress gets "window" (done,
        windows planned from total_frames, at least done) and "frames" (frames handed to `emit`, total_frames; 0 when
        unknown or exceeded).
        keep: for a clip of one window, keep the model's output before compositing (`generated`) and, for a
        full-frame window, its latents (and with keep_pixels its decoded pixels) in the result.
        """
        if self.closed:
            raise RuntimeError("this RemovalPipeline was closed; build a new one")
        options = options or RunOptions()
        options.validate()
        progress = finished_work(progress, self.device)  # GPU steps count when they have finished
        # without a timer given, the stages are timed without synchronizing the device (host wall clock, and the
        # GPU's span per stage from CUDA events: StageTimer.device_s), so the host queues work ahead as it can
        timer = timer if timer is not None else StageTimer(self.device, sync=False)
        scheduler = WindowScheduler(self, options, emit, timer=timer, progress=progress,
                                    store=store, total_frames=total_frames, trace=trace, emit_mask=emit_mask,
                                    keep=keep, keep_pixels=keep_pixels)
        depth = stream_prefetch(options, self.models is not None) if prefetch is None else prefetch
        return scheduler.run(pairs, depth)

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
            box = choose_crop(window_mask, crop_mode, buckets=options.shape_buckets)
        if not window_mask.any():  # nothing new to remove: `out` already holds the input / previous output
            return WindowRun(win.start, win.stop, win.overlap, None, None, ran=False), None
        if self.models is not None:
            self.plan.check_window(full_frame=box is None, crop_mode=crop_mode)  # NVFP4 W4A4 refuses full frames
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
            from fastremover.classic import classic_remove  # not imported by model runs

            with timer.stage("classic"):
                part = classic_remove(frames_in, mask_in)
            hand(0, paste(0, part))
            filled = _Filled(None, run_hw=None)
        else:
            with timer.stage("preprocess"):
                prep = self.prepare(frames_in, mask_in, size)
                prep.rounding = options.rounding
            # this run shape's Triton kernels, compiled concurrently before their first launch (a no-op off the fast
            # CUDA paths, and for a shape compiled before)
            self.engine.precompile([(prep.frames.shape[2], *prep.run_hw)])
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


class WindowScheduler:
    """One request's window loop (`RemovalPipeline.remove_stream`; `remove` collects what it emits).

    The clip arrives frame by frame. The scheduler reads ahead as far as the next window needs
    (`windows.window_lookahead`), plans that window from the frames it has (`windows.next_window`: the same windows
    `windows.plan_windows` gives for the whole clip), runs it (`RemovalPipeline._run_window`), and hands each output
    frame to `emit` as soon as no later window can change it. It holds the frames [base, base + len(inputs)) of the
    clip - inputs, dilated masks and outputs so far (None: the output is the input) - so memory is bounded by one
    window plus the read-ahead, whatever the clip's length."""

    def __init__(self, pipe: "RemovalPipeline", options: RunOptions, emit: Callable[[np.ndarray], None], *,
                 timer: StageTimer, progress: Progress | None = None, store: "ResumeStore | None" = None,
                 total_frames: int = 0, trace: "Trace | None" = None,
                 emit_mask: Callable[[np.ndarray], None] | None = None, keep: bool = False, keep_pixels: bool = False):
        self.pipe, self.options, self.emit, self.emit_mask = pipe, options, emit, emit_mask
        self.timer, self.progress, self.store, self.trace = timer, progress, store, trace
        self.total_frames, self.keep, self.keep_pixels = total_frames, keep, keep_pixels
        # An explicit --size resizes the whole frame: a crop would be a different geometry, so auto means off then.
        self.crop_mode = "off" if parse_size(options.size) is not None else options.crop
        self.inputs: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.outs: list[np.ndarray | None] = []
        self.base = 0  # the clip's index of inputs[0]
        self.ended = False  # the source has no more frames
        self.emitted = 0  # frames [0, emitted) of the clip went to `emit`
        self.single = False  # the clip is one window (known once the first window is planned)
        self.result = StreamResult(timer=timer)
        self.tail: _DropTail | None = None  # frame_tail "drop": the released pipeline keeps the largest 4k+1 prefix
        if options.frame_tail == "drop" and total_frames > 0:
            self.total_frames = usable_window_length(total_frames)

    # -- input -------------------------------------------------------------------------------------------------------

    def _prepared(self, pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(frame, dilated mask) per input pair, each checked (run in the read-ahead thread); with frame_tail "drop"
        without the last 1-3 pairs of a clip that is not 4k+1 long (`self.tail` counts them)."""
        for i, (frame, mask) in enumerate(pairs if self.tail is None else self.tail):
            if frame.ndim != 3 or frame.shape[-1] != 3 or frame.dtype != np.uint8:
                raise FastRemoverError(f"frames must be uint8 [H,W,3], got {frame.dtype} {list(frame.shape)}")
            if mask.shape != frame.shape[:2]:
                raise FastRemoverError(f"mask shape {list(mask.shape)} does not match the frame "
                                       f"{list(frame.shape[:2])}")
            item = frame, dilate_masks(np.asarray(mask, bool)[None], self.options.dilate)[0]
            if self.trace is not None:
                self.trace("read", i)
            yield item

    def _fill(self, source: Iterator, count: int) -> None:
        """Read until the clip's frames [0, count) are held (or the source ends)."""
        timer, result = self.timer, self.result
        while not self.ended and self.base + len(self.inputs) < count:
            t = time.perf_counter()
            item = next(source, None)  # waits only when decoding is behind the windows
            timer.wall_s["read"] = timer.wall_s.get("read", 0.0) + time.perf_counter() - t
            if item is None:
                self.ended = True
                break
            frame, dilated = item
            if self.inputs and frame.shape != self.inputs[0].shape:
                raise FastRemoverError("the video changes resolution mid-stream; re-encode it at one resolution")
            self.inputs.append(frame)
            self.masks.append(dilated)
            self.outs.append(None)
            result.any_masked |= bool(dilated.any())
            result.all_masked &= bool(dilated.all())

    # -- output ------------------------------------------------------------------------------------------------------

    def _hand_out(self, frame: np.ndarray, mask: np.ndarray) -> None:
        t = time.perf_counter()
        if self.emit_mask is not None:
            self.emit_mask(mask)
        self.emit(frame)
        self.result.emit_s += time.perf_counter() - t
        if self.trace is not None:
            self.trace("emit", self.emitted)
        self.emitted += 1
        if self.progress:  # total 0: unknown (no count in the container, or the count was short)
            total = self.total_frames
            self.progress("frames", self.emitted, total if total >= self.emitted else 0)

    def _emit_final(self, window_out: np.ndarray, first: int, start: int, count: int) -> None:
        """Frames [start, start + count) of the last window (clip frames first + ...) are final: emit them."""
        for j in range(start, start + count):
            if first + j >= self.emitted:
                self._hand_out(window_out[j], self.masks[first + j - self.base])

    def _release(self, upto: int) -> None:
        """Frames before `upto` are final: emit those not emitted yet and drop them."""
        while self.base < upto:
            out, frame, mask = self.outs.pop(0), self.inputs.pop(0), self.masks.pop(0)
            if self.base >= self.emitted:  # (the last window's frames went out as they were decoded)
                self._hand_out(frame if out is None else out, mask)
            self.base += 1

    # -- the loop ----------------------------------------------------------------------------------------------------

    def _first_window(self, win: Window) -> int:
        """What the first window decides for the whole request (the geometry, the resume store, notes); returns the
        windows a resumed run finished before."""
        result, options = self.result, self.options
        self.single = self.ended and win.stop == self.base + len(self.inputs)
        result.height, result.width = self.inputs[0].shape[:2]
        finished = 0
        if self.store is not None:
            if self.single:  # nothing to resume in a run of one window
                self.store.clear()
                self.store = None
            else:
                from fastremover.stream import fingerprint_frames

                finished = self.store.start(fingerprint_frames(self.inputs[:4] + self.masks[:4]))
                if self.store.note:
                    self._note(self.store.note)
                if finished:
                    self._note(f"--resume: continued after {finished} finished windows (their output rebuilt from "
                               "the saved state)")
        usable = usable_window_length(options.window)
        if not self.single and usable != options.window:
            self._note(f"--window {options.window}: using {usable} frames per window (the VAE works in 4k+1 frames)")
        return finished

    def _note(self, message: str) -> None:
        """A note for the user: logged now, and kept in the result."""
        logger.warning(message)
        self.result.notes.append(message)

    def _window(self, index: int, win: Window, finished: int) -> WindowRun:
        """Run (or, resumed, rebuild) one window; its frames' outputs go back into `outs`."""
        pipe, result, store = self.pipe, self.result, self.store
        span = slice(win.start - self.base, win.stop - self.base)
        frames_w = np.stack(self.inputs[span])
        dilated_w = np.stack(self.masks[span])
        # The buffers now hold views of the stacks, so each frame is in memory once, not twice.
        self.inputs[span], self.masks[span] = list(frames_w), list(dilated_w)
        out_w = np.stack([f if o is None else o for f, o in zip(self.inputs[span], self.outs[span])])
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
            clip_all_masked = result.all_masked and self.ended
            # The last window: no later window changes its frames, so each goes out as soon as it is composited
            # and cross-faded (frames before win.start went out in _release).
            last = self.ended and win.stop == self.base + len(self.inputs)
            run, filled = pipe._run_window(
                out_w, frames_w, dilated_w, win, self.options, self.timer, self.progress, crop_mode=self.crop_mode,
                clip_all_masked=clip_all_masked, keep_whole=self.keep and self.single,
                keep_pixels=self.keep_pixels, on_final=partial(self._emit_final, out_w, win.start) if last else None,
                trace=self.trace, index=index)
            if filled is not None and self.keep and self.single:
                result.generated, result.latents, result.pixels = filled.frames, filled.latents, filled.pixels
            if store is not None:
                store.save(index, {"start": win.start, "stop": win.stop, "overlap": win.overlap, "box": run.box,
                                   "run_hw": run.run_hw, "ran": run.ran}, out_w, frames_w)
        # Per frame: None where the output is the input, else its own copy (views would keep the whole window's array
        # alive as long as any of its frames waits for the next window). Frames already emitted (the last window's,
        # as they were decoded) are never read again: nothing to keep.
        self.outs[span] = [None if win.start + j < self.emitted or np.array_equal(o, f) else o.copy()
                           for j, (o, f) in enumerate(zip(out_w, frames_w))]
        return run

    def run(self, pairs: Iterable[tuple[np.ndarray, np.ndarray]], prefetch: int) -> StreamResult:
        """Read `pairs` (ahead by `prefetch` frames in a background thread; 0: as needed), run every window, emit
        every frame; returns the StreamResult."""
        from fastremover.stream import Prefetch
        from fastremover.windows import next_window, window_lookahead

        options, result, progress = self.options, self.result, self.progress
        if options.frame_tail == "drop":
            self.tail = _DropTail(pairs)
        prepared = self._prepared(pairs)
        source = Prefetch(prepared, prefetch, name="fastremover-read") if prefetch > 0 else prepared
        total = self.total_frames
        planned = len(plan_windows(total, options.window, options.overlap, options.shape_buckets)) if total > 0 else 0
        if progress:
            progress("window", 0, planned)
        finished = index = 0
        prev: Window | None = None
        try:
            while True:
                self._fill(source, window_lookahead(prev, options.window, options.overlap))
                win = next_window(prev, self.base + len(self.inputs), self.ended, options.window, options.overlap,
                                  options.shape_buckets)
                if win is None:
                    break
                if index == 0:
                    finished = self._first_window(win)
                    if self.crop_mode == "off" and self.total_frames > 0 and self.pipe.models is not None:
                        # every window's run shape is known: compile all their kernels in one batch
                        height, width = self.inputs[0].shape[:2]
                        self.pipe.engine.precompile(self.pipe.planned_shapes(self.total_frames, height, width,
                                                                             options))
                self._release(win.start)
                result.windows.append(self._window(index, win, finished))
                index += 1
                prev = win
                if progress:
                    progress("window", index, max(index, planned))
            self._release(self.base + len(self.inputs))
        finally:
            source.close()
        assert self.emitted == self.base, (self.emitted, self.base)
        if self.tail is not None and self.tail.dropped:
            self._note(_dropped_tail_note(self.tail.dropped))
        result.num_frames = self.base
        result.resumed_windows = finished
        result.ran_model = self.pipe.models is not None and any(run.ran for run in result.windows)
        if not result.any_masked:
            self._note("the mask is empty: nothing to remove, the output is the input")
        elif result.all_masked:
            self._note("the mask covers every pixel: the whole video is regenerated, nothing of the input is kept")
        return result
