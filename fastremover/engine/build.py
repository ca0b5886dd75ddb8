"""The engine: one `EngineConfig` (fastremover/config.py) resolved against a device, then built into modules, once,
when the pipeline is built.

    resolve(config) -> Plan       the device and dtype, the mode that runs (after fallbacks), its attention backend,
                                  the transformer's linear method, the FFN path, and the notes that explain every
                                  fallback; `Plan.check_window` is the per-window rule of the plan (W4A4 on full frames)
    build(models, config, parallel=None) -> Engine(denoiser, vae, resolved: ResolvedEngine, plan)
                                  with a ParallelContext of several ranks, the sequence-parallel denoiser and the
                                  parallel VAE (fastremover/engine/parallel.py) around them

Modes:

    auto   exact where it can run, else eager (no note when it picks eager)
    eager  the reference-order modules (every device)
    exact  fused Triton kernels + a 16-bit attention backend + the CUDA-graph loop, no quantization   (CUDA + Triton)
    fast   exact + FP8 e4m3 W8A8 linears + the 8-bit attention backend of highest priority that runs (16-bit
           attention with a note where none does)                         (GPUs with FP8 tensor cores, sm_89+)

A mode the device cannot run falls back to the next safer one with a note (never silently); an explicit attention
backend that cannot run is an error with its validator's reasons (fastremover/ops/attention/registry.py).

Linear methods (ops/linear/registry.py): the plan names the transformer's block-linear method - `dense` (exact),
`fp8-rowwise` (fast), or `--weights` (`nvfp4`, `nvfp4-w4a4`: eager mode only, put into the eager transformer by the
method's `prepare_eager`). The engine passes the `LinearMethod` itself to the modules it builds.

The fast mode's first FFN GEMM carries the GELU and its quantization in its epilogue where that kernel runs
(fast/kernels/gemm_fp8.py: sm_90), else the two-pass path (`_scaled_mm`, then the GELU quantization):
`linears.fused_ffn1` auto / on (a note where it cannot run) / off (FASTREMOVER_FUSED_FFN1=1 / 0).

Device and precision are resolved here only (`resolve_device`, `resolve_precision`): no device given means a CUDA GPU
if one is visible, else the CPU; no precision means fp16 on a GPU, fp32 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastremover.config import MODES, PRECISIONS, EngineConfig, ResolvedEngine
from fastremover.env import kernel_tuning
from fastremover.errors import FastRemoverError
from fastremover.ops import linear
from fastremover.engine.denoise import EagerDenoiser, FastDenoiser
from fastremover.log import logger
from fastremover.models.transformer import RemoverTransformer
from fastremover.ops import attention as attention_backends

__all__ = ["DTYPES", "MODES", "Engine", "Plan", "build", "build_denoiser", "fp8_supported", "resolve",
           "resolve_attention", "resolve_device", "resolve_mode", "resolve_precision", "triton_available"]

DTYPES: dict[str, torch.dtype] = dict(zip(PRECISIONS, (torch.float16, torch.bfloat16, torch.float32)))


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device a config's `device` names; None: a CUDA GPU if one is visible, else the CPU. A CUDA device where
    none is visible is a FastRemoverError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastRemoverError(f"--device {device}: no CUDA GPU is available here; use --device cpu")
    return device


def resolve_precision(precision: str | None, device: torch.device) -> str:
    """The model dtype's name: as given, else fp16 on a GPU and fp32 on the CPU."""
    return precision or ("fp16" if device.type == "cuda" else "fp32")


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


def linear_method_for(mode: str, weights: str) -> str:
    """The block linears' method (an ops/linear/registry.py registry name) of a resolved mode: the fast mode's FP8
    linears, the exact mode's dense ones, or the eager mode's stored weights (`--weights`)."""
    return {"fast": "fp8-rowwise", "exact": "dense"}.get(mode, weights)


@dataclass(frozen=True)
class Plan:
    """What a config runs on one device, decided before any module is built."""

    config: EngineConfig
    device: torch.device
    precision: str  # fp16 | bf16 | fp32
    mode: str  # eager | exact | fast, after fallbacks
    attention: str  # canonical backend name
    linear_method: str  # the transformer's block linears (ops/linear/registry.py)
    fused_ffn1: bool  # asked for (fast mode and not switched off); whether it runs is the transformer's check
    cuda_graphs: bool
    mode_notes: tuple[str, ...] = ()
    attention_notes: tuple[str, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def notes(self) -> list[str]:
        return [*self.mode_notes, *self.attention_notes]

    def check_window(self, full_frame: bool, crop_mode: str = "auto") -> None:
        """The plan's rule for one window the model runs on (full_frame: no crop): NVFP4 W4A4 collapses on full
        frames, so it runs there only with `linears.force_w4a4` (a FastRemoverError otherwise). ``crop_mode``: the
        run's --crop, so that under --crop on a window whose box is the whole frame is told so, not to use --crop on."""
        if self.linear_method == "nvfp4-w4a4" and full_frame and not self.config.linears.force_w4a4:
            from fastremover.ops.linear.nvfp4 import W4A4_FULL_FRAME_REFUSAL, W4A4_WHOLE_CROP_REFUSAL

            raise FastRemoverError(W4A4_WHOLE_CROP_REFUSAL if crop_mode == "on" else W4A4_FULL_FRAME_REFUSAL)

    def check_model(self, transformer_config) -> None:
        """The plan's rule for the transformer it runs (its RemoverTransformerConfig): the attention backend must take
        the model's heads as the mode hands them (e4m3 codes in the fast mode to a backend that takes codes; e.g. the
        sparse kernel's FP8 dot needs head dim >= 32), a FastRemoverError otherwise. engine.build checks it before
        it moves or builds anything; the eager mode runs its own attention."""
        if self.mode == "eager":
            return
        attention_backends.runnable(
            self.attention, self.device, dtype=self.dtype,
            shape=(transformer_config.num_attention_heads, transformer_config.attention_head_dim),
            fp8_activations=linear.get(self.linear_method).fp8_activations)


def resolve(config: EngineConfig, device: torch.device | str | None = None) -> Plan:
    """The plan of `config` on `device` (default: the config's own device, resolved; an explicit device is taken
    as it is): mode fallbacks and the attention backend, each explained in a note."""
    device = resolve_device(config.device) if device is None else torch.device(device)
    mode = config.mode
    if config.linears.weights != "dense" and mode == "auto":
        mode = "eager"  # NVFP4 weights: the eager transformer (explicit exact / fast are refused by the config)
    active, notes = resolve_mode(mode, device)
    return _plan(config, device, active, tuple(notes))


def _plan(config: EngineConfig, device: torch.device, mode: str, mode_notes: tuple[str, ...] = ()) -> Plan:
    """The plan for an already resolved mode."""
    backend, attention_notes = resolve_attention(config.attention.backend, mode, device)
    return Plan(config=config, device=device, precision=resolve_precision(config.precision, device), mode=mode,
                attention=backend, linear_method=linear_method_for(mode, config.linears.weights),
                fused_ffn1=mode == "fast" and config.linears.fused_ffn1 != "off",
                cuda_graphs=device.type == "cuda" and config.graphs.cuda_graphs != "off",
                mode_notes=mode_notes, attention_notes=tuple(attention_notes))


def _denoiser(plan: Plan, transformer: RemoverTransformer, scheduler_config: dict):
    """(denoiser, extra notes) for a plan."""
    if plan.mode == "eager":
        return EagerDenoiser(transformer, scheduler_config), []
    from fastremover.fast.transformer_fast import FastTransformer  # needs Triton: only for the exact / fast modes

    fast = FastTransformer(transformer, linear_method=linear.get(plan.linear_method),
                           attention=plan.attention, fused_ffn1=plan.fused_ffn1, options=plan.config.transformer,
                           attention_options=plan.config.attention)
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
    """The built modules of one resolved config. Under sequence parallelism (`parallel` with several ranks) the
    denoiser and VAE are the parallel ones: on rank 0 each call announces its stage to the other ranks, which run
    `follow()` until rank 0 calls `stop()`."""

    denoiser: object | None
    vae: object | None
    resolved: ResolvedEngine
    plan: Plan | None = None
    parallel: object | None = None  # a ParallelEngine (fastremover/engine/parallel.py) or None
    precompiler: object | None = None  # a fast.precompile.Precompiler, made at the first `precompile` that needs it

    def precompiles(self) -> bool:
        """Whether `precompile` does anything: the fused Triton paths on CUDA (exact / fast mode, the fast VAE), one
        process, FASTREMOVER_PRECOMPILE not off (0)."""
        plan = self.plan
        return (plan is not None and self.denoiser is not None and plan.mode in ("exact", "fast")
                and plan.device.type == "cuda" and self.parallel is None
                and getattr(self.vae, "kernels", None) == "triton" and kernel_tuning().precompile != "off")

    def precompile(self, shapes, background: bool | None = None) -> dict | None:
        """Compile, concurrently, the Triton kernels the fast VAE and the fast transformer will launch for windows of
        these run shapes ((frames, height, width) of the VAE input: the padded crop) that earlier calls did not
        (fastremover/fast/precompile.py); timed as the phase "precompile". A no-op (None) where `precompiles` is
        False. Never an error: a kernel that was not compiled here compiles at its launch. `background` (None:
        FASTREMOVER_PRECOMPILE=record-background, off by default: docs/performance.md, sessions 27-28): a process's
        later shapes are recorded in a background thread while the window runs (`Precompiler.background_ok`)."""
        if not self.precompiles():
            return None
        from fastremover.timing import phase

        mode = kernel_tuning().precompile
        if background is None:
            background = mode == "record-background"
        with phase("precompile"):
            if self.precompiler is None:
                from fastremover.fast.precompile import Precompiler

                fast = getattr(self.denoiser, "fast", None)
                self.precompiler = Precompiler(self.plan.device, vae=self.vae,
                                               transformer=fast if getattr(fast, "use_triton", False) else None,
                                               wait=mode == "wait")
            return self.precompiler.shapes(shapes, background=background).describe()

    def follow(self) -> None:
        """A rank other than 0: run the stages rank 0 announces, until it stops."""
        if self.parallel is None:
            raise RuntimeError("follow() is for the ranks of a parallel engine")
        self.parallel.follow()

    def stop(self) -> None:
        """Rank 0: tell the other ranks the run is over (nothing for a one-process engine)."""
        if self.parallel is not None:
            self.parallel.stop()


def build(models, config: EngineConfig, parallel=None) -> Engine:
    """Resolve `config` on its device and build its modules (models: a loaded `RemoverModels`, None for the weightless
    classic remover). The transformer is moved to the device and dtype; a quantized `--weights` method replaces the
    eager transformer's block linears in place. `parallel`: this process's ParallelContext (fastremover/parallel);
    with several ranks the sequence-parallel denoiser and the parallel VAE are built around the modules. Every note
    is logged (the package logger) and recorded in the ResolvedEngine."""
    device = resolve_device(config.device)
    if models is not None and device.type == "cuda":
        # before anything compiles or imports FlashInfer (resolve's attention validators may): Triton's and
        # FlashInfer's caches in the persistent cache, and Triton's compiles timed as a phase
        from fastremover.cache import install_tool_dirs
        from fastremover.timing import time_triton_compiles

        install_tool_dirs()
        time_triton_compiles()
    plan = resolve(config, device)
    device, dtype = plan.device, plan.dtype
    if parallel is not None and parallel.is_parallel and attention_backends.get(plan.attention).token_layout:
        raise FastRemoverError(f"--attention {plan.attention} does not run under sequence parallelism (--parallel)")
    tuning = kernel_tuning().describe()
    if models is None:
        if parallel is not None and parallel.is_parallel:
            raise FastRemoverError("--parallel ulysses needs a model (--model random or a checkpoint), not classic")
        resolved = ResolvedEngine(model="classic", device=str(device), precision=plan.precision, mode="eager",
                                  requested_mode=config.mode, vae="none", vae_precision=config.vae.precision,
                                  weights=config.linears.weights, tuning=tuning, config=config.describe())
        return Engine(None, None, resolved, plan)
    plan.check_model(models.transformer.config)
    from fastremover.fast.vae import build_vae
    from fastremover.timing import phase

    notes = list(plan.mode_notes)
    extra: dict = {}
    with phase("host_to_device"):  # a no-op where the weights were loaded on the device in the model dtype
        models.transformer.to(device).to_inference_dtype(dtype)
    method = linear.get(plan.linear_method)
    if plan.mode == "eager" and method.prepare_eager is not None:
        report = method.prepare_eager(models.transformer)
        notes.append(report.summary())
        extra[method.report_key] = report.describe()
    with phase("vae_setup"):
        vae, vae_path = build_vae(models.vae, plan.mode, device, dtype, config.vae.precision, config.vae.fast)
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
    engine_parallel = None
    if parallel is not None and parallel.is_parallel:
        from fastremover.engine.parallel import ParallelEngine

        engine_parallel = ParallelEngine(parallel, models.transformer.config.num_attention_heads, denoiser, vae)
        denoiser, vae = engine_parallel.denoiser, engine_parallel.vae
        notes += engine_parallel.notes
        extra.update(engine_parallel.describe())
    for note in notes:
        logger.warning(note)
    resolved = ResolvedEngine(model=models.source, device=str(device), precision=plan.precision, mode=plan.mode,
                              requested_mode=config.mode, linear_method=method.name, vae=vae_path,
                              vae_precision=config.vae.precision, weights=config.linears.weights, tuning=tuning,
                              config=config.describe(), notes=notes, **denoiser.describe(), **extra)
    return Engine(denoiser, vae, resolved, plan, engine_parallel)
