"""Per-stage timing shared by the pipeline, the CLI summary and the bench harness.

Wall-clock per stage; on CUDA the timer synchronizes at stage boundaries (only when `sync=True`, the default for
user runs and benchmarks) so that a stage's time is the GPU work it launched, and it also records CUDA events so the
bench can report device time. `sync=False` keeps whole requests free of extra synchronization (determinism checks).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class StageTimer:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sync: bool = True
    wall_s: dict[str, float] = field(default_factory=dict)
    _events: dict[str, tuple] = field(default_factory=dict)

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    @contextmanager
    def stage(self, name: str):
        if self._cuda and self.sync:
            torch.cuda.synchronize(self.device)
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
                torch.cuda.synchronize(self.device)
            self.wall_s[name] = self.wall_s.get(name, 0.0) + time.perf_counter() - t0
            if start_ev is not None:
                prev = self._events.get(name, [])
                self._events[name] = [*prev, (start_ev, end_ev)]

    def device_s(self) -> dict[str, float]:
        """Per-stage time from CUDA events (synchronizes once); empty on CPU."""
        if not self._events:
            return {}
        torch.cuda.synchronize(self.device)
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
