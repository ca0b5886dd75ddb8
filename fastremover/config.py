"""The engine's typed input and every flag and environment variable that sets it (one definition per option).

    ModelSource             which weights: "classic" (no model), "random" (a preset config with deterministic random
                            weights), a checkpoint folder or a Hugging Face Hub id ORG/NAME[@REVISION]
                            (fastremover.pipeline.load_source loads it; fastremover.models.hub resolves the id)
    EngineConfig            frozen; how the model runs: device, precision, mode and the nested options
      .attention            AttentionOptions  backend, keep, window (the sparse backends)
      .linears              LinearOptions     weights (dense / nvfp4 / nvfp4-w4a4), force_w4a4, fused_ffn1
      .vae                  VAEOptions        precision, nvfp4_convs, fast (FastVAEOptions: the fast VAE's switches)
      .transformer          TransformerOptions  the fused transformer's switches (streams, GEMM choice)
      .graphs               GraphOptions      cuda_graphs, max_graphs
      .parallel             ParallelOptions   mode, world_size, transport, head_groups, timeout_s (read by the
                                              launcher, fastremover/parallel/launch.py, and the engine's build)
    ResolvedEngine          the record of what runs (after every fallback) plus its notes: `fastremover info`, the
                            bench JSON (`engine_config`) and the CLI's `-v` log print it

Where a value comes from:

* a field's metadata names its CLI flag (`flag`: the argparse dest), how the flag parses, its help, and for a few A/B
  switches an environment variable (`env`) with the spelling of its values. `add_model_args` / `add_engine_args`
  add the flags to a command's parser from that metadata (every command that takes engine flags - remove, demo,
  batch, serve, bench, verify - gets the same definitions); `EngineConfig.from_args(args)` reads the flags the
  command has, then the environment, `EngineConfig.from_env()` the environment alone. An environment value overrides
  the flag (the variables exist for A/B runs of an otherwise unchanged command line). A value outside the field's
  choices is a `FastRemoverError` naming the flag or the variable.
* the environment itself is read in fastremover/env.py only (`env.variables()` here; there: the kernel switches
  (KernelTuning), torchrun's rank variables, the service's API key, CUDA_VISIBLE_DEVICES, TRITON_INTERPRET, CUDA_HOME,
  the persistent cache's folder and the libraries' own cache folders; a child process's environment).
* the checks that need a registry ask it: an attention backend's name and the sparse options
  (fastremover.ops.attention), a Hub id (fastremover.models.hub). None of them imports torch.
* `resolve` is not here: `fastremover.engine.build.resolve(config, device)` turns a config into a plan for a device
  (the device and dtype, mode fallbacks, the attention backend and linear method, the notes), and
  `fastremover.engine.build.build` into modules plus the ResolvedEngine. This module imports neither torch nor any
  kernel, so flags and variables are checked in well under a second, before anything is loaded.

Adding an option: one field in the options class it belongs to (with `flag` / `env` metadata if a flag or a variable
sets it); the engine reads it from the config it is given.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from fastremover.env import KernelTuning, env_value, variables
from fastremover.errors import FastRemoverError
from fastremover.ops import attention as attention_backends  # the registry (no torch at import)
from fastremover.ops.attention.sparse import check_options, parse_window

# The choice lists (each defined here only; the engine, the registry and the parallel package import them)
MODES = ("eager", "exact", "fast")
PRECISIONS = ("fp16", "bf16", "fp32")
WEIGHTS = ("dense", "nvfp4", "nvfp4-w4a4")
VAE_PRECISIONS = ("auto", "fp16", "fp8")
SWITCH = ("auto", "on", "off")
PARALLEL_MODES = ("none", "ulysses")
TRANSPORTS = ("fp16", "fp8")
MAX_RANKS = 64
DEFAULT_PARALLEL_TIMEOUT_S = 300.0


def _opt(default, *, choices=None, flag: str | None = None, env: str | None = None,
         env_values: Mapping[str, Any] | None = None, help: str = "", parse: Callable | None = None,
         metavar: str | None = None, cli_choices: Callable[[], list] | None = None):
    """A config field: its default, the values it accepts, the CLI flag (argparse dest) and environment variable that
    set it, how the variable's values map to the field's (`env_values`; None: the text itself), and for the flag:
    `parse` (argparse's type; a bool field is a store_true switch), `metavar`, and `cli_choices` (the choices argparse
    shows where the field's own check lives elsewhere, e.g. the attention registry)."""
    meta = {"choices": choices, "flag": flag, "env": env, "env_values": env_values, "help": help, "parse": parse,
            "metavar": metavar, "cli_choices": cli_choices}
    return field(default=default, metadata=meta)


def _attention_choices() -> list[str]:
    return ["auto", *attention_backends.names(with_aliases=True)]


# ----------------------------------------------------------------------------------------------------------------------
# The model source


@dataclass(frozen=True)
class ModelSource:
    """Which weights a pipeline loads. `name`: "classic" (the weightless fill, no model), "random" (the `preset`
    config with deterministic random weights from `weights_seed`), a MiniMax-Remover checkpoint folder, or a model
    on the Hugging Face Hub, "ORG/NAME[@REVISION]" or "hf:ORG/NAME[@REVISION]" (fastremover.models.hub: the local
    cache first, downloaded into it when missing)."""

    name: str = _opt("classic", flag="model", metavar="MODEL",
                     help="classic (the weightless fill) | random (preset config, random weights) | PATH to a "
                     "MiniMax-Remover checkpoint folder with transformer/ vae/ scheduler/ | ORG/NAME[@REVISION] on "
                     "the Hugging Face Hub, e.g. zibojia/minimax-remover (read from the local Hugging Face cache; "
                     "downloaded into it when missing unless HF_HUB_OFFLINE=1; see `fastremover download`)")
    preset: str = _opt("minimax-remover", flag="preset", help="config for --model random: minimax-remover | tiny")
    weights_seed: int = _opt(0, flag="weights_seed", parse=int, help="seed of the random weights for --model random")

    @classmethod
    def of(cls, model: "ModelSource | str | None" = None, *, preset: str | None = None,
           weights_seed: int | None = None) -> "ModelSource":
        """A source from a name (None: classic) and optional preset / seed; a ModelSource passes through (with the
        preset / seed replaced where given)."""
        source = model if isinstance(model, ModelSource) else cls(name=model or "classic")
        changes = {k: v for k, v in (("preset", preset), ("weights_seed", weights_seed)) if v is not None}
        return replace(source, **changes) if changes else source

    @classmethod
    def from_args(cls, args) -> "ModelSource":
        """From a command's --model / --preset / --weights-seed (those it has; --model omitted: classic)."""
        values = {f.name: getattr(args, f.metadata["flag"]) for f in fields(cls) if hasattr(args, f.metadata["flag"])}
        if values.get("name") is None:
            values["name"] = "classic"
        source = cls(**values)
        source.validate()
        return source

    @property
    def kind(self) -> str:
        """"classic", "random", "folder" or "hub" (an existing path is a folder; fastremover.models.hub.parse_model)."""
        if self.name in ("classic", "random"):
            return self.name
        from fastremover.models.hub import parse_model  # no torch, no huggingface_hub at import

        try:
            return parse_model(self.name).kind
        except FastRemoverError:  # a malformed Hub id: validate() says why
            return "hub"

    @property
    def label(self) -> str:
        """A short name for logs and the service: classic, random, the folder's name or the Hub id."""
        kind = self.kind
        if kind == "folder":
            return Path(self.name).name
        return self.name.removeprefix("hf:") if kind == "hub" else self.name

    def validate(self) -> None:
        """FastRemoverError unless the name is classic, random, an existing folder, or a Hub id whose cached
        snapshot verifies or that may be downloaded when the model loads (fastremover.models.hub.check_model: no
        network, no weights read)."""
        if isinstance(self.weights_seed, bool) or not isinstance(self.weights_seed, int) or self.weights_seed < 0:
            raise FastRemoverError(f"--weights-seed {self.weights_seed!r}: must be a whole number >= 0")
        if self.name not in ("classic", "random"):
            from fastremover.models.hub import check_model

            check_model(self.name)

    def describe(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------------------------------
# The engine config


@dataclass(frozen=True)
class AttentionOptions:
    # auto: the runnable backend of highest priority for the mode (fastremover/ops/attention/registry.py); a name or
    # an alias: that backend, an error if it cannot run here
    backend: str = _opt("auto", flag="attention", cli_choices=_attention_choices,
                        help="attention backend of modes exact/fast: auto (the highest-priority backend that runs "
                        "here: exact: flashinfer-fa3, else sdpa; fast: flashattn3-fp8 where it is built, else "
                        "cudnn-fp8, else sdpa in fp16, with a note saying why) or one explicitly (an error if it "
                        "cannot run here). flashinfer-fa3 / flashinfer-fa3-fp8: FlashInfer's FA3 Hopper kernels (pip "
                        "install flashinfer-python); cudnn-fp8: cuDNN's FP8 attention (the cudnn extra); "
                        "flashattn3-fp8: FlashAttention-3's FP8 kernel (built from source: tools/build_flash3.sh); "
                        "sparse-sta / sparse-vsa: tile-sparse attention (sliding window / top-k tiles; lossy, never "
                        "picked by auto: check it with verify --attention-keeps first); sparse-sta-cudnn / "
                        "sparse-vsa-cudnn: the same masks over 128-token tiles on cuDNN's FP8 attention (--mode fast "
                        "on Hopper, the cudnn extra; about twice as fast). Old names fa3, fp8-fa3, fp8, "
                        "fp8-flash3 work too")
    # the sparse backends (fastremover/ops/attention/sparse.py): the fraction of key tiles each query tile attends to
    # (None: 0.25), and sparse-sta's window in 4x4x4-token tiles per axis (None: the one keeping `keep` of the tiles);
    # EngineConfig.validate refuses them for the other backends
    keep: float | None = _opt(None, flag="attention_keep", parse=float, metavar="R",
                              help="sparse-*: fraction of key tiles each query tile attends to, in "
                              "(0, 1] (default 0.25)")
    window: tuple[int, int, int] | None = _opt(None, flag="attention_window", metavar="T,H,W",
                                               help="sparse-sta(-cudnn): the window in tiles per axis (4x4x4 tokens; "
                                               "4x4x8 for -cudnn) (default: "
                                               "the one that keeps --attention-keep of the tiles)")

    def __post_init__(self):
        # the window as given ("T,H,W" text from the flag, a list from JSON, a tuple) -> (T, H, W)
        if self.window is not None:
            object.__setattr__(self, "window", parse_window(self.window))


@dataclass(frozen=True)
class LinearOptions:
    weights: str = _opt("dense", choices=WEIGHTS, flag="weights",
                        help="transformer block linears: dense (default) | nvfp4 (4-bit NVFP4 weights, W4A16: ~3.5x "
                        "less weight memory, no speed-up on Hopper; eager mode) | nvfp4-w4a4 (activations 4-bit too; "
                        "crops only, see --force-w4a4)")
    force_w4a4: bool = _opt(False, choices=(False, True), flag="force_w4a4",
                            help="allow --weights nvfp4-w4a4 on full frames (it may collapse)")
    # fast mode: the first FFN GEMM with GELU + quantization in its epilogue (fast/kernels/gemm_fp8.py, sm_90).
    # auto: where it runs, silently; on: asked for (a note where it cannot run); off: the two-pass FFN
    fused_ffn1: str = _opt("auto", choices=SWITCH, env="FASTREMOVER_FUSED_FFN1", env_values={"1": "on", "0": "off"},
                           help="fused FFN1 GEMM + GELU + quantization")


@dataclass(frozen=True)
class TransformerOptions:
    """The fused transformer's (fast/transformer_fast.py) switches besides its linear method and attention backend:
    the defaults are what runs; tools and tests turn them off to compare (each is explained where it is used)."""

    concurrent: bool = _opt(True, choices=(False, True),
                            help="8-bit attention on CUDA: q / k / V preparation on parallel streams")
    tail_overlap: bool = _opt(True, choices=(False, True),
                              help="FlashAttention-3 FP8: the attention's partial last wave as a second call")
    stream_priority: bool = _opt(True, choices=(False, True), help="V's side stream at a higher priority")
    fused_v_stats: bool = _opt(True, choices=(False, True), help="V's statistics pass finalizes itself")
    gemm: str = _opt("auto", choices=("auto", "cublaslt", "torch"),
                     help="fp8-rowwise GEMMs: cuBLASLt where it runs (auto), or one explicitly")


@dataclass(frozen=True)
class FastVAEOptions:
    """The fast VAE's (fast/vae/, `FastWanVAE`) switches: the defaults are what runs; tools and tests set the
    others to compare or to bound memory. Each is explained in FastWanVAE's docstring."""

    encode_frames: int | str | None = _opt("auto", help="frames per step of the encoder's full-resolution level")
    decode_frames: int | str | None = _opt("auto", help="frames per step of the decoder's full-resolution levels")
    pair: bool | str = _opt("auto", choices=("auto", True, False), help="both removal encodes as one batch of 2")
    pair_budget_gib: float = _opt(2.0, help="memory the batch-2 encode may take (pair auto)")
    pad_rgb: bool | None = _opt(None, choices=(None, False, True), help="3-channel convs padded to 8 (None: on CUDA)")
    tap_head: bool = _opt(True, choices=(False, True), help="the decoder's conv_out as per-tap partial sums")
    stripe_mib: float | None = _opt(None, help="1-frame steps above twice this size in row stripes")
    cudnn_benchmark: bool | None = _opt(None, choices=(None, False, True), help="torch.backends.cudnn.benchmark")
    fuse_bias: bool = _opt(True, choices=(False, True), help="conv biases added by the consuming kernel")
    precise_norm: bool = _opt(False, choices=(False, True), help="the norm kernel's precise mode")
    pad_channels: int | None = _opt(None, help="activations padded to multiples of this (None: 64 on CUDA)")
    pad_encoder: bool = _opt(False, choices=(False, True), help="pad the encoder's channels too")
    fp8_precise_acc: bool = _opt(False, choices=(False, True), help="FP8 convs: promote partial sums to fp32")
    fp8_max_channels: int = _opt(128, help="FP8 convs: the widest decoder conv")
    fp8_encoder_max_channels: int | None = _opt(None, help="FP8 convs: the widest encoder conv (None: by scales)")
    fp8_scales: str = _opt("auto", choices=("auto", "static", "dynamic"), help="FP8 convs: activation scales")
    upsample_conv: str = _opt("auto", choices=("auto", "subpixel", "eager"), help="the decoder's upsampling convs")
    conv_plans: bool | str = _opt("auto", choices=("auto", True, False), help="convs on checked cuDNN plans")

    def __post_init__(self):
        for name in ("encode_frames", "decode_frames"):
            v = getattr(self, name)
            if v is not None and v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be 'auto', None or a positive int, got {v!r}")
        v = self.pad_channels
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0 or v % 8):
            raise ValueError(f"pad_channels must be None or an int >= 0 that is a multiple of 8, got {v!r}")
        if self.stripe_mib is not None and not self.stripe_mib > 0:
            raise ValueError(f"stripe_mib must be None or > 0, got {self.stripe_mib!r}")
        for name in ("fp8_max_channels", "fp8_encoder_max_channels"):
            v = getattr(self, name)
            if (v is not None or name == "fp8_max_channels") and (
                    not isinstance(v, int) or isinstance(v, bool) or v < 64):
                raise ValueError(f"{name} must be an int >= 64, got {v!r}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class VAEOptions:
    precision: str = _opt("auto", choices=VAE_PRECISIONS, flag="vae_precision",
                          help="VAE of modes exact/fast on a GPU (the fast channels-last VAE): auto / fp16 = the model "
                          "dtype; fp8 = FP8 3x3x3 conv3d (lossy); the eager mode always runs the eager VAE")
    nvfp4_convs: bool = _opt(True, choices=(False, True),
                             help="with --weights nvfp4*: also the eager VAE's 3x3x3 convs with >= 192 input channels "
                             "in NVFP4 (fast/nvfp4_conv.py)")
    fast: FastVAEOptions = field(default_factory=FastVAEOptions)


@dataclass(frozen=True)
class GraphOptions:
    cuda_graphs: str = _opt("auto", choices=("auto", "off"),
                            help="capture the denoise loop as CUDA graphs (auto: on CUDA devices)")
    max_graphs: int = _opt(4, help="captured graphs kept (least recently used out first)")


@dataclass(frozen=True)
class ParallelOptions:
    """Sequence parallelism over processes (fastremover/parallel): the launcher reads these and starts (or, under
    torchrun, joins) the ranks; the engine's build makes the sequence-parallel denoiser and VAE for them. `transport`:
    how q/k/v travel between ranks ("fp16": as they are, exact; "fp8": e4m3 codes + one fp32 scale per (row, head)).
    `world_size` None: the ranks torchrun started (TorchrunEnv), else one process."""

    mode: str = _opt("none", choices=PARALLEL_MODES, flag="parallel",
                     help="split one clip over several processes: sequence-parallel denoise + parallel VAE "
                     "(docs/parallel.md)")
    world_size: int | None = _opt(None, flag="gpus", parse=int, metavar="N",
                                  help="--parallel ulysses: start this many ranks here (rank r on cuda:r; CPU "
                                  "processes with --device cpu); omit under torchrun")
    transport: str = _opt("fp16", choices=TRANSPORTS, flag="sp_transport",
                          help="how q/k/v travel between ranks: fp16 (exact) or fp8 (e4m3 + one scale per row and "
                          "head)")
    head_groups: int = _opt(1, flag="sp_head_groups", parse=int, metavar="N",
                            help="exchange and attend each rank's heads in this many groups (transfers overlap the "
                            "attention)")
    timeout_s: float = _opt(DEFAULT_PARALLEL_TIMEOUT_S, flag="parallel_timeout", parse=float, metavar="SECONDS",
                            help="seconds one collective may wait before the run fails (default 300)")

    def validate(self) -> None:
        """The checks of the parallel flags (FastRemoverError naming the first bad one)."""
        if self.mode not in PARALLEL_MODES:
            raise FastRemoverError(f"--parallel {self.mode!r}: choose one of {list(PARALLEL_MODES)}")
        if self.transport not in TRANSPORTS:
            raise FastRemoverError(f"--sp-transport {self.transport!r}: choose one of {list(TRANSPORTS)}")
        if self.world_size is not None:
            _positive_int("--gpus", self.world_size, MAX_RANKS)
        _positive_int("--sp-head-groups", self.head_groups)
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise FastRemoverError(f"--parallel-timeout {t!r}: must be a positive number of seconds")
        if self.mode == "none" and (self.world_size not in (None, 1) or self.transport != "fp16"
                                    or self.head_groups != 1):
            raise FastRemoverError("--gpus N / --sp-transport / --sp-head-groups need --parallel ulysses")


def _positive_int(flag: str, value, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high is not None and value > high):
        limit = f"between 1 and {high}" if high is not None else "at least 1"
        raise FastRemoverError(f"{flag} {value!r}: must be a whole number {limit}")


def validate_device(device: str | None) -> str | None:
    """None (pick automatically), "cpu", "cuda" or "cuda:N"; anything else is refused here, before torch is
    imported. Whether a CUDA device exists is checked when the engine resolves the device."""
    if device is None:
        return None
    name = str(device).strip().lower()
    if name in ("cpu", "cuda"):
        return name
    if name.startswith("cuda:") and name[5:].isdigit():
        return name
    raise FastRemoverError(f"--device {device!r}: choose cpu, cuda or cuda:N (e.g. cuda:1)")


@dataclass(frozen=True)
class EngineConfig:
    """How the model runs: device, dtype, engine mode and the nested options. Frozen: derive variants with
    `dataclasses.replace` or `EngineConfig.with_(path=value)`."""

    device: str | None = _opt(None, flag="device",
                              help="cpu | cuda | cuda:N (default: a CUDA GPU if one is visible, else the CPU)")
    precision: str | None = _opt(None, choices=(None, *PRECISIONS), flag="precision",
                                 help="model dtype (default: fp16 on a GPU, fp32 on the CPU)")
    mode: str = _opt("auto", choices=("auto", *MODES), flag="mode",
                     help="engine: eager (reference order), exact (fused kernels + CUDA graph, no quantization), fast "
                     "(exact + FP8 linears + 8-bit attention); auto = exact on a CUDA GPU, eager elsewhere")
    attention: AttentionOptions = field(default_factory=AttentionOptions)
    linears: LinearOptions = field(default_factory=LinearOptions)
    transformer: TransformerOptions = field(default_factory=TransformerOptions)
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
            if choices is not None and (value not in choices or type(value) not in {type(c) for c in choices}):
                shown = [c for c in choices if c is not None]
                raise FastRemoverError(f"{name} {value!r}: choose one of {shown}")
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise FastRemoverError(f"{name} {value!r}: must be a whole number")
        if self.graphs.max_graphs < 1:
            raise FastRemoverError(f"graphs.max_graphs {self.graphs.max_graphs}: must be at least 1")
        self.parallel.validate()
        validate_device(self.device)
        if self.attention.backend != "auto":
            attention_backends.canonical(self.attention.backend)  # FastRemoverError for an unknown name
        if self.attention.keep is not None or self.attention.window is not None:
            check_options(self.attention.backend, self.attention.keep, self.attention.window)
        if self.linears.weights != "dense" and self.mode in ("exact", "fast"):
            raise FastRemoverError(f"--weights {self.linears.weights} runs in --mode eager only (the fused "
                                   "transformer reads dense weights)")

    # -- construction -----------------------------------------------------------------------------------------------

    def with_(self, **changes) -> "EngineConfig":
        """A copy with fields changed by dotted path with `__` for the dot: `config.with_(attention__backend="sdpa")`."""
        config = self
        for key, value in changes.items():
            config = _replace_path(config, key.split("__"), value, check=False)
        config.validate()
        return config

    @classmethod
    def from_args(cls, args, environ: Mapping[str, str] | None = None, **changes) -> "EngineConfig":
        """From an argparse namespace: the engine flags its command has (`add_engine_args` records them; the others
        keep their defaults), then `changes` (`with_` paths: what a command sets itself), then the environment's
        overrides (`from_env`)."""
        config = cls()
        recorded = getattr(args, ENGINE_FLAGS_DEST, None)
        for path, f, _ in _leaves(config):
            dest = f.metadata.get("flag")
            if dest is None or not hasattr(args, dest) or (recorded is not None and ".".join(path) not in recorded):
                continue
            value = getattr(args, dest)
            if value is None and f.default is not None:  # a flag whose default the command left open
                continue
            config = _replace_path(config, path, value, check=False)
        for key, value in changes.items():
            config = _replace_path(config, key.split("__"), value, check=False)
        config.validate()
        return config.with_env(environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EngineConfig":
        return cls().with_env(environ)

    def with_env(self, environ: Mapping[str, str] | None = None) -> "EngineConfig":
        """A copy with every field that names an environment variable set from it where the variable is set and not
        empty (the process's, `env.variables()`, when `environ` is None)."""
        environ = variables() if environ is None else environ
        config = self
        for path, f, _ in _leaves(self):
            var = f.metadata.get("env")
            if var is not None and environ.get(var, "").strip():
                config = _replace_path(config, path, env_value(var, environ[var], f), check=False)
        config.validate()
        return config

    # -- output -----------------------------------------------------------------------------------------------------

    def describe(self) -> dict:
        """Nested plain dict (JSON-ready)."""
        return asdict(self)


# ----------------------------------------------------------------------------------------------------------------------
# The flags, from the fields' metadata

ENGINE_FLAGS_DEST = "engine_flags"  # the argparse default where add_engine_args records the config paths it added
ENGINE_SECTIONS = ("device", "precision", "mode", "attention", "linears", "vae")  # the engine flags of every command


def _add_flag(parser, f, default) -> None:
    meta = f.metadata
    flag = "--" + meta["flag"].replace("_", "-")
    kwargs: dict = {"dest": meta["flag"], "help": meta["help"]}
    if meta["choices"] == (False, True):
        kwargs["action"] = "store_true"
    else:
        kwargs["default"] = default
        choices = meta["cli_choices"]() if meta["cli_choices"] else meta["choices"]
        if choices is not None:
            kwargs["choices"] = [c for c in choices if c is not None]
        if meta["parse"] is not None:
            kwargs["type"] = meta["parse"]
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
    parser.add_argument(flag, **kwargs)


def add_engine_args(parser, sections: tuple[str, ...] = ENGINE_SECTIONS, *, exclude: tuple[str, ...] = (),
                    help: Mapping[str, str] | None = None) -> list[str]:
    """Add the flags of the EngineConfig fields under `sections` (top-level field names) to an argparse parser, as
    their metadata defines them, except the config paths in `exclude`; `help` replaces a flag's help by config path.
    Records the paths on the parser (EngineConfig.from_args reads exactly those) and returns them."""
    added = []
    for path, f, default in _leaves(EngineConfig()):
        key = ".".join(path)
        if f.metadata.get("flag") is None or path[0] not in sections or key in exclude:
            continue
        if help and key in help:
            f = _with_help(f, help[key])
        _add_flag(parser, f, default)
        added.append(key)
    recorded = list(parser.get_default(ENGINE_FLAGS_DEST) or [])
    parser.set_defaults(**{ENGINE_FLAGS_DEST: tuple(recorded + added)})
    return added


def add_model_args(parser, *, default: str | None = "classic", required: bool = False,
                   help: str | None = None) -> None:
    """--model / --preset / --weights-seed (ModelSource's fields). default None: the command notes that it falls
    back to classic when --model is omitted."""
    for f in fields(ModelSource):
        if f.name == "name":
            kwargs = {"dest": "model", "default": default, "required": required, "metavar": "MODEL",
                      "help": help or f.metadata["help"]}
            parser.add_argument("--model", **kwargs)
        else:
            _add_flag(parser, f, f.default)


def _with_help(f, text: str):
    class _F:  # a field view with another help text
        metadata = {**f.metadata, "help": text}
        name, type, default = f.name, f.type, f.default

    return _F


# ----------------------------------------------------------------------------------------------------------------------
# Kernel switches and the record of what runs


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
    linear_method: str = "dense"  # the transformer's block linears (ops/linear/registry.py registry entry)
    attention: str = "sdpa"
    ffn1: str = "none"  # fast mode: the FFN's first GEMM + GELU quantization path (fast/transformer_fast.py)
    fp8_gemm: str = "none"  # fast mode: cuBLASLt with workspace-free algorithms (ops/linear/cublaslt.py) or torch._scaled_mm
    concurrent_branches: bool = False  # fp8 attention on CUDA: q / k / V preparation on parallel streams
    vae: str = "eager"  # the VAE path that runs: "eager" (models.vae.WanVAE) or "fast-fp16" / "fast-bf16" / "fast-fp8"
    vae_precision: str = "auto"  # as requested: auto | fp16 (the model dtype) | fp8 (FP8 conv3d in the fast VAE)
    cuda_graphs: bool = False
    weights: str = "dense"  # the transformer block linears: dense | nvfp4 | nvfp4-w4a4 (ops/linear/nvfp4.py)
    nvfp4: dict | None = None  # with NVFP4 weights: resident bytes before / after packing (Nvfp4Report.describe)
    nvfp4_vae: dict | None = None  # with NVFP4 weights: the eager VAE's packed 3x3x3 convs (Nvfp4ConvReport.describe)
    parallel: str = "none"  # "ulysses" when this process is one rank of a sequence-parallel run
    world_size: int = 1  # the ranks one request is split over
    sp_transport: str = "fp16"  # how q/k/v travel between the ranks (ParallelOptions.transport)
    head_groups: int = 1  # the exchange's head groups (ParallelOptions.head_groups)
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
        try:
            value = _replace_path(getattr(obj, head), rest, value, check=False)
        except ValueError as e:  # a sub-option's own check (FastVAEOptions)
            raise FastRemoverError(f"engine config: {'.'.join(path)}: {e}") from None
    if not check and isinstance(obj, EngineConfig):
        return _unchecked_replace(obj, head, value)
    return replace(obj, **{head: value})


def _unchecked_replace(config: EngineConfig, name: str, value) -> EngineConfig:
    """replace() without __post_init__'s check (fields are set one at a time; the caller checks the whole)."""
    new = object.__new__(EngineConfig)
    for f in fields(config):
        object.__setattr__(new, f.name, value if f.name == name else getattr(config, f.name))
    return new


def option_table() -> list[dict]:
    """Every option: path, default, choices, flag, variable, help (for docs and tests)."""
    rows = []
    for cls, root in ((EngineConfig, ""), (KernelTuning, "tuning.")):
        for path, f, value in _leaves(cls()):
            rows.append({"option": root + ".".join(path), "default": value, "choices": f.metadata.get("choices"),
                         "flag": f.metadata.get("flag"), "env": f.metadata.get("env"),
                         "help": f.metadata.get("help", "")})
    return rows
