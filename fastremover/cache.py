"""The persistent cache: what a process measured or compiled to warm up, kept for the next process on this machine.

    <FASTREMOVER_CACHE_DIR>            (fastremover.config.cache_dir: default ~/.cache/fastremover; "off": no cache)
      triton/                          Triton's compiled kernels (TRITON_CACHE_DIR, unless it is set)
      flashinfer/                      FlashInfer's JIT modules (FLASHINFER_WORKSPACE_BASE, unless it is set)
      entries/<namespace>/<hash>.json  choices this package makes by measuring: the cuDNN conv plan of a signature
                                       (fast/cudnn_conv.py), the config a Triton kernel's autotuning picked
                                       (fast/kernels/_common.autotune)

An entry is a JSON object {"format", "namespace", "env", "key", "value"}. `env` (`environment(device)`) names what the
value was measured on: the GPU's name and compute capability, the driver, the CUDA runtime, cuDNN and its frontend,
Triton, torch and fastremover versions; `key` names what it is for (a signature). The file name is a hash of
namespace, env and key, so a change of any of them is a miss and a new entry, never a stale hit. Values are plain
JSON; the caller checks that a value still fits before it uses it (a config still among the candidates, a plan still
giving torch's bits), so a cache hit can only save time, never change an output.

Contract (nothing here ever raises to the caller):
- writes are atomic: a temporary file beside the entry (named by fastremover.outputs.temp_name, so one a killed
  process left is recognised and removed), then os.replace. Readers see the old entry or the new one, never a torn
  one; two processes writing the same entry at once both succeed (the last rename wins; both values are valid).
- an entry that does not parse, or whose stored namespace / env / key differ from the ones asked for, is ignored with
  a note (logged once per entry) and replaced by the next `put`.
- a folder that cannot be created or written (read-only, a full disk, a file in the way) turns the cache off for the
  rest of the process with one note; every later `get` misses and every `put` does nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

from fastremover.log import logger

FORMAT = 1  # the entry layout; a change makes every old entry a miss
ENTRIES = "entries"


def _jsonable(value):
    """Keys and values as plain JSON: tuples -> lists, dtypes / devices / anything else -> their str()."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class PersistentCache:
    """JSON entries under `root` (None: a cache that is off). `note(message)` receives the notes (default: the
    package logger's warning, each distinct message once)."""

    def __init__(self, root: str | os.PathLike | None, note: Callable[[str], None] | None = None):
        self.root = Path(root) if root is not None else None
        self.enabled = self.root is not None
        self._note = note
        self._noted: set[str] = set()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.writes = 0
        self.namespaces: dict[str, list[int]] = {}  # namespace -> [hits, misses, writes]

    def _count(self, namespace: str, which: int) -> None:
        with self._lock:
            self.namespaces.setdefault(namespace, [0, 0, 0])[which] += 1

    # -- notes ------------------------------------------------------------------------------------------------------

    def note(self, message: str) -> None:
        with self._lock:
            if message in self._noted:
                return
            self._noted.add(message)
        (self._note if self._note is not None else logger.warning)(message)

    def _disable(self, what: str, exc: OSError) -> None:
        self.enabled = False
        self.note(f"the cache folder {self.root} cannot be {what} ({exc.strerror or exc}): running without a "
                  "persistent cache (set FASTREMOVER_CACHE_DIR to a writable folder, or to off)")

    # -- entries ----------------------------------------------------------------------------------------------------

    def path(self, namespace: str, key, env: dict) -> Path | None:
        """The file of an entry (None when the cache is off)."""
        if self.root is None:
            return None
        blob = json.dumps([FORMAT, namespace, _jsonable(env), _jsonable(key)], sort_keys=True)
        return self.root / ENTRIES / namespace / (hashlib.sha256(blob.encode()).hexdigest()[:32] + ".json")

    def get(self, namespace: str, key, env: dict) -> Any | None:
        """The stored value, or None (a miss: no entry, a corrupt one (noted), or the cache is off)."""
        if not self.enabled:
            return None
        path = self.path(namespace, key, env)
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError):  # no entry (or no folder: the write says why)
            self.misses += 1
            self._count(namespace, 1)
            return None
        except OSError as exc:  # unreadable: a miss (the write that follows says whether the folder works)
            self.note(f"cache entry {path} cannot be read ({exc.strerror or exc}): ignored")
            self.misses += 1
            self._count(namespace, 1)
            return None
        try:
            entry = json.loads(text)
            ok = (isinstance(entry, dict) and entry.get("format") == FORMAT and entry.get("namespace") == namespace
                  and entry.get("env") == _jsonable(env) and entry.get("key") == _jsonable(key) and "value" in entry)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            self.note(f"cache entry {path} is corrupt or does not match its name: ignored (it is rewritten)")
            self.misses += 1
            self._count(namespace, 1)
            return None
        self.hits += 1
        self._count(namespace, 0)
        return entry["value"]

    def put(self, namespace: str, key, value, env: dict) -> bool:
        """Store `value` (JSON-able) atomically; False when the cache is off or turned off by this write."""
        if not self.enabled:
            return False
        from fastremover import outputs  # light (no torch, no media libraries)

        path = self.path(namespace, key, env)
        entry = {"format": FORMAT, "namespace": namespace, "env": _jsonable(env), "key": _jsonable(key),
                 "value": _jsonable(value)}
        data = json.dumps(entry, sort_keys=True, indent=1) + "\n"
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            outputs.remove_stale_temps(path.parent, path.name)
            tmp = path.with_name(outputs.temp_name(path.name))
            with open(tmp, "x") as f:
                f.write(data)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            self._disable("written", exc)
            return False
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self.writes += 1
        self._count(namespace, 2)
        return True

    def usable_dir(self, name: str) -> Path | None:
        """`root/name`, created, if files can be written in it (a probe file is written and removed); else None with
        the note that turns the cache off."""
        if not self.enabled:
            return None
        from fastremover import outputs

        folder = self.root / name
        probe = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / outputs.temp_name("probe")
            with open(probe, "x") as f:
                f.write("ok\n")
        except OSError as exc:
            self._disable("written", exc)
            return None
        finally:
            if probe is not None:
                try:
                    os.unlink(probe)
                except OSError:
                    pass
        return folder

    def stats(self) -> dict:
        return {"root": str(self.root) if self.root else None, "enabled": self.enabled, "hits": self.hits,
                "misses": self.misses, "writes": self.writes,
                "namespaces": {ns: dict(zip(("hits", "misses", "writes"), v)) for ns, v in sorted(self.namespaces.items())}}


# ----------------------------------------------------------------------------------------------------------------------
# The process-wide cache


_default: PersistentCache | None = None
_default_lock = threading.Lock()


def default_cache() -> PersistentCache:
    """The process's cache at `fastremover.config.cache_dir()` (FASTREMOVER_CACHE_DIR), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            from fastremover.env import cache_dir

            _default = PersistentCache(cache_dir())
        return _default


def reset_default_cache() -> None:
    """Forget the process's cache (tests; a changed FASTREMOVER_CACHE_DIR is read again on next use)."""
    global _default
    with _default_lock:
        _default = None


_tool_dirs: dict | None = None


def install_tool_dirs(cache: PersistentCache | None = None) -> dict:
    """Point Triton's kernel cache and FlashInfer's JIT modules into the cache folder, where their own variables
    (TRITON_CACHE_DIR, FLASHINFER_WORKSPACE_BASE) are not set and the folder is writable. Call before the libraries
    compile anything (Triton reads its variable at each compile, FlashInfer when it is imported). Returns
    {variable: folder} of what is set now (once per process for the default cache)."""
    global _tool_dirs
    if cache is None and _tool_dirs is not None:
        return _tool_dirs
    from fastremover.env import TOOL_CACHE_VARS, tool_cache_dirs

    use = cache or default_cache()
    done = tool_cache_dirs()
    for var, name in TOOL_CACHE_VARS.items():
        if var in done:
            continue
        folder = use.usable_dir(name)
        if folder is not None:
            os.environ[var] = str(folder)
            done[var] = str(folder)
    if cache is None:
        _tool_dirs = done
    return done


# ----------------------------------------------------------------------------------------------------------------------
# What a value was measured on


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _driver_version() -> str | None:
    """The CUDA driver's version (cuDriverGetVersion through the driver library), None where it cannot be read."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        try:
            if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
                return f"{version.value // 1000}.{version.value % 1000 // 10}"
        except AttributeError:
            return None
    return None


@functools.lru_cache(maxsize=None)
def _software() -> tuple:
    import torch

    import fastremover

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (("fastremover", fastremover.__version__), ("torch", torch.__version__), ("cuda", torch.version.cuda),
            ("cudnn", cudnn), ("cudnn_frontend", _package_version("nvidia-cudnn-frontend")),
            ("triton", _package_version("triton")))


@functools.lru_cache(maxsize=None)
def _device_env(device_type: str, index: int | None) -> tuple:
    if device_type != "cuda":
        return (("device", device_type),)
    import torch

    props = torch.cuda.get_device_properties(index)
    return (("device", "cuda"), ("gpu", props.name), ("capability", f"{props.major}.{props.minor}"),
            ("sms", props.multi_processor_count), ("driver", _driver_version()))


def environment(device=None) -> dict:
    """What a cached value depends on besides its key: the device (GPU name, compute capability, SM count, driver)
    and the library versions (see the module docstring)."""
    import torch

    device = torch.device(device if device is not None else "cpu")
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return dict(_device_env(device.type, index) + _software())


def lookup(namespace: str, key, device, cache: PersistentCache | None = None):
    """`get` from the process's cache (or `cache`) with the environment of `device`."""
    cache = cache or default_cache()
    if not cache.enabled:
        return None
    return cache.get(namespace, key, environment(device))


def store(namespace: str, key, value, device, cache: PersistentCache | None = None) -> bool:
    cache = cache or default_cache()
    if not cache.enabled:
        return False
    return cache.put(namespace, key, value, environment(device))


def describe() -> dict:
    """The process's cache for records (`--timings-json`, the bench JSON): folder, on/off, hits, misses, writes, and
    the tool folders set."""
    return {**default_cache().stats(), "tool_dirs": dict(_tool_dirs or {})}


__all__ = ["PersistentCache", "default_cache", "describe", "environment", "install_tool_dirs", "lookup",
           "reset_default_cache", "store"]
