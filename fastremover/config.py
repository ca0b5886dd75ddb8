"""EngineConfig: the one typed input that says how the model runs, and ResolvedEngine: what runs.

    EngineConfig            frozen; nested options, one field per option
      .attention            AttentionOptions  backend
      .linears              LinearOptions     weights (dense / nvfp4 / nvfp4-w4a4), force_w4a4, fused_ffn1
      .vae                  VAEOptions        precision
      .graphs               GraphOptions      cuda_graphs, max_graphs
      .parallel             ParallelOptions   world_size, transport (read by fastremover/parallel; default one rank)
    KernelTuning            process-wide kernel switches, environment only (autotuning on / off)
    ResolvedEngine          the record of what runs (after every fallback) plus its notes: `fastremover info`, the
                            bench JSON (`engine_config`) and the CLI's `-v` log print it

Where a value comes from, in ONE place (this module):

* a field's metadata names its CLI flag (`flag`: the argparse dest) and, for a few A/B switches, an environment
  variable (`env`) with the spelling of its values; `EngineConfig.from_args(args)` reads the flags a command has and
  then the environment, `EngineConfig.from_env()` the environment alone. An environment value overrides the flag (the
  variables exist for A/B runs of an otherwise unchanged command line). A value outside the field's choices is a
  `FastRemoverError` naming the flag or the variable.
* `resolve` is not here: `fastremover.fast.engine.resolve(config, device)` turns a config into a plan for a device
  (mode fallbacks, the attention backend, the notes), and `fastremover.fast.engine.build` into modules plus the
  ResolvedEngine. This module imports neither torch nor any kernel, so flags and variables are checked in well under a
  second, before anything is loaded.

Adding an option: one field in the options class it belongs to (with `flag` / `env` metadata if a flag or a variable
sets it); the engine reads it from the config it is given.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from typing import Any, Mapping

from fastremover.errors import FastRemoverError

MODES = ("eager", "exact", "fast")  # = fastremover.fast.engine.MODES (tests/test_config.py checks they agree)
PRECISIONS = ("fp16", "bf16", "fp32")
WEIGHTS = ("dense", "nvfp4", "nvfp4-w4a4")
VAE_PRECISIONS = ("auto", "fp16", "fp8")
SWITCH = ("auto", "on", "off")
TRANSPORTS = ("fp16", "fp8")  # = fastremover.parallel.context.TRANSPORTS (tests/test_config.py checks they agree)


def _opt(default, *, choices=None, flag: str | None = None, env: str | None = None,
         env_values: Mapping[str, Any] | None = None, help: str = ""):
    """A config field: its default, the values it accepts, the CLI flag (argparse dest) and environment variable that
    set it, and how the variable's values map to the field's (`env_values`; None: the text itself)."""
    meta = {"choices": choices, "flag": flag, "env": env, "env_values": env_values, "help": help}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class AttentionOptions:
    # auto: the runnable backend of highest priority for the mode (fastremover/ops/attention/registry.py); a name or
    # an alias: that backend, an error if it cannot run here
    backend: str = _opt("auto", flag="attention", help="attention backend of the exact / fast modes")


@dataclass(frozen=True)
class LinearOptions:
    weights: str = _opt("dense", choices=WEIGHTS, flag="weights", help="transformer block linears as stored")
    force_w4a4: bool = _opt(False, choices=(False, True), flag="force_w4a4",
                            help="allow nvfp4-w4a4 on full-frame windows")
    # fast mode: the first FFN GEMM with GELU + quantization in its epilogue (fast/kernels/gemm_fp8.py, sm_90).
    # auto: where it runs, silently; on: asked for (a note where it cannot run); off: the two-pass FFN
    fused_ffn1: str = _opt("auto", choices=SWITCH, env="FASTREMOVER_FUSED_FFN1", env_values={"1": "on", "0": "off"},
                           help="fused FFN1 GEMM + GELU + quantization")


@dataclass(frozen=True)
class VAEOptions:
    precision: str = _opt("auto", choices=VAE_PRECISIONS, flag="vae_precision",
                          help="fast VAE: auto / fp16 = the model dtype; fp8 = FP8 3x3x3 conv3d")
    nvfp4_convs: bool = _opt(True, choices=(False, True),
                             help="with --weights nvfp4*: also the eager VAE's 3x3x3 convs with >= 192 input channels "
                             "in NVFP4 (fast/nvfp4_conv.py)")


@dataclass(frozen=True)
class GraphOptions:
    cuda_graphs: str = _opt("auto", choices=("auto", "off"),
                            help="capture the denoise loop as CUDA graphs (auto: on CUDA devices)")
    max_graphs: int = _opt(4, help="captured graphs kept (least recently used out first)")


@dataclass(frozen=True)
class ParallelOptions:
    """Sequence parallelism over GPUs (fastremover/parallel: its launcher and ParallelContext read these): the ranks
    one request is split over, and how q/k/v travel between them ("fp16": as they are, exact; "fp8": e4m3 codes + one
    fp32 scale per (row, head)). The single-process engine runs one rank."""

    world_size: int = _opt(1, help="ranks (GPUs) one request is split over")
    transport: str = _opt("fp16", choices=TRANSPORTS, help="how q/k/v travel between ranks")


@dataclass(frozen=True)
class EngineConfig:
    """How the model runs: device, dtype, engine mode and the nested options. Frozen: derive variants with
    `dataclasses.replace` or `EngineConfig.with_(path=value)`."""

    device: str | None = _opt(None, flag="device", help="cpu | cuda | cuda:N (None: cuda if available)")
    precision: str | None = _opt(None, choices=(None, *PRECISIONS), flag="precision",
                                 help="model dtype (None: fp16 on a GPU, fp32 on the CPU)")
    mode: str = _opt("auto", choices=("auto", *MODES), flag="mode", help="engine mode")
    attention: AttentionOptions = field(default_factory=AttentionOptions)
    linears: LinearOptions = field(default_factory=LinearOptions)
    vae: VAEOptions = field(default_factory=VAEOptions)
    graphs: GraphOptions = field(default_factory=GraphOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)

    def __post_init__(self):
        self.validate()

    # -- checks ---------------------------------------------------------------------------------------------------

    def validate(self) -> None:
        """FastRemoverError naming the first option out of range (nothing is imported or touched)."""
        for path, f, value in _leaves(self):
            choices = f.metadata.get("choices")
            name = _name(path, f)
            if choices is not None and value not in choices:
                shown = [c for c in choices if c is not None]
                raise FastRemoverError(f"{name} {value!r}: choose one of {shown}")
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise FastRemoverError(f"{name} {value!r}: must be a whole number")
        if self.graphs.max_graphs < 1:
            raise FastRemoverError(f"graphs.max_graphs {self.graphs.max_graphs}: must be at least 1")
        if self.parallel.world_size < 1:
            raise FastRemoverError(f"parallel.world_size {self.parallel.world_size}: must be at least 1")
        from fastremover.options import validate_device  # no torch

        validate_device(self.device)
        if self.attention.backend != "auto":
            from fastremover.ops import attention  # the registry (no torch at import)

            attention.canonical(self.attention.backend)  # FastRemoverError for an unknown name
        if self.linears.weights != "dense" and self.mode in ("exact", "fast"):
            raise FastRemoverError(f"--weights {self.linears.weights} runs in --mode eager only (the fused "
                                   "transformer reads dense weights)")

    # -- construction -----------------------------------------------------------------------------------------------

    def with_(self, **changes) -> "EngineConfig":
        """A copy with fields changed by dotted path with `__` for the dot: `config.with_(attention__backend="sdpa")`."""
        config = self
        for key, value in changes.items():
            config = _replace_path(config, key.split("__"), value)
        return config

    @classmethod
    def from_args(cls, args, environ: Mapping[str, str] | None = None) -> "EngineConfig":
        """From an argparse namespace (the flags a command has; the others keep their defaults), then the
        environment overrides (`from_env`)."""
        config = cls()
        for path, f, _ in _leaves(config):
            dest = f.metadata.get("flag")
            if dest is not None and hasattr(args, dest):
                config = _replace_path(config, path, getattr(args, dest), check=False)
        config.validate()
        return config.with_env(environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EngineConfig":
        return cls().with_env(environ)

    def with_env(self, environ: Mapping[str, str] | None = None) -> "EngineConfig":
        """A copy with every field that names an environment variable set from it where the variable is set and not
        empty (os.environ when `environ` is None)."""
        environ = os.environ if environ is None else environ
        config = self
        for path, f, _ in _leaves(self):
            var = f.metadata.get("env")
            if var is not None and environ.get(var, "").strip():
                config = _replace_path(config, path, _env_value(var, environ[var], f), check=False)
        config.validate()
        return config

    # -- output -----------------------------------------------------------------------------------------------------

    def describe(self) -> dict:
        """Nested plain dict (JSON-ready)."""
        return asdict(self)


@dataclass(frozen=True)
class KernelTuning:
    """Process-wide kernel switches, read from the environment by the kernels at call time (autotuning caches are
    process-wide too): for A/B runs and for suspected kernel problems, never needed to run."""

    # the FP8 conv3d kernel's timing-based config choice (off: the first candidate config)
    conv3d_fp8_tune: bool = _opt(True, env="FASTREMOVER_CONV3D_FP8_TUNE", env_values={"1": True, "0": False})
    # the sub-pixel upsampling conv's timing-based config choice (off: the first candidate)
    upconv_tune: bool = _opt(True, env="FASTREMOVER_UPCONV_TUNE", env_values={"1": True, "0": False})
    # the fast VAE's convs on cuDNN plans that give torch's bits faster (fast/cudnn_conv.py; off: torch's convs)
    cudnn_conv_plans: bool = _opt(True, env="FASTREMOVER_CUDNN_CONV_PLANS", env_values={"1": True, "0": False})
    # the persistent cache of warm-up results (fastremover/cache.py: Triton's kernels, cuDNN plan choices, autotune
    # results, FlashInfer's modules): a folder; "" = the platform's user cache folder (`cache_dir`); "off" = none
    cache_dir: str = _opt("", env="FASTREMOVER_CACHE_DIR")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelTuning":
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            var = f.metadata["env"]
            text = environ.get(var, "").strip()
            if text:
                values[f.name] = _env_value(var, text, f)
        return cls(**values)

    def describe(self) -> dict:
        return asdict(self)


def cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The persistent cache folder (fastremover/cache.py): FASTREMOVER_CACHE_DIR, else the platform's user cache
    folder (Linux: $XDG_CACHE_HOME/fastremover or ~/.cache/fastremover; macOS: ~/Library/Caches/fastremover; Windows:
    %LOCALAPPDATA%\\fastremover\\Cache); None when the variable is "off" (or "none", "0")."""
    environ = os.environ if environ is None else environ
    setting = KernelTuning.from_env(environ).cache_dir.strip()
    if setting.lower() in ("off", "none", "0"):
        return None
    if setting:
        return os.path.expanduser(setting)
    import sys

    home = os.path.expanduser("~")
    if sys.platform == "win32":
        base = environ.get("LOCALAPPDATA") or os.path.join(home, "AppData", "Local")
        return os.path.join(base, "fastremover", "Cache")
    if sys.platform == "darwin":
        return os.path.join(home, "Library", "Caches", "fastremover")
    return os.path.join(environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "fastremover")


def kernel_tuning() -> KernelTuning:
    """The kernel switches as the environment sets them now (what the kernels read at each call)."""
    return KernelTuning.from_env()


@dataclass
class ResolvedEngine:
    """What runs (after every fallback), with the notes that explain each fallback: printed by `fastremover info`,
    stored in the bench JSON, logged at debug level by the CLI. `config` is the input it was resolved from."""

    model: str  # "classic", "random:<preset>:<seed>" or a checkpoint path
    device: str
    precision: str
    mode: str = "eager"  # the mode that runs (after any fallback)
    requested_mode: str = "eager"
    fused_kernels: str = "none"
    fp8_linears: bool = False
    attention: str = "sdpa"
    ffn1: str = "none"  # fast mode: the FFN's first GEMM + GELU quantization path (fast/transformer_fast.py)
    fp8_gemm: str = "none"  # fast mode: cuBLASLt with workspace-free algorithms (fast/cublaslt.py) or torch._scaled_mm
    concurrent_branches: bool = False  # fp8 attention on CUDA: q / k / V preparation on parallel streams
    vae: str = "eager"  # the VAE path that runs: "eager" (models.vae.WanVAE) or "fast-fp16" / "fast-bf16" / "fast-fp8"
    vae_precision: str = "auto"  # as requested: auto | fp16 (the model dtype) | fp8 (FP8 conv3d in the fast VAE)
    cuda_graphs: bool = False
    weights: str = "dense"  # the transformer block linears: dense | nvfp4 | nvfp4-w4a4 (fast/nvfp4_linear.py)
    nvfp4: dict | None = None  # with NVFP4 weights: resident bytes before / after packing (Nvfp4Report.describe)
    nvfp4_vae: dict | None = None  # with NVFP4 weights: the eager VAE's packed 3x3x3 convs (Nvfp4ConvReport.describe)
    parallel_world_size: int = 1  # config.parallel.world_size (this process runs one rank of them)
    tuning: dict | None = None  # KernelTuning.describe() at build time
    config: dict | None = None  # the EngineConfig it was resolved from (EngineConfig.describe())
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------------------------------
# Helpers


def _leaves(obj, prefix: tuple[str, ...] = ()):
    """(path, field, value) of every non-dataclass field, depth first."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from _leaves(value, prefix + (f.name,))
        else:
            yield prefix + (f.name,), f, value


def _name(path: tuple[str, ...], f) -> str:
    if f.metadata.get("flag"):
        return "--" + f.metadata["flag"].replace("_", "-")
    return ".".join(path)


def _replace_path(obj, path, value, check: bool = True):
    head, *rest = path
    if head not in {f.name for f in fields(obj)}:
        raise FastRemoverError(f"engine config: no option {'.'.join(path)!r} in {type(obj).__name__}")
    if rest:
        value = _replace_path(getattr(obj, head), rest, value, check=False)
    if not check and isinstance(obj, EngineConfig):
        return _unchecked_replace(obj, head, value)
    return replace(obj, **{head: value})


def _unchecked_replace(config: EngineConfig, name: str, value) -> EngineConfig:
    """replace() without __post_init__'s check (from_args sets fields one at a time; it checks the whole at the end)."""
    new = object.__new__(EngineConfig)
    for f in fields(config):
        object.__setattr__(new, f.name, value if f.name == name else getattr(config, f.name))
    return new


def _env_value(var: str, text: str, f):
    text = text.strip()
    values = f.metadata.get("env_values")
    if values is None:
        return text
    if text not in values:
        raise FastRemoverError(f"{var}={text!r}: use one of {list(values)}")
    return values[text]


def option_table() -> list[dict]:
    """Every option: path, default, choices, flag, variable, help (for docs and tests)."""
    rows = []
    for cls, root in ((EngineConfig, ""), (KernelTuning, "tuning.")):
        for path, f, value in _leaves(cls()):
            rows.append({"option": root + ".".join(path), "default": value, "choices": f.metadata.get("choices"),
                         "flag": f.metadata.get("flag"), "env": f.metadata.get("env"),
                         "help": f.metadata.get("help", "")})
    return rows

