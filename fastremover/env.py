"""Every environment variable the package reads, read here only (tests/unit/test_config.py checks it).

    variables()             the process's environment (os.environ): what EngineConfig.with_env reads the engine's
                            FASTREMOVER_* overrides from (fastremover/config.py names them in its fields' metadata)
    KernelTuning            process-wide kernel switches, environment only (autotuning on / off, the persistent
                            cache's folder): `kernel_tuning()` is what the kernels read at each call
    cache_dir               the persistent cache's folder (fastremover/cache.py)
    TorchrunEnv             the rank torchrun describes (`torchrun_env`: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_*)
    serve_api_key           FASTREMOVER_API_KEY
    visible_cuda_devices, triton_interpret, cuda_home, tool_cache_dirs (the libraries' own cache folders)
    child_environment, environment_set   a child process's environment; variables set for a block

This module is a foundation: it imports nothing of the package but errors.py, so the kernels, the cache and the
optional-library adapters below the engine config read their switches here without importing the config.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator, Mapping

from fastremover.errors import FastRemoverError

_ON_OFF = {"1": True, "0": False}


def variables() -> Mapping[str, str]:
    """The process's environment as it is now."""
    return os.environ


def _switch(default, env: str, env_values: Mapping[str, Any] | None = None):
    """A KernelTuning field: its default and the variable that sets it (with the spelling of its values)."""
    return field(default=default, metadata={"env": env, "env_values": env_values, "choices": None, "flag": None,
                                            "help": ""})


def env_value(var: str, text: str, f):
    """A variable's text as the value of field `f` (its metadata's `env_values` maps the spellings; None: the text
    itself); FastRemoverError naming the variable for a spelling not in the map."""
    text = text.strip()
    values = f.metadata.get("env_values")
    if values is None:
        return text
    if text not in values:
        raise FastRemoverError(f"{var}={text!r}: use one of {list(values)}")
    return values[text]


# ----------------------------------------------------------------------------------------------------------------------
# Kernel switches


@dataclass(frozen=True)
class KernelTuning:
    """Process-wide kernel switches, read from the environment by the kernels at call time (autotuning caches are
    process-wide too): for A/B runs and for suspected kernel problems, never needed to run."""

    # the FP8 conv3d kernel's timing-based config choice (off: the first candidate config)
    conv3d_fp8_tune: bool = _switch(True, "FASTREMOVER_CONV3D_FP8_TUNE", _ON_OFF)
    # the sub-pixel upsampling conv's timing-based config choice (off: the first candidate)
    upconv_tune: bool = _switch(True, "FASTREMOVER_UPCONV_TUNE", _ON_OFF)
    # the fast VAE's convs on cuDNN plans that give torch's bits faster (fast/cudnn_conv.py; off: torch's convs)
    cudnn_conv_plans: bool = _switch(True, "FASTREMOVER_CUDNN_CONV_PLANS", _ON_OFF)
    # the block-sparse attention kernel's config by name, e.g. m64n64w4s3t1ws0vt1 (BlockSparseConfig in
    # fast/kernels/block_sparse_attention.py; unset: the default for the tile size)
    sparse_attn_config: str | None = _switch(None, "FASTREMOVER_SPARSE_ATTN_CONFIG")
    # compile a window's Triton kernels concurrently before its VAE encode (fastremover/fast/precompile.py; off:
    # each kernel compiles at its first launch)
    # "background" (the default): it returns once they are submitted, and a launch waits only for its own kernel (the
    # window's work overlaps the compiles); "wait" (or 1): it returns when its compiles are done; "off" (or 0): none;
    # "record-background": as background, and a process's later shapes are also recorded in a background thread
    # (no faster where measured: off by default, docs/performance.md sessions 27-28)
    precompile: str = _switch("background", "FASTREMOVER_PRECOMPILE", {"1": "wait", "wait": "wait", "background": "background",
                                                                 "record-background": "record-background",
                                                                 "0": "off", "off": "off"})
    # a shape's first call replays its later denoise steps from a CUDA graph of one transformer step where the host's
    # launches bound the step (engine/denoise.step_graph_pays; off: eagerly until a whole-loop recording pays)
    step_graphs: bool = _switch(True, "FASTREMOVER_STEP_GRAPHS", _ON_OFF)
    # the persistent cache of warm-up results (fastremover/cache.py: Triton's kernels, cuDNN plan choices, autotune
    # results, FlashInfer's modules): a folder; "" = the platform's user cache folder (`cache_dir`); "off" = none
    cache_dir: str = _switch("", "FASTREMOVER_CACHE_DIR")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelTuning":
        environ = variables() if environ is None else environ
        values = {}
        for f in fields(cls):
            var = f.metadata["env"]
            text = environ.get(var, "").strip()
            if text:
                values[f.name] = env_value(var, text, f)
        return cls(**values)

    def describe(self) -> dict:
        return asdict(self)


def cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The persistent cache folder (fastremover/cache.py): FASTREMOVER_CACHE_DIR, else the platform's user cache
    folder (Linux: $XDG_CACHE_HOME/fastremover or ~/.cache/fastremover; macOS: ~/Library/Caches/fastremover; Windows:
    %LOCALAPPDATA%\\fastremover\\Cache); None when the variable is "off" (or "none", "0")."""
    environ = variables() if environ is None else environ
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


# ----------------------------------------------------------------------------------------------------------------------
# The process environment beyond the engine options


@dataclass(frozen=True)
class TorchrunEnv:
    """The rank torchrun (torch.distributed.elastic) describes in the environment."""

    world_size: int
    rank: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # TORCHELASTIC_USE_AGENT_STORE: the agent serves the rendezvous store


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's rank under torchrun, or None when WORLD_SIZE is absent or 1 (one process)."""
    environ = variables() if environ is None else environ
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank = int(environ["RANK"])
        return TorchrunEnv(world_size=world, rank=rank, local_rank=int(environ.get("LOCAL_RANK", rank)),
                           master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=int(environ["MASTER_PORT"]),
                           agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
    except (KeyError, ValueError) as e:
        raise FastRemoverError(f"the torchrun environment is incomplete or malformed ({e}): start the ranks with "
                               "torchrun, or unset WORLD_SIZE") from None


API_KEY_ENV = "FASTREMOVER_API_KEY"


def serve_api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The service's API key from FASTREMOVER_API_KEY (None when unset or empty)."""
    environ = variables() if environ is None else environ
    return environ.get(API_KEY_ENV) or None


def visible_cuda_devices(environ: Mapping[str, str] | None = None) -> str | None:
    """CUDA_VISIBLE_DEVICES as set (None when unset)."""
    environ = variables() if environ is None else environ
    return environ.get("CUDA_VISIBLE_DEVICES")


def triton_interpret(environ: Mapping[str, str] | None = None) -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its CPU interpreter (tests)."""
    environ = variables() if environ is None else environ
    return environ.get("TRITON_INTERPRET") == "1"


def cuda_home(environ: Mapping[str, str] | None = None) -> str | None:
    """The CUDA toolkit's folder (CUDA_HOME, else CUDA_PATH) for JIT builds; None when neither is set."""
    environ = variables() if environ is None else environ
    return environ.get("CUDA_HOME") or environ.get("CUDA_PATH") or None


#: The libraries' own cache folders, which the persistent cache fills unless they are set (fastremover/cache.py)
TOOL_CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "FLASHINFER_WORKSPACE_BASE": "flashinfer"}


def tool_cache_dirs(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{variable: folder} of TOOL_CACHE_VARS that are set and not empty."""
    environ = variables() if environ is None else environ
    return {var: environ[var] for var in TOOL_CACHE_VARS if environ.get(var)}


def child_environment(changes: Mapping[str, str] | None = None, *, pythonpath_first: str | None = None,
                      environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: this one's with `changes` set, and `pythonpath_first` put in front of
    PYTHONPATH (so the child imports this checkout)."""
    environ = variables() if environ is None else environ
    env = {**environ, **(changes or {})}
    if pythonpath_first:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath_first, environ.get("PYTHONPATH", "")) if p)
    return env


@contextmanager
def environment_set(changes: Mapping[str, str]) -> Iterator[None]:
    """`changes` set in this process's environment for the block; the earlier values (or their absence) after it."""
    before = {var: os.environ.get(var) for var in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
