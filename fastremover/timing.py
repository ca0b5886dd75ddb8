"""Timing shared by the pipeline, the CLI, the bench harness and the one-time costs of a process.

* `StageTimer`: wall-clock per stage of a request; on CUDA it records CUDA events around each stage (`device_s`: the
  GPU's span per stage) and, with `sync=True` (the bench's per-stage breakdown), synchronizes at stage boundaries so
  that a stage's wall time is the GPU work it launched. Requests (`remove_stream` without a timer: the CLI, the
  service, batch runs, the Python API) use `sync=False`: no extra synchronization, the host queues work ahead. Its
  waits poll the `FinishedWork` progress of the request while they wait.
* `phase(name)` / `PHASES`: the process's one-time costs (imports, weight read, host-to-device copies, quantization,
  Triton compiles, autotuning, cuDNN plan and graph builds, cuBLASLt plans, CUDA-graph capture), host wall clock,
  exclusive: a phase entered inside another pauses it, so the phases never count a second twice and add up to at most
  the process's time. `mark(name)` keeps the first wall-clock time of an event (the first frame handed to the
  writer). `fastremover remove --timings-json` writes them; `fastremover bench --cold` reads them.
* `FinishedWork`: progress events of GPU work (the denoise steps) reported when the GPU has finished that work (a CUDA
  event per step, polled by the host thread that waits anyway), not when the host queued it.
* `RequestClock`: the windows' wall-clock times and the first frame of a request, from its progress events.

This module imports torch only where a CUDA call needs it, so the CLI can mark its start before anything heavy loads.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

Progress = Callable[[str, int, int], None]


def _torch():
    import torch

    return torch


# ----------------------------------------------------------------------------------------------------------------------
# Per-request stages


def _cpu():
    return _torch().device("cpu")


@dataclass
class StageTimer:
    device: "torch.device" = field(default_factory=_cpu)  # noqa: F821
    sync: bool = True
    wall_s: dict[str, float] = field(default_factory=dict)
    _events: dict[str, tuple] = field(default_factory=dict)

    @property
    def _cuda(self) -> bool:
        torch = _torch()
        return self.device.type == "cuda" and torch.cuda.is_available()

    @contextmanager
    def stage(self, name: str):
        torch = _torch()
        if self._cuda and self.sync:
            wait_device(self.device)
        start_ev = end_ev = None
        if self._cuda:
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if end_ev is not None:
                end_ev.record()
            if self._cuda and self.sync:
                wait_device(self.device)
            self.wall_s[name] = self.wall_s.get(name, 0.0) + time.perf_counter() - t0
            if start_ev is not None:
                prev = self._events.get(name, [])
                self._events[name] = [*prev, (start_ev, end_ev)]

    def device_s(self) -> dict[str, float]:
        """Per-stage time from CUDA events (synchronizes once); empty on CPU."""
        if not self._events:
            return {}
        _torch().cuda.synchronize(self.device)
        return {k: sum(a.elapsed_time(b) for a, b in v) / 1e3 for k, v in self._events.items()}

    @property
    def total_s(self) -> float:
        return sum(self.wall_s.values())

    def summary(self) -> str:
        parts = [f"{k} {v:.2f}s" for k, v in self.wall_s.items()]
        return "  ".join(parts) + f"  | total {self.total_s:.2f}s"


def cuda_time_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Mean GPU time of `fn()` in ms over `iters` back-to-back calls after `warmup` untimed ones (CUDA events; the
    side-by-side micro-benchmarks' timer)."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def capture_graph(fn):
    """(torch.cuda.CUDAGraph, its output) of `fn()` captured once, after one warm-up run on a side stream (the usual
    recipe: lazy allocations and first-call work stay out of the graph); `graph.replay()` reruns it."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# ----------------------------------------------------------------------------------------------------------------------
# Progress of finished GPU work

_waiting: "weakref.WeakSet[FinishedWork]" = weakref.WeakSet()


class FinishedWork:
    """Wraps a progress callback so that the events of `stages` (default: the denoise steps) on a CUDA device are
    reported once the GPU has finished the work queued before them: each such call records a CUDA event on the
    current stream and is reported, in order, when the event has completed. Completed events are looked for at every
    later progress call and while `wait_device` waits (the stage timer's waits); a "window" event first waits for
    every pending one (a window ends after its steps). Off CUDA, or while a CUDA graph is
    being recorded, calls pass straight through (on the CPU a step has finished when it returns)."""

    def __init__(self, progress: Progress, device, stages: tuple[str, ...] = ("denoise",)):
        self.progress = progress
        self.device = device
        self.stages = frozenset(stages)
        self.pending: list[tuple] = []
        self._lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        torch = _torch()
        if stage in self.stages and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            with self._lock:
                self.pending.append((event, stage, done, total))
            _waiting.add(self)
            self.poll()
            return
        if stage == "window":
            self.flush()
        else:
            self.poll()
        self.progress(stage, done, total)

    def poll(self) -> None:
        """Report the pending events whose GPU work has finished (in order, stopping at the first unfinished)."""
        while True:
            with self._lock:
                if not self.pending or not self.pending[0][0].query():
                    return
                _, stage, done, total = self.pending.pop(0)
            self.progress(stage, done, total)

    def flush(self) -> None:
        """Wait for every pending event and report it."""
        while True:
            with self._lock:
                if not self.pending:
                    return
                event, stage, done, total = self.pending.pop(0)
            event.synchronize()
            self.progress(stage, done, total)


def finished_work(progress: Progress | None, device) -> Progress | None:
    """`progress` wrapped in a `FinishedWork` on a CUDA device (unchanged elsewhere, or when None)."""
    if progress is None or getattr(device, "type", str(device)) != "cuda" or isinstance(progress, FinishedWork):
        return progress
    return FinishedWork(progress, device)


def wait_device(device) -> None:
    """torch.cuda.synchronize(device), reporting the `FinishedWork` events that complete while it waits."""
    torch = _torch()
    waiting = [w for w in list(_waiting) if w.pending]
    if waiting:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        delay = 5e-5
        while not done.query():
            for w in waiting:
                w.poll()
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        for w in waiting:
            w.poll()
    torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------------
# One-time costs of the process


class PhaseRecorder:
    """Exclusive host wall-clock seconds per phase name (see the module docstring), thread by thread."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.marks: dict[str, float] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _add(self, name: str, seconds: float, count: int = 0) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.counts[name] = self.counts.get(name, 0) + count

    @contextmanager
    def phase(self, name: str):
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        if stack and stack[-1][0] == name:  # re-entered (a phase inside itself): counted once, by the outer one
            yield
            return
        now = time.perf_counter()
        if stack:  # pause the enclosing phase
            outer, started = stack[-1]
            self._add(outer, now - started)
        stack.append((name, now))
        try:
            yield
        finally:
            now = time.perf_counter()
            _, started = stack.pop()
            self._add(name, now - started, 1)
            if stack:  # the enclosing phase runs again from now
                stack[-1] = (stack[-1][0], now)

    def mark(self, name: str) -> None:
        """Keep the wall-clock time (time.time()) of the first `name` event."""
        with self._lock:
            self.marks.setdefault(name, time.time())

    def describe(self) -> dict:
        with self._lock:
            return {"phases_s": {k: round(v, 6) for k, v in self.seconds.items()}, "counts": dict(self.counts),
                    "marks_unix": dict(self.marks)}

    def reset(self) -> None:
        with self._lock:
            self.seconds.clear()
            self.counts.clear()
            self.marks.clear()


PHASES = PhaseRecorder()


def phase(name: str):
    """`with phase("autotune"): ...`: the block's time goes to `name` in the process's PHASES."""
    return PHASES.phase(name)


def mark(name: str) -> None:
    PHASES.mark(name)


_triton_timed = False
_triton_wanted = False
_precompiling = threading.local()


@contextmanager
def precompiling():
    """Within (this thread): Triton compiles are submitted ahead of their launches (fastremover/fast/precompile.py):
    logged as "triton precompile" and counted in the enclosing phase ("precompile"), not as "triton_compile" (whose
    count stays the number of lazy compiles)."""
    old = getattr(_precompiling, "on", False)
    _precompiling.on = True
    try:
        yield
    finally:
        _precompiling.on = old


def precompiling_now() -> bool:
    """Whether this thread is inside `precompiling` (submitting compiles ahead of their launches)."""
    return getattr(_precompiling, "on", False)


def time_triton_compiles() -> bool:
    """Count Triton's kernel compiles (or loads from its on-disk cache) as the phase "triton_compile" from now on
    (wraps JITFunction._do_compile once per process). Where Triton is not imported yet this does not import it (a run
    that compiles no Triton kernel, the eager mode, need not): the package's kernel modules call `triton_imported`
    when they import it, which wraps it then. False where this Triton has no such method (older releases): the
    compiles then count to whatever phase encloses them."""
    global _triton_wanted
    if _triton_timed:
        return True
    if "triton" not in sys.modules:
        _triton_wanted = True
        return True
    return _wrap_triton_compile()


def triton_imported() -> None:
    """Called by fastremover/fast/kernels/_common.py (which every Triton kernel of the package imports) once Triton is
    imported: starts counting the compiles if `time_triton_compiles` was asked for before."""
    if _triton_wanted:
        _wrap_triton_compile()


def _wrap_triton_compile() -> bool:
    global _triton_timed
    if _triton_timed:
        return True
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        return False

    def _do_compile(self, *args, **kwargs):
        # which kernel and specialization (debug log, `-v`): what tools/triton_variants.py predicts offline
        ahead = precompiling_now()
        logging.getLogger("fastremover").debug("triton %s: %s %s", "precompile" if ahead else "compile",
                                               getattr(self, "__name__", "?"), args[0] if args else "")
        if ahead:
            return original(self, *args, **kwargs)
        with phase("triton_compile"):
            return original(self, *args, **kwargs)

    JITFunction._do_compile = _do_compile
    _triton_timed = True
    return True


class RequestClock:
    """Wraps a progress callback (or None) and keeps the wall-clock time of each window's end and of the first frame
    handed to the writer ("frames" events; also `mark("first_frame")`)."""

    def __init__(self, progress: Progress | None = None):
        self.progress = progress
        self.started = time.time()
        self.window_ends: list[float] = []
        self.first_frame: float | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.time()
        if stage == "window":
            if done == 0:
                self.started = now
            elif done > len(self.window_ends):
                self.window_ends.append(now)
        elif stage == "frames" and done >= 1 and self.first_frame is None:
            self.first_frame = now
            mark("first_frame")
        if self.progress is not None:
            self.progress(stage, done, total)

    def windows_s(self) -> list[float]:
        starts = [self.started, *self.window_ends[:-1]]
        return [round(end - start, 6) for start, end in zip(starts, self.window_ends)]

    def describe(self) -> dict:
        return {"windows_s": self.windows_s(), "first_frame_unix": self.first_frame, "request_start_unix": self.started}
