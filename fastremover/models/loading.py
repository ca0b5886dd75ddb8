"""Checkpoints and presets: `config.json` + safetensors (diffusers layout) -> our modules, with strict key checks.

A MiniMax-Remover checkpoint directory holds three folders:
    transformer/ config.json, diffusion_pytorch_model.safetensors (or *-0000N-of-0000M.safetensors + *.index.json)
    vae/         the same for the Wan VAE (diffusers `AutoencoderKLWan`)
    scheduler/   scheduler_config.json

Where the weights go: without a device (and on the CPU) the modules are built in fp32 on the host, as the pipeline
expects them there. With a CUDA device and the model dtype (`load_models(..., device=, dtype=)`, as the pipeline's
`from_model` asks), nothing builds an fp32 copy of the model on the host: the modules are built on the meta device
in their inference dtypes, and each tensor is read from its safetensors file and copied into place on its own (the
transformer straight onto the device, its fp32 islands in fp32; the small VAE on the host in the model dtype, which
the fast VAE copies to the device once). The bits are those of the fp32 path followed by the pipeline's cast (one
round-to-nearest-even conversion either way). Random weights are then drawn on the device (deterministic per
(seed, tensor name), but with the device's random generator: other values than on the CPU).

`load_models` takes any --model string: fastremover.models.hub.resolve_model (the one place a model string becomes a
checkpoint folder) turns a Hugging Face Hub id into a folder of the local cache, downloading it when allowed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from fastremover.errors import FastRemoverError
from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
from fastremover.models.vae import WanVAE, WanVAEConfig

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

# Presets: model configs without weights. `minimax-remover` is the released model's shape (Wan-1.3B-sized DiT with
# 48 input channels + the default Wan 2.1 VAE); `tiny` is for tests and CPU demos (same structure, small widths).
PRESETS: dict[str, dict[str, dict]] = {
    "minimax-remover": {
        "transformer": RemoverTransformerConfig().to_dict(),
        "vae": WanVAEConfig().to_dict(),
    },
    "tiny": {
        "transformer": RemoverTransformerConfig(
            num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=1, freq_dim=32
        ).to_dict(),
        "vae": WanVAEConfig(base_dim=8, num_res_blocks=1).to_dict(),
    },
}


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FastRemoverError(f"{what}: {path} is missing; a checkpoint folder needs transformer/, vae/ and scheduler/") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FastRemoverError(f"{what}: cannot read {path} ({e}); re-download or fix the file") from None
    if not isinstance(data, dict):
        raise FastRemoverError(f"{what}: {path} must hold a JSON object")
    return data


def read_safetensors_dir(folder: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a diffusers model folder: one safetensors file, or shards listed by an index json."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(Path(folder), what):
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise FastRemoverError(f"{what}: cannot read {path} ({e}); the file is corrupt or not safetensors") from None
    return tensors


def _check_names_and_shapes(own: dict, shapes: dict[str, tuple], what: str) -> None:
    """One clear error listing every missing, unexpected or mis-shaped tensor of a checkpoint (`shapes`) against the
    module's state (`own`)."""
    missing = sorted(set(own) - set(shapes))
    unexpected = sorted(set(shapes) - set(own))
    misshaped = sorted(
        f"{k} {tuple(shapes[k])} (expected {tuple(own[k].shape)})"
        for k in set(own) & set(shapes)
        if tuple(own[k].shape) != tuple(shapes[k])
    )
    if missing or unexpected or misshaped:

        def show(names: list[str]) -> str:
            return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")

        parts = []
        if missing:
            parts.append(f"missing: {show(missing)}")
        if unexpected:
            parts.append(f"unexpected: {show(unexpected)}")
        if misshaped:
            parts.append(f"wrong shape: {show(misshaped)}")
        raise FastRemoverError(f"{what} weights do not match its config.json — " + "; ".join(parts))


def load_state_dict_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy `state` into `module`; any missing, unexpected or mis-shaped tensor is one clear error listing them."""
    own = module.state_dict()
    _check_names_and_shapes(own, {k: tuple(v.shape) for k, v in state.items()}, what)
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state[k].to(t.dtype))


def _safetensors_files(folder: Path, what: str) -> list[Path]:
    """The weight files of a diffusers model folder (one file, or the shards its index lists)."""
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = _read_json(index, what).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FastRemoverError(f"{what}: {index} has no weight_map")
        names = sorted(set(weight_map.values()))
    elif (folder / WEIGHTS_NAME).exists():
        names = [WEIGHTS_NAME]
    else:
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(found) != 1:
            raise FastRemoverError(
                f"{what}: no weights in {folder} (expected {WEIGHTS_NAME} or {INDEX_NAME}"
                + (f"; found several: {found}" if found else "")
                + ")"
            )
        names = found
    files = [folder / name for name in names]
    for path in files:
        if not path.exists():
            raise FastRemoverError(f"{what}: shard {path} listed in the index is missing")
    return files


def load_safetensors_into(module: nn.Module, folder: Path, what: str) -> None:
    """Fill `module` (its parameters already allocated where and in the dtypes they are to live, e.g. by
    `to_empty`) from a diffusers model folder tensor by tensor: names and shapes are checked first (one clear error),
    then each tensor is read from its file on the host in its stored dtype ("weights_read") and copied into its
    parameter, converted there ("host_to_device"); at most one tensor is held on the host at a time."""
    from safetensors import SafetensorError, safe_open

    from fastremover.timing import phase

    files = _safetensors_files(Path(folder), what)
    own = module.state_dict()
    try:
        handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
    except (SafetensorError, OSError, ValueError) as e:
        raise FastRemoverError(f"{what}: cannot read {folder} ({e}); the file is corrupt or not safetensors") from None
    shapes, source = {}, {}
    for f in handles:
        for name in f.keys():
            shapes[name] = tuple(f.get_slice(name).get_shape())
            source[name] = f
    _check_names_and_shapes(own, shapes, what)
    with torch.no_grad():
        for name, target in own.items():
            try:
                with phase("weights_read"):
                    t = source[name].get_tensor(name)
            except (SafetensorError, OSError, ValueError) as e:
                raise FastRemoverError(f"{what}: cannot read {name} from {folder} ({e}); the file is corrupt") from None
            with phase("host_to_device"):
                target.copy_(t, non_blocking=False)
            del t


def _on_device(cls, cfg, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """An uninitialised module of `cls(cfg)` with its parameters allocated on `device` in their inference dtypes
    (the transformer's fp32 islands in fp32, everything else in `dtype`), built without touching host memory."""
    with torch.device("meta"):
        module = cls(cfg)
    if hasattr(module, "to_inference_dtype"):
        module.to_inference_dtype(dtype)
    else:
        module.to(dtype)
    # module.to_empty(device=device) without its torch.empty_like of meta tensors: a Python decomposition whose first
    # use imports sympy (seconds in a fresh GPU process); the meta parameters are contiguous, so this is the same
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def random_init_(module: nn.Module, seed: int) -> nn.Module:
    """Deterministic random weights: each tensor is drawn from its own generator seeded by (seed, name), so the values
    do not depend on module construction order or on which other tensors exist. The generator is on the device the
    tensor lives on (fp32 draws, converted to the tensor's dtype there): on the CPU the values every test and
    benchmark knows; on a GPU other values (the device's generator), equally deterministic.

    Scales keep activations O(1) through many layers (weights ~ N(0, 1/fan_in), residual output projections smaller),
    which makes random-weight runs at the real config useful for timing and fidelity measurements.
    """
    with torch.no_grad():
        for name, t in module.state_dict().items():
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            dev = t.device
            g = torch.Generator(dev).manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            leaf = name.rsplit(".", 1)[-1]
            if "scale_shift_table" in name:
                value = torch.randn(t.shape, generator=g, device=dev) / math.sqrt(t.shape[-1])
            elif t.ndim >= 2:  # linear / conv weights
                fan_in = math.prod(t.shape[1:])
                std = 1.0 / math.sqrt(fan_in)
                if name.endswith(("to_out.0.weight", "ffn.net.2.weight")):
                    std *= 0.5
                value = torch.randn(t.shape, generator=g, device=dev) * std
            elif leaf == "bias":
                value = torch.randn(t.shape, generator=g, device=dev) * 0.02
            elif leaf in ("weight", "gamma"):  # norm scales: near 1
                value = 1.0 + 0.1 * torch.randn(t.shape, generator=g, device=dev)
            else:
                value = torch.randn(t.shape, generator=g, device=dev) * 0.02
            t.copy_(value.reshape(t.shape).to(t.dtype))
    return module


@dataclass
class RemoverModels:
    transformer: RemoverTransformer
    vae: WanVAE
    scheduler_config: dict
    source: str  # "random:<preset>:<seed>", the checkpoint path, or for a Hub model "ORG/NAME@<commit>"
    repo_id: str | None = None  # a Hub model's id
    revision: str | None = None  # a Hub model's commit (the snapshot that was loaded)


def _check_checkpoint_dir(root: Path) -> None:
    if not root.exists():
        raise FastRemoverError(f"checkpoint {root} does not exist; pass a folder with transformer/, vae/, scheduler/")
    if not root.is_dir():
        raise FastRemoverError(f"checkpoint {root} is not a folder; pass a folder with transformer/, vae/, scheduler/")
    missing = [p for p in ("transformer", "vae") if not (root / p).is_dir()]
    if missing:
        raise FastRemoverError(
            f"checkpoint {root} is missing {', '.join(p + '/' for p in missing)}; a MiniMax-Remover checkpoint has "
            "transformer/, vae/ and scheduler/ (download all three)"
        )


def _direct(device, dtype) -> bool:
    """Whether models are built straight at their place (a CUDA device and a dtype given), see the module doc."""
    return device is not None and dtype is not None and torch.device(device).type == "cuda"


def load_checkpoint(path: str | os.PathLike, *, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None) -> RemoverModels:
    """Load a local MiniMax-Remover checkpoint folder: in fp32 on the CPU (the pipeline casts and moves it), or, with
    a CUDA `device` and the model `dtype`, straight to their place (the module docstring)."""
    from fastremover.schedulers import load_scheduler_config

    root = Path(path).expanduser()
    _check_checkpoint_dir(root)
    t_cfg = RemoverTransformerConfig.from_dict(_read_json(root / "transformer" / "config.json", "transformer"))
    v_cfg = WanVAEConfig.from_dict(_read_json(root / "vae" / "config.json", "vae"))
    if _direct(device, dtype):
        transformer = _on_device(RemoverTransformer, t_cfg, torch.device(device), dtype)
        vae = _on_device(WanVAE, v_cfg, torch.device("cpu"), dtype)
        load_safetensors_into(transformer, root / "transformer", "transformer")
        load_safetensors_into(vae, root / "vae", "vae")
    else:
        from fastremover.timing import phase

        with phase("weights_read"):
            transformer = RemoverTransformer(t_cfg)
            vae = WanVAE(v_cfg)
            load_state_dict_strict(transformer, read_safetensors_dir(root / "transformer", "transformer"),
                                   "transformer")
            load_state_dict_strict(vae, read_safetensors_dir(root / "vae", "vae"), "vae")
    sched_dir = root / "scheduler"
    scheduler_config = load_scheduler_config(sched_dir)
    return RemoverModels(transformer.eval(), vae.eval(), scheduler_config, str(root))


def random_models(preset: str = "tiny", seed: int = 0, *, device: str | torch.device | None = None,
                  dtype: torch.dtype | None = None) -> RemoverModels:
    """Models at a preset's config with deterministic random weights: fp32 on the CPU, or, with a CUDA `device` and
    the model `dtype`, drawn on the device (other values than the CPU's; the VAE then moves to the host in `dtype`,
    as a loaded checkpoint's does)."""
    from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG

    if preset not in PRESETS:
        raise FastRemoverError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    t_cfg = RemoverTransformerConfig.from_dict(cfg["transformer"])
    v_cfg = WanVAEConfig.from_dict(cfg["vae"])
    if _direct(device, dtype):
        transformer = random_init_(_on_device(RemoverTransformer, t_cfg, torch.device(device), dtype), seed)
        vae = random_init_(_on_device(WanVAE, v_cfg, torch.device(device), dtype), seed + 1).to("cpu")
    else:
        transformer = random_init_(RemoverTransformer(t_cfg), seed)
        vae = random_init_(WanVAE(v_cfg), seed + 1)
    return RemoverModels(transformer.eval(), vae.eval(), dict(DEFAULT_SCHEDULER_CONFIG), f"random:{preset}:{seed}")


def save_checkpoint(models: RemoverModels, path: str | os.PathLike) -> Path:
    """Write models as a diffusers-layout checkpoint folder (used by tests, and to pin random weights to disk)."""
    from safetensors.torch import save_file

    root = Path(path)
    for sub, module in (("transformer", models.transformer), ("vae", models.vae)):
        (root / sub).mkdir(parents=True, exist_ok=True)
        with open(root / sub / "config.json", "w") as f:
            json.dump(module.config.to_dict(), f, indent=2)
        state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
        save_file(state, str(root / sub / WEIGHTS_NAME))
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    with open(root / "scheduler" / "scheduler_config.json", "w") as f:
        json.dump(models.scheduler_config, f, indent=2)
    return root


def load_models(model: str, preset: str = "minimax-remover", seed: int = 0, *,
                device: str | torch.device | None = None, dtype: torch.dtype | None = None, download: bool = True,
                progress: bool = True) -> RemoverModels:
    """`model` is "random" (preset config, random weights), a checkpoint folder path or a Hugging Face Hub id
    ORG/NAME[@REVISION] (fastremover.models.hub.resolve_model: the local cache first, else downloaded when `download`
    and not HF_HUB_OFFLINE). device / dtype: where the pipeline will run the models (a CUDA device and the model
    dtype: built there directly, see the module doc)."""
    from fastremover.models.hub import resolve_model

    resolved = resolve_model(model, download=download, progress=progress)
    if resolved.kind == "random":
        from fastremover.timing import phase

        with phase("weights_init"):  # the random draws
            return random_models(preset, seed, device=device, dtype=dtype)
    if resolved.kind == "classic":
        raise FastRemoverError("--model classic has no weights to load (RemovalPipeline.from_model runs it)")
    models = load_checkpoint(resolved.path, device=device, dtype=dtype)
    if resolved.kind == "hub":
        models.source, models.repo_id, models.revision = resolved.source, resolved.repo_id, resolved.revision
    return models
