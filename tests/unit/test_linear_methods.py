"""The linear-method seam (fastremover/ops/linear/registry.py): the registry, the typed FP8 activation, and the fast
transformer running whatever method it is given (a test-registered dummy included) without knowing its name."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastremover.fast.kernels.quant import quant_fp8_rowwise_reference
from fastremover.fast.transformer_fast import FastTransformer
from fastremover.models.loading import random_init_
from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
from fastremover.ops.linear import registry as lm
from fastremover.ops.linear.fp8_rowwise import Fp8Linear
from fastremover.ops.linear.nvfp4 import Nvfp4Linear, quantize_linears_nvfp4

TINY = RemoverTransformerConfig(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2, freq_dim=32)


def tiny_model(seed):
    return random_init_(RemoverTransformer(TINY), seed).eval().to_inference_dtype(torch.float32)


def x_input(seed, shape=(1, 48, 3, 8, 12)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def run_steps(fast, x, timesteps=(900.0, 400.0)):
    cond = fast.conditioning(torch.tensor(timesteps), batch=x.shape[0])
    with torch.no_grad():
        return [fast.forward_step(x, cond, i) for i in range(len(timesteps))]


class registered:
    """Register a LinearMethod for the duration of a with block."""

    def __init__(self, method):
        self.method = method

    def __enter__(self):
        return lm.register(self.method)

    def __exit__(self, *exc):
        lm.unregister(self.method.name)


def test_registry_names_lookup_and_refusals():
    assert {"dense", "fp8-rowwise", "nvfp4", "nvfp4-w4a4"} <= set(lm.names())
    assert lm.get("fp8-rowwise").fp8_activations and not lm.get("nvfp4").fp8_activations
    assert lm.get(lm.get("dense")) is lm.get("dense")
    with pytest.raises(ValueError, match="unknown linear method 'int3'"):
        lm.get("int3")
    with pytest.raises(ValueError, match="registered already"):
        lm.register(lm.LinearMethod("dense", lm.ACT_16BIT, lambda *a: None))
    with pytest.raises(ValueError, match="activation must be one of"):
        lm.LinearMethod("odd", "fp6", lambda *a: None)


def test_fp8_activation_and_fp8_linear_take_either_form():
    lin = nn.Linear(64, 48)
    layer = Fp8Linear(lin, torch.float32)
    x = torch.randn(10, 64)
    q, s = quant_fp8_rowwise_reference(x)
    act = lm.Fp8Activation.of((q, s))
    assert lm.Fp8Activation.of(act) is act and act.shape == q.shape
    assert torch.equal(layer(act), layer(q, s))
    # a row slice: the same rows (a GEMM at another row count may block its sums differently: ulp-level)
    assert rel_err(layer(act.rows(slice(2, 5))), layer(q, s)[2:5]) < 1e-6
    assert torch.equal(act.dequantize(), q.float() * s)
    with pytest.raises(ValueError, match="carries its own row scales"):
        layer(act, s)
    with pytest.raises(ValueError, match="takes an Fp8Activation"):
        layer(q)
    # the dense layer shares the eager weight (no copy) and matches F.linear; ConcatLinear splits a bias override
    dense = lm.DenseLinear(lin.weight, lin.bias)
    assert dense.weight is lin.weight and torch.equal(dense(x), lin(x))
    assert torch.equal(dense.gelu(x), F.gelu(lin(x), approximate="tanh"))
    parts = [nn.Linear(64, 8), nn.Linear(64, 16)]
    cat = lm.ConcatLinear([lm.DenseLinear(p.weight, p.bias) for p in parts])
    other = torch.randn(24)
    assert torch.equal(cat(x), torch.cat([p(x) for p in parts], 1))
    assert torch.equal(cat(x, bias=other), torch.cat([F.linear(x, p.weight, b) for p, b in
                                                      zip(parts, other.split([8, 16]))], 1))


def test_a_registered_16bit_method_is_used_by_the_transformer():
    """A dummy method (dense math, counting its calls, its own layer class) registered in the test: the transformer
    builds every block linear with it and calls each one; the result is bit-equal to the dense method's."""
    calls = []

    class Counting(lm.DenseLinear):
        def forward(self, x, bias=None):
            calls.append(("forward", tuple(x.shape)))
            return super().forward(x, bias)

        def gelu(self, x):
            calls.append(("gelu", tuple(x.shape)))
            return super().gelu(x)

    def build(linear, out_dtype, gemm="auto"):
        return Counting(linear.weight, linear.bias)

    model, x = tiny_model(3), x_input(4)
    expect = run_steps(FastTransformer(model, use_triton=False), x)
    with registered(lm.LinearMethod("test-counting", lm.ACT_16BIT, build)):
        fast = FastTransformer(model, use_triton=False, linear_method="test-counting")
    assert all(isinstance(blk[n], Counting) for blk in fast.linears for n in ("qkv", "o", "ff1", "ff2"))
    got = run_steps(fast, x)
    assert all(torch.equal(g, e) for g, e in zip(got, expect))
    # per block and step: qkv, o, ff2 forward + ff1 through gelu
    assert sorted(c[0] for c in calls) == sorted(["forward"] * 3 * 2 * 2 + ["gelu"] * 2 * 2)
    assert {c[1][1] for c in calls if c[0] == "forward"} == {32, 64}  # in-features of qkv/o (dim) and ff2 (ffn)


def test_a_registered_fp8_method_gets_typed_activations_from_the_norms():
    """A dummy FP8 method: its layers record what they are given. Every call receives an Fp8Activation (from the
    fused norms for qkv and ff1, from the row-wise quantizer for o, from the GELU quantization for ff2), and the
    result is bit-equal to the built-in fp8-rowwise method's."""
    seen = []

    class Recording(Fp8Linear):
        def forward(self, x, x_scale=None, bias=None):
            seen.append(type(x).__name__)
            return super().forward(x, x_scale, bias)

    model, x = tiny_model(5), x_input(6)
    expect = run_steps(FastTransformer(model, linear_method="fp8-rowwise", use_triton=False), x)
    with registered(lm.LinearMethod("test-fp8", lm.ACT_FP8_ROWWISE,
                                    lambda lin, dt, gemm="auto": Recording(lin, dt, gemm))):
        fast = FastTransformer(model, use_triton=False, linear_method="test-fp8")
    assert fast.fp8 and fast.fp8_blocks is fast.linears
    got = run_steps(fast, x)
    assert all(torch.equal(g, e) for g, e in zip(got, expect))
    assert seen and set(seen) == {"Fp8Activation"} and len(seen) == 4 * 2 * 2


def test_nvfp4_method_in_the_fast_transformer_matches_the_eager_nvfp4_model():
    """`nvfp4` (W4A16) through the seam: built from an eager model already quantized by quantize_linears_nvfp4, the
    fast transformer shares its NVFP4 layers (no dense master anywhere; q/k/v as a ConcatLinear, each its own global
    scale) and matches the eager NVFP4 model as closely as the dense fast transformer matches the dense eager one;
    both differ from dense by the 4-bit weights."""
    dense_model, x = tiny_model(7), x_input(8)
    model = tiny_model(7)
    quantize_linears_nvfp4(model)
    master = weakref.ref(model.blocks[0].attn1.to_q)
    fast = FastTransformer(model, use_triton=False, linear_method="nvfp4")
    blk = fast.linears[0]
    assert blk["o"] is model.blocks[0].attn1.to_out[0] and isinstance(blk["qkv"], lm.ConcatLinear)
    assert [p for p in blk["qkv"].parts] == [model.blocks[0].attn1.to_q, model.blocks[0].attn1.to_k,
                                              model.blocks[0].attn1.to_v]
    assert not any(isinstance(m, nn.Linear) for b in model.blocks for m in b.modules())
    t = torch.tensor([900.0])
    cond = fast.conditioning(t, batch=1)
    with torch.no_grad():
        got, eager = fast.forward_step(x, cond, 0), model(x, t)
        dense = dense_model(x, t)
        dense_fast = FastTransformer(dense_model, use_triton=False)
        dense_got = dense_fast.forward_step(x, dense_fast.conditioning(t, batch=1), 0)
    err, err_dense, err_4bit = rel_err(got, eager), rel_err(dense_got, dense), rel_err(eager, dense)
    print(f"nvfp4 fast vs eager {err:.2e}; dense fast vs eager {err_dense:.2e}; nvfp4 vs dense {err_4bit:.2e}")
    assert err <= 1e-4 and err < 0.01 * err_4bit
    # a fast transformer built from the dense model quantizes its own layers (the eager masters stay in the model)
    own = FastTransformer(dense_model, use_triton=False, linear_method="nvfp4")
    assert isinstance(own.linears[0]["ff1"], Nvfp4Linear)
    with torch.no_grad():
        own_got = own.forward_step(x, own.conditioning(t, batch=1), 0)
    assert rel_err(own_got, got) <= 1e-4
    del fast, blk, model
    gc.collect()
    assert master() is None
    with pytest.raises(ValueError, match="is w4a16"):
        q = tiny_model(7)
        quantize_linears_nvfp4(q)
        FastTransformer(q, use_triton=False, linear_method="nvfp4-w4a4")


def test_weights_flag_chooses_the_registered_method_end_to_end(monkeypatch):
    """`--weights nvfp4` -> the plan's linear method -> the registry's entry -> the engine's build -> the eager
    transformer's block linears: the build asks the registry (a replaced entry is the one that runs) and the layers
    it leaves are the method's."""
    from fastremover.config import EngineConfig, LinearOptions
    from fastremover.engine.build import build
    from fastremover.models.loading import random_models

    real = lm.get("nvfp4")
    calls = []

    def prepare(transformer):
        calls.append(transformer)
        return real.prepare_eager(transformer)

    lm.register(lm.LinearMethod("nvfp4", real.activation, real.build, real.build_fused, quantized=True,
                                prepare_eager=prepare, report_key=real.report_key), replace=True)
    try:
        models = random_models("tiny", 0)
        engine = build(models, EngineConfig(device="cpu", linears=LinearOptions(weights="nvfp4")))
    finally:
        lm.register(real, replace=True)
    assert calls == [models.transformer]
    assert engine.resolved.linear_method == "nvfp4" and engine.resolved.mode == "eager"
    block = models.transformer.blocks[0]
    assert isinstance(block.attn1.to_q, Nvfp4Linear) and isinstance(block.ffn.net[2], Nvfp4Linear)
    assert engine.resolved.nvfp4["layers"] == 6 * len(models.transformer.blocks)
