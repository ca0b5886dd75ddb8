"""fastremover/fast/precompile.py: a window's Triton launches recorded on the meta device and compiled ahead,
concurrently, into the kernels' own caches (issue 45).

The compiled-kernel parts run in subprocesses: this process may have imported the kernels for the interpreter
(TRITON_INTERPRET=1), where there are no compile keys. The compile tests target sm_90 through a stand-in driver (no
GPU here): Triton's own JITFunction.run computes every key, ptxas ships in the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path, timeout=600) -> str:
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["FASTREMOVER_CACHE_DIR"] = "off"
    script = tmp_path / "script.py"  # (a file: @triton.jit needs the source)
    script.write_text(textwrap.dedent(code))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


# a small fast VAE (2 levels) and the tiny transformer as an H200 fast-mode engine makes them (CPU weights; the
# recording runs on their meta twins)
ENGINE = """
import sys, torch
from fastremover.config import FastVAEOptions
from fastremover.fast import precompile
from fastremover.fast.kernels import upsample_conv
from fastremover.fast.vae import conv as vae_conv, model as vae_model
from fastremover.models.vae import WanVAE, WanVAEConfig

cfg = WanVAEConfig(base_dim=16, num_res_blocks=1)
old = vae_conv.load_upconv, vae_model.load_upconv
vae_conv.load_upconv = vae_model.load_upconv = lambda d, dt: upsample_conv
vae = vae_model.FastWanVAE(WanVAE(cfg).to(torch.float16), device="cpu", dtype=torch.float16, kernels="triton",
                           options=FastVAEOptions(pad_rgb=True, pad_channels=0, conv_plans=False))
vae_conv.load_upconv, vae_model.load_upconv = old
vae.convs.bias_kernel = True

from helpers import attention_fakes, tiny_transformer
from fastremover.fast.transformer_fast import FastTransformer
fake = attention_fakes.registered("test-cudnn-like", codes_call=attention_fakes.fake_cudnn_codes, output="fp8-codes")
fake.__enter__()
fast = FastTransformer(tiny_transformer(0, dtype=torch.float16), linear_method="fp8-rowwise", use_triton=True,
                       attention="test-cudnn-like")
fast.fused_ffn1 = fast.fused_v_stats = True
"""


def test_recording_names_the_windows_kernels_without_importing_dynamo(tmp_path):
    out = _run(ENGINE + """
assert "torch._dynamo" not in sys.modules and "sympy" not in sys.modules
with precompile.recording(torch.device("cpu"), sm_count=132) as rec:
    precompile.record_vae(vae, 9, 64, 96)
    precompile.record_transformer(fast, 9, 64, 96)
names = sorted({l.name for l in rec.launches})
print("NAMES", names)
print("DYNAMO", "torch._dynamo" in sys.modules, "sympy" in sys.modules)
""", tmp_path)
    names = eval(out.split("NAMES", 1)[1].splitlines()[0])
    assert {"_vae_norm_kernel", "_add_rows_kernel", "_upsample_conv_kernel", "_adaln_kernel", "_qk_norm_rope_kernel",
            "_column_stats_final_kernel", "_tensor_quant_kernel", "_gemm_gelu_quant_kernel"} <= set(names), names
    assert "DYNAMO False False" in out  # a meta-tensor decomposition would import them (seconds on a fresh GPU)


def test_the_vae_recording_of_a_few_frames_has_every_specialization_of_a_whole_window(tmp_path):
    """record_vae records at most VAE_RECORD_FRAMES frames: the same distinct launches as 81 frames (and as every
    length between), at several frame sizes; one frame alone would miss one."""
    out = _run(ENGINE + """
import triton
backend = precompile.make_backend(triton.backends.compiler.GPUTarget("cuda", 90, 32))

def keys(frames, height, width):
    with precompile.recording(torch.device("cpu"), sm_count=132) as rec:
        precompile.record_vae(vae, frames, height, width)
    return [k[:1] + k[2:] for k, _ in rec.unique(backend)], len(rec.launches)

cap = precompile.VAE_RECORD_FRAMES
for hw in [(64, 96), (48, 160), (80, 80)]:
    short, n_short = keys(cap, *hw)
    precompile.VAE_RECORD_FRAMES = 10**6
    for frames in (81, 41, 17, cap + 4):
        full, n_full = keys(frames, *hw)
        assert set(full) == set(short) and n_full > n_short, (hw, frames, set(full) ^ set(short))
    one, _ = keys(1, *hw)
    assert set(one) < set(short), hw
    precompile.VAE_RECORD_FRAMES = cap
print("SAME", len(short))
""", tmp_path)
    assert "SAME" in out, out


def test_recorded_keys_equal_the_keys_of_a_launch_with_real_tensors(tmp_path):
    """The stand-ins' keys (meta tensors) are the keys Triton's binder gives the same launch with real tensors."""
    out = _run("""
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction
from fastremover.fast import precompile
from fastremover.fast.kernels import adaln, qk_norm_rope

backend = precompile.make_backend(GPUTarget("cuda", 90, 32))

def calls(device):
    x = torch.zeros(40, 3 * 64, dtype=torch.float16, device=device)
    q, k, v = x.chunk(3, dim=1)
    w = torch.ones(64, dtype=torch.float16, device=device)
    cos = torch.zeros(20, 16, dtype=torch.float32, device=device)
    amax = torch.ones(4, 1, dtype=torch.float32, device=device)
    qk_norm_rope.qk_norm_rope(k, w, cos, cos, 20, 2, 1e-6)
    qk_norm_rope.qk_norm_rope(q, w, cos, cos, 20, 2, 1e-6, fp8_amax=amax[1])
    mods = torch.zeros(6, 2, 64, dtype=torch.float32, device=device)
    adaln.adaln_modulate(torch.zeros(40, 64, dtype=torch.float16, device=device), mods[0], mods[1], 20, 1e-6, fp8=True)

with precompile.recording(torch.device("cpu")) as rec:
    calls(torch.device("meta"))
with precompile.recording(torch.device("cpu")) as real:
    real_run = JITFunction.run
    got = []
    def run(self, *args, grid, warmup, **kwargs):  # the binder on the real (CPU) tensors themselves
        _, spec, options = precompile._binder(self, backend)(*args, **kwargs)
        got.append((self.fn.__name__, repr(spec), repr(sorted(options.items()))))
    JITFunction.run = run
    calls(torch.device("cpu"))
    JITFunction.run = real_run
want = [k[:1] + k[2:] for k, _ in rec.unique(backend)]
print("EQUAL", want == list(dict.fromkeys(got)), len(want))
""", tmp_path)
    assert "EQUAL True 3" in out, out


COMPILE = """
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class SM90:  # a stand-in for the CUDA driver: the target and device / stream numbers JITFunction.run asks for
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
driver.set_active(SM90())
"""


def test_concurrent_compile_fills_the_caches_the_launch_reads(tmp_path):
    """compile_launches leaves every recorded specialization in its JITFunction's cache (a later launch of the same
    arguments does not compile) and in Triton's disk cache; a launch that cannot compile fails alone."""
    out = _run(COMPILE + """
import os
from triton.runtime.jit import JITFunction
from fastremover.fast import precompile
from fastremover.fast.kernels import adaln, qk_norm_rope

def calls(device):
    x = torch.zeros(40, 3 * 64, dtype=torch.float16, device=device)
    q, k, v = x.chunk(3, dim=1)
    w = torch.ones(64, dtype=torch.float16, device=device)
    cos = torch.zeros(20, 16, dtype=torch.float32, device=device)
    amax = torch.ones(1, dtype=torch.float32, device=device)
    qk_norm_rope.qk_norm_rope(k, w, cos, cos, 20, 2, 1e-6)
    qk_norm_rope.qk_norm_rope(q, w, cos, cos, 20, 2, 1e-6, fp8_amax=amax)
    mods = torch.zeros(6, 2, 64, dtype=torch.float32, device=device)
    adaln.adaln_modulate(torch.zeros(40, 64, dtype=torch.float16, device=device), mods[0], mods[1], 20, 1e-6)

with precompile.recording(torch.device("cpu")) as rec:
    calls(torch.device("meta"))
launches = [l for _, l in rec.unique(precompile.make_backend())]

@triton.jit
def broken(X, B: tl.constexpr):
    tl.store(X + tl.arange(0, B), undefined_name)  # fails to compile

class P:
    dtype = torch.float32
    def data_ptr(self): return 1 << 20
bad = precompile.Launch(broken, (P(),), {"B": 16})
submitted, failed = precompile.compile_launches(launches + [bad], threads=2)
print("SUBMITTED", submitted, "FAILED", failed)
print("DISK", len(os.listdir(os.environ["TRITON_CACHE_DIR"])) >= 3)
compiles = []
original = JITFunction._do_compile
JITFunction._do_compile = lambda self, *a, **k: compiles.append(self.fn.__name__) or original(self, *a, **k)
for l in launches:  # the launches again, as the run makes them: found in the in-memory cache
    l.fn.run(*l.args, grid=None, warmup=True, **l.kwargs)
print("LAZY", compiles)
""", tmp_path)
    assert "SUBMITTED 4 FAILED 1" in out, out
    assert "DISK True" in out, out
    assert "LAZY []" in out, out


def test_a_background_compile_is_awaited_by_its_launch_not_repeated(tmp_path):
    """compile_launches with a pool returns once the compiles are submitted; a launch of a pending kernel then gets
    the compile submitted ahead: nothing compiles on the launching thread, also where the pending compile is not in
    the kernel's cache (Triton 3.6: `_await_hook`; emulated here by dropping 3.9's placeholder)."""
    out = _run("""
import threading
import triton.compiler
main_thread = []
real_compile = triton.compiler.compile
def counted(*a, **k):  # (the JITFunction imports triton.compiler.compile when it first runs)
    if threading.current_thread() is threading.main_thread():
        main_thread.append(1)
    return real_compile(*a, **k)
triton.compiler.compile = counted
""" + COMPILE + """
from concurrent.futures import ThreadPoolExecutor
from fastremover.fast import precompile
from fastremover.fast.kernels import adaln, qk_norm_rope

def calls(device):
    x = torch.zeros(40, 3 * 64, dtype=torch.float16, device=device)
    q, k, v = x.chunk(3, dim=1)
    w = torch.ones(64, dtype=torch.float16, device=device)
    cos = torch.zeros(20, 16, dtype=torch.float32, device=device)
    qk_norm_rope.qk_norm_rope(k, w, cos, cos, 20, 2, 1e-6)
    mods = torch.zeros(6, 2, 64, dtype=torch.float32, device=device)
    adaln.adaln_modulate(torch.zeros(40, 64, dtype=torch.float16, device=device), mods[0], mods[1], 20, 1e-6)

with precompile.recording(torch.device("cpu")) as rec:
    calls(torch.device("meta"))
launches = [l for _, l in rec.unique(precompile.make_backend())]
pool = ThreadPoolExecutor(2)
submitted, failed = precompile.compile_launches(launches, pool=pool)
print("SUBMITTED", submitted, "FAILED", failed, "PENDING", len(precompile._PENDING))
first = launches[0].fn
for cache in first.device_caches.values():  # Triton 3.9 keeps a placeholder; 3.6 has none: take it away
    for key in [k for k, v in cache[0].items() if hasattr(v, "future")]:
        del cache[0][key]
kernels = []
for l in launches:
    k = l.fn.run(*l.args, grid=None, warmup=True, **l.kwargs)
    kernels.append(k.result() if hasattr(k, "future") else k)
print("KERNELS", all(hasattr(k, "asm") for k in kernels), "MAIN", len(main_thread))
print("SETTLED", precompile.settle(wait=True))
""", tmp_path)
    assert "SUBMITTED 2 FAILED 0 PENDING 2" in out, out
    assert "KERNELS True MAIN 0" in out, out
    assert "SETTLED 0" in out, out


def test_a_background_precompiler_submits_and_finishes(tmp_path):
    out = _run(COMPILE + ENGINE + """
prec = precompile.Precompiler(torch.device("cpu"), vae=vae, transformer=fast, threads=2, wait=False)
r = prec.shapes([(9, 64, 96)])
print("REPORT", r.recorded > 0 and r.submitted == r.distinct > 0 and r.failed == 0)
print("LEFT", precompile.settle(wait=True))
""", tmp_path)
    assert "REPORT True" in out and "LEFT 0" in out, out


def test_a_later_shape_is_recorded_in_the_background_with_a_foreground_recordings_keys(tmp_path):
    """A process's first shape is recorded before `shapes` returns; a later one (background=True, compiles in the
    background) in a background thread: `shapes` returns at once, and when the thread is done every specialization a
    foreground recording of that shape finds has been submitted. With `wait` every shape records in the foreground."""
    out = _run(COMPILE + ENGINE + """
prec = precompile.Precompiler(torch.device("cpu"), vae=vae, transformer=fast, threads=2, wait=False)
print("OK BEFORE", prec.background_ok())
r1 = prec.shapes([(9, 64, 96)], background=True)
print("FIRST", r1.background, r1.recorded > 0 and r1.submitted == r1.distinct > 0)
print("OK AFTER", prec.background_ok())
r2 = prec.shapes([(9, 48, 160)], background=True)
print("SECOND", r2.background, r2.recorded)
done = prec.last.result(timeout=300)
print("DONE", done.background, done.recorded > 0, done.failed)
want = {k for k, _ in prec.record([(9, 48, 160)]).unique(prec.backend)}
print("COVERED", want <= prec.keys, len(want))
print("AGAIN", prec.shapes([(9, 48, 160)], background=True).recorded)
print("LEFT", precompile.settle(wait=True))
waits = precompile.Precompiler(torch.device("cpu"), vae=vae, transformer=fast, threads=2, wait=True)
waits.shapes([(9, 64, 96)])
print("WAIT", waits.background_ok(), waits.shapes([(9, 48, 160)], background=True).background)
""", tmp_path)
    assert "OK BEFORE False" in out and "FIRST False True" in out and "OK AFTER True" in out, out
    assert "SECOND True 0" in out and "DONE False True 0" in out, out
    assert "COVERED True" in out and "AGAIN 0" in out and "LEFT 0" in out and "WAIT False False" in out, out


def test_a_recording_intercepts_only_its_own_threads_calls(tmp_path):
    """While a thread records, another thread's calls of the patched functions (a Triton launch, the sub-pixel
    conv's availability, the GPU's properties) reach the real ones, and nothing of theirs is recorded; afterwards
    every function is the one before."""
    out = _run(COMPILE + """
import threading
import torch.nn.functional as F
from triton.runtime.jit import JITFunction
from fastremover.fast import precompile
from fastremover.fast.kernels import qk_norm_rope, upsample_conv

before = (JITFunction.run, upsample_conv.available, torch.cuda.get_device_properties, F.scaled_dot_product_attention)
inside, checked, seen = threading.Event(), threading.Event(), {}

def record():
    with precompile.recording(torch.device("cpu"), sm_count=132) as rec:
        seen["available"] = upsample_conv.available(torch.device("cpu"))
        seen["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        inside.set()
        checked.wait(60)
        x = torch.zeros(40, 192, dtype=torch.float16, device="meta")
        qk_norm_rope.qk_norm_rope(x[:, :64], torch.ones(64, dtype=torch.float16, device="meta"),
                                  torch.zeros(20, 16, device="meta"), torch.zeros(20, 16, device="meta"), 20, 2, 1e-6)
    seen["launches"] = [l.name for l in rec.launches]

t = threading.Thread(target=record)
t.start()
inside.wait(60)
main = {"available": upsample_conv.available(torch.device("cpu"))}
try:
    torch.cuda.get_device_properties(0)
    main["props"] = "stub"
except Exception as e:
    main["props"] = "real"
try:  # the real run: a bad launch raises (it is not recorded)
    qk_norm_rope._qk_norm_rope_kernel.run(grid=(1,), warmup=False)
    main["run"] = "recorded"
except Exception:
    main["run"] = "real"
checked.set()
t.join(60)
print("MAIN", main)
print("SEEN", seen)
after = (JITFunction.run, upsample_conv.available, torch.cuda.get_device_properties, F.scaled_dot_product_attention)
print("RESTORED", all(a is b for a, b in zip(before, after)))
""", tmp_path)
    assert "MAIN {'available': False, 'props': 'real', 'run': 'real'}" in out, out
    assert "'available': True, 'sms': 132, 'launches': ['_qk_norm_rope_kernel']" in out, out
    assert "RESTORED True" in out, out


def test_precompiler_records_each_shape_once_and_survives_a_failing_part(tmp_path):
    out = _run(COMPILE + ENGINE + """
class Broken:
    options = vae.options
prec = precompile.Precompiler(torch.device("cpu"), vae=Broken(), transformer=fast, threads=2)
r1 = prec.shapes([(9, 64, 96)])
r2 = prec.shapes([(9, 64, 96)])
print("FIRST", r1.recorded > 0 and r1.submitted == r1.distinct > 0 and r1.failed == 0)
print("SECOND", r2.recorded, r2.submitted)
""", tmp_path)
    assert "FIRST True" in out and "SECOND 0 0" in out, out


def test_launch_kernels_calls_what_forward_step_calls():
    """FastTransformer.launch_kernels (what the precompile records) makes forward_step's fused-kernel calls of the
    first step: the same ops, in the same order, on tensors of the same shapes and dtypes, with the same flags."""
    import torch

    from helpers import attention_fakes, tiny_transformer

    from fastremover.fast.transformer_fast import FastTransformer, kernel_ops
    from fastremover.ops.linear.registry import Fp8Activation

    def recorder(calls, ops):
        def wrap(name, fn):
            def call(*args, **kwargs):
                tensors = [(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)]
                flags = {k: (v if not isinstance(v, torch.Tensor) else (tuple(v.shape), v.dtype))
                         for k, v in kwargs.items()}
                calls.append((name, tensors, sorted(flags.items(), key=str)))
                if args[0].device.type == "meta":
                    return {"quant_centred": lambda: (torch.empty(1), torch.empty(1), torch.empty(1))}.get(
                        name, lambda: None)()
                kwargs = {k: v for k, v in kwargs.items() if k not in ("fused_finalize", "counter")}
                return fn(*args, **kwargs)
            return call
        return type("Ops", (), {k: staticmethod(wrap(k, v)) for k, v in vars(ops).items()})()

    with attention_fakes.registered("test-cudnn-like", codes_call=attention_fakes.fake_cudnn_codes,
                                    output="fp8-codes"):
        fast = FastTransformer(tiny_transformer(0), linear_method="fp8-rowwise", use_triton=False,
                               attention="test-cudnn-like")
        fast.fused_v_stats = True
        real, ahead = [], []
        fast.ops = recorder(real, kernel_ops(False))
        hidden = (1, fast.config.in_channels, 2, 4, 6)
        cond = fast.conditioning(torch.tensor([999.0, 500.0]), 1)
        fast.forward_step(torch.randn(hidden), cond, 0)
        fast.ops = recorder(ahead, kernel_ops(False))
        fast.launch_kernels(hidden, torch.device("meta"))
    assert [c[0] for c in real] == [c[0] for c in ahead]
    assert real == ahead
    assert Fp8Activation  # (the fp8 path ran: its ops are in the lists)
    assert {"quant_centred", "qk_norm_rope", "gate_residual_adaln", "adaln_modulate"} <= {c[0] for c in real}


def test_a_recording_on_a_gpu_answers_with_that_gpus_properties(monkeypatch):
    """Within a recording, get_device_properties keeps the recorded GPU's own properties (the persistent cache's keys
    read its name and capability: the H100 run lost the whole VAE recording to a stub without them); only the SM
    count may be set."""
    import types

    import torch

    from fastremover.fast import precompile

    live = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: live)
    with precompile.recording(torch.device("cuda", 0)):
        props = torch.cuda.get_device_properties(0)
        assert (props.name, props.major, props.multi_processor_count) == ("NVIDIA H100 80GB HBM3", 9, 132)
    with precompile.recording(torch.device("cuda", 0), sm_count=78):
        assert torch.cuda.get_device_properties(0).multi_processor_count == 78
    with precompile.recording():  # the meta device: the SM count alone
        props = torch.cuda.get_device_properties(0)
        assert props.multi_processor_count == 132
        with pytest.raises(AttributeError, match="name"):
            props.name  # noqa: B018


@pytest.mark.parametrize("blocks", [1, 2, 3, 5])
def test_every_steps_ffn_bound_has_the_first_steps_alignment(blocks):
    """The fused FFN1 GEMM specializes on its bound's pointer alignment: block i's bound is 16-byte aligned alike at
    every step (the precompile records the first step only; the H100 run compiled a second variant at step 2)."""
    import dataclasses

    import torch

    from helpers import TINY_TRANSFORMER, tiny_transformer

    from fastremover.fast.transformer_fast import FastTransformer

    cfg = dataclasses.replace(TINY_TRANSFORMER, num_layers=blocks)
    fast = FastTransformer(tiny_transformer(0, cfg), linear_method="fp8-rowwise", use_triton=False)
    amax = fast.conditioning(torch.tensor([999.0, 700.0, 400.0, 100.0]), 1).ffn_amax
    assert amax.shape == (4, blocks, 1)
    for step in range(4):
        for i in range(blocks):
            assert amax[step, i].storage_offset() * 4 % 16 == amax[0, i].storage_offset() * 4 % 16, (step, i)


def test_the_hook_does_nothing_on_the_cpu(tmp_path):
    """A CPU run (eager mode) neither precompiles nor imports the precompile machinery or Triton's compiler."""
    out = _run("""
import sys
import numpy as np
from fastremover import EngineConfig, RemovalPipeline, RunOptions
pipe = RemovalPipeline.from_model("random", preset="tiny", config=EngineConfig(device="cpu"))
frames = np.zeros((5, 32, 48, 3), np.uint8)
mask = np.zeros((5, 32, 48), bool)
mask[:, 8:16, 8:16] = True
pipe.remove(frames, mask, RunOptions(steps=1, crop="off"))
print("HOOK", pipe.engine.precompiles(), pipe.engine.precompile([(5, 32, 48)]))
print("IMPORTED", "fastremover.fast.precompile" in sys.modules)
""", tmp_path)
    assert "HOOK False None" in out and "IMPORTED False" in out, out


GPU_RUN = """
import hashlib, json, sys
import numpy as np
import torch
from fastremover import EngineConfig, RemovalPipeline, RunOptions, media
from fastremover.timing import PHASES
pipe = RemovalPipeline.from_model("random", preset=sys.argv[1], config=EngineConfig(mode="fast"))
video, mask = media.synthetic_clip(33, 240, 432, seed=0, object_fraction=0.1)
before = dict(PHASES.counts)
result = pipe.remove(video.frames, mask, RunOptions(steps=2, crop="off"))
lazy = PHASES.counts.get("triton_compile", 0) - before.get("triton_compile", 0)
# a second shape in the same process: recorded in a background thread with FASTREMOVER_PRECOMPILE=record-background
video2, mask2 = media.synthetic_clip(17, 256, 400, seed=1, object_fraction=0.1)
second = pipe.remove(video2.frames, mask2, RunOptions(steps=2, crop="off"))
print("RESULT", json.dumps({"sha": hashlib.sha256(result.frames.tobytes()).hexdigest(), "lazy": lazy,
                            "precompiled": PHASES.counts.get("precompile", 0),
                            "second_sha": hashlib.sha256(second.frames.tobytes()).hexdigest(),
                            "background": PHASES.counts.get("precompile_background", 0)}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "minimax-remover"])
def test_gpu_a_precompiled_run_compiles_nothing_lazily_and_gives_the_same_bytes(tmp_path, preset):
    import json

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = {}
    for switch in ("0", "1", "background", "record-background"):
        script = tmp_path / "run.py"
        script.write_text(GPU_RUN)
        env = {**os.environ, "FASTREMOVER_PRECOMPILE": switch, "TRITON_CACHE_DIR": str(tmp_path / f"triton{switch}"),
               "FASTREMOVER_CACHE_DIR": str(tmp_path / f"cache{switch}")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        r = subprocess.run([sys.executable, str(script), preset], env=env, capture_output=True, text=True,
                           timeout=1200)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        results[switch] = json.loads(r.stdout.split("RESULT", 1)[1])
    assert results["0"]["lazy"] > 0 and results["0"]["precompiled"] == 0
    assert results["1"]["precompiled"] >= 1
    assert results["1"]["lazy"] == 0, results  # every kernel of the window was compiled ahead
    assert results["1"]["sha"] == results["0"]["sha"]  # the same kernels: the same bytes
    # in the background: the launches wait for the compiles submitted ahead, none compiles again
    assert results["background"]["precompiled"] >= 1 and results["background"]["lazy"] == 0, results
    assert results["background"]["sha"] == results["0"]["sha"]
    # the second shape: recorded in a background thread (record-background), before the window (1, background):
    # the same bytes
    assert results["record-background"]["background"] == 1 and results["background"]["background"] == 0, results
    assert results["record-background"]["sha"] == results["0"]["sha"]
    assert len({r["second_sha"] for r in results.values()}) == 1, results
