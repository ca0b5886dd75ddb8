"""fastremover/fast/cudnn_conv.py: cuDNN plans for the fast VAE's convs that give torch's bits faster.

CPU: the selection rule (`choose`) and the per-signature flow of `ConvPlans` with plain functions standing in for
cuDNN's plans and a fake clock; the gating (CUDA, fp16/bf16, the environment switch). GPU (`gpu` marker): at the
W2 encoder's full-resolution conv a plan is chosen and its output is torch.equal to F.conv3d on fresh inputs; the
whole fast VAE at W2 gives torch.equal latents and video with and without the plans.
"""

import pytest
import torch
import torch.nn.functional as F

from fastremover.config import FastVAEOptions
from fastremover.errors import FastRemoverError
from fastremover.fast import cudnn_conv
from fastremover.fast.cudnn_conv import ConvPlans, choose


def _conv(x, w):
    return F.conv3d(x, w, None, 1, (0, 1, 1))


def _inputs(seed=0, c=4, t=4, h=6, w=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, c, t, h, w, generator=g), torch.randn(c, c, 3, 3, 3, generator=g)


def _clock(times):
    """time_ms for `choose`: the ms of whichever function is timed, looked up by what it computes."""
    def time_ms(fn):
        time_ms.calls.append(fn)
        return times[len(time_ms.calls) - 1]
    time_ms.calls = []
    return time_ms


def test_choose_keeps_only_plans_that_reproduce_torch_and_takes_the_fastest():
    x, w = _inputs()
    probe, _ = _inputs(1)

    def same(xi, out):
        out.copy_(_conv(xi, w))

    def other_order(xi, out):  # the same conv summed in float64: off by an ulp in some elements
        out.copy_(F.conv3d(xi.double(), w.double(), None, 1, (0, 1, 1)).float())

    def live_only(xi, out):  # equal on the call's input, wrong on any other: the probe must catch it
        out.copy_(_conv(x, w))

    def broken(xi, out):
        raise RuntimeError("plan does not run")

    assert not torch.equal(F.conv3d(x.double(), w.double(), None, 1, (0, 1, 1)).float(), _conv(x, w))
    cands = {"other": other_order, "live": live_only, "broken": broken, "same": same}
    clock = _clock([10.0, 4.0])  # torch's conv, then the one kept candidate
    c = choose(lambda xi: _conv(xi, w), cands, [(x, _conv(x, w)), (probe, _conv(probe, w))], clock)
    assert c.name == "same" and c.run is same and c.equal_candidates == ["same"]
    assert c.torch_ms == 10.0 and c.ms == 4.0
    assert set(c.rejected) == {"other", "live", "broken"}
    assert "differs" in c.rejected["other"] and "differs" in c.rejected["live"] and "RuntimeError" in c.rejected["broken"]
    assert len(clock.calls) == 2  # rejected candidates are never timed


@pytest.mark.parametrize("times, want", [([10.0, 9.8], "torch"),  # within MIN_GAIN: torch's call
                                          ([10.0, 12.0, 8.0], "b"),  # the fastest of two equal ones
                                          ([10.0, 9.0, 9.5], "a")])
def test_choose_needs_a_real_gain(times, want):
    x, w = _inputs()

    def run(xi, out):
        out.copy_(_conv(xi, w))

    cands = {"a": run, "b": lambda xi, out: run(xi, out)}
    if len(times) == 2:
        cands = {"a": run}
    c = choose(lambda xi: _conv(xi, w), cands, [(x, _conv(x, w))], _clock(times))
    assert c.name == want and (c.run is None) == (want == "torch")


class _FakePlans:
    """Stands in for the cuDNN graph: plan 'good' computes torch's conv, 'off' adds one to an element."""

    builds = 0

    def __init__(self, x, weight, y, stride, padding, names):
        type(self).builds += 1
        self.built = {n: i for i, n in enumerate(names) if n in ("good", "off")}
        self.failed = {n: "not offered for this conv" for n in names if n not in self.built}
        self.runs = 0

    def run(self, index, x, weight, y):
        self.runs += 1
        type(self).last = self
        y.copy_(F.conv3d(x, weight, None, 1, (0, 1, 1)))
        if index == 1:  # "off"
            y.view(-1)[0] += 1


def test_conv_plans_first_call_chooses_then_runs_the_plan(monkeypatch):
    _FakePlans.builds = 0
    plans = ConvPlans(torch.device("cpu"), candidates=("good", "off", "missing"), min_gflop=0.0,
                      builder=_FakePlans, time_ms=_clock([5.0, 1.0, 5.0, 1.0]))
    x, w = _inputs()
    y1 = plans.conv(x, w, 1, (0, 1, 1))  # the first call: torch's output
    assert torch.equal(y1, _conv(x, w)) and _FakePlans.builds == 1
    (choice,) = plans.choices.values()
    assert choice.name == "good" and set(choice.rejected) == {"off", "missing"}
    fake = _FakePlans.last
    before = fake.runs
    for seed in (5, 6):
        xs, _ = _inputs(seed)
        assert torch.equal(plans.conv(xs, w, (1, 1, 1), [0, 1, 1]), _conv(xs, w))  # same signature: the plan runs
    assert fake.runs == before + 2 and _FakePlans.builds == 1
    (row,) = plans.report()
    assert row["plan"] == "good" and row["torch_ms"] == 5.0 and row["ms"] == 1.0 and row["rejected"] == 2
    x2, w2 = _inputs(7, t=5)  # another signature: its own first call
    assert torch.equal(plans.conv(x2, w2, 1, (0, 1, 1)), _conv(x2, w2)) and _FakePlans.builds == 2


class _SizeDependentPlans(_FakePlans):
    """'good' computes torch's conv except at inputs of 9 columns, where it sums in another order (one ulp off)."""

    def run(self, index, x, weight, y):
        super().run(index, x, weight, y)
        if x.shape[-1] == 9:
            y.view(-1)[1] = torch.nextafter(y.view(-1)[1], torch.tensor(float("inf")))


def test_a_new_size_of_a_known_conv_takes_its_choice_after_the_equality_checks():
    """Another crop size of a conv whose choice was measured (rows and columns; the chunk length is kept): its plan is
    built alone and used without timing if it reproduces torch's output on the call's input and a random one; a
    plan that differs at the new size is measured in full (and not chosen); a class whose measured choice was
    torch's call takes it with no build; another weight is another class."""
    _SizeDependentPlans.builds = 0
    clock = _clock([5.0, 1.0, 5.0, 5.0, 1.0, 5.0, 1.0])
    plans = ConvPlans(torch.device("cpu"), candidates=("good", "off"), min_gflop=0.0, builder=_SizeDependentPlans,
                      time_ms=clock, cache=None)
    x, w = _inputs()
    plans.conv(x, w, 1, (0, 1, 1))
    assert _SizeDependentPlans.builds == 1 and len(clock.calls) == 2
    x2, _ = _inputs(3, h=8, w=5)
    assert torch.equal(plans.conv(x2, w, 1, (0, 1, 1)), _conv(x2, w))
    choice = plans.choices.get((3, tuple(x2.shape), x2.stride(), tuple(w.shape), w.stride(), x2.dtype, (1, 1, 1),
                                (0, 1, 1)))
    assert choice.name == "good" and choice.inferred and _SizeDependentPlans.builds == 2 and len(clock.calls) == 2
    xs, _ = _inputs(4, h=8, w=5)
    assert torch.equal(plans.conv(xs, w, 1, (0, 1, 1)), _conv(xs, w))  # the inferred plan runs from then on
    x3, _ = _inputs(5, w=9)  # 'good' is off by an ulp here: the full choice, which keeps torch's call
    assert torch.equal(plans.conv(x3, w, 1, (0, 1, 1)), _conv(x3, w))
    assert _SizeDependentPlans.builds == 4 and len(clock.calls) == 3  # a build for the hint, one for the full choice
    choice = plans.choices.get((3, tuple(x3.shape), x3.stride(), tuple(w.shape), w.stride(), x3.dtype, (1, 1, 1),
                                (0, 1, 1)))
    assert choice.name == "torch" and not choice.inferred
    x4, _ = _inputs(6, h=5)  # the class's last measured choice is now torch's call: no build, no timing
    assert torch.equal(plans.conv(x4, w, 1, (0, 1, 1)), _conv(x4, w))
    assert _SizeDependentPlans.builds == 4 and len(clock.calls) == 3
    w5 = torch.randn(4, 4, 1, 3, 3)  # another weight shape: its own class, measured in full
    plans.conv(x, w5, 1, (0, 1, 1))
    assert _SizeDependentPlans.builds == 5
    x6, _ = _inputs(8, t=5, h=8, w=5)  # another chunk length: its own class too
    plans.conv(x6, w, 1, (0, 1, 1))
    assert _SizeDependentPlans.builds == 6


def test_small_convs_and_unaligned_inputs_keep_torchs_call():
    _FakePlans.builds = 0
    plans = ConvPlans(torch.device("cpu"), candidates=("good",), builder=_FakePlans, time_ms=_clock([1.0, 0.1]))
    x, w = _inputs()  # a few kFLOP, far below MIN_GFLOP
    assert torch.equal(plans.conv(x, w, 1, (0, 1, 1)), _conv(x, w))
    assert _FakePlans.builds == 0 and plans.report() == []
    (choice,) = plans.choices.values()
    assert choice.name == "torch"
    plans = ConvPlans(torch.device("cpu"), candidates=("good",), min_gflop=0.0, builder=_FakePlans,
                      time_ms=_clock([1.0, 0.1]))
    base = torch.randn(1 * 4 * 4 * 6 * 7 + 1)
    odd = base[1:].view(1, 4, 4, 6, 7)  # data pointer 4 bytes past an allocation: not 16-byte aligned
    assert torch.equal(plans.conv(odd, w, 1, (0, 1, 1)), _conv(odd, w))
    assert _FakePlans.builds == 0 and not plans.choices


def test_gating_and_the_environment_switch(monkeypatch):
    from fastremover.env import KernelTuning
    from fastremover.fast.vae import FastWanVAE
    from fastremover.models.loading import PRESETS, random_init_
    from fastremover.models.vae import WanVAE, WanVAEConfig

    assert "CUDA" in cudnn_conv.available(torch.device("cpu"), torch.float16)
    if torch.cuda.is_available():
        assert "fp16/bf16" in cudnn_conv.available(torch.device("cuda"), torch.float32)
    assert KernelTuning.from_env({"FASTREMOVER_CUDNN_CONV_PLANS": "0"}).cudnn_conv_plans is False
    assert KernelTuning().cudnn_conv_plans is True
    vae = random_init_(WanVAE(WanVAEConfig.from_dict(PRESETS["tiny"]["vae"])), 0).eval()
    assert FastWanVAE(vae, device="cpu", dtype=torch.float32).convs.plans is None
    with pytest.raises(FastRemoverError, match="conv_plans=True: cuDNN plans need a CUDA device"):
        FastWanVAE(vae, device="cpu", dtype=torch.float32, options=FastVAEOptions(conv_plans=True))
    with pytest.raises(ValueError, match="conv_plans must be"):
        FastWanVAE(vae, device="cpu", dtype=torch.float32, options=FastVAEOptions(conv_plans="yes"))


# ---------------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_plan_at_the_w2_encoder_conv_gives_torchs_bits():
    """The encoder's full-resolution 96 -> 96 conv as the fast VAE calls it at W2 (2 cached + 2 new frames,
    channels-last fp16): a plan is chosen, and on fresh inputs its output equals F.conv3d's bit for bit."""
    if cudnn_conv.available(torch.device("cuda"), torch.float16):
        pytest.skip(cudnn_conv.available(torch.device("cuda"), torch.float16))
    dev, cl = torch.device("cuda"), torch.channels_last_3d
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(96, 96, 3, 3, 3, device=dev, generator=g) * 0.03).half().contiguous(memory_format=cl)
    plans = ConvPlans(dev)
    first = torch.randn(1, 96, 4, 480, 832, device=dev, generator=g).half().contiguous(memory_format=cl)
    assert torch.equal(plans.conv(first, w, (1, 1, 1), (0, 1, 1)), F.conv3d(first, w, None, 1, (0, 1, 1)))
    (choice,) = plans.choices.values()
    print(f"W2 encoder conv: {choice.name} {choice.ms:.3f} ms vs torch's {choice.torch_ms:.3f} ms; "
          f"{len(choice.equal_candidates)} equal candidates, rejected {choice.rejected}")
    assert choice.run is not None, f"no faster plan with torch's bits: {choice.rejected}"
    for seed in (1, 2, 3):
        x = (torch.randn(1, 96, 4, 480, 832, device=dev, generator=g) * seed).half().contiguous(memory_format=cl)
        assert torch.equal(plans.conv(x, w, (1, 1, 1), (0, 1, 1)), F.conv3d(x, w, None, 1, (0, 1, 1)))


@pytest.mark.gpu
def test_gpu_fast_vae_w2_same_bits_with_and_without_plans(monkeypatch, tmp_path):
    """The whole fast VAE at W2 (81 x 480 x 832, fp16, random weights), then at a crop of another size (41 x 320 x
    640, whose convs take the W2 choices of their classes after the equality checks, untimed): both removal encodes
    and the decode give torch.equal results with conv_plans on and off, and plans ran for some of the convs."""
    from fastremover import media
    from fastremover.fast.vae import FastWanVAE
    from fastremover.models.loading import random_init_
    from fastremover.models.vae import WanVAE, WanVAEConfig

    if cudnn_conv.available(torch.device("cuda"), torch.float16):
        pytest.skip(cudnn_conv.available(torch.device("cuda"), torch.float16))
    monkeypatch.setenv("FASTREMOVER_CACHE_DIR", str(tmp_path / "cache"))  # an empty cache: every choice made here
    monkeypatch.setattr("fastremover.cache._default", None)  # (the process's own cache is put back afterwards)
    dev = torch.device("cuda")
    vae = random_init_(WanVAE(WanVAEConfig()), 1).eval()
    inputs = []
    for frames, h, w in ((81, 480, 832), (41, 320, 640)):
        clip, mask = media.synthetic_clip(frames, h, w, seed=0)
        x = torch.from_numpy(clip.frames).to(dev).permute(3, 0, 1, 2)[None].half().div_(127.5).sub_(1.0)
        m = torch.from_numpy(mask).to(dev)[None, None].expand(1, 3, -1, -1, -1).half().contiguous()
        inputs.append((x, m))
    outs = {}
    for on in (False, True):
        fast = FastWanVAE(vae, device=dev, dtype=torch.float16, options=FastVAEOptions(conv_plans=on))
        for size, (x, m) in enumerate(inputs):
            fast.encode_removal_inputs(x, m)  # the plans' first calls (and Triton's compiles)
            za, zb = fast.encode_removal_inputs(x, m)
            outs[on, size] = (za, zb, fast.decode(za))
        if on:
            rows = fast.convs.plans.report()
            chosen = [r for r in rows if r["plan"] != "torch"]
            ms = (lambda v: "untimed" if v is None else f"{v:.3f}")
            print(f"plans for {len(chosen)} of {len(rows)} signatures ({sum(r['inferred'] for r in rows)} from "
                  "their class): " + "; ".join(f"{r['x']} {ms(r['torch_ms'])}->{ms(r['ms'])} ms" for r in chosen))
            assert chosen, rows
            assert any(r["inferred"] and r["plan"] != "torch" for r in rows), rows
        del fast
    for size in range(len(inputs)):
        for a, b in zip(outs[False, size], outs[True, size]):
            assert torch.equal(a, b)
