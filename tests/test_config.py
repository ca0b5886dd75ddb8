"""EngineConfig (fastremover/config.py): the typed, frozen input; its flags and environment overrides read in one place;
its resolution on a device (fastremover/fast/engine.py) into a plan and, built, a ResolvedEngine that records the input
it came from."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fastremover.cli import build_parser
from fastremover.config import (
    AttentionOptions,
    EngineConfig,
    KernelTuning,
    LinearOptions,
    ParallelOptions,
    ResolvedEngine,
    option_table,
)
from fastremover.errors import FastRemoverError

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_defaults_are_frozen_and_nested():
    c = EngineConfig()
    assert (c.mode, c.attention.backend, c.linears.weights, c.linears.fused_ffn1, c.vae.precision) == (
        "auto", "auto", "dense", "auto", "auto")
    assert (c.graphs.cuda_graphs, c.graphs.max_graphs, c.parallel.world_size, c.parallel.transport) == (
        "auto", 4, 1, "fp16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = "fast"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.attention.backend = "sdpa"
    d = c.describe()
    assert d["attention"] == {"backend": "auto"} and d["parallel"] == {"world_size": 1, "transport": "fp16"}
    changed = c.with_(mode="fast", attention__backend="fp8", graphs__max_graphs=2)
    assert (changed.mode, changed.attention.backend, changed.graphs.max_graphs) == ("fast", "fp8", 2)
    assert c.mode == "auto" and c.attention.backend == "auto"  # the original is untouched
    with pytest.raises(FastRemoverError, match="no option"):
        c.with_(attention__nope=1)


@pytest.mark.parametrize("changes,match", [
    ({"mode": "turbo"}, "--mode 'turbo'"),
    ({"precision": "fp64"}, "--precision"),
    ({"device": "gpu0"}, "--device"),
    ({"attention__backend": "flash9"}, "unknown backend"),
    ({"linears__weights": "int4"}, "--weights"),
    ({"linears__fused_ffn1": "yes"}, "fused_ffn1"),
    ({"vae__precision": "int8"}, "--vae-precision"),
    ({"graphs__max_graphs": 0}, "max_graphs"),
    ({"graphs__max_graphs": 2.5}, "whole number"),
    ({"parallel__world_size": 0}, "world_size"),
    ({"parallel__world_size": "2"}, "whole number"),
    ({"parallel__transport": "int8"}, "transport"),
])
def test_values_out_of_range_are_refused_naming_the_option(changes, match):
    with pytest.raises(FastRemoverError, match=re.escape(match) if "'" in match else match):
        EngineConfig().with_(**changes)


def test_nvfp4_weights_refuse_the_fused_modes():
    with pytest.raises(FastRemoverError, match="runs in --mode eager only"):
        EngineConfig(mode="exact", linears=LinearOptions(weights="nvfp4"))
    assert EngineConfig(mode="auto", linears=LinearOptions(weights="nvfp4")).linears.weights == "nvfp4"


def test_from_args_reads_the_flags_of_each_command():
    args = build_parser().parse_args(["remove", "v.mp4", "--mask", "m.mp4", "-o", "o.mp4", "--mode", "fast",
                                      "--attention", "fp8", "--vae-precision", "fp8", "--precision", "bf16",
                                      "--device", "cuda:1", "--weights", "dense"])
    c = EngineConfig.from_args(args, environ={})
    assert (c.mode, c.attention.backend, c.vae.precision, c.precision, c.device) == ("fast", "fp8", "fp8", "bf16",
                                                                                     "cuda:1")
    # bench has no --mode / --weights: those keep their defaults
    bench = EngineConfig.from_args(build_parser().parse_args(["bench", "--attention", "sdpa"]), environ={})
    assert (bench.mode, bench.attention.backend, bench.linears.weights) == ("auto", "sdpa", "dense")
    with pytest.raises(FastRemoverError, match="runs in --mode eager only"):
        EngineConfig.from_args(build_parser().parse_args(["remove", "v", "--mask", "m", "-o", "o.mp4", "--mode",
                                                          "exact", "--weights", "nvfp4"]), environ={})


def test_every_flag_named_by_a_field_exists_on_remove():
    """The metadata's argparse dests cannot go stale: each is a flag of `fastremover remove`."""
    dests = vars(build_parser().parse_args(["remove", "v", "--mask", "m", "-o", "o.mp4"]))
    flags = [row["flag"] for row in option_table() if row["flag"]]
    assert flags and all(f in dests for f in flags), [f for f in flags if f not in dests]


@pytest.mark.parametrize("value,expect", [("1", "on"), ("0", "off"), ("", "auto"), (" ", "auto")])
def test_fused_ffn1_variable(value, expect):
    assert EngineConfig.from_env({"FASTREMOVER_FUSED_FFN1": value}).linears.fused_ffn1 == expect


def test_environment_overrides_the_flags_and_bad_values_name_the_variable():
    args = build_parser().parse_args(["remove", "v", "--mask", "m", "-o", "o.mp4", "--mode", "fast"])
    c = EngineConfig.from_args(args, environ={"FASTREMOVER_FUSED_FFN1": "0"})
    assert c.mode == "fast" and c.linears.fused_ffn1 == "off"
    with pytest.raises(FastRemoverError, match="FASTREMOVER_FUSED_FFN1='yes'"):
        EngineConfig.from_env({"FASTREMOVER_FUSED_FFN1": "yes"})
    with pytest.raises(FastRemoverError, match="FASTREMOVER_CONV3D_FP8_TUNE='off'"):
        KernelTuning.from_env({"FASTREMOVER_CONV3D_FP8_TUNE": "off"})


def test_kernel_tuning_from_the_environment():
    assert KernelTuning.from_env({}) == KernelTuning()
    t = KernelTuning.from_env({"FASTREMOVER_CONV3D_FP8_TUNE": "0", "FASTREMOVER_UPCONV_TUNE": " 0 "})
    assert t == KernelTuning(conv3d_fp8_tune=False, upconv_tune=False)
    # the Triton FP8 attention's switches left with the kernel (experiments/attention_fp8.py reads them itself)
    assert KernelTuning.from_env({"FASTREMOVER_FP8_ATTN_CONFIG": "m32n32w4s1t0ws0a1"}) == KernelTuning()


def test_the_kernels_read_their_switches_through_the_config(monkeypatch):
    from fastremover.fast.kernels import conv3d_fp8

    monkeypatch.setenv("FASTREMOVER_CONV3D_FP8_TUNE", "0")
    assert conv3d_fp8._tuning_enabled() is False
    monkeypatch.setenv("FASTREMOVER_CONV3D_FP8_TUNE", "1")
    assert conv3d_fp8._tuning_enabled() is True
    monkeypatch.setenv("FASTREMOVER_CONV3D_FP8_TUNE", "maybe")
    with pytest.raises(FastRemoverError, match="FASTREMOVER_CONV3D_FP8_TUNE"):
        conv3d_fp8._tuning_enabled()


def test_fastremover_variables_are_read_only_in_config_py():
    """One place: no other package module reads a FASTREMOVER_* variable (os.environ / os.getenv with that name)."""
    readers = []
    for path in sorted((REPO / "fastremover").rglob("*.py")):
        if path.name == "config.py" and path.parent.name == "fastremover":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).startswith("FASTREMOVER_"):
                func = ast.unparse(node.func)
                if "environ" in func or "getenv" in func:
                    readers.append(f"{path.relative_to(REPO)}:{node.lineno} {func}({node.args[0].value!r})")
            if isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value) \
                    and isinstance(node.slice, ast.Constant) and str(node.slice.value).startswith("FASTREMOVER_"):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    # the service's API key is a deployment secret of `fastremover serve`, not an engine option
    readers = [r for r in readers if "API_KEY" not in r]
    assert not readers, readers


def test_option_table_lists_every_option_once():
    rows = option_table()
    names = [r["option"] for r in rows]
    assert len(names) == len(set(names))
    assert {"mode", "attention.backend", "linears.fused_ffn1", "vae.precision", "graphs.max_graphs",
            "parallel.world_size", "tuning.conv3d_fp8_tune"} <= set(names)
    assert {r["env"] for r in rows if r["env"]} == {"FASTREMOVER_FUSED_FFN1", "FASTREMOVER_CONV3D_FP8_TUNE",
                                                    "FASTREMOVER_UPCONV_TUNE", "FASTREMOVER_CUDNN_CONV_PLANS",
                                                    "FASTREMOVER_CACHE_DIR"}


def test_modes_agree_everywhere():
    from fastremover import config
    from fastremover.fast import engine
    from fastremover.ops.attention import registry

    assert config.MODES == engine.MODES == registry.MODES


# ----------------------------------------------------------------------------------------------------------------------
# Resolution on a device


def test_resolve_on_the_cpu_falls_back_with_notes():
    from fastremover.fast.engine import resolve

    plan = resolve(EngineConfig(mode="fast"), CPU)
    assert plan.mode == "eager" and plan.attention == "sdpa" and not plan.cuda_graphs and not plan.fused_ffn1
    assert len(plan.notes) == 1 and "mode fast needs a CUDA GPU" in plan.notes[0]
    assert resolve(EngineConfig(), CPU).notes == []  # auto picks eager on a CPU without a note
    nvfp4 = resolve(EngineConfig(linears=LinearOptions(weights="nvfp4")), CPU)
    assert nvfp4.mode == "eager"
    with pytest.raises(FastRemoverError, match="not available in the eager mode"):
        resolve(EngineConfig(attention=AttentionOptions("fp8")), CPU)  # explicit fp8 attention never silently fp16


def test_plan_switches_follow_the_config(monkeypatch):
    """The fused-FFN and CUDA-graph switches of a plan (the device check itself is fp8_supported's: faked here)."""
    from fastremover.fast import engine

    monkeypatch.setattr(engine, "resolve_mode", lambda mode, device: (mode, []))  # a device that runs every mode
    monkeypatch.setattr(engine, "resolve_attention", lambda attention, mode, device: ("sdpa", []))
    cuda = torch.device("cuda")
    fast = engine.resolve(EngineConfig(mode="fast"), cuda)
    assert fast.fused_ffn1 and fast.cuda_graphs
    assert not engine.resolve(EngineConfig(mode="fast", linears=LinearOptions(fused_ffn1="off")), cuda).fused_ffn1
    assert not engine.resolve(EngineConfig(mode="exact"), cuda).fused_ffn1
    no_graphs = EngineConfig(mode="exact").with_(graphs__cuda_graphs="off")
    assert not engine.resolve(no_graphs, cuda).cuda_graphs


def test_build_records_what_runs_and_the_input():
    from fastremover.fast.engine import build
    from fastremover.models.loading import random_models

    config = EngineConfig(mode="exact")
    engine = build(random_models("tiny", 0), config, CPU, torch.float32, "fp32")
    r = engine.resolved
    assert isinstance(r, ResolvedEngine)
    assert (r.mode, r.requested_mode, r.vae, r.attention, r.device, r.precision) == ("eager", "exact", "eager",
                                                                                     "sdpa", "cpu", "fp32")
    assert r.config == config.describe() and r.tuning == KernelTuning.from_env().describe()
    assert r.notes and "mode exact needs a CUDA GPU" in r.notes[0]
    assert engine.denoiser is not None and engine.vae is not None
    classic = build(None, config, CPU, torch.float32, "fp32")
    assert classic.denoiser is None and classic.vae is None
    assert (classic.resolved.model, classic.resolved.mode, classic.resolved.vae) == ("classic", "eager", "none")


def test_resolved_engine_keeps_every_field_of_the_pipelines_record():
    """ResolvedEngine replaces pipeline.EngineConfig (the output record of the same name before): no field is lost,
    and the fast denoiser's describe() keys are all fields (as the pipeline spreads them into it)."""
    import fastremover.pipeline as pipeline

    new = {f.name for f in dataclasses.fields(ResolvedEngine)}
    old = getattr(pipeline, "EngineConfig", None)
    if old is not None and old is not EngineConfig:
        assert {f.name for f in dataclasses.fields(old)} <= new
    assert {"fused_kernels", "fp8_linears", "attention", "ffn1", "fp8_gemm", "concurrent_branches",
            "cuda_graphs"} <= new


def test_build_denoiser_keeps_its_signature_and_reads_the_environment(monkeypatch):
    """The old entry point (mode already resolved, attention by name) still works; without a config it takes the
    environment's overrides, with one it takes the config's."""
    from fastremover.fast.engine import build_denoiser
    from fastremover.models.loading import random_models
    from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG

    model = random_models("tiny", 0).transformer
    monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", "1")
    denoiser, notes = build_denoiser(model, DEFAULT_SCHEDULER_CONFIG, "fast", CPU, attention="sdpa")
    assert denoiser.fast.fp8 and any("FASTREMOVER_FUSED_FFN1=1" in n for n in notes), notes
    explicit = EngineConfig(linears=LinearOptions(fused_ffn1="off")).with_(graphs__max_graphs=2)
    denoiser, notes = build_denoiser(model, DEFAULT_SCHEDULER_CONFIG, "fast", CPU, attention="sdpa", config=explicit)
    assert not any("FFN" in n for n in notes) and denoiser._graphs.max_items == 2


def test_parallel_options_match_the_parallel_package():
    """The transports are the ones fastremover/parallel implements; the default is one rank, 16-bit exchange."""
    from fastremover.config import TRANSPORTS

    context = pytest.importorskip("fastremover.parallel.context")
    assert TRANSPORTS == context.TRANSPORTS
    assert ParallelOptions() == ParallelOptions(world_size=1, transport="fp16")
    assert EngineConfig().with_(parallel__world_size=4, parallel__transport="fp8").parallel.world_size == 4
