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
    -> VAE decode of denormalized x -> crop padding, resize back to the source size, paste the crop back
    -> composite: pixels outside the dilated mask are copied from the input (feathered inside the mask for crops);
       shared frames are cross-faded linearly from the previous window's output to this one's
The `classic` backend replaces encode/denoise/decode with the weightless fill of `fastremover.classic`.
A clip of at most one window, without a crop, takes exactly the single-pass path (bit-identical to the reference order).
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fastremover.classic import classic_remove
from fastremover.errors import FastRemoverError
from fastremover.masks import composite, dilate_masks
from fastremover.fast.engine import MODES, build_denoiser, resolve_mode
from fastremover.models.loading import RemoverModels, load_models
from fastremover.timing import StageTimer
from fastremover.windows import (
    CROP_MODES,
    DEFAULT_WINDOW,
    Box,
    Window,
    ceil_4k1,
    choose_crop,
    crossfade_weights,
    plan_windows,
    usable_window_length,
    validate_windows,
)

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SIZE_MULTIPLE = 16  # VAE 8x spatial downsampling times the transformer's 2x2 patches
# A crop's output is pasted back with a ramp up to this wide inside the mask: the model saw less of the scene, so its
# colours may drift a little from the surroundings (see crop_feather for the cap).
CROP_FEATHER = 4

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def parse_size(size: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """"native"/None -> None; "WxH" or (W, H) -> (W, H), both multiples of 16."""
    if size is None or size == "native":
        return None
    if isinstance(size, str):
        try:
            w_str, h_str = size.lower().split("x")
            w, h = int(w_str), int(h_str)
        except ValueError:
            raise FastRemoverError(f"--size {size!r}: use 'native' or WIDTHxHEIGHT, e.g. 832x480") from None
    else:
        w, h = size
    if w <= 0 or h <= 0 or w % SIZE_MULTIPLE or h % SIZE_MULTIPLE:
        raise FastRemoverError(
            f"--size {w}x{h}: width and height must be positive multiples of {SIZE_MULTIPLE} "
            f"(e.g. {max(16, w // 16 * 16)}x{max(16, h // 16 * 16)}), or use --size native"
        )
    return w, h


def crop_feather(dilate: int) -> int:
    """Width of the crop's paste-back ramp for a mask dilated by `dilate` (L1) pixels: at most CROP_FEATHER, and narrow
    enough that the ramp lies on the dilation ring only, so no pixel of the object itself is blended back in.

    An object pixel's nearest unmasked pixel is more than `dilate` away in L1, so at least (dilate + 1) / sqrt(2) in
    the Euclidean distance the ramp uses; the ramp is fully opaque from feather + 1 on.
    """
    return max(0, min(CROP_FEATHER, math.floor((dilate + 1) / math.sqrt(2) - 1)))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class RunOptions:
    """Per-request options."""

    steps: int = 12
    seed: int = 42
    dilate: int = 6
    size: str | tuple[int, int] = "native"
    composite: bool = True
    window: int = DEFAULT_WINDOW  # frames per window (used as the largest 4k+1 <= window); shorter clips: one window
    # frames each window shares with the previous one (conditioning + cross-fade); None: about a fifth of the window
    # as 4k+1 frames (17 for the default 81, see windows.default_overlap)
    overlap: int | None = None
    crop: str = "auto"  # auto | on | off: run the model on a box around the mask instead of the whole frame

    def validate(self) -> None:
        if self.steps < 1:
            raise FastRemoverError(f"--steps {self.steps}: need at least 1 step")
        if self.dilate < 0:
            raise FastRemoverError(f"--dilate {self.dilate}: must be >= 0")
        parse_size(self.size)
        validate_windows(self.window, self.overlap)
        if self.crop not in CROP_MODES:
            raise FastRemoverError(f"--crop {self.crop!r}: choose one of {list(CROP_MODES)}")
        if self.crop == "on" and parse_size(self.size) is not None:
            raise FastRemoverError(
                f"--crop on runs the model at the source resolution; it cannot be combined with --size {self.size} "
                "(use --size native, or --crop off)"
            )


@dataclass
class EngineConfig:
    """What runs: printed by `fastremover info`, stored in bench JSON."""

    model: str  # "classic", "random:<preset>:<seed>" or a checkpoint path
    device: str
    precision: str
    mode: str = "eager"  # the mode that runs (after any fallback)
    requested_mode: str = "eager"
    fused_kernels: str = "none"
    fp8_linears: bool = False
    attention: str = "sdpa"
    ffn1: str = "none"  # fp8 mode: the FFN's first GEMM + GELU quantization path (fast/transformer_fast.py)
    fp8_gemm: str = "none"  # fp8 mode: cuBLASLt with workspace-free algorithms (fast/cublaslt.py) or torch._scaled_mm
    concurrent_branches: bool = False  # fp8 attention on CUDA: q / k / V preparation on parallel streams
    vae: str = "eager"  # the VAE path that runs: "eager" (models.vae.WanVAE) or "fast-fp16" / "fast-bf16" / "fast-fp8"
    vae_precision: str = "auto"  # as requested: auto | fp16 (the model dtype) | fp8 (FP8 conv3d in the fast VAE)
    cuda_graphs: bool = False
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        return asdict(self)


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
class Prepared:
    """Model-ready tensors for one clip plus the geometry needed to undo the fitting."""

    frames: torch.Tensor  # [1,3,F',H',W'] in [-1,1], run dtype
    mask: torch.Tensor  # [1,3,F',H',W'] in {0,1}, run dtype
    num_frames: int  # F before padding to 4k+1
    source_hw: tuple[int, int]
    run_hw: tuple[int, int]
    resized: bool  # explicit size (resize back at the end) vs native (crop the padding)


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


def _to_uint8(x: torch.Tensor) -> np.ndarray:
    """[1,3,F,H,W] in [-1,1] -> uint8 [F,H,W,3] (rounded, not truncated)."""
    y = ((x[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return y.permute(1, 2, 3, 0).contiguous().cpu().numpy()


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
    ):
        self.device = torch.device(device or default_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise FastRemoverError("--device cuda: no CUDA GPU is available here; use --device cpu")
        precision = precision or ("fp16" if self.device.type == "cuda" else "fp32")
        if precision not in PRECISIONS:
            raise FastRemoverError(f"--precision {precision!r}: choose one of {list(PRECISIONS)}")
        if mode not in ("auto", *MODES):
            raise FastRemoverError(f"--mode {mode!r}: choose one of {['auto', *MODES]}")
        self.dtype = PRECISIONS[precision]
        self.models = models
        active, notes = resolve_mode(mode, self.device) if models is not None else ("eager", [])
        self.denoiser = None
        self.vae = None  # models.vae (eager) or a FastWanVAE, chosen with the mode (fast.vae_fast.build_vae)
        vae_path = "none"
        if models is not None:
            from fastremover.fast.vae_fast import build_vae

            models.transformer.to(self.device).to_inference_dtype(self.dtype)
            self.vae, vae_path = build_vae(models.vae, active, self.device, self.dtype, vae_precision)
            self.denoiser, attention_notes = build_denoiser(
                models.transformer, models.scheduler_config, active, self.device, attention
            )
            notes = notes + attention_notes
        components = self.denoiser.describe() if self.denoiser is not None else {}
        self.config = EngineConfig(
            model="classic" if models is None else models.source,
            device=str(self.device),
            precision=precision,
            mode=active,
            requested_mode=mode,
            notes=notes,
            vae=vae_path,
            vae_precision=vae_precision,
            **components,
        )

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
    ) -> "RemovalPipeline":
        """`model`: "classic" (no weights), "random" (preset config, deterministic random weights) or a checkpoint dir."""
        models = None if model == "classic" else load_models(model, preset, weights_seed)
        return cls(models, device=device, precision=precision, mode=mode, attention=attention,
                   vae_precision=vae_precision)

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
        """Normalized latents of the masked video and of the mask video (as 2*mask-1).

        The fast VAE forms both inputs chunk by chunk and encodes them as one batch of 2 when memory allows."""
        vae = self.vae

        def chunks(offset):  # one "vae_encode" bar over both encodes
            return (lambda done, total: progress("vae_encode", offset * total + done, 2 * total)) if progress else None

        plan = None
        if self.device.type == "cuda":  # frames too large for the free GPU memory: spatial tiles (fast/vae_tiling.py)
            from fastremover.fast.vae_tiling import choose_tiling, encode_tiled

            _, _, frames, height, width = prep.frames.shape
            plan = choose_tiling(frames, height, width, self.dtype, None, self.models.vae.config, op="encode")
        if plan is not None:
            def encode(x, report):
                return encode_tiled(vae.encode, x, plan.tile, plan.overlap, report)
        elif hasattr(vae, "encode_removal_inputs"):
            report = (lambda done, total: progress("vae_encode", done, total)) if progress else None
            masked_latents, mask_latents = vae.encode_removal_inputs(prep.frames, prep.mask, progress=report)
            return vae.normalize(masked_latents), vae.normalize(mask_latents)
        else:
            def encode(x, report):
                return vae.encode(x, progress=report)
        masked_latents = vae.normalize(encode(prep.frames * (1 - prep.mask), chunks(0)))
        mask_latents = vae.normalize(encode(2 * prep.mask - 1.0, chunks(1)))
        return masked_latents, mask_latents

    @torch.no_grad()
    def denoise(
        self,
        masked_latents: torch.Tensor,
        mask_latents: torch.Tensor,
        steps: int,
        seed: int,
        progress: Progress | None = None,
    ) -> torch.Tensor:
        generator = torch.Generator(self.device).manual_seed(seed)
        noise = torch.randn(masked_latents.shape, generator=generator, device=self.device, dtype=self.dtype)
        return self.denoiser(noise, masked_latents, mask_latents, steps, progress)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, progress: Progress | None = None) -> torch.Tensor:
        vae = self.vae
        report = (lambda done, total: progress("vae_decode", done, total)) if progress else None
        z = vae.denormalize(latents.to(self.dtype))
        if self.device.type == "cuda":  # tiled when the free GPU memory is short (the eager VAE's memory model: the
            # fast VAE needs about half of that, so the choice errs on the safe side)
            from fastremover.fast.vae_tiling import decode_auto

            return decode_auto(vae.decode, z, self.models.vae.config, progress=report)
        return vae.decode(z, progress=report)

    def finish(self, pixels: torch.Tensor, prep: Prepared) -> np.ndarray:
        """Decoded [1,3,F',H',W'] -> uint8 [F,H,W,3] at the source size (drop frame padding, crop or resize back)."""
        x = pixels[:, :, : prep.num_frames]
        if prep.resized:
            x = _resize_video(x.float(), prep.source_hw)
        else:
            x = x[..., : prep.source_hw[0], : prep.source_hw[1]]
        return _to_uint8(x)

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
        options = options or RunOptions()
        options.validate()
        size = parse_size(options.size)
        timer = timer or StageTimer(self.device)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise FastRemoverError(f"frames must be uint8 [F,H,W,3], got {frames.dtype} {list(frames.shape)}")
        if mask.shape != frames.shape[:3]:
            raise FastRemoverError(f"mask shape {list(mask.shape)} does not match the video {list(frames.shape[:3])}")
        notes: list[str] = []

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
        feather_for_crops = crop_feather(options.dilate)

        out = frames.copy()  # the output, written window by window
        runs: list[WindowRun] = []
        generated = latents = pixels = None  # set for a single window only (see RemovalResult)
        if progress:
            progress("window", 0, len(windows))
        for index, win in enumerate(windows):
            span = slice(win.start, win.stop)
            with timer.stage("preprocess"):
                # Frames shared with the previous window enter as known content: its output, with the mask cleared,
                # so the model continues from what it already generated instead of inventing it again.
                window_frames = out[span].copy()
                window_mask = dilated[span].copy()
                window_mask[: win.overlap] = False
                # The box only needs to hold what is still to be generated (the shared frames are known already).
                box = choose_crop(window_mask, crop_mode)
            if not window_mask.any():  # nothing new to remove: `out` already holds the input / previous output
                runs.append(WindowRun(win.start, win.stop, win.overlap, None, None, ran=False))
            else:
                if self.models is None and window_mask.all() and not dilated.all():
                    raise FastRemoverError(
                        f"frames {win.start}..{win.stop - 1} are masked entirely: the classic remover has nothing to "
                        "fill them from inside one window; use a larger --window or a diffusion model (--model PATH)"
                    )
                # Latents and decoded pixels describe the whole clip only for one full-frame window.
                whole_clip = len(windows) == 1 and box is None
                filled = self._fill_window(window_frames, window_mask, box, size, options, timer, progress,
                                           keep_latents=whole_clip, keep_pixels=whole_clip and keep_pixels)
                with timer.stage("composite"):
                    # Against the input and the real mask: shared frames take this window's model pixels inside the
                    # mask too, so the cross-fade below blends the two windows' pixels there.
                    if options.composite:
                        feather = feather_for_crops if box is not None else 0
                        window_out = composite(frames[span], filled.frames, dilated[span], feather=feather)
                    else:
                        window_out = filled.frames
                    _write_window(out, window_out, win)
                runs.append(WindowRun(win.start, win.stop, win.overlap, box, filled.run_hw, ran=True))
                if len(windows) == 1:
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

    def _fill_window(
        self,
        frames: np.ndarray,
        mask: np.ndarray,
        box: Box | None,
        size: tuple[int, int] | None,
        options: RunOptions,
        timer: StageTimer,
        progress: Progress | None,
        keep_latents: bool = False,
        keep_pixels: bool = False,
    ) -> "_Filled":
        """One window's frames (uint8 [F,H,W,3]) with the pixels of `mask` filled in by the model (or the classic
        fill), on the whole frame or only inside `box` (the rest of the frame is `frames` unchanged)."""
        if box is not None:
            y0, y1, x0, x1 = box
            with timer.stage("preprocess"):
                frames_in = np.ascontiguousarray(frames[:, y0:y1, x0:x1])
                mask_in = np.ascontiguousarray(mask[:, y0:y1, x0:x1])
        else:
            frames_in, mask_in = frames, mask

        if self.models is None:
            with timer.stage("classic"):
                filled = _Filled(classic_remove(frames_in, mask_in), run_hw=None)
        else:
            with timer.stage("preprocess"):
                prep = self.prepare(frames_in, mask_in, size)
            with timer.stage("vae_encode"):
                masked_latents, mask_latents = self.encode(prep, progress)
            with timer.stage("denoise"):
                latents = self.denoise(masked_latents, mask_latents, options.steps, options.seed, progress)
            with timer.stage("vae_decode"):
                pixels = self.decode(latents, progress)
            with timer.stage("composite"):
                filled = _Filled(
                    self.finish(pixels, prep),
                    prep.run_hw,
                    latents=latents.float().cpu() if keep_latents else None,
                    pixels=pixels.float().cpu() if keep_pixels else None,
                )

        if box is not None:
            with timer.stage("composite"):
                whole = frames.copy()
                whole[:, y0:y1, x0:x1] = filled.frames
                filled.frames = whole
        return filled



@dataclass
class _Filled:
    """One window's model (or classic) output at the window's frame size, plus what the model ran on."""

    frames: np.ndarray  # uint8 [F,H,W,3]
    run_hw: tuple[int, int] | None  # the model's input (H, W) after fitting; None for classic
    latents: torch.Tensor | None = None
    pixels: torch.Tensor | None = None


def _write_window(clip: np.ndarray, window_frames: np.ndarray, win: Window) -> None:
    """Write one window's frames into the whole clip. The frames it shares with the previous window are cross-faded
    linearly from what `clip` holds there (the previous window's output) to the new frames, so neither window's
    content switches abruptly."""
    clip[win.start + win.overlap : win.stop] = window_frames[win.overlap :]
    for i, weight in enumerate(crossfade_weights(win.overlap)):
        old = clip[win.start + i].astype(np.float32)
        # old + w * (new - old) is exactly `old` wherever both agree (e.g. every pixel outside the mask).
        clip[win.start + i] = np.rint(old + weight * (window_frames[i].astype(np.float32) - old)).astype(np.uint8)


def warn(message: str) -> None:
    print(f"fastremover: {message}", file=sys.stderr)
