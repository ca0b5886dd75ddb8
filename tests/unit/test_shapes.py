"""Fewer run shapes and bounded per-shape state: the canonical sizes of crop boxes and last windows
(fastremover/windows.py), the capture rule of the denoise loop (engine/denoise.capture_pays), and the LRU bounds of the
library caches (cuDNN attention graphs, cuBLASLt plans, cuDNN conv plans) with the objects a captured graph keeps."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastremover import lru, media
from fastremover.config import EngineConfig
from fastremover.lru import LRUCache, held_while, used
from fastremover.options import RunOptions
from fastremover.windows import (
    SHAPE_BUCKETS,
    bucket_length,
    bucket_side,
    choose_crop,
    next_window,
    plan_windows,
    run_shapes,
    snap_box,
    window_lookahead,
)


# ----------------------------------------------------------------------------------------------------------------------
# The bucket rule


def test_bucket_side_is_a_small_canonical_set_with_bounded_growth():
    for per_octave in (2, 4, 8):
        sizes = set()
        for side in range(16, 2049):
            b = bucket_side(side, per_octave)
            assert b >= side and b % 16 == 0
            assert b <= side * (1 + 1 / per_octave) or b - side < 16, (side, b)
            assert bucket_side(b, per_octave) == b  # canonical sizes map to themselves
            if side > 1:
                assert b >= bucket_side(side - 1, per_octave)  # monotone
            sizes.add(b)
        # 16..2048: per octave above 16 * per_octave at most `per_octave` sizes, below it multiples of 16
        assert len([s for s in sizes if s > 256]) <= 3 * per_octave
    assert [bucket_side(s) for s in (256, 257, 300, 384, 385, 513, 700, 854)] == [256, 320, 320, 384, 448, 640, 768,
                                                                                  896]
    assert [bucket_side(s, 0) for s in (256, 257, 300, 854)] == [256, 272, 304, 864]  # off: multiples of 16


def test_snap_box_with_buckets_gives_canonical_sides_or_the_whole_axis():
    rng = np.random.default_rng(3)
    for _ in range(2000):
        height, width = (int(v) for v in rng.integers(64, 1400, size=2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height + 1, size=2))
        x0, x1 = sorted(int(v) for v in rng.integers(0, width + 1, size=2))
        y1, x1 = max(y1, y0 + 1), max(x1, x0 + 1)
        if y1 > height or x1 > width:
            continue
        b = snap_box((y0, y1, x0, x1), (height, width), buckets=SHAPE_BUCKETS)
        plain = snap_box((y0, y1, x0, x1), (height, width))
        assert b[0] <= y0 and y1 <= b[1] <= height and b[2] <= x0 and x1 <= b[3] <= width
        for lo, hi, size, plo, phi in ((b[0], b[1], height, plain[0], plain[1]),
                                       (b[2], b[3], width, plain[2], plain[3])):
            if (lo, hi) != (0, size):
                assert bucket_side(hi - lo) == hi - lo and hi - lo >= phi - plo  # canonical, never smaller


def test_crop_boxes_of_a_moving_object_share_fewer_shapes_with_buckets():
    _, mask = media.synthetic_clip(81, 480, 854, seed=2, object_fraction=0.04, travel=0.6)
    sides = {0: set(), SHAPE_BUCKETS: set()}
    for length in range(5, 82, 4):  # windows of growing length: the object's path in them, so the box, grows
        for buckets in sides:
            box = choose_crop(mask[:length], "on", buckets=buckets)
            sides[buckets].add((box[1] - box[0], box[3] - box[2]))
    assert len(sides[SHAPE_BUCKETS]) < len(sides[0])


def test_bucket_length_and_the_last_window():
    assert [bucket_length(n, 81, 4) for n in (1, 5, 21, 25, 41, 45, 61, 65, 81)] == [1, 21, 21, 41, 41, 61, 61, 81, 81]
    assert [bucket_length(n, 81, 0) for n in (5, 25, 81)] == [5, 25, 81]
    plain, snapped = plan_windows(152, 81, None), plan_windows(152, 81, None, SHAPE_BUCKETS)
    assert [w.length for w in plain] == [81, 81, 25] and [w.length for w in snapped] == [81, 81, 41]
    assert snapped[-1].stop == 152 and snapped[-1].overlap == 145 - snapped[-1].start
    assert plan_windows(60, 81, None, SHAPE_BUCKETS) == plan_windows(60, 81, None)  # one window: the clip as it is
    for n in range(1, 400, 7):  # the streamed plan (window by window, one window of look-ahead) is the same
        for window, overlap in ((81, None), (21, 5), (33, 0)):
            want = plan_windows(n, window, overlap, SHAPE_BUCKETS)
            got, prev = [], None
            while True:
                known = min(n, window_lookahead(prev, window, overlap))
                win = next_window(prev, known, known == n, window, overlap, SHAPE_BUCKETS)
                if win is None:
                    break
                got.append(win)
                prev = win
            assert got == want, (n, window, overlap)


def test_shape_buckets_option_and_the_pipeline_runs_on_canonical_shapes():
    from fastremover.models.loading import random_models
    from fastremover.pipeline import RemovalPipeline

    with pytest.raises(Exception, match="shape_buckets"):
        RunOptions(shape_buckets=-1).validate()
    assert RunOptions().shape_buckets == SHAPE_BUCKETS
    video, mask = media.synthetic_clip(45, 32, 48, seed=0)
    pipe = RemovalPipeline(random_models("tiny", seed=0), EngineConfig(device="cpu", precision="fp32"))
    opts = RunOptions(steps=1, window=33)
    out = []
    result = pipe.remove_stream(zip(video.frames, mask), out.append, opts)  # as `fastremover remove` runs
    assert [w.stop - w.start for w in result.windows] == [33, 25]  # the last window: 21 frames snapped to 25
    assert [n for n, _ in run_shapes(result.windows)] == [33, 25] and len(out) == 45


# ----------------------------------------------------------------------------------------------------------------------
# Capture only where it pays


def test_capture_rule():
    """The measured rule (engine/denoise.py): small shapes, whose steps the host's launching bounds, are recorded on
    their second call; a shape whose steps the GPU bounds never is; one step never pays for a recording."""
    from fastremover.engine import denoise

    assert not denoise.capture_pays(12, 1, tokens=3520)  # a shape seen once is never recorded
    assert denoise.capture_pays(12, 2, tokens=3520)  # host-bound (the measured 3520-token crop): its second call
    assert not denoise.capture_pays(1, 2, tokens=3520)  # one step does not pay for a recording
    assert not any(denoise.capture_pays(12, n, tokens=13440) for n in range(1, 100))  # GPU-bound: never
    assert denoise.step_saving_s(3520) > 0.04 and denoise.step_saving_s(13440) == 0.0
    # a call that does not record: a graph of one step for the steps after the eager ones, where the host bounds
    assert denoise.step_graph_pays(12, 3520) and not denoise.step_graph_pays(12, 13440)
    assert not denoise.step_graph_pays(denoise.STEP_GRAPH_EAGER_STEPS, 100)  # no step left to replay
    assert not denoise.step_graph_pays(denoise.STEP_GRAPH_EAGER_STEPS + 1, 3520)  # one replay does not pay
    # the crossover lies between the measured host-bound and GPU-bound shapes
    last = max(t for t in range(0, 20000, 10) if denoise.capture_pays(12, 1000, tokens=t))
    assert 3520 < last < 13440


# ----------------------------------------------------------------------------------------------------------------------
# Bounded per-shape state


def test_held_while_collects_what_the_caches_hand_out():
    a, b, c = object(), object(), object()
    used(a)  # outside a block: nothing is collected
    with held_while() as outer:
        used(a)
        with held_while() as inner:
            used(b)
            used(b)
        used(c)
    assert inner == [b] and outer == [a, b, c]
    assert getattr(lru._collecting, "held", None) is None


def test_cudnn_attention_graphs_are_bounded_and_a_recording_keeps_its_own(monkeypatch):
    from fastremover.ops.attention import cudnn_fp8

    monkeypatch.setattr(cudnn_fp8, "_graphs", LRUCache(2))
    built = []

    class Graph:
        def __init__(self, key):
            self.key = key
            built.append(key)

    with held_while() as held:
        g1 = cudnn_fp8._cached(("s", 1), lambda: Graph(1))
        assert cudnn_fp8._cached(("s", 1), lambda: Graph(1)) is g1 and built == [1]  # a hit
    for k in (2, 3, 4):
        cudnn_fp8._cached(("s", k), lambda k=k: Graph(k))
    assert len(cudnn_fp8._graphs) == 2 and ("s", 1) not in cudnn_fp8._graphs  # evicted from the cache...
    assert held == [g1]  # ...but the recording that used it still holds it
    assert cudnn_fp8._cached(("s", 1), lambda: Graph(1)) is not g1 and built == [1, 2, 3, 4, 1]


def test_cublaslt_plans_and_conv_plans_are_lru_bounded(monkeypatch):
    from fastremover.fast import cudnn_conv
    from fastremover.ops.linear import cublaslt

    assert isinstance(cublaslt._plans, LRUCache) and cublaslt._plans.max_items == cublaslt.MAX_PLANS
    assert isinstance(cudnn_sdpa_graphs(), LRUCache)

    class Plans:
        def __init__(self, x, weight, y, stride, padding, names):
            self.built, self.failed = {}, {n: "no" for n in names}

    monkeypatch.setattr(cudnn_conv, "MAX_SIGNATURES", 3)
    plans = cudnn_conv.ConvPlans(torch.device("cpu"), candidates=("a",), min_gflop=0.0, builder=Plans,
                                 time_ms=lambda fn: 1.0, cache=None)
    w = torch.randn(2, 2, 3, 3, 3)
    for t in range(3, 9):
        x = torch.randn(1, 2, t, 5, 5)
        assert torch.equal(plans.conv(x, w, 1, (0, 1, 1)), F.conv3d(x, w, None, 1, (0, 1, 1)))
    assert len(plans.choices) == 3


def cudnn_sdpa_graphs():
    from fastremover.ops.attention import cudnn_fp8

    return cudnn_fp8._graphs
