"""`fastremover info`: versions, device, the engine configuration the environment gives, and what each engine mode
resolves to here (fastremover.engine.build.resolve: what the pipeline runs)."""

from __future__ import annotations

import importlib
import platform

import torch

import fastremover

# The sub-options tools and tests set (config.TransformerOptions, config.FastVAEOptions): listed once as a group
LAB_GROUPS = ("transformer.", "vae.fast.")


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:  # any import failure means "not usable here"
        return None


def collect_info() -> dict:
    info: dict = {
        "fastremover": fastremover.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "av (PyAV)": _version("av"),
        "opencv": _version("cv2"),
        "safetensors": _version("safetensors"),
        "triton": _version("triton"),
        "diffusers (reference only)": _version("diffusers"),
        "huggingface_hub (the hub extra)": _version("huggingface_hub"),
    }
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)")
    info["devices"] = gpus or ["cpu only (no CUDA GPU visible)"]
    info["engine config (defaults + environment)"] = _engine_config()
    from fastremover.engine.build import resolve_device

    device = resolve_device(None)
    info["modes"] = _modes(device)
    from fastremover.ops.linear.nvfp4 import format_memory_estimate, nvfp4_memory_estimate
    from fastremover.models.transformer import RemoverTransformerConfig

    info["transformer weights (released config), --weights"] = format_memory_estimate(
        nvfp4_memory_estimate(RemoverTransformerConfig())).splitlines()
    from fastremover.fast.nvfp4_conv import format_vae_memory_estimate, vae_conv_memory_estimate
    from fastremover.models.vae import WanVAEConfig

    info["vae weights (released config), --weights nvfp4"] = [format_vae_memory_estimate(
        vae_conv_memory_estimate(WanVAEConfig()))]
    info["vae"] = _vae_paths(device)
    from fastremover.models.hub import cache_lines

    info["Hugging Face cache (--model ORG/NAME)"] = cache_lines()
    return info


def _vae_paths(device: torch.device) -> dict[str, str]:
    """Which VAE each --vae-precision runs here (fastremover.fast.vae.build_vae is what the pipeline uses)."""
    from fastremover.fast.vae import fp8_conv_available

    fast = device.type == "cuda"
    sm90 = fast and torch.cuda.get_device_capability(device) >= (9, 0)  # TMA: sub-pixel upsampling, static FP8 scales
    base = ("fast channels-last VAE (fused norm+SiLU, copy-free causal cache, batch-2 encode when it fits"
            + (", sub-pixel upsampling convs)" if sm90 else ")"))
    fp8_ok = fast and fp8_conv_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    fp8_how = (" + FP8 conv3d (TMA kernel, static activation scales) for the encoder's residual-block convs and the "
               "decoder's 96-channel level" if sm90 else
               " + FP8 conv3d (per-call activation scales) for the 96-channel convs")
    return {
        "eager mode": "eager VAE (models.vae.WanVAE)",
        "exact/fast, --vae-precision auto|fp16": (base + ", model dtype") if fast else "eager VAE (no CUDA GPU)",
        "exact/fast, --vae-precision fp8": (base + fp8_how) if fp8_ok else
        "not available here (" + ("no CUDA GPU" if not fast else "needs fastremover.fast.kernels.conv3d_fp8 and an "
                                  "sm_89+ GPU") + ")",
    }


def _engine_config() -> dict[str, str]:
    """Every engine option and kernel switch with the value it has here (the defaults, then the environment's
    overrides: `EngineConfig.from_env`), and where a flag or a variable sets it."""
    from fastremover.config import EngineConfig, option_table
    from fastremover.env import kernel_tuning

    config, tuning = EngineConfig.from_env().describe(), kernel_tuning().describe()
    out = {}
    for row in option_table():
        if row["option"].startswith(LAB_GROUPS):
            continue
        path = row["option"].split(".")
        value = tuning[path[1]] if path[0] == "tuning" else _get(config, path)
        if row["option"] == "tuning.cache_dir":  # the folder it resolves to (fastremover/cache.py)
            from fastremover.env import cache_dir

            value = cache_dir() or "off"
        where = ", ".join(x for x in (row["flag"] and "--" + row["flag"].replace("_", "-"), row["env"]) if x)
        out[row["option"]] = f"{value}" + (f"  ({where})" if where else "")
    for group in LAB_GROUPS:
        out[group + "*"] = "the defaults (switches tools and tests set; fastremover/config.py)"
    return out


def _get(tree: dict, path: list[str]):
    for key in path:
        tree = tree[key]
    return tree


def _modes(device: torch.device) -> dict[str, str]:
    """What each engine mode resolves to on this device, with the environment's overrides (engine.resolve: what the
    pipeline runs)."""
    from fastremover.config import EngineConfig
    from fastremover.engine.build import MODES, resolve
    from fastremover.ops import attention

    out = {}
    base = EngineConfig.from_env()
    for mode in MODES:
        plan = resolve(base.with_(mode=mode), device)
        notes = plan.notes
        if plan.mode == "eager":
            desc = "eager module (reference order), torch SDPA"
        else:
            desc = (f"fused Triton kernels, {'CUDA-graph' if plan.cuda_graphs else 'eager'} denoise loop, attention "
                    f"{plan.attention} (--attention choices here: {'/'.join(attention.available(device))})")
            if plan.mode == "fast":
                desc += ", FP8 e4m3 linears" + ("" if plan.fused_ffn1 else ", two-pass FFN1")
        out[mode] = desc + (f"  [{notes[0]}]" if notes else "")
    return out


def format_info(info: dict) -> str:
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            lines.append(f"{key}:")
            lines.extend(f"  {v}" for v in value)
        else:
            lines.append(f"{key}: {value if value is not None else 'not installed'}")
    return "\n".join(lines)
