"""Sequence-parallel denoise (Ulysses), the parallel VAE and the parallel run's error rules, on gloo with 2 and 3 CPU
processes (fastremover.parallel). Every multi-process check runs inside one launch per world size (`_rank_checks`,
forked from a forkserver: starting processes is the slow part on a small machine); each launch has a deadline, and
every collective a timeout, so a bug fails the test instead of hanging it.

The transformer checks use a test-only config with 6 heads (the tiny preset has 2, which 3 does not divide)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastremover.config import EngineConfig, ModelSource, ParallelOptions
from fastremover.errors import FastRemoverError
from fastremover.parallel import transport
from fastremover.engine.interfaces import SINGLE
from fastremover.parallel.context import ParallelContext, ParallelError, set_parallel, split_sizes
from fastremover.parallel.ulysses import check_heads
from fastremover.parallel.launch import remove_rank, run_remove, spawn
from helpers import attention_fakes

SPAWN_TIMEOUT_S = 150  # a whole launch (start, model builds, every check)
COLLECTIVE_TIMEOUT_S = 30  # one collective
# the failure runs: a rank stopping through a collective's timeout would take longer than this after its start-up,
# a prompt stop takes its start-up plus well under a second
FAILURE_TIMEOUT_S = 60


def _cfg():
    from fastremover.models.transformer import RemoverTransformerConfig

    return RemoverTransformerConfig(num_attention_heads=6, attention_head_dim=8, ffn_dim=32, num_layers=2, freq_dim=32)


def _model(seed=3):
    from fastremover.models.loading import random_init_
    from fastremover.models.transformer import RemoverTransformer

    return random_init_(RemoverTransformer(_cfg()), seed).eval().to_inference_dtype(torch.float32)


def _latents(shape, seed=1, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) + offset for _ in range(3)]


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ----------------------------------------------------------------------------------------------------------------------
# What each rank runs (module-level: the launched processes import it by name)

# token counts 15 and 16: uneven over 2 ranks (8 + 7) and over 3 ranks (6 + 5 + 5) respectively
SHAPES = ((1, 16, 1, 6, 10), (1, 16, 1, 8, 8))
STEPS = 2


def _denoise_pair(ctx, denoiser, target, inputs, **ctx_fields):
    """(single-process latents, parallel latents) of one denoiser on the same inputs, in this process."""
    set_parallel(target, SINGLE)
    ref = denoiser(*inputs, STEPS)
    par_ctx = ParallelContext(**{**ctx.__dict__, **ctx_fields})
    set_parallel(target, par_ctx)
    try:
        got = denoiser(*inputs, STEPS)
    finally:
        set_parallel(target, SINGLE)
    return ref, got


def _rank_checks(ctx):
    from fastremover.engine.denoise import EagerDenoiser, FastDenoiser
    from fastremover.fast.transformer_fast import FastTransformer
    from fastremover.models.loading import random_init_
    from fastremover.models.vae import WanVAE, WanVAEConfig
    from fastremover.parallel.vae import RowParallelDecoder, encode_pair
    from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG as SCHED

    out = {}
    model = _model()
    eager = EagerDenoiser(model, SCHED)
    exact = FastDenoiser(FastTransformer(model, use_triton=False), SCHED, cuda_graphs=False)
    heads_per_rank = 6 // ctx.world_size
    for i, shape in enumerate(SHAPES):
        inputs = _latents(shape)
        out[f"eager{i}"] = _denoise_pair(ctx, eager, model, inputs)
        # the head-group pipelined exchange: every head its own group
        out[f"exact_groups{i}"] = _denoise_pair(ctx, exact, exact.fast, inputs, head_groups=heads_per_rank)
    inputs = _latents(SHAPES[0])
    out["eager_fp8_transport"] = _denoise_pair(ctx, eager, model, inputs, transport="fp8")
    # the fast mode's 8-bit attention path (cuDNN's contract faked by its dequantized math): K's centre and V's
    # statistics all-reduced, the e4m3 codes themselves on the wire
    with attention_fakes.registered("test-cudnn-like", codes_call=attention_fakes.fake_cudnn_codes,
                                    output="fp8-codes"):
        fp8 = FastDenoiser(FastTransformer(model, linear_method="fp8-rowwise", use_triton=False,
                           attention="test-cudnn-like"), SCHED,
                           cuda_graphs=False)
    out["fp8_attention"] = _denoise_pair(ctx, fp8, fp8.fast, inputs)
    # the raw exchange: identity "attention" (returns v) on e4m3 codes must give back exactly what went in
    b, s_r, h, d = 1, ctx.token_range(13)[1] - ctx.token_range(13)[0], 6, 8
    ctx.sequence_total = 13
    codes = (torch.randn(b, s_r, h, d, generator=torch.Generator().manual_seed(ctx.rank)) * 8).to(torch.float8_e4m3fn)
    back = ctx.attention(lambda q, k, v: v, codes.clone(), codes.clone(), codes)
    out["codes_round_trip"] = back.dtype == codes.dtype and torch.equal(back.view(torch.uint8), codes.view(torch.uint8))
    # CUDA graphs under sequence parallelism: the ranks take the same branch (all graphs or none)
    from fastremover.engine.denoise import capture_agreed

    def fail_on_last():
        if ctx.rank == ctx.world_size - 1:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        return "graph"

    out["capture_one_fails"] = capture_agreed(fail_on_last, ctx)
    out["capture_all_ok"] = capture_agreed(lambda: "graph", ctx)
    # start-up fingerprints: a rank that sees something else is named
    try:
        ctx.barrier_same("inputs", {"clip": "a.mp4" if ctx.rank != ctx.world_size - 1 else "b.mp4"})
        out["fingerprint"] = None
    except FastRemoverError as e:
        out["fingerprint"] = str(e)

    # the VAE: 40 x 24 pixels -> 5 x 3 latent rows, uneven over 2 (3 + 2) and 3 ranks (2 + 2 + 1)
    vae = random_init_(WanVAE(WanVAEConfig(base_dim=8, num_res_blocks=1)), 5).eval()
    g = torch.Generator().manual_seed(7)
    z = torch.randn(1, 16, 2, 5, 3, generator=g)
    with torch.no_grad():
        serial = vae.decode(z) if ctx.is_root else None
    par = RowParallelDecoder(ctx, vae).decode(z)
    out["decode"] = (serial, par) if ctx.is_root else par is None
    video = torch.rand(1, 3, 5, 40, 24, generator=g) * 2 - 1
    mask = (torch.rand(1, 3, 5, 40, 24, generator=g) > 0.5).float()
    first, second = video * (1 - mask), 2 * mask - 1.0
    pair = encode_pair(ctx, vae, first if ctx.rank == 0 else None, second if ctx.rank == 1 else None)
    if ctx.is_root:
        out["encode"] = (pair, (vae.encode(first), vae.encode(second)))
    else:
        out["encode"] = pair is None
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request):
    """Every rank's results of `_rank_checks`, one launch per world size."""
    t = time.monotonic()
    results = spawn(_rank_checks, request.param, threads=1, timeout_s=SPAWN_TIMEOUT_S,
                    collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    print(f"{request.param} ranks: {time.monotonic() - t:.1f} s")
    return results


# ----------------------------------------------------------------------------------------------------------------------
# Sequence-parallel denoise


@pytest.mark.parametrize("i", range(len(SHAPES)), ids=["15-tokens", "16-tokens"])
def test_sequence_parallel_denoise_equals_one_process(ranks, i):
    """Eager module and fast transformer (exact mode, eager ops, head groups pipelined), every rank: the latents
    after the denoise loop are torch.equal to one process's. Exact because each token's adaLN / norm / GEMM row and
    each head's attention is the same computation (the CPU kernels do not depend on the row or head count here: at
    least 4 token rows per rank - with 3 or fewer the CPU BLAS takes another GEMM kernel, whose rows differ in the
    last bit) and the flow prediction is gathered, not reduced."""
    for rank, res in enumerate(ranks):
        for name in (f"eager{i}", f"exact_groups{i}"):
            ref, got = res[name]
            assert torch.equal(ref, got), (rank, name, rel_err(got, ref))


def test_fp8_transport_denoise_within_tolerance(ranks):
    """--sp-transport fp8 (q/k/v as e4m3 + a scale per (row, head) on the wire, 16-bit attention): the latents after
    2 steps within 1e-2 (max relative error; 1.8e-3 seen) of the exact run, and not equal to it (the lossy path
    ran). Each q/k/v element moves by at most 2^-4 of itself (transport.py); the same for any number of ranks, since
    the quantization is per (row, head)."""
    for rank, res in enumerate(ranks):
        ref, got = res["eager_fp8_transport"]
        err = rel_err(got, ref)
        print(f"rank {rank} of {len(ranks)}: fp8 transport max rel. error {err:.2e}")
        assert 0 < err <= 1e-2, (rank, err)


def test_fp8_attention_path_within_tolerance(ranks):
    """The fast mode's 8-bit attention under Ulysses (codes on the wire; K's centre and V's mean / amax
    all-reduced): within 1e-4 of the single-process fp8 run (1.4e-7 seen). Not equal by construction: the sequence
    means are summed per rank and then across ranks (another order than torch.mean), so the centre and scale differ
    in the last bits (a V code at a rounding tie could move by one step). A rank using its own statistics instead
    would centre and scale the V rows of different ranks differently: far outside this bound."""
    for rank, res in enumerate(ranks):
        ref, got = res["fp8_attention"]
        print(f"rank {rank} of {len(ranks)}: 8-bit attention path max rel. error {rel_err(got, ref):.2e}")
        assert rel_err(got, ref) <= 1e-4, (rank, rel_err(got, ref))


def test_ulysses_exchange_round_trips_codes_exactly(ranks):
    """e4m3 codes (the fast mode's q/k/v) through the all-to-all and back, 13 tokens over 2 / 3 ranks: bit-exact."""
    assert all(res["codes_round_trip"] for res in ranks)


def test_graph_capture_is_all_ranks_or_none(ranks):
    """A capture that fails on one rank drops every rank's graph (their collectives must match); the failing rank
    names its error in one line, the others say another rank failed. When every rank captures, every rank keeps it."""
    last = len(ranks) - 1
    for rank, r in enumerate(ranks):
        assert r["capture_all_ok"] == ("graph", None)
        graph, why = r["capture_one_fails"]
        assert graph is None
        if rank == last:
            assert why == "capture failed (RuntimeError: operation not permitted when stream is capturing)"
        else:
            assert "another rank" in why


def test_replay_wait_raises_instead_of_hanging():
    from fastremover.engine.denoise import wait_for_replay

    class Event:
        def __init__(self, ready_after):
            self.calls, self.ready_after = 0, ready_after

        def query(self):
            self.calls += 1
            return self.calls > self.ready_after

    now = [0.0]

    def clock():
        return now[0]

    def sleep(dt):
        now[0] += dt

    ev = Event(ready_after=5)
    wait_for_replay(None, 10.0, event=ev, clock=clock, sleep=sleep)
    assert ev.calls == 6
    with pytest.raises(ParallelError, match=r"rank 1: the denoise loop's CUDA graph did not finish within 2 s"):
        wait_for_replay(None, 2.0, 1, event=Event(ready_after=10**9), clock=clock, sleep=sleep)


def test_startup_fingerprint_mismatch_is_named(ranks):
    n = len(ranks)
    for res in ranks:
        assert res["fingerprint"] is not None and f"ranks [{n - 1}]" in res["fingerprint"], res["fingerprint"]


# ----------------------------------------------------------------------------------------------------------------------
# Parallel VAE


def test_parallel_decode_matches_serial(ranks):
    """Rows split over the ranks (uneven), halos before every spatial conv, the middle attention on the gathered
    frame: the video gathered on rank 0 is within 1e-5 (max relative difference) of WanVAE.decode, and torch.equal
    to it up to the first level whose RMS norm differs. Why not torch.equal everywhere: the eager RMS norm sums
    squares over the channel dim of an NCDHW tensor, and ATen's CPU sum groups those additions differently for
    different plane sizes (h * w), so a slab's channel sums can differ from the whole frame's in the last bit
    (tests/parallel/test_parallel.py::test_channel_sum_depends_on_the_plane_size shows it on plain tensors); the convs
    themselves (the kernel chosen as one process chooses it) and the gathered attention are exact."""
    serial, par = ranks[0]["decode"]
    assert par.shape == serial.shape
    print(f"{len(ranks)} ranks: decode max rel. difference {rel_err(par, serial):.2e}")
    assert rel_err(par, serial) <= 1e-5, rel_err(par, serial)
    assert all(res["decode"] is True for res in ranks[1:])


def test_channel_sum_depends_on_the_plane_size():
    """The one inexact op of the row-split decode (see above): per-pixel channel sums of the same values, over a
    whole [1, 16, 1, 20, 12] frame and over its first 11 rows, are not all bit-equal on the CPU."""
    torch.set_num_threads(1)
    x = torch.randn(1, 16, 1, 20, 12, generator=torch.Generator().manual_seed(0))
    full = x.square().sum(1, keepdim=True)[..., :11, :]
    slab = x[..., :11, :].contiguous().square().sum(1, keepdim=True)
    assert not torch.equal(full, slab) and torch.allclose(full, slab, rtol=1e-6, atol=0)


def test_parallel_encode_pair_equals_serial(ranks):
    """The masked video on rank 0 and the mask video on rank 1, at once: both latents torch.equal to serial encodes
    (the same module on the same input)."""
    (a, b), (ea, eb) = ranks[0]["encode"]
    assert torch.equal(a, ea) and torch.equal(b, eb)
    assert all(res["encode"] is True for res in ranks[1:])


# ----------------------------------------------------------------------------------------------------------------------
# Without processes


def test_fp8_transport_round_trip_within_e4m3_bound():
    """pack_fp8 / unpack_fp8 per (row, head): every element within 2^-4 |x| + 2^-10 scale (transport.py), rows with
    a wide dynamic range and all-zero rows included; the bound is not vacuous (some element is off by > 1/4 of it)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 6, 16, generator=g) * torch.logspace(-4, 3, 16)[torch.randperm(16, generator=g)]
    x[0, 0, 0] = 0.0
    packed = transport.pack_fp8(x)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 7, 6, 20)
    back = transport.unpack_fp8(packed, torch.float32)
    err, bound = (back - x).abs(), transport.fp8_round_trip_bound(x)
    assert bool((err <= bound).all()), (err / bound).max()
    assert (err / bound).max() > 0.25
    assert torch.equal(back[0, 0, 0], torch.zeros(16))
    # scales: amax / 448 per (row, head)
    scale = packed[..., 16:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / torch.tensor(448.0))


def test_degree_must_divide_heads():
    check_heads(12, 4)
    with pytest.raises(FastRemoverError, match=r"divisible by 5; this model has 12 attention heads \(usable degrees: "
                                               r"\[2, 3, 4, 6, 12\]\)"):
        check_heads(12, 5)
    # the attention hook refuses before any communication (this context has no process group)
    ctx = ParallelContext(rank=0, world_size=3, sequence_total=6)
    q = torch.zeros(1, 2, 2, 8)
    with pytest.raises(FastRemoverError, match="divisible by 3; this model has 2 attention heads"):
        ctx.attention(lambda q, k, v: q, q, q, q)


def test_parallel_flags_are_checked_before_anything_loads():
    ParallelOptions(mode="ulysses", world_size=2, transport="fp8", head_groups=3, timeout_s=60.0).validate()
    ParallelOptions().validate()  # the defaults: one process
    for kwargs, words in (({"mode": "ring"}, "--parallel 'ring'"), ({"mode": "ulysses", "world_size": 0}, "--gpus 0"),
                          ({"mode": "ulysses", "transport": "int8"}, "--sp-transport 'int8'"),
                          ({"mode": "ulysses", "head_groups": 0}, "--sp-head-groups 0"),
                          ({"mode": "ulysses", "timeout_s": -1}, "--parallel-timeout -1"),
                          ({"world_size": 2}, "need --parallel ulysses")):
        with pytest.raises(FastRemoverError, match=words.replace("(", r"\(")):
            EngineConfig(parallel=ParallelOptions(**kwargs))


def test_size_one_context_changes_nothing():
    """The default context (what every model holds): the hooks return their inputs / call the attention directly."""
    x = torch.randn(1, 5, 4)
    assert SINGLE.shard_tokens(x) is x and SINGLE.gather_tokens(x, 5) is x
    rope = (torch.randn(5, 2), torch.randn(5, 2))
    assert SINGLE.shard_rope(rope) is rope
    assert SINGLE.attention(lambda q, k, v: "called", x, x, x) == "called"
    y = torch.randn(2, 5, 3)
    assert torch.equal(SINGLE.sequence_mean(y), torch.mean(y, dim=1, dtype=torch.float32))
    assert split_sizes(7, 3) == [3, 2, 2]
    with pytest.raises(FastRemoverError, match="--sp-transport 'int4'"):
        ParallelContext(transport="int4")


# ----------------------------------------------------------------------------------------------------------------------
# A whole removal, and its failures


def test_the_engine_builds_the_parallel_denoiser_and_vae():
    """A context of several ranks given to the pipeline: the engine's build makes the sequence-parallel denoiser and
    VAE around the modules (no proxies swapped onto a built pipeline) and records the run's parallel shape. Building
    communicates nothing (this context has no process group)."""
    from fastremover.models.loading import random_models
    from fastremover.engine.parallel import ParallelDenoiser, ParallelVAE
    from fastremover.pipeline import RemovalPipeline

    ctx = ParallelContext(rank=0, world_size=2)
    pipe = RemovalPipeline(random_models("tiny", 0), EngineConfig(device="cpu", mode="eager"), parallel=ctx)
    assert isinstance(pipe.denoiser, ParallelDenoiser) and isinstance(pipe.vae, ParallelVAE)
    assert pipe.denoiser is pipe.engine.denoiser and pipe.engine.parallel.inner_denoiser.transformer.parallel is ctx
    assert pipe.engine.parallel.decoder is not None  # the eager VAE decodes by rows
    assert (pipe.config.parallel, pipe.config.world_size, pipe.config.sp_transport) == ("ulysses", 2, "fp16")
    assert pipe.vae.describe() == "eager (parallel over 2 ranks)"
    with pytest.raises(FastRemoverError, match="needs a model"):
        RemovalPipeline(None, EngineConfig(device="cpu"), parallel=ctx)
    one = RemovalPipeline(random_models("tiny", 0), EngineConfig(device="cpu", mode="eager"), parallel=SINGLE)
    assert one.engine.parallel is None and one.config.parallel == "none"


def _clip(tmp: Path) -> tuple[str, str]:
    from PIL import Image

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (5, 32, 48, 3), dtype=np.uint8)
    mask = np.zeros_like(frames)
    mask[:, 8:20, 10:30] = 255
    for name, arr in (("in", frames), ("mask", mask)):
        (tmp / name).mkdir()
        for i, f in enumerate(arr):
            Image.fromarray(f).save(tmp / name / f"{i:04d}.png")
    return str(tmp / "in"), str(tmp / "mask")


def _build_failing_on_rank1(source, config, ctx):
    """A pipeline whose transformer raises on rank 1 (the others run normally)."""
    import torch.distributed as dist

    from fastremover.parallel.launch import build_pipeline

    pipe = build_pipeline(source, config, ctx)
    if dist.get_rank() == 1:
        def boom(*args, **kwargs):
            raise ValueError("injected failure in the transformer")

        pipe.models.transformer.forward = boom
    return pipe


def test_parallel_remove_matches_serial_and_failures_stop_every_rank(tmp_path):
    """Tiny preset, 2 ranks (eager mode: the denoise under Ulysses, encodes on two ranks, decode by rows; through
    run_remove, what `remove --parallel ulysses --gpus 2` calls): the output frames match a one-process run's (at
    most one uint8 step apart, almost all equal). Then a rank that raises mid-run: every rank stops within the
    collective timeout (start-up included) with one message naming rank 1 and its error, and no output (not even a
    temporary file) is left. Then rank 0 failing its input check: the other rank stops with the same message."""
    from PIL import Image

    from fastremover.options import RunOptions
    from fastremover.worker import Job, RemovalWorker

    video, mask = _clip(tmp_path)
    source, config = ModelSource("random", preset="tiny"), EngineConfig(device="cpu", mode="eager")
    opts = RunOptions(steps=2, seed=1)
    RemovalWorker(source, config).run(Job(video, mask, str(tmp_path / "serial") + "/", options=opts))  # one process
    # what `remove --parallel ulysses --gpus 2 --device cpu` calls
    parallel = config.with_(parallel__mode="ulysses", parallel__world_size=2, parallel__timeout_s=COLLECTIVE_TIMEOUT_S)
    par = run_remove(source, parallel, Job(video, mask, str(tmp_path / "par") + "/", options=opts))
    assert par.describe["world_size"] == 2 and par.describe["parallel"] == "ulysses"
    # uint8 frames: the denoise is exact, the decode within 1e-5 (test_parallel_decode_matches_serial), so a pixel
    # may round to the other side of a step
    a, b = (np.stack([np.asarray(Image.open(p)) for p in sorted(Path(d).glob("*.png"))]).astype(int)
            for d in (tmp_path / "serial", tmp_path / "par"))
    assert a.shape == b.shape == (5, 32, 48, 3) and np.abs(a - b).max() <= 1 and (a != b).mean() < 1e-3

    before = sorted(os.listdir(tmp_path))
    t = time.monotonic()
    with pytest.raises(ParallelError, match="rank 1 failed: ValueError: injected failure in the transformer"):
        spawn(remove_rank, 2, (source, config, Job(video, mask, str(tmp_path / "broken") + "/", options=opts), None,
                               _build_failing_on_rank1),
              threads=1, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=FAILURE_TIMEOUT_S)
    assert time.monotonic() - t < FAILURE_TIMEOUT_S
    assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary file

    with pytest.raises(ParallelError, match="rank 0: .*missing.mp4"):
        spawn(remove_rank, 2, (source, config, Job(str(tmp_path / "missing.mp4"), mask, str(tmp_path / "x") + "/",
                                                   options=opts)),
              threads=1, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=FAILURE_TIMEOUT_S)
    assert sorted(os.listdir(tmp_path)) == before


# ----------------------------------------------------------------------------------------------------------------------
# GPU (unrun here)


def _nccl_checks(ctx):
    """NCCL: Ulysses exact-mode denoise on the GPUs equals one GPU's at a real head count (12 heads)."""
    from fastremover.engine.denoise import FastDenoiser
    from fastremover.fast.transformer_fast import FastTransformer
    from fastremover.models.loading import random_init_
    from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
    from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG as SCHED

    cfg = RemoverTransformerConfig(num_layers=2)
    model = random_init_(RemoverTransformer(cfg), 0).eval().to(ctx.device).to_inference_dtype(torch.float16)
    den = FastDenoiser(FastTransformer(model), SCHED, cuda_graphs=False)
    inputs = [t.to(ctx.device, torch.float16) for t in _latents((1, 16, 3, 30, 52))]
    ref, got = _denoise_pair(ctx, den, den.fast, inputs)
    return rel_err(got, ref)


def _nccl_graph_checks(ctx, num_layers=2):
    """The denoise loop with the collectives inside a CUDA graph (ctx: NCCL; on one GPU a one-rank group that still
    communicates, `always_communicate`): the replays equal the eager loop under the same context, exact and fp8."""
    from fastremover.engine.denoise import FastDenoiser, capture_pays
    from fastremover.fast.transformer_fast import FastTransformer
    from fastremover.models.loading import random_init_
    from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
    from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG as SCHED

    cfg = RemoverTransformerConfig(num_layers=num_layers)
    model = random_init_(RemoverTransformer(cfg), 0).eval().to(ctx.device).to_inference_dtype(torch.float16)
    out = {}
    for fp8 in (False, True):
        fast = FastTransformer(model, linear_method="fp8-rowwise" if fp8 else "dense")
        set_parallel(fast, ctx)
        eager = FastDenoiser(fast, SCHED, cuda_graphs=False)
        graphs = FastDenoiser(fast, SCHED, cuda_graphs=True)
        a = [t.to(ctx.device, torch.float16) for t in _latents((1, 16, 3, 30, 52))]
        b = [t.to(ctx.device, torch.float16) for t in _latents((1, 16, 3, 30, 52), seed=5)]
        ctx.comm_seconds = 0.0
        ref_a = eager(*a, STEPS)
        communicated = ctx.comm_seconds > 0
        # the fewest steps whose second call records (denoise.capture_pays: at 2 steps a recording does not pay)
        n = next(k for k in range(STEPS, 50) if capture_pays(k, 2))
        ref_a = eager(*a, n) if n != STEPS else ref_a
        first = graphs(*a, n)  # the first call of a shape runs eagerly
        graphs(*a, n)  # the second runs eagerly on a side stream, then records the loop
        captured = len(graphs._graphs)
        rep_a, rep_b, ref_b = graphs(*a, n), graphs(*b, n), eager(*b, n)
        out["fp8" if fp8 else "exact"] = {
            "communicated": communicated, "captured": captured, "notes": graphs.notes,
            "warmup_equal": torch.equal(first, ref_a), "replay_equal": torch.equal(rep_a, ref_a),
            "replay_new_inputs_equal": torch.equal(rep_b, ref_b), "inputs_differ": not torch.equal(ref_a, ref_b)}
    return out


@pytest.mark.gpu
def test_gpu_nccl_collectives_inside_cuda_graphs_one_gpu():
    """One GPU: a one-rank NCCL group whose hooks still run the all-to-alls, all-reduces and the gather, so the
    captured graph holds NCCL kernels; its replays equal the eager loop bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (res,) = spawn(_nccl_graph_checks, 1, device="cuda", timeout_s=600, collective_timeout_s=120,
                   always_communicate=True)
    for mode, r in res.items():
        assert r["communicated"] and r["captured"] == 1 and not r["notes"], (mode, r)
        assert r["warmup_equal"] and r["replay_equal"] and r["replay_new_inputs_equal"] and r["inputs_differ"], (mode,
                                                                                                                 r)


@pytest.mark.gpu
def test_gpu_nccl_collectives_inside_cuda_graphs_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    for res in spawn(_nccl_graph_checks, 2, device="cuda", timeout_s=600, collective_timeout_s=120):
        for mode, r in res.items():
            assert r["communicated"] and r["captured"] == 1 and not r["notes"], (mode, r)
            assert r["warmup_equal"] and r["replay_equal"] and r["replay_new_inputs_equal"], (mode, r)


@pytest.mark.gpu
def test_gpu_nccl_sequence_parallel_denoise():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    errs = spawn(_nccl_checks, 2, device="cuda", timeout_s=600, collective_timeout_s=120)
    assert max(errs) <= 1e-2, errs
