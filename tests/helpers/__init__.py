"""Helpers the test modules share (test modules import this package, never each other): `helpers` is importable
because pyproject's pytest config puts tests/ on sys.path (`pythonpath`)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from fastremover import media
from fastremover.config import ModelSource
from fastremover.models.loading import random_init_
from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
from fastremover.worker import RemovalWorker

TESTS = Path(__file__).resolve().parents[1]  # tests/, the folder that holds this package
REPO = TESTS.parent
TOOLS = REPO / "tools"


def load_tool(name: str):
    """A tools/ script as a module (tools/ is not a package; the scripts import each other as siblings)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    module_name = f"tools_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------------------------
# Floats


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits -> integers in value order (+0 and -0 both 0), as int64."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    i = t.view(bits).long()
    if t.element_size() == 1:
        i = torch.where(i >= 128, -(i - 128), i)
    else:
        nbits = 8 * t.element_size()
        i = torch.where(i < 0, -(i & ((1 << (nbits - 1)) - 1)), i)
    return i


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert a.dtype == b.dtype and a.shape == b.shape
    return (ordered(a) - ordered(b)).abs()


# ----------------------------------------------------------------------------------------------------------------------
# Models


TINY_TRANSFORMER = RemoverTransformerConfig(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2,
                                            freq_dim=32)


def tiny_transformer(seed: int, cfg: RemoverTransformerConfig = TINY_TRANSFORMER, device="cpu",
                     dtype=torch.float32) -> RemoverTransformer:
    """A RemoverTransformer with deterministic random weights (seed), in eval mode, on `device` in `dtype`."""
    return random_init_(RemoverTransformer(cfg), seed).eval().to(device).to_inference_dtype(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# The service (serve/test_serve*.py)


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root (hidden ones too) -> sha256 of its bytes; symlinks by their target; folders as "dir"."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = os.fsdecode(path.relative_to(root))
        if path.is_symlink():
            state[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            state[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            state[rel] = "dir"
    return state


def write_clip(folder: Path, frames: int = 9, height: int = 48, width: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """A synthetic clip and its mask as mp4 files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    video, mask = media.synthetic_clip(frames, height, width, seed=seed)
    media.write_video(folder / "clip.mp4", video.frames, video.fps)
    media.write_video(folder / "mask.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), video.fps)
    return folder / "clip.mp4", folder / "mask.mp4"


class GatedPipeline:
    """The real classic pipeline, held at a progress report (`hold_at`, default its first) while `release` is clear
    (the hold keeps calling the worker's callback, so cancel and stop take effect there exactly as in a long run)."""

    def __init__(self):
        from fastremover.pipeline import RemovalPipeline

        self.inner = RemovalPipeline.from_model("classic")
        self.config = self.inner.config
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.hold_at = ("window", 0)  # the (stage, done) report to hold at
        self.fail: Exception | None = None  # raised there instead, once (an internal error inside the run)

    def _gate(self, progress):
        def gated(stage: str, done: int, total: int) -> None:
            if progress is not None:
                progress(stage, done, total)
            if (stage, done) == self.hold_at:
                if self.fail is not None:
                    error, self.fail = self.fail, None
                    raise error
                self.entered.set()
                while not self.release.wait(0.02):
                    if progress is not None:
                        progress(stage, done, total)

        return gated

    def remove(self, frames, mask, options=None, *, progress=None, **kwargs):
        return self.inner.remove(frames, mask, options, progress=self._gate(progress), **kwargs)

    def remove_stream(self, pairs, emit, options=None, *, progress=None, **kwargs):
        return self.inner.remove_stream(pairs, emit, options, progress=self._gate(progress), **kwargs)

    def __getattr__(self, name):  # everything else (close, closed, ...) is the real pipeline's
        return getattr(self.inner, name)


def gated_worker() -> tuple[RemovalWorker, GatedPipeline]:
    pipe = GatedPipeline()
    return RemovalWorker(ModelSource(), pipeline=pipe), pipe


@contextmanager
def live_server(data_dir: Path, *extra: str, env: dict | None = None, script: str | None = None):
    """`python -m fastremover.serve --port 0 ...` (or `python -c script ...`) on 127.0.0.1; yields (process, url)."""
    args = [sys.executable, "-c", script] if script else [sys.executable, "-m", "fastremover.serve"]
    cmd = args + ["--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        line = proc.stdout.readline()
        if "listening on http://" not in line:
            proc.kill()
            raise AssertionError(f"server did not start: {line!r} {proc.stderr.read()}")
        url = line.split("listening on ", 1)[1].split()[0]
        wait_healthy(url, proc)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


@contextmanager
def thread_server(app):
    """uvicorn serving `app` on 127.0.0.1 (a random port) in a thread of this process; yields the base URL."""
    import uvicorn

    from fastremover.serve.cli import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def wait_healthy(url: str, proc=None, timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc is None or proc.poll() is None, f"server exited: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "server never became healthy"
        time.sleep(0.05)


# A server whose (real, classic) worker holds every job at its first progress report until the file named by
# $GATE exists: the test decides when a job may finish. Run it with live_server(..., script=GATED_SERVER, env=...).
GATED_SERVER = f"""
import os, sys, threading, time
sys.path.insert(0, {str(TESTS)!r})
from helpers import GatedPipeline
from fastremover.config import ModelSource
from fastremover.serve.cli import add_serve_parser, config_from_args, serve
from fastremover.worker import RemovalWorker
import argparse
parser = argparse.ArgumentParser()
add_serve_parser(parser.add_subparsers(dest="command"))
args = parser.parse_args(["serve", *sys.argv[1:]])
pipe = GatedPipeline()
pipe.release.clear()
def watch():
    while not os.path.exists(os.environ["GATE"]):
        time.sleep(0.02)
    pipe.release.set()
threading.Thread(target=watch, daemon=True).start()
sys.exit(serve(config_from_args(args), args.host, args.port, log_level=args.log_level,
               workers=[RemovalWorker(ModelSource(), pipeline=pipe)]))
"""


# ----------------------------------------------------------------------------------------------------------------------
# Batch runs (e2e/test_batch*.py)


CLIPS = 12
HEIGHT, WIDTH, OBJECT = 48, 64, 0.15  # tiny clips: the test's time goes to starting workers, not to removing


def synthetic(frames: int, seed: int):
    return media.synthetic_clip(frames, HEIGHT, WIDTH, seed=seed, object_fraction=OBJECT)


def frames_of(i: int) -> int:
    return (5, 9, 13)[i % 3]


def make_clips(root: Path, count: int = CLIPS) -> tuple[Path, Path]:
    """``count`` clips clip00.mp4 ... in root/in and their masks (same names) in root/masks."""
    inputs, masks = root / "in", root / "masks"
    for i in range(count):
        video, mask = synthetic(frames_of(i), seed=i)
        name = f"clip{i:02d}.mp4"
        media.write_video(inputs / name, video.frames, video.fps)
        media.write_video(masks / name, np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), video.fps)
    return inputs, masks


# ----------------------------------------------------------------------------------------------------------------------
# Batch workers (e2e/test_batch.py)


class DieOnce(str):
    """A str that ends the process unpickling it (exit code 3) the first time (while `marker` does not exist yet),
    and is the plain str after that: a batch worker killed between receiving a clip and starting it."""

    def __new__(cls, text: str, marker: str):
        obj = str.__new__(cls, text)
        obj.marker = marker
        return obj

    def __reduce__(self):
        return (_die_once, (str(self), self.marker))


def _die_once(text: str, marker: str) -> str:
    if not os.path.exists(marker):
        Path(marker).touch()
        os._exit(3)
    return text
