import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable is read when a kernel module is
# imported (@triton.jit), so it must be set before any test imports fastremover.fast.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The persistent cache (fastremover/cache.py) of everything the tests run, in processes they start too: a folder of
# this run, never the user's ~/.cache/fastremover.
if not os.environ.get("FASTREMOVER_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    os.environ["FASTREMOVER_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastremover-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FASTREMOVER_CACHE_DIR"], True)


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
    # 2-core CI: keep torch from oversubscribing when pytest runs several things (with pytest-xdist, the cores are
    # shared among its worker processes).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))
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


def _graph_replays_new_inputs(fn, q, k, v) -> torch.Tensor:
    """fn(q, k, v) captured into a CUDA graph (after a warm-up call on a side stream): the replay gives the warm-up's
    output, and after q is negated in place a replay gives a different one (the graph reads its input buffers), which
    is returned for the caller's own check against an eager call on the new inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = fn(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    q.mul_(-1)  # new inputs in the same buffers: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, first)
    return out


@pytest.fixture
def graph_replays_new_inputs():
    """The CUDA-graph check shared by the attention backend tests: out = graph_replays_new_inputs(fn, q, k, v)."""
    return _graph_replays_new_inputs
