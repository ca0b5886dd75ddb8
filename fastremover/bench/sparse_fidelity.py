"""`fastremover verify --attention sparse-vsa --attention-keeps 1,0.5,0.25`: what sparse attention costs in quality
on YOUR checkpoint and clip, per keep rate, against the same engine mode with its dense attention.

Each engine mode runs once with its dense attention (the mode's default backend) and once per keep rate with the
sparse backend, on the same inputs, seed and steps, in one window on the whole frame (the reference comparison's
geometry, `fidelity_options`); PSNR / SSIM of the decoded video before compositing and the latents' cosine are
against that dense run. Random weights make attention far more diffuse than a trained model's, so the numbers on
`--model random` are a lower bound of what a checkpoint gets; the released Remover was not trained with sparse
attention, so only a run on the checkpoint and clip you use says whether a keep rate is good enough.
"""

from __future__ import annotations

import gc
import math
import tempfile

import torch

from fastremover.bench.harness import BenchInputs, run_engine
from fastremover.bench.metrics import fidelity
from fastremover.config import AttentionOptions, EngineConfig
from fastremover.errors import FastRemoverError
from fastremover.fast.engine import resolve
from fastremover.masks import dilate_masks
from fastremover.models.loading import RemoverModels
from fastremover.pipeline import RemovalPipeline


def parse_keeps(text: str) -> list[float]:
    """`--attention-keeps 1,0.5,0.25` -> [1.0, 0.5, 0.25]; FastRemoverError for anything else."""
    try:
        keeps = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        keeps = []
    if not keeps or not all(0 < k <= 1 for k in keeps):
        raise FastRemoverError(f"--attention-keeps {text!r}: give comma-separated fractions in (0, 1], e.g. "
                               "1,0.5,0.25,0.125")
    return keeps


def sparse_fidelity(models: RemoverModels, inputs: BenchInputs, config: EngineConfig, *, modes: list[str],
                    keeps: list[float], steps: int = 12, seed: int = 42) -> list[dict]:
    """One row per (mode, keep): the sparse run's fidelity against the dense run of the same mode (see the module
    docstring), with both runs' denoise and total seconds, the layout's kept fraction and window. `config`: the
    engine config with the sparse backend (and sparse-sta's window, if any); each mode runs it at each keep rate, and
    with the default attention (auto) for the dense run."""
    backend = config.attention.backend
    for mode in modes:  # what a mode cannot run is refused before any mode runs
        ran = resolve(config.with_(mode=mode, attention=AttentionOptions())).mode
        if ran not in ("exact", "fast"):
            raise FastRemoverError(f"--attention {backend} runs in the exact and fast modes only; mode {mode} runs "
                                   f"{ran} here")
        resolve(config.with_(mode=mode)).check_model(models.transformer.config)
    rows = []
    mask = torch.from_numpy(dilate_masks(inputs.mask, 6))
    with tempfile.TemporaryDirectory(prefix="fastremover-sparse-") as workdir:
        for mode in modes:
            dense_pipe = RemovalPipeline(models, config.with_(mode=mode, attention=AttentionOptions()))
            dense = run_engine(dense_pipe, inputs, steps, seed, 0, workdir)
            dense_attention = dense_pipe.config.attention
            del dense_pipe
            for keep in keeps:
                pipe = RemovalPipeline(models, config.with_(mode=mode, attention__keep=keep))
                run = run_engine(pipe, inputs, steps, seed, 0, workdir)
                pad = run.pixels.shape[2] - mask.shape[0]
                m = torch.cat([mask, mask[-1:].expand(pad, -1, -1)]) if pad > 0 else mask
                fid = fidelity(run.pixels, dense.pixels, m, run.latents, dense.latents, device=pipe.device)
                layouts = pipe.denoiser.fast.token_layouts()
                rows.append({
                    "mode": pipe.config.mode, "attention": pipe.config.attention, "keep": keep,
                    "dense_attention": dense_attention,
                    "kept_fraction": layouts[0]["density"] if layouts else None,
                    "window": layouts[0]["window"] if layouts else None,
                    **{k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in fid.items()},
                    "denoise_s": round(run.stages_s().get("denoise", math.nan), 4),
                    "dense_denoise_s": round(dense.stages_s().get("denoise", math.nan), 4),
                    "total_s": round(run.total_s(), 4), "dense_total_s": round(dense.total_s(), 4),
                })
                del pipe
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    return rows


def format_sparse_table(rows: list[dict]) -> str:
    lines = ["sparse attention against the same mode's dense attention (random weights: a lower bound; run it on "
             "your checkpoint and clip)",
             f"{'mode':6} {'attention':11} {'keep':>6} {'kept':>6} {'PSNR dB':>8} {'worst':>7} {'mask':>7} "
             f"{'latent cos':>10} {'denoise s':>10} {'dense s':>8}"]
    for r in rows:
        kept = r["kept_fraction"]
        lines.append(f"{r['mode']:6} {r['attention']:11} {r['keep']:>6.3f} "
                     f"{(f'{kept:.3f}' if kept is not None else '-'):>6} {r['psnr_mean_db']:>8.2f} "
                     f"{r['psnr_min_db']:>7.2f} {r['psnr_mask_db']:>7.2f} {r['latent_cos']:>10.6f} "
                     f"{r['denoise_s']:>10.3f} {r['dense_denoise_s']:>8.3f}")
    return "\n".join(lines)
