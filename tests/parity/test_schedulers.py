"""fastremover.schedulers against diffusers' schedulers (the oracle), step by step, plus config handling."""

import json

import pytest
import torch

import fastremover.schedulers as schedulers
from fastremover.errors import FastRemoverError
from fastremover.schedulers import DEFAULT_SCHEDULE, DEFAULT_SCHEDULER_CONFIG, SCHEDULES, build_scheduler, load_scheduler_config

diffusers = pytest.importorskip("diffusers", reason="diffusers (the oracle; in the dev extra) is not installed")
from fastremover.bench.reference import set_diffusers_timesteps  # noqa: E402  (the reference's way to either schedule)

UNIPC = DEFAULT_SCHEDULER_CONFIG
EULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.33.1", "shift": 3.0}
SHAPE = (1, 16, 3, 8, 8)


def reference(config: dict, num_steps: int, device: str = "cpu", schedule: str = DEFAULT_SCHEDULE):
    """diffusers' scheduler with `schedule`: its own ("diffusers"), or 0.33.1's UniPC sigmas given to it
    ("minimax-remover"; tests/parity/test_schedule_released.py pins them to 0.33.1's values)."""
    cls = getattr(diffusers, config["_class_name"])
    ref = cls.from_config(config)
    set_diffusers_timesteps(ref, num_steps, device, schedule)
    return ref


def trajectories(config: dict, num_steps: int, dtype=torch.float32, device="cpu", seed=0, skip_schedule_check=False,
                 schedule: str = DEFAULT_SCHEDULE):
    """Run ours and diffusers from the same initial sample with the same fresh random model output at every step."""
    ours = build_scheduler(config, num_steps, device=device, schedule=schedule)
    ref = reference(config, num_steps, device, schedule)
    if not skip_schedule_check:
        # The exact values the transformer sees (diffusers' UniPC holds them as int64).
        assert torch.equal(ours.timesteps.cpu(), ref.timesteps.cpu().float())
        assert torch.equal(ours.sigmas.cpu(), ref.sigmas.cpu())
    gen = torch.Generator().manual_seed(seed)
    x_ours = x_ref = torch.randn(SHAPE, generator=gen).to(device, dtype)
    outs_ours, outs_ref = [], []
    for i, t in enumerate(ref.timesteps):
        model_output = torch.randn(SHAPE, generator=gen).to(device, dtype)
        x_ref = ref.step(model_output, t, x_ref).prev_sample
        x_ours = ours.step(i, model_output, x_ours)
        assert x_ours.dtype == x_ref.dtype
        outs_ours.append(x_ours)
        outs_ref.append(x_ref)
    return outs_ours, outs_ref


def max_diff(outs_ours, outs_ref) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(outs_ours, outs_ref))


# --------------------------------------------------------------------------------------------------------------
# fp32 parity: every step within 1e-6 (in practice bit-identical on CPU)


@pytest.mark.parametrize("num_steps", [6, 12, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_euler_matches_diffusers(shift, num_steps):
    assert max_diff(*trajectories({**EULER, "shift": shift}, num_steps)) <= 1e-6


@pytest.mark.parametrize(
    "extra", [{"shift_terminal": 0.1}, {"num_train_timesteps": 500}, {"time_shift_type": "linear", "max_shift": 2.0}]
)
def test_euler_options_match_diffusers(extra):
    assert max_diff(*trajectories({**EULER, **extra}, 12)) <= 1e-6


@pytest.mark.parametrize("num_steps", [6, 12, 50])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unipc_default_config_matches_diffusers(num_steps, schedule):
    assert max_diff(*trajectories(UNIPC, num_steps, schedule=schedule)) <= 1e-6


@pytest.mark.parametrize("num_steps", [6, 12, 50])
@pytest.mark.parametrize("solver_type", ["bh1", "bh2"])
@pytest.mark.parametrize("solver_order", [1, 2, 3])
def test_unipc_orders_match_diffusers(solver_order, solver_type, num_steps):
    # bh1 into a final sigma of 0 is NaN in diffusers (see test_unipc_bh1_into_zero_lands_on_x0), so bh1 runs here
    # with final_sigmas_type="sigma_min".
    final = "sigma_min" if solver_type == "bh1" else "zero"
    config = {**UNIPC, "solver_order": solver_order, "solver_type": solver_type, "final_sigmas_type": final}
    assert max_diff(*trajectories(config, num_steps)) <= 1e-6


@pytest.mark.parametrize(
    "extra",
    [
        {"flow_shift": 1.0},
        {"flow_shift": 5.0},
        {"lower_order_final": False, "final_sigmas_type": "sigma_min"},
        {"lower_order_final": False, "final_sigmas_type": "sigma_min", "solver_type": "bh1"},
        {"lower_order_final": False, "solver_order": 1},
        {"lower_order_final": False, "solver_order": 3, "final_sigmas_type": "sigma_min", "num_steps": 2},
        {"solver_order": 3, "final_sigmas_type": "sigma_min"},
        {"disable_corrector": [0, 3]},
        {"solver_order": 3, "disable_corrector": [1]},
        {"shift_terminal": 0.05, "schedule": "diffusers"},
        {"timestep_spacing": "trailing"},
        {"timestep_spacing": "leading", "steps_offset": 1},
        {"solver_type": "midpoint"},
        {"num_train_timesteps": 500},
        {"_diffusers_version": "0.33.1", "some_future_key": 1},
    ],
)
def test_unipc_options_match_diffusers(extra):
    extra = dict(extra)
    num_steps = extra.pop("num_steps", 12)
    schedule = extra.pop("schedule", DEFAULT_SCHEDULE)
    assert max_diff(*trajectories({**UNIPC, **extra}, num_steps, schedule=schedule)) <= 1e-6


def test_released_schedule_has_no_shift_terminal():
    # diffusers 0.33.1's UniPC knows no shift_terminal: refused rather than silently ignored or applied.
    with pytest.raises(FastRemoverError, match="shift_terminal"):
        build_scheduler({**UNIPC, "shift_terminal": 0.05}, 6)
    build_scheduler({**UNIPC, "shift_terminal": 0.05}, 6, schedule="diffusers")


@pytest.mark.parametrize("schedule", ["0.33.1", "", None])
def test_unknown_schedule(schedule):
    with pytest.raises(FastRemoverError, match="--schedule"):
        build_scheduler(None, 6, schedule=schedule)


def test_unipc_single_step_matches_diffusers():
    assert max_diff(*trajectories({**UNIPC, "solver_order": 3}, 1)) <= 1e-6


def test_unipc_bh1_into_zero_lands_on_x0():
    # diffusers computes a_t * B(h) * 0 = -inf * 0 on the last bh1 step into sigma = 0 and returns NaN; the first-order
    # update there is exactly the x0 prediction, which is what we return. All earlier steps match diffusers.
    config = {**UNIPC, "solver_type": "bh1"}
    ours = build_scheduler(config, 6)
    ref = reference(config, 6)
    gen = torch.Generator().manual_seed(0)
    x_ours = x_ref = torch.randn(SHAPE, generator=gen)
    for i, t in enumerate(ref.timesteps):
        model_output = torch.randn(SHAPE, generator=gen)
        x0 = x_ours - ours.sigmas[i] * model_output
        x_ref = ref.step(model_output, t, x_ref).prev_sample
        x_ours = ours.step(i, model_output, x_ours)
        if i < 5:
            assert (x_ours - x_ref).abs().max() <= 1e-6
    assert torch.equal(x_ours, x0)


def test_reset_replays_identically():
    sched = build_scheduler({**UNIPC, "solver_order": 3}, 8)
    gen = torch.Generator().manual_seed(1)
    x_start = torch.randn(SHAPE, generator=gen)
    model_outputs = [torch.randn(SHAPE, generator=gen) for _ in range(8)]
    finals = []
    for _ in range(2):
        sched.reset()
        x = x_start
        for i, mo in enumerate(model_outputs):
            x = sched.step(i, mo, x)
        finals.append(x)
    assert torch.equal(*finals)
    with pytest.raises(RuntimeError, match="in order"):
        sched.step(3, model_outputs[0], x_start)


# --------------------------------------------------------------------------------------------------------------
# low precision (the pipeline runs fp16 latents and fp16 model outputs)

LOW = [torch.float16, torch.bfloat16]
UNIPC_CONFIGS = pytest.mark.parametrize("config", [UNIPC, {**UNIPC, "solver_order": 3}], ids=["order2", "order3"])


@pytest.mark.parametrize("dtype", LOW)
def test_euler_low_precision_matches_diffusers(dtype):
    outs_ours, outs_ref = trajectories(EULER, 12, dtype)
    assert all(torch.equal(a, b) for a, b in zip(outs_ours, outs_ref))


@pytest.mark.parametrize("dtype", LOW)
@UNIPC_CONFIGS
def test_unipc_low_precision_rounding_matches_diffusers_on_cpu(config, dtype, monkeypatch):
    # Every rounding point is diffusers'. The one intended difference: diffusers' UniPC multiplies the model output by
    # a CPU 0-dim sigma, which CUDA applies unrounded but CPU kernels round to fp16 first; we follow CUDA. With the
    # CPU rule swapped in, the runs are bit-identical.
    monkeypatch.setattr(schedulers, "_scaled", lambda coef, x: coef * x)
    outs_ours, outs_ref = trajectories(config, 12, dtype)
    assert all(torch.equal(a, b) for a, b in zip(outs_ours, outs_ref))


@pytest.mark.parametrize("dtype", LOW)
@UNIPC_CONFIGS
def test_unipc_low_precision_close_to_diffusers_on_cpu(config, dtype):
    # As built (CUDA's rule), against diffusers on the CPU: the two round the x0 prediction differently now and then,
    # by one unit in the last place; over 12 steps the samples stay within 4 units in the last place of their
    # magnitude (|x| < 8 here: fp16 unit 2**-8, bf16 unit 2**-5; 2 units seen).
    outs_ours, outs_ref = trajectories(config, 12, dtype)
    unit = 2.0**-8 if dtype == torch.float16 else 2.0**-5
    assert max(b.abs().max().item() for b in outs_ref) < 8
    assert max_diff(outs_ours, outs_ref) <= 4 * unit


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_steps", [12, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "config",
    [UNIPC, {**UNIPC, "solver_order": 3}, {**UNIPC, "solver_order": 1}, EULER],
    ids=["unipc2", "unipc3", "unipc1", "euler"],
)
def test_matches_diffusers_on_cuda(config, dtype, num_steps, schedule):
    # On the GPU, built on the GPU, every rounding and every coefficient is diffusers' (>= 0.38) own.
    outs_ours, outs_ref = trajectories(config, num_steps, dtype, device="cuda", schedule=schedule)
    assert all(torch.equal(a, b) for a, b in zip(outs_ours, outs_ref))


# --------------------------------------------------------------------------------------------------------------
# no host work in step


@pytest.mark.parametrize("config", [UNIPC, {**UNIPC, "solver_order": 3}, EULER], ids=["unipc2", "unipc3", "euler"])
def test_step_is_pure_device_work(config):
    # On the meta device tensors have no values: .item(), bool(tensor) or a tensor made on the CPU inside step
    # would raise here, and every schedule tensor must have moved.
    sched = build_scheduler(config, 12, device="meta")
    tensors = {name: v for name, v in vars(sched).items() if isinstance(v, torch.Tensor)}
    assert {"timesteps", "sigmas"} <= tensors.keys()
    assert all(v.device.type == "meta" and v.dtype == torch.float32 for v in tensors.values())
    x = torch.empty(SHAPE, device="meta", dtype=torch.float16)
    for i in range(12):
        x = sched.step(i, torch.empty_like(x), x)
    assert x.device.type == "meta" and x.shape == SHAPE and x.dtype == torch.float16


@pytest.mark.gpu
@pytest.mark.parametrize("config", [UNIPC, {**UNIPC, "solver_order": 3}, EULER], ids=["unipc2", "unipc3", "euler"])
def test_cuda_graph_replays_the_loop(config):
    # Capture fails on any host sync inside step; the replay must follow new inputs like an eager run.
    num_steps = 12
    sched = build_scheduler(config, num_steps, device="cuda")
    x_start = torch.empty(SHAPE, device="cuda", dtype=torch.float16)
    model_outputs = torch.empty((num_steps, *SHAPE), device="cuda", dtype=torch.float16)  # stands in for the model

    def loop() -> torch.Tensor:
        sched.reset()
        x = x_start
        for i in range(num_steps):
            x = sched.step(i, model_outputs[i], x)
        return x

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop()  # warm-up, as capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = loop()

    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(2):
        x_start.copy_(torch.randn(SHAPE, device="cuda", generator=gen))
        model_outputs.copy_(torch.randn(model_outputs.shape, device="cuda", generator=gen))
        graph.replay()
        assert torch.equal(out, loop())


def test_describe():
    assert build_scheduler(None, 12).describe() == {
        "scheduler": "UniPCMultistepScheduler",
        "num_steps": 12,
        "schedule": "minimax-remover",
        "num_train_timesteps": 1000,
        "flow_shift": 3.0,
        "shift_terminal": None,
        "solver_order": 2,
        "solver_type": "bh2",
        "lower_order_final": True,
        "disable_corrector": [],
        "final_sigmas_type": "zero",
    }
    assert build_scheduler(EULER, 6).describe() == {
        "scheduler": "FlowMatchEulerDiscreteScheduler",
        "num_steps": 6,
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "shift_terminal": None,
    }
    json.dumps(build_scheduler(None, 12).describe())


# --------------------------------------------------------------------------------------------------------------
# config loading and validation


def test_load_missing_file_gives_default(tmp_path):
    assert load_scheduler_config(tmp_path) == DEFAULT_SCHEDULER_CONFIG
    assert load_scheduler_config(tmp_path / "nope.json") == DEFAULT_SCHEDULER_CONFIG
    load_scheduler_config(tmp_path)["disable_corrector"].append(1)  # a copy
    assert DEFAULT_SCHEDULER_CONFIG["disable_corrector"] == []


def test_load_folder_and_file(tmp_path):
    (tmp_path / "scheduler_config.json").write_text(json.dumps(EULER))
    assert load_scheduler_config(tmp_path) == EULER
    assert load_scheduler_config(tmp_path / "scheduler_config.json") == EULER


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe"])
def test_load_bad_file(tmp_path, text):
    path = tmp_path / "scheduler_config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(FastRemoverError, match="scheduler_config.json") as err:
        load_scheduler_config(tmp_path)
    assert "delete it" in str(err.value)


@pytest.mark.parametrize("name", ["DDIMScheduler", None])
def test_unsupported_class(tmp_path, name):
    config = {**UNIPC, "_class_name": name}
    if name is None:
        del config["_class_name"]
    (tmp_path / "scheduler_config.json").write_text(json.dumps(config))
    with pytest.raises(FastRemoverError, match=r"_class_name .*UniPCMultistepScheduler"):
        load_scheduler_config(tmp_path)
    with pytest.raises(FastRemoverError, match="_class_name"):
        build_scheduler(config, 6)


@pytest.mark.parametrize(
    "base, key, value",
    [
        (UNIPC, "thresholding", True),
        (UNIPC, "use_karras_sigmas", True),
        (UNIPC, "use_exponential_sigmas", True),
        (UNIPC, "prediction_type", "epsilon"),
        (UNIPC, "predict_x0", False),
        (UNIPC, "use_flow_sigmas", False),
        (UNIPC, "use_dynamic_shifting", True),
        (UNIPC, "solver_p", {"_class_name": "DDIMScheduler"}),
        (UNIPC, "solver_type", "bh3"),
        (UNIPC, "solver_order", 0),
        (UNIPC, "final_sigmas_type", "max"),
        (UNIPC, "timestep_spacing", "uniform"),
        (UNIPC, "flow_shift", "3"),
        (UNIPC, "lower_order_final", 1),
        (UNIPC, "disable_corrector", 2),
        (UNIPC, "shift_terminal", 1.0),
        (EULER, "use_dynamic_shifting", True),
        (EULER, "stochastic_sampling", True),
        (EULER, "invert_sigmas", True),
        (EULER, "use_beta_sigmas", True),
        (EULER, "time_shift_type", "cubic"),
        (EULER, "shift", -1.0),
    ],
)
def test_unsupported_option(tmp_path, base, key, value):
    config = {**base, key: value}
    (tmp_path / "scheduler_config.json").write_text(json.dumps(config))
    with pytest.raises(FastRemoverError, match=rf"scheduler_config.json: \w+ option {key}="):
        load_scheduler_config(tmp_path)
    with pytest.raises(FastRemoverError, match=rf"option {key}="):
        build_scheduler(config, 6)


def test_missing_key_takes_diffusers_default():
    config = {k: v for k, v in UNIPC.items() if k != "prediction_type"}
    with pytest.raises(FastRemoverError, match=r"prediction_type='epsilon' \(diffusers' default"):
        build_scheduler(config, 6)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"lower_order_final": False}, "divides by zero"),
        ({"lower_order_final": False, "solver_order": 3, "final_sigmas_type": "sigma_min"}, "0/0"),
    ],
)
def test_endings_diffusers_cannot_compute_are_rejected(extra, match):
    # diffusers returns inf / NaN for the last sample of these.
    with pytest.raises(FastRemoverError, match=match):
        build_scheduler({**UNIPC, **extra}, 6)


@pytest.mark.parametrize("num_steps", [0, -3, 2.0, True])
def test_bad_num_steps(num_steps):
    with pytest.raises(FastRemoverError, match="steps"):
        build_scheduler(None, num_steps)
