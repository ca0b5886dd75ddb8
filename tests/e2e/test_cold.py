"""A user's first run: -v / -q after the subcommand, `fastremover warmup`, the phase timers and `--timings-json`,
progress that counts finished GPU work, weights loaded straight to their place, and `fastremover bench --cold`
end to end on the tiny model (fresh processes; no time is asserted)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastremover import media, timing
from fastremover.cli import build_parser, main
from fastremover.config import EngineConfig
from helpers import REPO



def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    video, mask = media.synthetic_clip(5, 32, 48, seed=0)
    media.write_video(folder / "in.mp4", video.frames, video.fps)
    media.write_video(folder / "mask.mp4", np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), video.fps)
    return folder / "in.mp4", folder / "mask.mp4"


# ----------------------------------------------------------------------------------------------------------------------
# The command line


def test_verbosity_flags_after_the_subcommand():
    parse = build_parser().parse_args
    base = ["remove", "v.mp4", "--mask", "m.mp4", "-o", "o.mp4"]
    assert parse(base).verbosity == 0
    assert parse([*base, "-v"]).verbosity == 1 and parse([*base, "--verbose"]).verbosity == 1
    assert parse([*base, "-q"]).verbosity == -1
    assert parse(["-q", *base]).verbosity == -1  # before the subcommand, as before
    assert parse(["-q", *base, "-v"]).verbosity == 1  # the later one wins
    assert parse(["info", "-v"]).verbosity == 1 and parse(["bench", "-q"]).verbosity == -1
    with pytest.raises(SystemExit):
        parse([*base, "-v", "-q"])


def test_v_after_remove_prints_debug_records(clip, tmp_path, capsys):
    video, mask = clip
    assert main(["remove", str(video), "--mask", str(mask), "-o", str(tmp_path / "o.mp4"), "--quiet", "-v"]) == 0
    assert "fastremover: debug: engine" in capsys.readouterr().err


def test_warmup_help_does_not_import_torch():
    code = ("import sys\nfrom fastremover.cli import main\ntry:\n    main(['warmup', '--help'])\nexcept SystemExit as e:"
            "\n    assert e.code == 0\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "--sizes" in proc.stdout and "persistent cache" in proc.stdout


def test_warmup_runs_each_size_and_refuses_bad_sizes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FASTREMOVER_CACHE_DIR", str(tmp_path / "cache"))
    from fastremover import cache

    cache.reset_default_cache()
    try:
        assert main(["warmup", "--sizes", "48x32", "--frames", "5", "--preset", "tiny", "--steps", "1",
                     "--quiet"]) == 0
        out = capsys.readouterr().out
        assert "warmed 48x32 (5 frames)" in out and str(tmp_path / "cache") in out
        assert main(["warmup", "--sizes", "50x32", "--preset", "tiny"]) == 2
        assert "multiples of 16" in capsys.readouterr().err
        assert main(["warmup", "--model", "classic"]) == 2
    finally:
        cache.reset_default_cache()


def test_timings_json_of_a_remove_run(clip, tmp_path, capsys):
    video, mask = clip
    out, record = tmp_path / "o.mp4", tmp_path / "t.json"
    assert main(["remove", str(video), "--mask", str(mask), "-o", str(out), "--model", "random", "--preset", "tiny",
                 "--steps", "1", "--quiet", "--timings-json", str(record)]) == 0
    data = json.loads(record.read_text())
    assert {"main", "first_frame"} <= set(data["marks_unix"])
    assert data["marks_unix"]["main"] <= data["first_frame_unix"] <= data["end_unix"]
    assert {"imports", "weights_init", "host_to_device", "quantize", "vae_setup"} <= set(data["phases_s"])
    assert len(data["windows_s"]) == 1 and data["num_frames"] == 5 and "denoise" in data["stages_s"]
    assert data["cache"]["root"] and data["engine"]["mode"] == "eager"
    before = video.read_bytes()
    assert main(["remove", str(video), "--mask", str(mask), "-o", str(out), "--timings-json", str(video)]) == 2
    assert "--timings-json" in capsys.readouterr().err and video.read_bytes() == before


#: What a model run from a local checkpoint folder (eager, CPU) must not import: the reference's and the service's
#: libraries, the Hub client (the model is a folder), Triton (no kernel runs in the eager mode), torch's compiler, the
#: classic fill, the box-mask trackers, the H3 decoder, and the front ends other than `remove`.
NOT_IMPORTED_BY_A_MODEL_RUN = ("diffusers", "scipy", "huggingface_hub", "fastapi", "uvicorn", "ray", "triton",
                               "torch._dynamo", "torch._inductor", "fastremover.bench", "fastremover.classic",
                               "fastremover.masktools.build", "fastremover.masktools.track",
                               "fastremover.models.h3_decoder", "fastremover.fast.h3_nvfp4", "fastremover.serve.app",
                               "fastremover.batch.driver", "fastremover.parallel.launch")

RUN_THEN_LIST_MODULES = ("import json, sys\nfrom fastremover.cli import main\nrc = main(sys.argv[2:])\n"
                         "open(sys.argv[1], 'w').write(json.dumps(sorted(n for n, m in sys.modules.items() "
                         "if m is not None)))\nsys.exit(rc)\n")


def test_a_model_run_imports_only_what_it_runs(clip, tmp_path):
    """`remove` with a checkpoint folder (tiny, eager, CPU) in a fresh process: the modules it must not import are
    absent at the end (every one of them is installed here, or the check would be empty: see the skip)."""
    from importlib.util import find_spec

    from fastremover.models import loading

    absent = [n for n in ("diffusers", "scipy", "huggingface_hub", "fastapi", "ray", "triton") if not find_spec(n)]
    if absent:
        pytest.skip(f"not installed, so not importing them proves nothing: {absent}")
    video, mask = clip
    ckpt = loading.save_checkpoint(loading.random_models("tiny", 1), tmp_path / "ck")
    listing, out = tmp_path / "modules.json", tmp_path / "o.mp4"
    argv = ["remove", str(video), "--mask", str(mask), "-o", str(out), "--model", str(ckpt), "--mode", "eager",
            "--device", "cpu", "--steps", "1", "--quiet"]
    proc = subprocess.run([sys.executable, "-c", RUN_THEN_LIST_MODULES, str(listing), *argv], capture_output=True,
                          text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "mode eager" in proc.stdout and media.read_video(out).num_frames == 5
    loaded = set(json.loads(listing.read_text()))
    assert {"torch", "fastremover.pipeline", "safetensors"} <= loaded  # it did run the model from the folder
    assert not [n for n in NOT_IMPORTED_BY_A_MODEL_RUN if n in loaded]


def test_triton_compiles_are_timed_from_the_first_kernel_import_not_before():
    """`time_triton_compiles` (the engine's build calls it on a GPU) does not import Triton; the first kernel module
    that does starts the timing."""
    pytest.importorskip("triton", reason="Triton is not installed")
    code = ("import sys\nfrom fastremover import timing\nassert timing.time_triton_compiles()\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n"
            "import fastremover.fast.kernels._common\nfrom triton.runtime.jit import JITFunction\n"
            "assert timing._triton_timed and JITFunction._do_compile.__module__ == 'fastremover.timing'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------------------------------------------------
# Timers and progress


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_phases_are_exclusive_and_marks_keep_the_first_time(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    rec = timing.PhaseRecorder()
    with rec.phase("build"):
        clock.now += 1
        with rec.phase("autotune"):
            clock.now += 2
            with rec.phase("triton_compile"):
                clock.now += 4
            with rec.phase("autotune"):  # re-entered: counted once, by the outer block
                clock.now += 8
        clock.now += 16
    assert rec.seconds == {"build": 17, "autotune": 10, "triton_compile": 4}
    assert rec.counts == {"build": 1, "autotune": 1, "triton_compile": 1}
    rec.mark("first_frame")
    first = rec.marks["first_frame"]
    rec.mark("first_frame")
    assert rec.marks["first_frame"] == first


def test_request_clock_records_windows_and_the_first_frame():
    seen = []
    clock = timing.RequestClock(lambda *a: seen.append(a))
    for event in [("window", 0, 2), ("denoise", 1, 2), ("frames", 1, 9), ("frames", 2, 9), ("window", 1, 2),
                  ("window", 2, 2)]:
        clock(*event)
    assert len(clock.window_ends) == 2 and len(clock.windows_s()) == 2 and clock.first_frame is not None
    assert len(seen) == 6  # every event reaches the wrapped callback


class _FakeEvent:
    finished: set = set()
    count = 0

    def __init__(self):
        type(self).count += 1
        self.id = type(self).count

    def record(self, stream=None):
        pass

    def query(self):
        return self.id in type(self).finished

    def synchronize(self):
        type(self).finished.add(self.id)


def test_finished_work_reports_steps_when_the_gpu_has_finished_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _FakeEvent.finished, _FakeEvent.count = set(), 0
    seen = []
    progress = timing.finished_work(lambda *a: seen.append(a), torch.device("cuda"))
    assert isinstance(progress, timing.FinishedWork)
    for step in (1, 2, 3):
        progress("denoise", step, 3)  # queued: nothing has finished
    assert seen == []
    _FakeEvent.finished.add(1)
    progress("vae_decode", 1, 5)  # another stage: the finished step first, then this event
    assert seen == [("denoise", 1, 3), ("vae_decode", 1, 5)]
    progress("window", 1, 1)  # a window ends after all its steps
    assert seen[2:] == [("denoise", 2, 3), ("denoise", 3, 3), ("window", 1, 1)]
    cpu = lambda *a: None  # noqa: E731
    assert timing.finished_work(cpu, torch.device("cpu")) is cpu and timing.finished_work(None, "cuda") is None


# ----------------------------------------------------------------------------------------------------------------------
# Weights straight to their place


def test_weights_built_in_place_equal_the_fp32_path_cast(tmp_path):
    from fastremover.models import loading
    from fastremover.models.transformer import RemoverTransformer
    from fastremover.models.vae import WanVAE

    models = loading.random_models("tiny", 3)
    loading.save_checkpoint(models, tmp_path / "ck")
    old = loading.load_checkpoint(tmp_path / "ck")
    for cls, name, cfg in ((RemoverTransformer, "transformer", old.transformer.config),
                           (WanVAE, "vae", old.vae.config)):
        placed = loading._on_device(cls, cfg, torch.device("cpu"), torch.bfloat16)
        assert all(p.device.type == "cpu" for p in placed.parameters())
        loading.load_safetensors_into(placed, tmp_path / "ck" / name, name)
        ref = getattr(old, name)
        ref = ref.to_inference_dtype(torch.bfloat16) if name == "transformer" else ref.to(torch.bfloat16)
        want, got = ref.state_dict(), placed.state_dict()
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert placed.state_dict()  # the transformer's fp32 islands stayed fp32 (checked through the dtypes above)
    assert any(v.dtype == torch.float32 for v in loading._on_device(
        RemoverTransformer, old.transformer.config, torch.device("cpu"), torch.float16).state_dict().values())


def test_building_in_place_imports_no_sympy_or_dynamo():
    """The meta-device build of both models (what a CUDA load does before it copies the weights in) runs no Python
    decomposition: a draw, a division or an empty_like of a meta tensor imports sympy / torch._dynamo on its first
    use (seconds in a fresh GPU process). Fresh process; CPU as the target device."""
    code = ("import sys, torch\n"
            "from fastremover.models import loading\n"
            "from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig\n"
            "from fastremover.models.vae import WanVAE, WanVAEConfig\n"
            "assert 'sympy' not in sys.modules\n"
            "for cls, cfg in ((RemoverTransformer, RemoverTransformerConfig()), (WanVAE, WanVAEConfig())):\n"
            "    m = loading._on_device(cls, cfg, torch.device('cpu'), torch.float16)\n"
            "    assert all(p.is_contiguous() and p.device.type == 'cpu' for p in m.parameters())\n"
            "bad = [n for n in ('sympy', 'torch._dynamo', 'torch.fx.experimental.symbolic_shapes') if n in sys.modules]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_checkpoint_that_does_not_match_is_one_clear_error_in_place(tmp_path):
    from fastremover.errors import FastRemoverError
    from fastremover.models import loading
    from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig

    models = loading.random_models("tiny", 0)
    loading.save_checkpoint(models, tmp_path / "ck")
    wider = RemoverTransformerConfig.from_dict({**models.transformer.config.to_dict(), "ffn_dim": 96})
    placed = loading._on_device(RemoverTransformer, wider, torch.device("cpu"), torch.float32)
    with pytest.raises(FastRemoverError, match="wrong shape"):
        loading.load_safetensors_into(placed, tmp_path / "ck" / "transformer", "transformer")


def test_random_weights_on_the_cpu_are_unchanged():
    """The CPU path draws what it always drew (the device path only changes GPU runs)."""
    from fastremover.models import loading

    a = loading.random_models("tiny", 0)
    b = loading.load_models("random", "tiny", 0)
    assert all(torch.equal(x, y) for x, y in zip(a.transformer.state_dict().values(),
                                                 b.transformer.state_dict().values()))
    w = a.transformer.state_dict()["blocks.0.attn1.to_q.weight"]
    assert w.dtype == torch.float32 and w.device.type == "cpu"


def test_phase_delta_is_what_the_process_spent_since_the_copy():
    from fastremover.bench.cold import phase_delta
    from fastremover.timing import PHASES

    saved = dict(PHASES.seconds), dict(PHASES.counts)
    try:
        PHASES._add("graph_capture", 0.5, 1)
        before = dict(PHASES.seconds)
        PHASES._add("graph_capture", 0.25, 1)
        PHASES._add("cudnn_graphs_test", 0.125, 1)
        PHASES._add("autotune_test", 0.0001, 1)  # below a millisecond: left out
        delta = phase_delta(before)
    finally:
        PHASES.reset()
        PHASES.seconds.update(saved[0])
        PHASES.counts.update(saved[1])
    assert delta["graph_capture"] == 0.25 and delta["cudnn_graphs_test"] == 0.125
    assert "autotune_test" not in delta


# ----------------------------------------------------------------------------------------------------------------------
# bench --cold end to end


@pytest.mark.slow
def test_bench_cold_end_to_end_on_the_tiny_model(tmp_path, capsys):
    """The whole harness on the CPU: two fresh `fastremover remove` processes, the reference's process, the warm
    worker, two new-shape clips and the padding cost; the JSON has every field the issue asks for."""
    pytest.importorskip("diffusers", reason="the reference's process needs diffusers (the reference extra)")
    assert main(["bench", "--cold", "--workload", "w2", "--preset", "tiny", "--cold-clip", "5x64x48", "--steps", "1",
                 "--shape-clips", "2", "--shape-frames", "5", "--padding-cost", "--capture-costs", "--repeats", "0",
                 "--precompile-variants", "background", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cold-w2-eager-*.json")
    record = json.loads(path.read_text())
    for key in ("gpu", "commit", "command", "engine_first_run_s", "engine_second_run_s", "engine_warm_s",
                "reference_cold_s", "reference_warm_s", "first_frame_s", "new_shape_ratio", "phases"):
        assert record[key] is not None, key
    assert {"startup", "imports", "weights_read", "window_1"} <= set(record["phases"])
    assert record["host"]["python_loop_mops"] > 0  # (harness.host: which machine of a GPU kind ran it)
    assert record["outputs_identical"] and len(record["new_shape_clips"]) == 2
    assert all(isinstance(c["first_phases_s"], dict) for c in record["new_shape_clips"])
    assert record["first_frame_s"] < record["engine_first_run_s"]
    assert record["reference"]["frames"] == 5 and record["reference"]["size"] == "64x48"
    assert {"buckets_0", "buckets_4", "time_ratio", "pixel_ratio"} <= set(record["padding_cost"])
    assert record["engine_first"]["cache"]["enabled"]
    at = record["engine_second"]["milestones_s"]  # in the order they happen, from the spawn
    assert list(at)[:3] == ["main", "engine_ready", "request_start"] and "first_frame" in at
    assert 0 < at["main"] < at["engine_ready"] <= at["request_start"] < at["first_frame"]
    assert "CUDA" in record["capture_costs"]["skipped"]  # a GPU step of the harness: a flag, skipped here with why
    variant = record["precompile_variants"]["background"]  # (a no-op on the CPU: its own runs, the same bytes)
    assert variant["outputs_identical"] and variant["engine_first_run_s"] > 0 and "window_1" in variant["phases"]
    out = capsys.readouterr().out
    assert "engine first run" in out and "precompile background: first run" in out
    assert main(["bench", "--cold", "--workload", "w2", "--precompile-variants", "later"]) == 2
    assert "--precompile-variants 'later'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# GPU (run by the device tool)


@pytest.mark.gpu
def test_gpu_weights_on_the_device_equal_the_host_path_and_the_output_too(tmp_path):
    from fastremover.models import loading
    from fastremover.pipeline import RemovalPipeline

    loading.save_checkpoint(loading.random_models("tiny", 1), tmp_path / "ck")
    direct = loading.load_checkpoint(tmp_path / "ck", device="cuda", dtype=torch.float16)
    host = loading.load_checkpoint(tmp_path / "ck")
    host.transformer.to("cuda").to_inference_dtype(torch.float16)
    for k, v in host.transformer.state_dict().items():
        got = direct.transformer.state_dict()[k]
        assert got.device.type == "cuda" and got.dtype == v.dtype and torch.equal(got, v), k
    for k, v in host.vae.state_dict().items():
        got = direct.vae.state_dict()[k]
        assert got.device.type == "cpu" and got.dtype == torch.float16 and torch.equal(got, v.half()), k
    a = loading.random_models("tiny", 0, device="cuda", dtype=torch.float16)
    b = loading.random_models("tiny", 0, device="cuda", dtype=torch.float16)
    assert all(torch.equal(x, y) for x, y in zip(a.transformer.state_dict().values(),
                                                 b.transformer.state_dict().values()))
    video, mask = media.synthetic_clip(9, 64, 96, seed=0)
    from fastremover.options import RunOptions

    opts = RunOptions(steps=2)
    config = EngineConfig(device="cuda", mode="eager")
    one = RemovalPipeline.from_model(str(tmp_path / "ck"), config=config).remove(video.frames, mask, opts)
    two = RemovalPipeline(loading.load_checkpoint(tmp_path / "ck"), config).remove(video.frames, mask, opts)
    assert np.array_equal(one.frames, two.frames)


@pytest.mark.gpu
def test_gpu_conv_plan_choice_from_the_cache_gives_torchs_bits(tmp_path):
    import torch.nn.functional as F

    from fastremover.cache import PersistentCache
    from fastremover.fast import cudnn_conv

    why = cudnn_conv.available(torch.device("cuda"), torch.float16)
    if why:
        pytest.skip(why)
    x = torch.randn(1, 96, 4, 240, 416, device="cuda", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last_3d)
    w = torch.randn(96, 96, 3, 3, 3, device="cuda", dtype=torch.float16).contiguous(
        memory_format=torch.channels_last_3d) * 0.05
    want = F.conv3d(x, w, None, 1, (0, 1, 1))
    first = cudnn_conv.ConvPlans(torch.device("cuda"), cache=PersistentCache(tmp_path))
    assert torch.equal(first.conv(x, w, 1, (0, 1, 1)), want)
    second = cudnn_conv.ConvPlans(torch.device("cuda"), cache=PersistentCache(tmp_path))
    assert torch.equal(second.conv(x, w, 1, (0, 1, 1)), want)
    (c1,), (c2,) = first.choices.values(), second.choices.values()
    assert not c1.cached and c2.cached and c2.name == c1.name
    x2 = torch.randn_like(x)
    assert torch.equal(second.conv(x2, w, 1, (0, 1, 1)), F.conv3d(x2, w, None, 1, (0, 1, 1)))


@pytest.mark.gpu
def test_gpu_denoise_progress_counts_finished_steps(monkeypatch):
    """On the GPU a step is reported once its work has finished: when the callback sees step d, the event recorded
    behind step d (the d-th plain event created) has completed."""
    from fastremover.models.loading import random_models
    from fastremover.options import RunOptions
    from fastremover.pipeline import RemovalPipeline

    created = []
    real = torch.cuda.Event

    def event(*args, **kwargs):
        e = real(*args, **kwargs)
        if not args and not kwargs:  # FinishedWork's (the stage timer's carry enable_timing=True)
            created.append(e)
        return e

    monkeypatch.setattr(torch.cuda, "Event", event)
    pipe = RemovalPipeline(random_models("tiny", 0), EngineConfig(device="cuda", mode="eager"))
    video, mask = media.synthetic_clip(9, 64, 96, seed=0)
    seen = []

    def progress(stage, done, total):
        if stage == "denoise":
            seen.append((done, created[done - 1].query()))

    pipe.remove(video.frames, mask, RunOptions(steps=4), progress=progress)
    assert [d for d, _ in seen] == [1, 2, 3, 4] and all(ok for _, ok in seen) and len(created) >= 4
