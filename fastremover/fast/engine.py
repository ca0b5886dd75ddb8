"""The engine: one `EngineConfig` (fastremover/config.py) resolved against a device, then built into modules, once,
when the pipeline is built.

    resolve(config, device) -> Plan       the mode that runs (after fallbacks), its attention backend, the FFN path,
                                          and the notes that explain every fallback
    build(models, config, device) -> Engine(denoiser, vae, resolved: ResolvedEngine)

Modes:

    auto   exact where it can run, else eager (no note when it picks eager)
    eager  the reference-order modules (every device)
    exact  fused Triton kernels + a 16-bit attention backend + the CUDA-graph loop, no quantization   (CUDA + Triton)
    fast   exact + FP8 e4m3 W8A8 linears + the 8-bit attention backend of highest priority that runs (16-bit
           attention with a note where none does)                         (GPUs with FP8 tensor cores, sm_89+)

A mode the device cannot run falls back to the next safer one with a note (never silently); an explicit attention
backend that cannot run is an error with its validator's reasons (fastremover/ops/attention/registry.py). NVFP4
weights (`linears.weights`) run in the eager mode only.

The fast mode's first FFN GEMM carries the GELU and its quantization in its epilogue where that kernel runs
(fast/kernels/gemm_fp8.py: sm_90), else the two-pass path (`_scaled_mm`, then the GELU quantization):
`linears.fused_ffn1` auto / on (a note where it cannot run) / off (FASTREMOVER_FUSED_FFN1=1 / 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastremover.config import MODES, EngineConfig, ResolvedEngine, kernel_tuning
from fastremover.fast.denoise import EagerDenoiser, FastDenoiser
from fastremover.models.transformer import RemoverTransformer
from fastremover.ops import attention as attention_backends

__all__ = ["MODES", "Engine", "Plan", "build", "build_denoiser", "fp8_supported", "resolve", "resolve_attention",
           "resolve_mode", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_mode(mode: str, device: torch.device) -> tuple[str, list[str]]:
    """The mode that can run on `device` and the notes explaining any fallback."""
    if mode == "auto":
        return ("exact" if device.type == "cuda" and triton_available() else "eager"), []
    notes = []
    if mode in ("exact", "fast") and (device.type != "cuda" or not triton_available()):
        why = "no CUDA GPU" if device.type != "cuda" else "Triton is not installed"
        notes.append(f"mode {mode} needs a CUDA GPU with Triton ({why}): running the eager path")
        return "eager", notes
    if mode == "fast" and not fp8_supported(device):
        notes.append("mode fast needs FP8 tensor cores (sm_89 or newer): running mode exact (no quantization)")
        return "exact", notes
    return mode, notes


def resolve_attention(attention: str, mode: str, device: torch.device) -> tuple[str, list[str]]:
    """(canonical attention backend, notes) for an (already resolved) mode: `auto` picks by the registry's priorities;
    an explicit backend must belong to the mode and be able to run (fastremover.ops.attention.registry.resolve)."""
    return attention_backends.resolve(attention, mode, device)


@dataclass(frozen=True)
class Plan:
    """What a config runs on one device, decided before any module is built."""

    config: EngineConfig
    device: torch.device
    mode: str  # eager | exact | fast, after fallbacks
    attention: str  # canonical backend name
    fused_ffn1: bool  # asked for (fast mode and not switched off); whether it runs is the transformer's check
    cuda_graphs: bool
    mode_notes: tuple[str, ...] = ()
    attention_notes: tuple[str, ...] = ()

    @property
    def notes(self) -> list[str]:
        return [*self.mode_notes, *self.attention_notes]


def resolve(config: EngineConfig, device: torch.device | str) -> Plan:
    """The plan of `config` on `device`: mode fallbacks and the attention backend, each explained in a note."""
    device = torch.device(device)
    mode = config.mode
    if config.linears.weights != "dense" and mode == "auto":
        mode = "eager"  # NVFP4 weights: the eager transformer (explicit exact / fast are refused by the config)
    active, notes = resolve_mode(mode, device)
    return _plan(config, device, active, tuple(notes))


def _plan(config: EngineConfig, device: torch.device, mode: str, mode_notes: tuple[str, ...] = ()) -> Plan:
    """The plan for an already resolved mode."""
    backend, attention_notes = resolve_attention(config.attention.backend, mode, device)
    return Plan(config=config, device=device, mode=mode, attention=backend,
                fused_ffn1=mode == "fast" and config.linears.fused_ffn1 != "off",
                cuda_graphs=device.type == "cuda" and config.graphs.cuda_graphs != "off",
                mode_notes=mode_notes, attention_notes=tuple(attention_notes))


def _denoiser(plan: Plan, transformer: RemoverTransformer, scheduler_config: dict):
    """(denoiser, extra notes) for a plan."""
    if plan.mode == "eager":
        return EagerDenoiser(transformer, scheduler_config), []
    from fastremover.fast.transformer_fast import FastTransformer  # needs Triton: only for the exact / fast modes

    fast = FastTransformer(transformer, fp8=plan.mode == "fast", attention=plan.attention, fused_ffn1=plan.fused_ffn1)
    notes = []
    if plan.config.linears.fused_ffn1 == "on" and plan.mode == "fast" and not fast.fused_ffn1:
        notes.append("FASTREMOVER_FUSED_FFN1=1 (linears.fused_ffn1 on): the fused FFN GEMM needs an sm_90 GPU with "
                     "Triton tensor descriptors; running the two-pass FFN")
    denoiser = FastDenoiser(fast, scheduler_config, cuda_graphs=plan.cuda_graphs,
                            max_graphs=plan.config.graphs.max_graphs)
    return denoiser, notes


def build_denoiser(transformer: RemoverTransformer, scheduler_config: dict, mode: str, device: torch.device,
                   attention: str = "auto", config: EngineConfig | None = None):
    """(denoiser, notes) for an already resolved `mode` (not checked against the device again: tests run the fast
    transformer on the CPU). Without `config`, the environment's overrides apply to a default config; `attention`
    replaces the config's backend."""
    config = (config or EngineConfig.from_env()).with_(attention__backend=attention)
    plan = _plan(config, torch.device(device), mode)
    denoiser, notes = _denoiser(plan, transformer, scheduler_config)
    return denoiser, plan.notes + notes


@dataclass
class Engine:
    """The built modules of one resolved config."""

    denoiser: object | None
    vae: object | None
    resolved: ResolvedEngine
    plan: Plan | None = None
    extra: dict = field(default_factory=dict)


def build(models, config: EngineConfig, device: torch.device | str, dtype: torch.dtype, precision: str) -> Engine:
    """Resolve `config` on `device` and build its modules (models: a loaded `RemoverModels`, None for the weightless
    classic remover). The transformer is moved to device/dtype; NVFP4 weights are packed in place."""
    device = torch.device(device)
    tuning = kernel_tuning().describe()
    if models is None:
        resolved = ResolvedEngine(model="classic", device=str(device), precision=precision, mode="eager",
                                  requested_mode=config.mode, vae="none", vae_precision=config.vae.precision,
                                  weights=config.linears.weights, tuning=tuning, config=config.describe())
        return Engine(None, None, resolved)
    from fastremover.fast.vae_fast import build_vae
    from fastremover.timing import phase

    if device.type == "cuda":  # before anything compiles: Triton's / FlashInfer's caches in the persistent cache
        from fastremover.cache import install_tool_dirs
        from fastremover.timing import time_triton_compiles

        install_tool_dirs()
        time_triton_compiles()
    plan = resolve(config, device)
    notes = list(plan.mode_notes)
    extra: dict = {}
    with phase("host_to_device"):  # a no-op where the weights were loaded on the device in the model dtype
        models.transformer.to(device).to_inference_dtype(dtype)
    if config.linears.weights != "dense":
        from fastremover.fast.nvfp4_linear import quantize_linears_nvfp4

        report = quantize_linears_nvfp4(models.transformer, w4a4=config.linears.weights == "nvfp4-w4a4")
        notes.append(report.summary())
        extra["nvfp4"] = report.describe()
    with phase("vae_setup"):
        vae, vae_path = build_vae(models.vae, plan.mode, device, dtype, config.vae.precision)
    eager_vae = getattr(vae, "module", None)  # the WanVAE inside an EagerVideoVAE (None: the fast VAE)
    if config.linears.weights != "dense" and config.vae.nvfp4_convs and eager_vae is not None:
        from fastremover.fast.nvfp4_conv import Nvfp4CausalConv3d, quantize_vae_convs_nvfp4

        if not any(isinstance(m, Nvfp4CausalConv3d) for m in eager_vae.modules()):
            vae_report = quantize_vae_convs_nvfp4(eager_vae)
            notes.append(vae_report.summary())
            extra["nvfp4_vae"] = vae_report.describe()
    with phase("quantize"):  # the fused transformer's weight preparation (FP8 quantization in the fast mode)
        denoiser, denoiser_notes = _denoiser(plan, models.transformer, models.scheduler_config)
    notes += [*plan.attention_notes, *denoiser_notes]
    resolved = ResolvedEngine(model=models.source, device=str(device), precision=precision, mode=plan.mode,
                              requested_mode=config.mode, vae=vae_path, vae_precision=config.vae.precision,
                              weights=config.linears.weights, parallel_world_size=config.parallel.world_size, tuning=tuning,
                              config=config.describe(), notes=notes, **denoiser.describe(), **extra)
    return Engine(denoiser, vae, resolved, plan, extra)
