"""The parallel run's flags and their limits (no torch: a bad flag fails before anything loads).

`fastremover.config.ParallelOptions` (the EngineConfig section) holds the values; this module has the limits and the
check the CLI runs on them."""

from __future__ import annotations

from fastremover.errors import FastRemoverError

PARALLEL_MODES = ("none", "ulysses")
TRANSPORTS = ("fp16", "fp8")
MAX_RANKS = 64
DEFAULT_TIMEOUT_S = 300.0


def _positive_int(flag: str, value, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high is not None and value > high):
        limit = f"between 1 and {high}" if high is not None else "at least 1"
        raise FastRemoverError(f"{flag} {value!r}: must be a whole number {limit}")


def check_parallel_flags(parallel: str = "none", gpus: int | None = None, transport: str = "fp16",
                         head_groups: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """`--parallel`, `--gpus`, `--sp-transport`, `--sp-head-groups`, `--parallel-timeout`: FastRemoverError naming
    the first bad one. gpus None: the ranks come from torchrun (WORLD_SIZE in the environment)."""
    if parallel not in PARALLEL_MODES:
        raise FastRemoverError(f"--parallel {parallel!r}: choose one of {list(PARALLEL_MODES)}")
    if transport not in TRANSPORTS:
        raise FastRemoverError(f"--sp-transport {transport!r}: choose one of {list(TRANSPORTS)}")
    if gpus is not None:
        _positive_int("--gpus", gpus, MAX_RANKS)
    _positive_int("--sp-head-groups", head_groups)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise FastRemoverError(f"--parallel-timeout {timeout_s!r}: must be a positive number of seconds")
    if parallel == "none" and (gpus not in (None, 1) or transport != "fp16" or head_groups != 1):
        raise FastRemoverError("--gpus N / --sp-transport / --sp-head-groups need --parallel ulysses")
