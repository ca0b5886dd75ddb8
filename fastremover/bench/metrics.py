"""Fidelity metrics between two decoded videos (and latents): PSNR (mean, worst frame, inside the mask), SSIM, cosine.

Videos are [1,3,F,H,W] tensors in [-1,1] (the VAE's output, before any compositing, so copied pixels cannot inflate the
numbers); they are mapped to [0,1] for PSNR/SSIM. Computed on whatever device the tensors are on, in float64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _unit(x: torch.Tensor) -> torch.Tensor:
    return (x.double() / 2 + 0.5).clamp(0, 1)


def psnr_per_frame(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR in dB of each frame, [F]; identical frames give +inf."""
    mse = (_unit(a) - _unit(b)).pow(2).mean(dim=(0, 1, 3, 4))
    return 10 * torch.log10(1.0 / mse)


def psnr_masked(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """PSNR over the pixels where mask [F,H,W] is set (all frames pooled); nan if the mask is empty."""
    m = mask.to(a.device, torch.bool)[None, None].expand_as(a)
    if not m.any():
        return float("nan")
    mse = (_unit(a) - _unit(b))[m].pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim_per_frame(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Mean SSIM of each frame over the three channels, [F] (Gaussian window, the usual K1=0.01, K2=0.03)."""
    x = _unit(a)[0].permute(1, 0, 2, 3)  # [F,3,H,W]
    y = _unit(b)[0].permute(1, 0, 2, 3)
    coords = torch.arange(window, dtype=torch.float64, device=x.device) - window // 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = (g / g.sum())
    kernel = (g[:, None] * g[None, :]).expand(3, 1, window, window).contiguous()

    def blur(t):
        return F.conv2d(t, kernel, groups=3)

    c1, c2 = 0.01**2, 0.03**2
    out = []
    for f in range(x.shape[0]):  # frame by frame keeps memory bounded at large sizes
        xf, yf = x[f : f + 1], y[f : f + 1]
        mu_x, mu_y = blur(xf), blur(yf)
        var_x = blur(xf * xf) - mu_x**2
        var_y = blur(yf * yf) - mu_y**2
        cov = blur(xf * yf) - mu_x * mu_y
        s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
        out.append(s.mean())
    return torch.stack(out)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def fidelity(engine_pixels: torch.Tensor, reference_pixels: torch.Tensor, mask: torch.Tensor,
             engine_latents: torch.Tensor, reference_latents: torch.Tensor,
             device: torch.device | str | None = None) -> dict:
    """All fidelity numbers of one engine run against the reference run.

    psnr_mean_db is the mean over the frames that differ (a bit-identical frame has infinite PSNR and is left out;
    all frames identical gives inf); psnr_min_db is the worst frame. device: where to compute (None: where the
    tensors are; the bench passes its GPU: SSIM of 81 frames of 720p in float64 takes minutes on a CPU).
    """
    if engine_pixels.shape != reference_pixels.shape:
        raise ValueError(f"shapes differ: {tuple(engine_pixels.shape)} vs {tuple(reference_pixels.shape)}")
    if device is not None:
        engine_pixels, reference_pixels = engine_pixels.to(device), reference_pixels.to(device)
    psnr = psnr_per_frame(engine_pixels, reference_pixels)
    finite = psnr[torch.isfinite(psnr)]
    return {
        "psnr_mean_db": float(finite.mean()) if len(finite) else math.inf,
        "psnr_min_db": float(psnr.min()),
        "psnr_mask_db": psnr_masked(engine_pixels, reference_pixels, mask),
        "ssim_mean": float(ssim_per_frame(engine_pixels, reference_pixels).mean()),
        "latent_cos": cosine(engine_latents, reference_latents),
        "identical": bool(torch.equal(engine_pixels, reference_pixels)),
    }
