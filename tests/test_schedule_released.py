"""--schedule: the released pipeline's UniPC schedule (diffusers 0.33.1's, the default) and today's diffusers one."""

import numpy as np
import pytest
import torch

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
    for sched in (build_scheduler(None, steps), build_scheduler(DEFAULT_SCHEDULER_CONFIG, steps, "cpu", "minimax-remover")):
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


# ---------------------------------------------------------------------------------------------------------------------
# The reference (diffusers >= 0.38) runs either schedule; whole-pipeline trajectories per schedule


def test_reference_reproduces_both_schedules_for_every_step_count():
    pytest.importorskip("diffusers")
    import diffusers

    from fastremover.bench.reference import set_diffusers_timesteps

    for schedule in SCHEDULES:
        for steps in list(range(1, 61)) + [100, 1000]:
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
    pytest.importorskip("diffusers")
    from fastremover.bench.reference import ReferencePipeline

    video, mask = synthetic_clip(9, 40, 56, seed=3)
    frames, seed = video.frames, 2
    models = random_models("tiny", seed=seed)
    ref = ReferencePipeline(models, device="cpu", dtype=torch.float32)
    pipe = RemovalPipeline(models, device="cpu", precision="fp32")
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
    assert not np.array_equal(*(pipe.remove(frames, mask, RunOptions(steps=4, seed=seed, dilate=2, schedule=s)).frames
                                for s in SCHEDULES))
