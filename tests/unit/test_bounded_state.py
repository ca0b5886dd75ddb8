"""Runtime state stays bounded: per-shape caches are LRUs, captured graphs hold what they read, close() releases."""

import pytest
import torch

from fastremover import media
from fastremover.config import EngineConfig
from fastremover.lru import LRUCache
from fastremover.models.loading import random_init_, random_models
from fastremover.models.transformer import ROPE_CACHE_SIZE, RemoverTransformer, RemoverTransformerConfig
from fastremover.options import RunOptions
from fastremover.pipeline import RemovalPipeline

TINY = RemoverTransformerConfig(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=1, freq_dim=32)


def test_lru_cache_evicts_least_recently_used():
    cache = LRUCache(2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1  # "a" is now the most recent
    assert cache.put("c", 3) == [("b", 2)]
    assert list(cache.keys()) == ["a", "c"] and cache.get("b") is None and len(cache) == 2
    with pytest.raises(ValueError):
        LRUCache(0)


def test_rope_tables_are_bounded_and_recomputed_identically():
    model = random_init_(RemoverTransformer(TINY), 0)
    first = model.rope((1, 2, 3), torch.device("cpu"))
    for w in range(1, ROPE_CACHE_SIZE + 10):
        model.rope((1, 2, w + 3), torch.device("cpu"))
    assert len(model._rope_cache) == ROPE_CACHE_SIZE
    again = model.rope((1, 2, 3), torch.device("cpu"))
    assert again is not first and all(torch.equal(a, b) for a, b in zip(first, again))


def test_v_statistics_counters_are_bounded():
    from fastremover.fast.transformer_fast import SHAPE_CACHE_SIZE, FastTransformer

    fast = FastTransformer(random_init_(RemoverTransformer(TINY), 0), linear_method="fp8-rowwise", use_triton=True)
    assert fast.fused_v_stats
    width = TINY.num_attention_heads * TINY.attention_head_dim
    for s in range(8, 8 + SHAPE_CACHE_SIZE + 5):
        fast._v_stats_options(0, torch.zeros(s, width), 1, s)
    assert len(fast._v_counters) == SHAPE_CACHE_SIZE


def test_close_releases_the_models_and_refuses_later_runs():
    video, mask = media.synthetic_clip(5, 32, 48, seed=0)
    with RemovalPipeline(random_models("tiny", 0), EngineConfig(device="cpu")) as pipe:
        pipe.remove(video.frames, mask, RunOptions(steps=1))
        assert pipe.models is not None
    assert pipe.closed and pipe.models is None and pipe.denoiser is None and pipe.vae is None
    with pytest.raises(RuntimeError, match="closed"):
        pipe.remove(video.frames, mask, RunOptions(steps=1))


@pytest.mark.gpu
def test_gpu_graph_cache_is_bounded_and_recaptures_exactly():
    """Three shapes, each called twice (the second call runs eagerly and records: denoise.capture_pays), through a
    denoiser that keeps two graphs: the first is evicted, its shape recorded again on return, and the replay equals
    the first (eager) run bit for bit."""
    from fastremover.engine.denoise import FastDenoiser, capture_pays
    from fastremover.fast.transformer_fast import FastTransformer
    from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG

    cfg = RemoverTransformerConfig(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=2)
    model = random_init_(RemoverTransformer(cfg), 1).cuda().to_inference_dtype(torch.float16)
    denoiser = FastDenoiser(FastTransformer(model), DEFAULT_SCHEDULER_CONFIG, cuda_graphs=True, max_graphs=2)
    g = torch.Generator("cuda").manual_seed(0)
    shapes = [(1, 16, 3, 30, 52), (1, 16, 3, 30, 54), (1, 16, 3, 32, 54)]
    STEPS = next(n for n in range(1, 50) if capture_pays(n, 2))  # the fewest steps whose second call records
    runs = {}
    for shape in shapes:
        x = [torch.randn(shape, generator=g, device="cuda", dtype=torch.float16) for _ in range(3)]
        runs[shape] = (x, denoiser(*x, steps=STEPS))
        assert not any(k[0] == shape for k in denoiser._graphs.keys())  # one call: eager, nothing recorded
        assert torch.equal(denoiser(*x, steps=STEPS), runs[shape][1])  # the second: eager again, then recorded
        assert any(k[0] == shape for k in denoiser._graphs.keys())
    assert len(denoiser._graphs) == 2
    x, first = runs[shapes[0]]
    assert torch.equal(denoiser(*x, steps=STEPS), first)  # recorded again after eviction (a recurring shape)
    assert torch.equal(denoiser(*x, steps=STEPS), first)  # and replayed
    assert len(denoiser._graphs) == 2
