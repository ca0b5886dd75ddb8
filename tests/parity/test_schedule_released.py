"""--schedule: the released pipeline's UniPC schedule (diffusers 0.33.1's, the default) and today's diffusers one."""

import types

import numpy as np
import pytest
import torch

from fastremover.config import EngineConfig
from fastremover.errors import FastRemoverError
from fastremover.masks import dilate_masks
from fastremover.media import synthetic_clip
from fastremover.models.loading import random_models
from fastremover.options import RunOptions
from fastremover.pipeline import RemovalPipeline
from fastremover.schedulers import DEFAULT_SCHEDULE, DEFAULT_SCHEDULER_CONFIG, SCHEDULES, build_scheduler

# Recorded facts: timesteps and sigmas of UniPCMultistepScheduler.from_config(DEFAULT_SCHEDULER_CONFIG) after
# set_timesteps(n) under diffusers==0.33.1 (the release MiniMax-Remover's requirements.txt pins), produced once in a
# throwaway venv with that release (diffusers 0.33.1, torch 2.13.0 CPU) and pasted here. The sigmas are float32 values
# written as the Python floats they convert to exactly.
RELEASED = {
    6: ([999, 937, 856, 749, 599, 374],
        [0.9996664524078369, 0.9371482133865356, 0.8567752838134766, 0.7496247887611389, 0.5996398329734802,
         0.37471866607666016, 0.0]),
    12: ([999, 970, 937, 899, 856, 807, 749, 681, 599, 499, 374, 214],
         [0.9996664524078369, 0.9702454805374146, 0.9371482133865356, 0.8996397852897644, 0.8567752838134766,
          0.8073193430900574, 0.7496247887611389, 0.6814461350440979, 0.5996398329734802, 0.4996665418148041,
          0.37471866607666016, 0.21410201489925385, 0.0]),
    50: ([999, 992, 985, 978, 971, 963, 956, 948, 939, 931, 922, 913, 904, 894, 884, 874, 864, 853, 841, 829, 817, 805,
          792, 778, 764, 749, 734, 718, 701, 684, 666, 647, 627, 606, 585, 562, 538, 512, 486, 458, 428, 396, 363, 327,
          290, 249, 206, 160, 111, 57],
         [0.9996664524078369, 0.9929074645042419, 0.9859633445739746, 0.9788264632225037, 0.9714885950088501,
          0.9639410972595215, 0.9561749696731567, 0.9481804966926575, 0.9399474263191223, 0.9314650297164917,
          0.9227216839790344, 0.9137052297592163, 0.9044026732444763, 0.8948001265525818, 0.8848828673362732,
          0.8746352195739746, 0.8640403151512146, 0.8530802130699158, 0.8417357206344604, 0.8299862146377563,
          0.8178097009658813, 0.8051823973655701, 0.7920788526535034, 0.7784715294837952, 0.7643308639526367,
          0.7496247887611389, 0.7343188524246216, 0.7183754444122314, 0.7017540335655212, 0.6844102740287781,
          0.666296124458313, 0.6473590731620789, 0.6275417804718018, 0.6067813038825989, 0.5850088000297546,
          0.5621483325958252, 0.5381162762641907, 0.5128201842308044, 0.48615768551826477, 0.45801493525505066,
          0.42826521396636963, 0.3967667818069458, 0.36336082220077515, 0.32786861062049866, 0.290088415145874,
          0.24979163706302643, 0.20671816170215607, 0.16057077050209045, 0.11100821942090988, 0.05763683095574379,
          0.0]),
}
# diffusers >= 0.37 at 12 steps (the figures): every timestep from the fourth on is one higher or more.
DIFFUSERS_12 = [999, 970, 937, 900, 857, 807, 750, 682, 600, 500, 376, 216]


def test_default_schedule_is_the_released_one():
    assert DEFAULT_SCHEDULE == "minimax-remover" == RunOptions().schedule
    assert SCHEDULES == ("minimax-remover", "diffusers")


@pytest.mark.parametrize("steps", sorted(RELEASED))
def test_released_schedule_reproduces_diffusers_0331(steps):
    timesteps, sigmas = RELEASED[steps]
    for sched in (build_scheduler(None, steps),
                  build_scheduler(DEFAULT_SCHEDULER_CONFIG, steps, "cpu", "minimax-remover")):
        assert torch.equal(sched.timesteps, torch.tensor(timesteps, dtype=torch.float32))
        assert torch.equal(sched.sigmas, torch.tensor(sigmas, dtype=torch.float32))


def test_diffusers_schedule_is_todays():
    sched = build_scheduler(None, 12, schedule="diffusers")
    assert sched.timesteps.tolist() == DIFFUSERS_12
    assert sched.sigmas[0].item() == pytest.approx(0.999999, abs=1e-6)
    assert sched.sigmas[-2].item() == pytest.approx(0.216303, abs=1e-6)
    assert not torch.equal(sched.sigmas, build_scheduler(None, 12).sigmas)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_both_schedules_are_precomputed_device_tensors(schedule):
    # Graph-capturable: on the meta device any host work inside step (.item(), a CPU tensor) would raise.
    sched = build_scheduler(None, 12, device="meta", schedule=schedule)
    assert all(v.device.type == "meta" for v in vars(sched).values() if isinstance(v, torch.Tensor))
    x = torch.empty((1, 16, 2, 4, 4), device="meta", dtype=torch.float16)
    for i in range(12):
        x = sched.step(i, torch.empty_like(x), x)
    assert x.device.type == "meta"


def test_euler_is_the_same_under_both_names():
    # diffusers 0.33.1 and 0.42 build FlowMatchEulerDiscreteScheduler's schedule identically (checked with both).
    euler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}
    a, b = (build_scheduler(euler, 12, schedule=s) for s in SCHEDULES)
    assert torch.equal(a.sigmas, b.sigmas) and torch.equal(a.timesteps, b.timesteps)


def test_options_refuse_an_unknown_schedule():
    with pytest.raises(FastRemoverError, match="--schedule"):
        RunOptions(schedule="0.33.1").validate()


class _Ctx:
    """A rank of a 2-rank run without a process group: tensors pass unchanged; rank 0's announcements are recorded,
    the other rank receives `commands`."""

    def __init__(self, rank: int, commands=()):
        self.rank, self.world_size, self.is_root = rank, 2, rank == 0
        self.sent, self.commands = [], list(commands)

    def broadcast_tensor(self, t):
        return t

    def broadcast_object(self, obj):
        if obj is None:
            return self.commands.pop(0)
        self.sent.append(obj)
        return obj


class _Inner:
    """A one-process denoiser that records the schedule of each call."""

    cuda_graphs = False

    def __init__(self):
        self.schedules = []

    def parallelize(self, ctx):
        pass

    def __call__(self, noise, masked_latents, mask_latents, steps, progress=None, schedule=DEFAULT_SCHEDULE):
        self.schedules.append((steps, schedule))
        return noise


def test_the_schedule_reaches_every_rank():
    # Rank 0's denoiser announces the schedule with the stage; a following rank runs the one it is told.
    from fastremover.engine.parallel import ParallelEngine

    x = torch.zeros(1)
    vae = types.SimpleNamespace(config=None, device=torch.device("cpu"), dtype=torch.float32)  # decodes on rank 0
    root = ParallelEngine(_Ctx(0), 2, _Inner(), vae)
    root.denoiser(x, x, x, 3, schedule="diffusers")
    assert root.ctx.sent == [("denoise", 3, "diffusers")] and root.inner_denoiser.schedules == [(3, "diffusers")]
    follower = ParallelEngine(_Ctx(1, [*root.ctx.sent, ("stop",)]), 2, _Inner(), vae)
    follower.follow()
    assert follower.inner_denoiser.schedules == [(3, "diffusers")]


# ---------------------------------------------------------------------------------------------------------------------
# The reference (diffusers >= 0.38) runs either schedule; whole-pipeline trajectories per schedule


def test_reference_reproduces_both_schedules_for_every_step_count():
    pytest.importorskip("diffusers", reason="diffusers (the oracle; in the dev extra) is not installed")
    import diffusers

    from fastremover.bench.reference import set_diffusers_timesteps

    for schedule in SCHEDULES:
        for steps in list(range(1, 31)) + [50, 100]:
            ref = diffusers.UniPCMultistepScheduler.from_config(DEFAULT_SCHEDULER_CONFIG)
            set_diffusers_timesteps(ref, steps, "cpu", schedule)
            ours = build_scheduler(None, steps, schedule=schedule)
            assert torch.equal(ref.timesteps.float(), ours.timesteps), (schedule, steps)
            assert torch.equal(ref.sigmas, ours.sigmas), (schedule, steps)
    ref = diffusers.UniPCMultistepScheduler.from_config(DEFAULT_SCHEDULER_CONFIG)
    set_diffusers_timesteps(ref, 12, "cpu", "minimax-remover")
    assert ref.timesteps.tolist() == RELEASED[12][0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_whole_pipeline_follows_the_schedule_it_is_given():
    pytest.importorskip("diffusers", reason="diffusers (the oracle; in the dev extra) is not installed")
    from fastremover.bench.reference import ReferencePipeline

    video, mask = synthetic_clip(5, 32, 48, seed=3)
    frames, seed = video.frames, 2
    models = random_models("tiny", seed=seed)
    ref = ReferencePipeline(models, device="cpu", dtype=torch.float32)
    pipe = RemovalPipeline(models, EngineConfig(device="cpu", precision="fp32"))
    prep = pipe.prepare(frames, dilate_masks(mask, 2), size=(48, 32))
    encoded = pipe.encode(prep)
    ours, theirs = {}, {}
    for schedule in SCHEDULES:
        theirs[schedule] = ref(frames, mask, height=32, width=48, steps=4, seed=seed, iterations=2,
                               schedule=schedule).latents
        ours[schedule] = pipe.denoise(*encoded, steps=4, seed=seed, schedule=schedule)
        # The engine and the upstream-order reference agree on each schedule (measured: about 3e-7)...
        assert rel_err(ours[schedule], theirs[schedule]) <= 1e-5
    # ... and the schedules give different samples (measured: 6e-2 to 9e-2 relative on this tiny model).
    assert rel_err(ours["minimax-remover"], theirs["diffusers"]) > 1e-2
    assert rel_err(ours["diffusers"], theirs["minimax-remover"]) > 1e-2
    # RunOptions.schedule reaches the denoiser through remove(): one window, whole frame, the same latents.
    for schedule in SCHEDULES:
        options = RunOptions(steps=4, seed=seed, dilate=2, size="48x32", crop="off", schedule=schedule)
        result = pipe.remove(frames, mask, options)
        assert torch.equal(result.latents, ours[schedule].float().cpu()), schedule


# ---------------------------------------------------------------------------------------------------------------------
# The released pipeline's other behaviours: truncation to uint8, the dropped frame tail, --upstream-compatible


@pytest.fixture(scope="module")
def tiny_pipe():
    return RemovalPipeline(random_models("tiny", seed=0), EngineConfig(device="cpu", precision="fp32"))


def test_rounding_truncate_is_upstreams_export(tiny_pipe):
    video, mask = synthetic_clip(5, 32, 48, seed=1)
    by = {}
    for rounding in ("round", "truncate"):
        options = RunOptions(steps=2, composite=False, crop="off", rounding=rounding)
        by[rounding] = tiny_pipe.remove(video.frames, mask, options, keep_pixels=True)
    pixels = by["truncate"].pixels[0].permute(1, 2, 3, 0)[:5]
    assert torch.equal(by["round"].pixels, by["truncate"].pixels)  # the same decode, only the last cast differs
    # upstream: postprocess_video's (x * 0.5 + 0.5).clamp(0, 1) then export_to_video's (frame * 255).astype(uint8)
    assert np.array_equal(by["truncate"].frames, ((pixels * 0.5 + 0.5).clamp(0, 1).numpy() * 255).astype(np.uint8))
    assert np.array_equal(by["round"].frames, ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().numpy().astype(np.uint8))
    assert not np.array_equal(by["round"].frames, by["truncate"].frames)


def test_drop_tail_keeps_the_largest_4k1_prefix():
    from fastremover.pipeline import _DropTail

    for n in range(0, 14):
        tail = _DropTail(iter(range(n)))
        kept = list(tail)
        expected = (n - 1) // 4 * 4 + 1 if n else 0
        assert kept == list(range(expected)) and tail.dropped == n - expected, n


def test_frame_tail_drop_in_remove_and_remove_stream(tiny_pipe):
    video, mask = synthetic_clip(10, 16, 16, seed=2)
    options = RunOptions(steps=1, frame_tail="drop", crop="off")
    whole = tiny_pipe.remove(video.frames, mask, options)
    assert len(whole.frames) == 9 and any("last 1 frame" in n for n in whole.notes)
    # The same 9 frames as a 9-frame clip: the tenth never reaches the model.
    assert np.array_equal(whole.frames, tiny_pipe.remove(video.frames[:9], mask[:9], options).frames)
    emitted = []
    streamed = tiny_pipe.remove_stream(zip(video.frames, mask), emitted.append, options)
    assert streamed.num_frames == 9 and np.array_equal(np.stack(emitted), whole.frames)
    assert any("last 1 frame" in n for n in streamed.notes)


def test_upstream_compatible_options():
    from fastremover.options import UPSTREAM_COMPATIBLE, upstream_compatible

    options = upstream_compatible(RunOptions(steps=6, dilate=3))
    assert (options.steps, options.dilate) == (6, 3)
    assert {k: getattr(options, k) for k in UPSTREAM_COMPATIBLE} == {
        "schedule": "minimax-remover", "rounding": "truncate", "frame_tail": "drop", "composite": False, "crop": "off"}
    for conflict, flag in ((dict(crop="on"), "--crop"), (dict(schedule="diffusers"), "--schedule")):
        with pytest.raises(FastRemoverError, match=flag):
            upstream_compatible(RunOptions(**conflict))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean()
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_upstream_compatible_matches_the_released_pipelines_order():
    # The upstream-order reference with 0.33.1's schedule and upstream's export (truncation, 4k+1 frames, no
    # compositing) against `--upstream-compatible` (tools/upstream_diff.py measures 93 dB at 12 steps; the defaults
    # are about 14 dB away with random weights, mostly compositing).
    pytest.importorskip("diffusers", reason="diffusers (the oracle; in the dev extra) is not installed")
    from fastremover.bench.reference import ReferencePipeline
    from fastremover.options import upstream_compatible

    models = random_models("tiny", seed=5)
    video, mask = synthetic_clip(6, 32, 32, seed=4)
    ref = ReferencePipeline(models, device="cpu", dtype=torch.float32)
    up = ref(video.frames[:5], mask[:5], height=32, width=32, steps=4, seed=7, iterations=6)
    theirs = ((up.pixels[0] * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).numpy() * 255).astype(np.uint8)
    pipe = RemovalPipeline(models, EngineConfig(device="cpu", precision="fp32"))
    ours = pipe.remove(video.frames, mask, upstream_compatible(RunOptions(steps=4, seed=7))).frames
    assert ours.shape == theirs.shape == (5, 32, 32, 3)
    assert psnr(ours, theirs) >= 80
    defaults = pipe.remove(video.frames, mask, RunOptions(steps=4, seed=7)).frames
    assert psnr(defaults[:5], theirs) < 40


def test_cli_upstream_compatible(tmp_path, capsys):
    from fastremover import media
    from fastremover.cli import main

    video, mask = synthetic_clip(6, 32, 32, seed=0)
    v, m = tmp_path / "in.mp4", tmp_path / "m.mp4"
    media.write_video(v, video.frames, 24)
    media.write_video(m, np.repeat(mask[..., None].astype(np.uint8) * 255, 3, axis=-1), 24)
    out = tmp_path / "out/"
    args = ["remove", v, "--mask", m, "-o", f"{out}/", "--model", "random", "--preset", "tiny", "--steps", "1",
            "--quiet", "--upstream-compatible"]
    assert main([str(a) for a in args]) == 0, capsys.readouterr().err
    assert len(list(out.glob("*.png"))) == 5  # 6 frames: the released pipeline keeps 4k+1 = 5
    code = main([str(a) for a in args + ["--crop", "on"]])
    err = capsys.readouterr().err
    assert code == 2 and "--upstream-compatible sets --crop off" in err and "Traceback" not in err


def test_the_service_and_batch_manifests_take_a_schedule(tmp_path):
    # The service's option field and a batch manifest's column; a bad value names --schedule (a 400 / a plan error).
    from fastremover.batch.plan import plan_batch

    for name in ("v.mp4", "m.mp4"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "list.csv").write_text("video,mask,output,schedule\nv.mp4,m.mp4,a.mp4,diffusers\nv.mp4,m.mp4,b.mp4,\n")
    named, default = plan_batch(tmp_path / "list.csv", tmp_path / "out").tasks
    assert (named.job.options.schedule, default.job.options.schedule) == ("diffusers", DEFAULT_SCHEDULE)
    (tmp_path / "bad.csv").write_text("video,mask,schedule\nv.mp4,m.mp4,0.33.1\n")
    with pytest.raises(FastRemoverError, match="bad.csv:2: --schedule '0.33.1'"):
        plan_batch(tmp_path / "bad.csv", tmp_path / "out")

    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from fastremover.serve.app import options_dict, parse_options

    options = parse_options({"schedule": "diffusers", "steps": "3"})
    assert options.schedule == "diffusers" and options_dict(options)["schedule"] == "diffusers"
    assert parse_options({}).schedule == DEFAULT_SCHEDULE
    with pytest.raises(FastRemoverError, match="--schedule"):
        parse_options({"schedule": "0.33.1"})
