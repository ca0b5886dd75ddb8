"""EngineConfig (fastremover/config.py): the typed, frozen input; its flags from one definition, the environment read in env.py;
its resolution on a device (fastremover/engine/build.py) into a plan and, built, a ResolvedEngine that records the input
it came from."""

import argparse
import ast
import dataclasses
import re

import pytest
import torch

from fastremover.cli import build_parser
from fastremover.config import ModelSource
from fastremover.config import (
    AttentionOptions,
    EngineConfig,
    LinearOptions,
    ParallelOptions,
    ResolvedEngine,
    option_table,
)
from fastremover.env import KernelTuning
from fastremover.errors import FastRemoverError
from helpers import REPO

CPU = torch.device("cpu")


def test_defaults_are_frozen_and_nested():
    c = EngineConfig()
    assert (c.mode, c.attention.backend, c.linears.weights, c.linears.fused_ffn1, c.vae.precision) == (
        "auto", "auto", "dense", "auto", "auto")
    p = c.parallel
    assert (c.graphs.cuda_graphs, c.graphs.max_graphs, p.mode, p.world_size, p.transport) == ("auto", 4, "none", None,
                                                                                                 "fp16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = "fast"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.attention.backend = "sdpa"
    d = c.describe()
    assert d["attention"] == {"backend": "auto", "keep": None, "window": None}
    assert d["parallel"] == {"mode": "none", "world_size": None, "transport": "fp16", "head_groups": 1,
                             "timeout_s": 300.0}
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
    ({"parallel__world_size": 0}, "--gpus 0"),
    ({"parallel__world_size": "2"}, "whole number"),
    ({"parallel__transport": "int8"}, "--sp-transport"),
    ({"parallel__mode": "ulysses", "parallel__head_groups": 0}, "--sp-head-groups"),
    ({"parallel__world_size": 2}, "need --parallel ulysses"),
    ({"vae__fast__pad_channels": 12}, "multiple of 8"),
    ({"transformer__gemm": "cutlass"}, "transformer.gemm"),
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
    # bench has no --mode (it compares --modes): that keeps its default
    bench = EngineConfig.from_args(build_parser().parse_args(["bench", "--attention", "sdpa"]), environ={})
    assert (bench.mode, bench.attention.backend, bench.linears.weights) == ("auto", "sdpa", "dense")
    # batch's own --gpus (which GPUs get a worker) is not the parallel ranks' --gpus: only the engine flags a command
    # got from the config's definitions are read
    batch = build_parser().parse_args(["batch", "in", "-o", "out", "--gpus", "2", "--mode", "eager"])
    assert EngineConfig.from_args(batch, environ={}).parallel.world_size is None
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
    # the precompile: in the background by default (measured faster, the same bytes); 1 / 0 keep their meaning
    assert KernelTuning().precompile == "background"
    for text, value in [("1", "wait"), ("wait", "wait"), ("background", "background"), ("0", "off"), ("off", "off"),
                        ("record-background", "record-background")]:
        assert KernelTuning.from_env({"FASTREMOVER_PRECOMPILE": text}).precompile == value
    with pytest.raises(FastRemoverError, match="FASTREMOVER_PRECOMPILE='later'"):
        KernelTuning.from_env({"FASTREMOVER_PRECOMPILE": "later"})


def test_the_kernels_read_their_switches_through_the_config(monkeypatch):
    from fastremover.fast.kernels import conv3d_fp8

    monkeypatch.setenv("FASTREMOVER_CONV3D_FP8_TUNE", "0")
    assert conv3d_fp8._tuning_enabled() is False
    monkeypatch.setenv("FASTREMOVER_CONV3D_FP8_TUNE", "1")
    assert conv3d_fp8._tuning_enabled() is True
    monkeypatch.setenv("FASTREMOVER_CONV3D_FP8_TUNE", "maybe")
    with pytest.raises(FastRemoverError, match="FASTREMOVER_CONV3D_FP8_TUNE"):
        conv3d_fp8._tuning_enabled()


def test_environment_variables_are_read_only_in_env_py():
    """One place: no other package module reads the environment (os.environ / os.getenv; setting a variable for a
    child process is not reading it). torchrun's variables are read there too (env.torchrun_env). config.py takes
    the mapping env.variables() gives it (its `environ` parameters), but never os.environ itself."""
    readers = []
    for path in sorted((REPO / "fastremover").rglob("*.py")):
        if path.name == "env.py" and path.parent.name == "fastremover":
            continue
        names = ("os.environ", "os.getenv")
        if not (path.name == "config.py" and path.parent.name == "fastremover"):
            names += ("environ", "getenv")
        tree = ast.parse(path.read_text())
        written = {id(n.value) for n in ast.walk(tree)
                   if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del))}
        for node in ast.walk(tree):
            text = ast.unparse(node) if isinstance(node, (ast.Attribute, ast.Name)) else ""
            if text in names and id(node) not in written:
                readers.append(f"{path.relative_to(REPO)}:{node.lineno} {text}")
    assert not readers, readers
    from fastremover.env import torchrun_env

    assert torchrun_env({}) is None and torchrun_env({"WORLD_SIZE": "1"}) is None
    env = torchrun_env({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (env.world_size, env.rank, env.local_rank, env.master_addr, env.master_port, env.agent_store) == (
        2, 1, 1, "127.0.0.1", 29500, True)
    with pytest.raises(FastRemoverError, match="torchrun environment"):
        torchrun_env({"WORLD_SIZE": "2"})


def test_option_table_lists_every_option_once():
    rows = option_table()
    names = [r["option"] for r in rows]
    assert len(names) == len(set(names))
    assert {"mode", "attention.backend", "linears.fused_ffn1", "vae.precision", "graphs.max_graphs",
            "parallel.world_size", "tuning.conv3d_fp8_tune"} <= set(names)
    assert {r["env"] for r in rows if r["env"]} == {"FASTREMOVER_FUSED_FFN1", "FASTREMOVER_CONV3D_FP8_TUNE",
                                                    "FASTREMOVER_UPCONV_TUNE", "FASTREMOVER_CUDNN_CONV_PLANS",
                                                    "FASTREMOVER_SPARSE_ATTN_CONFIG", "FASTREMOVER_CACHE_DIR",
                                                    "FASTREMOVER_PRECOMPILE", "FASTREMOVER_STEP_GRAPHS"}


def test_choice_lists_are_defined_once():
    """The engine, the registry, the parallel package and the fast VAE use config.py's lists themselves."""
    from fastremover import config
    from fastremover.engine import build as engine
    from fastremover.fast.vae import model as vae_model
    from fastremover.ops.attention import registry
    from fastremover.parallel import context

    assert engine.MODES is config.MODES and not hasattr(registry, "MODES")
    assert context.TRANSPORTS is config.TRANSPORTS and vae_model.VAE_PRECISIONS is config.VAE_PRECISIONS
    assert list(engine.DTYPES) == list(config.PRECISIONS)


# ----------------------------------------------------------------------------------------------------------------------
# Resolution on a device


def test_resolve_on_the_cpu_falls_back_with_notes():
    from fastremover.engine.build import resolve

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
    from fastremover.engine import build as engine

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
    from fastremover.engine.build import build
    from fastremover.models.loading import random_models

    config = EngineConfig(mode="exact", device="cpu")
    engine = build(random_models("tiny", 0), config)
    r = engine.resolved
    assert isinstance(r, ResolvedEngine)
    assert (r.mode, r.requested_mode, r.vae, r.attention, r.device, r.precision) == ("eager", "exact", "eager",
                                                                                     "sdpa", "cpu", "fp32")
    assert r.config == config.describe() and r.tuning == KernelTuning.from_env().describe()
    assert r.notes and "mode exact needs a CUDA GPU" in r.notes[0]
    assert engine.denoiser is not None and engine.vae is not None
    classic = build(None, config)
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
    from fastremover.engine.build import build_denoiser
    from fastremover.models.loading import random_models
    from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG

    model = random_models("tiny", 0).transformer
    monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", "1")
    denoiser, notes = build_denoiser(model, DEFAULT_SCHEDULER_CONFIG, "fast", CPU, attention="sdpa")
    assert denoiser.fast.fp8 and any("FASTREMOVER_FUSED_FFN1=1" in n for n in notes), notes
    explicit = EngineConfig(linears=LinearOptions(fused_ffn1="off")).with_(graphs__max_graphs=2)
    denoiser, notes = build_denoiser(model, DEFAULT_SCHEDULER_CONFIG, "fast", CPU, attention="sdpa", config=explicit)
    assert not any("FFN" in n for n in notes) and denoiser._graphs.max_items == 2


def test_parallel_options_default_to_one_process():
    """The default is one process, 16-bit exchange; the flags of `remove --parallel` set the section."""
    assert ParallelOptions() == ParallelOptions(mode="none", world_size=None, transport="fp16")
    changed = EngineConfig().with_(parallel__mode="ulysses", parallel__world_size=4, parallel__transport="fp8")
    assert changed.parallel.world_size == 4
    args = build_parser().parse_args(["remove", "v", "--mask", "m", "-o", "o.mp4", "--parallel", "ulysses",
                                      "--gpus", "2", "--sp-transport", "fp8", "--sp-head-groups", "3",
                                      "--parallel-timeout", "60"])
    assert EngineConfig.from_args(args, environ={}).parallel == ParallelOptions("ulysses", 2, "fp8", 3, 60.0)


def _engine_actions(parser) -> dict:
    """{flag: (dest, choices, default, help, nargs)} of the engine flags a parser has."""
    return {a.option_strings[0]: (a.dest, a.choices, a.default, a.help, a.nargs) for a in parser._actions
            if a.option_strings and a.dest in {row["flag"] for row in option_table() if row["flag"]}}


def _subparser(name: str):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_command_takes_the_engine_flags_from_the_one_definition():
    """remove, demo, batch, serve, bench and verify: each engine flag is the one config.py's field metadata defines
    (same choices, default and help), so `fastremover serve --help` shows --mode, --attention, --vae-precision,
    --weights ... exactly as `remove` does. bench / verify compare --modes instead of taking --mode."""
    remove = _engine_actions(_subparser("remove"))
    engine_flags = {"--device", "--precision", "--mode", "--attention", "--attention-keep", "--attention-window",
                    "--weights", "--force-w4a4", "--vae-precision"}
    assert engine_flags | {"--parallel", "--gpus", "--sp-transport", "--sp-head-groups", "--parallel-timeout"} == set(
        remove)
    mode = EngineConfig.__dataclass_fields__["mode"]
    assert remove["--mode"] == ("mode", ["auto", "eager", "exact", "fast"], "auto", mode.metadata["help"], None)
    for command in ("demo", "batch", "serve", "bench", "verify"):
        actions = _engine_actions(_subparser(command))
        expected = engine_flags - ({"--mode"} if command in ("bench", "verify") else set())
        assert expected <= set(actions), (command, expected - set(actions))
        for flag in expected - {"--device"}:  # serve words --device's default its own way (one worker per GPU)
            assert actions[flag] == remove[flag], (command, flag)
    assert "one worker per GPU" in _engine_actions(_subparser("serve"))["--device"][3]


def test_serve_builds_its_engine_config_from_the_flags(monkeypatch):
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from fastremover.serve.cli import config_from_args

    args = build_parser().parse_args(["serve", "--model", "random", "--preset", "tiny", "--mode", "eager",
                                      "--attention", "sdpa", "--vae-precision", "fp16", "--weights", "nvfp4"])
    config = config_from_args(args)
    assert config.model == ModelSource("random", preset="tiny")
    assert (config.engine.mode, config.engine.attention.backend, config.engine.vae.precision,
            config.engine.linears.weights) == ("eager", "sdpa", "fp16", "nvfp4")
    with pytest.raises(FastRemoverError, match="runs in --mode eager only"):
        config_from_args(build_parser().parse_args(["serve", "--mode", "exact", "--weights", "nvfp4"]))


def test_model_source():
    assert ModelSource().kind == "classic" and ModelSource.of(None) == ModelSource()
    random = ModelSource.of("random", preset="tiny", weights_seed=3)
    assert (random.kind, random.preset, random.weights_seed, random.label) == ("random", "tiny", 3, "random")
    assert ModelSource.of(random) is random
    assert ModelSource.of(random, preset="minimax-remover").preset == "minimax-remover"
    with pytest.raises(FastRemoverError, match="not 'classic', 'random' or an existing checkpoint folder"):
        ModelSource("/no/such/folder").validate()
    assert ModelSource(str(REPO)).kind == "folder" and ModelSource(str(REPO)).label == REPO.name
    with pytest.raises(FastRemoverError, match="--weights-seed"):
        ModelSource("random", weights_seed=-1).validate()
    args = build_parser().parse_args(["remove", "v", "--mask", "m", "-o", "o.mp4", "--model", "random",
                                      "--weights-seed", "5"])
    assert ModelSource.from_args(args) == ModelSource("random", weights_seed=5)
    assert ModelSource.from_args(build_parser().parse_args(["remove", "v", "--mask", "m", "-o", "o.mp4"])).kind == \
        "classic"


def test_device_and_precision_are_resolved_in_the_engine():
    from fastremover.engine.build import resolve, resolve_device, resolve_precision

    assert resolve_device("cpu") == CPU and resolve_precision(None, CPU) == "fp32"
    assert resolve_precision(None, torch.device("cuda")) == "fp16" and resolve_precision("bf16", CPU) == "bf16"
    plan = resolve(EngineConfig(device="cpu"))
    assert (plan.device, plan.precision, plan.dtype) == (CPU, "fp32", torch.float32)
    if not torch.cuda.is_available():
        assert resolve_device(None) == CPU
        with pytest.raises(FastRemoverError, match="no CUDA GPU"):
            resolve(EngineConfig(device="cuda"))


def test_run_options_are_checked_once_per_instance(monkeypatch):
    """RunOptions is frozen, so its check runs once however many layers call validate()."""
    import fastremover.options as options

    calls = []
    real = options.validate_windows
    monkeypatch.setattr(options, "validate_windows", lambda *a: calls.append(a) or real(*a))
    opts = options.RunOptions(window=9, overlap=2)
    assert opts.validate() is opts and opts.validate() is opts
    assert calls == [(9, 2)]
    with pytest.raises(FastRemoverError, match="--window"):
        options.RunOptions(window=0).validate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.steps = 3
