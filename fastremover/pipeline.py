"""RemovalPipeline: the one object the CLI, the Python API and the server call.

Data path (upstream MiniMax-Remover order, REFERENCE §1):
    frames uint8 + mask bool (media io)
    -> preprocess: dilate the mask (L1 diamond, = scipy binary_dilation), frames to [-1,1], fit the run size
       (native: pad bottom/right to multiples of 16; or an explicit WxH: bilinear resize, mask re-binarized),
       pad the frame count to 4k+1 by repeating the last frame
    -> VAE encode twice (posterior mode): masked = frames*(1-mask), and 2*mask-1; both normalized
    -> denoise: noise ~ randn [1,16,T,H/8,W/8] from torch.Generator(device).manual_seed(seed);
       each step the transformer sees cat([x, masked_lat, mask_lat]) and the scheduler steps x
    -> VAE decode of denormalized x -> crop padding, resize back to the source size
    -> composite: pixels outside the dilated mask are copied from the input
The `classic` backend replaces encode/denoise/decode with the weightless fill of `fastremover.classic`.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fastremover.classic import classic_remove
from fastremover.errors import FastRemoverError
from fastremover.masks import composite, dilate_masks
from fastremover.models.loading import RemoverModels, load_models
from fastremover.schedulers import build_scheduler
from fastremover.timing import StageTimer

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("eager",)
SIZE_MULTIPLE = 16  # VAE 8x spatial downsampling times the transformer's 2x2 patches

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

    def validate(self) -> None:
        if self.steps < 1:
            raise FastRemoverError(f"--steps {self.steps}: need at least 1 step")
        if self.dilate < 0:
            raise FastRemoverError(f"--dilate {self.dilate}: must be >= 0")
        parse_size(self.size)


@dataclass
class EngineConfig:
    """What runs: printed by `fastremover info`, stored in bench JSON."""

    model: str  # "classic", "random:<preset>:<seed>" or a checkpoint path
    device: str
    precision: str
    mode: str = "eager"
    attention: str = "sdpa"
    cuda_graphs: bool = False

    def describe(self) -> dict:
        return asdict(self)


@dataclass
class RemovalResult:
    frames: np.ndarray  # uint8 [F,H,W,3] at the source size: the final output (composited unless disabled)
    mask: np.ndarray  # bool [F,H,W] the dilated mask that was removed
    generated: np.ndarray | None = None  # uint8 [F,H,W,3] decoded model output before compositing (None if not run)
    latents: torch.Tensor | None = None  # final denoised latents (fp32, CPU), for fidelity checks
    pixels: torch.Tensor | None = None  # decoded [1,3,F',H',W'] at the run size, before any crop/composite (keep_pixels)
    timer: StageTimer = field(default_factory=StageTimer)
    ran_model: bool = False
    notes: list[str] = field(default_factory=list)


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
    target = (f - 1 + 3) // 4 * 4 + 1
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
        mode: str = "eager",
    ):
        self.device = torch.device(device or default_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise FastRemoverError("--device cuda: no CUDA GPU is available here; use --device cpu")
        precision = precision or ("fp16" if self.device.type == "cuda" else "fp32")
        if precision not in PRECISIONS:
            raise FastRemoverError(f"--precision {precision!r}: choose one of {list(PRECISIONS)}")
        if mode not in MODES:
            raise FastRemoverError(f"--mode {mode!r}: choose one of {list(MODES)}")
        self.dtype = PRECISIONS[precision]
        self.models = models
        if models is not None:
            models.transformer.to(self.device).to_inference_dtype(self.dtype)
            models.vae.to(self.device, self.dtype)
        self.config = EngineConfig(
            model="classic" if models is None else models.source,
            device=str(self.device),
            precision=precision,
            mode=mode,
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
        mode: str = "eager",
    ) -> "RemovalPipeline":
        """`model`: "classic" (no weights), "random" (preset config, deterministic random weights) or a checkpoint dir."""
        models = None if model == "classic" else load_models(model, preset, weights_seed)
        return cls(models, device=device, precision=precision, mode=mode)

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
    def encode(self, prep: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized latents of the masked video and of the mask video (as 2*mask-1)."""
        vae = self.models.vae
        masked = prep.frames * (1 - prep.mask)
        masked_latents = vae.normalize(vae.encode(masked))
        mask_latents = vae.normalize(vae.encode(2 * prep.mask - 1.0))
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
        transformer = self.models.transformer
        scheduler = build_scheduler(self.models.scheduler_config, steps, device=self.device)
        generator = torch.Generator(self.device).manual_seed(seed)
        latents = torch.randn(masked_latents.shape, generator=generator, device=self.device, dtype=self.dtype)
        scheduler.reset()
        for i in range(steps):
            model_input = torch.cat([latents.to(self.dtype), masked_latents, mask_latents], dim=1)
            timestep = scheduler.timesteps[i].expand(latents.shape[0])
            flow = transformer(model_input, timestep)
            latents = scheduler.step(i, flow, latents)
            if progress:
                progress("denoise", i + 1, steps)
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.models.vae
        return vae.decode(vae.denormalize(latents.to(self.dtype)))

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

        keep_pixels: also return the decoded video at the run size before cropping/compositing (for fidelity checks).
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

        if self.models is None:
            with timer.stage("classic"):
                out = classic_remove(frames, dilated)
            return RemovalResult(frames=out, mask=dilated, timer=timer, notes=notes)

        with timer.stage("preprocess"):
            prep = self.prepare(frames, dilated, size)
        with timer.stage("vae_encode"):
            masked_latents, mask_latents = self.encode(prep)
        with timer.stage("denoise"):
            latents = self.denoise(masked_latents, mask_latents, options.steps, options.seed, progress)
        with timer.stage("vae_decode"):
            pixels = self.decode(latents)
        with timer.stage("composite"):
            generated = self.finish(pixels, prep)
            out = composite(frames, generated, dilated) if options.composite else generated
        return RemovalResult(
            frames=out,
            mask=dilated,
            generated=generated,
            latents=latents.float().cpu(),
            pixels=pixels.float().cpu() if keep_pixels else None,
            timer=timer,
            ran_model=True,
            notes=notes,
        )


def warn(message: str) -> None:
    print(f"fastremover: {message}", file=sys.stderr)
