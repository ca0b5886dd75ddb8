import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable is read when a kernel module is
# imported (@triton.jit), so it must be set before any test imports fastremover.fast.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # GPU tests are skipped *with a visible reason* on CPU-only machines (CI); they run through the device tool.
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # 2-core CI: keep torch from oversubscribing when pytest runs several things.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield


def _raise_value_errors(cases) -> None:
    """Each (fn, words) case: fn() must raise ValueError with `words` in its message (the case index in failures)."""
    for i, (fn, words) in enumerate(cases):
        try:
            fn()
        except ValueError as e:
            assert words in str(e), f"case {i}: {e}"
        else:
            raise AssertionError(f"case {i} did not raise ValueError")


@pytest.fixture
def raise_value_errors():
    """The table-driven refusal check shared by the kernel wrapper tests: raise_value_errors([(fn, words), ...])."""
    return _raise_value_errors
