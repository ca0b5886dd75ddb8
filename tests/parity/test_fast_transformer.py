"""The fast transformer (exact and fp8 modes), its denoise loop and CUDA graph, against the eager module."""

import math

import pytest
import torch
import torch.nn.functional as F

from fastremover.config import TransformerOptions
from fastremover.engine.denoise import EagerDenoiser, FastDenoiser
from fastremover.engine.build import build_denoiser, resolve_mode
from fastremover.ops.linear.fp8_rowwise import Fp8Linear
from fastremover.fast.transformer_fast import FastTransformer
from fastremover.models.transformer import RemoverTransformerConfig
from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG
from helpers import TINY_TRANSFORMER as TINY, attention_fakes, tiny_transformer as tiny_model


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def inputs(seed, shape=(1, 48, 3, 8, 12), device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device, dtype)


@pytest.mark.parametrize("use_triton", [False, True], ids=["eager-ops", "triton-interpreter"])
def test_exact_mode_matches_eager_module(use_triton):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    model = tiny_model(seed)
    fast = FastTransformer(model, use_triton=use_triton)
    timesteps = torch.tensor([999.0, 500.0, 3.0])
    cond = fast.conditioning(timesteps, batch=1)
    x = inputs(seed)
    for i, t in enumerate(timesteps):
        with torch.no_grad():
            expect = model(x, t.reshape(1))
            got = fast.forward_step(x, cond, i)
        assert rel_err(got, expect) <= 1e-4, (i, rel_err(got, expect))


def test_conditioning_equals_eager_modulation():
    model = tiny_model(1)
    fast = FastTransformer(model, use_triton=False)
    t = torch.tensor([700.0])
    cond = fast.conditioning(t, batch=2)
    with torch.no_grad():
        temb, tproj = model.condition_embedder(t.expand(2))
        for layer, blk in enumerate(model.blocks):
            for j, part in enumerate(blk.modulation(tproj)):
                assert torch.equal(cond.block_mods[0, layer, j], part[:, 0])
        shift, scale = (model.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        assert torch.equal(cond.final_mods[0, 0], shift[:, 0]) and torch.equal(cond.final_mods[0, 1], scale[:, 0])


def test_fp8_mode_with_the_fused_ffn_gemm_matches_the_unfused_ops():
    """fp8 mode on the Triton kernels (interpreter), where ff1 + GELU + quantization is one GEMM (kernels/gemm_fp8.py),
    against the same mode on the eager ops (_scaled_mm, then the GELU quantization): close, and not identical (the
    fused epilogue skips the 16-bit rounding of the hidden, so identical output would mean it did not run)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton ops run on this test's CPU tensors only in the interpreter (conftest.py sets "
                    "TRITON_INTERPRET=1 without a GPU); the GPU path is test_gemm_fp8's real-shape test")
    model = tiny_model(5)
    fused = FastTransformer(model, linear_method="fp8-rowwise", use_triton=True)  # the default where the kernel runs
    plain = FastTransformer(model, linear_method="fp8-rowwise", use_triton=False)  # no Triton: the unfused ops
    assert not FastTransformer(model, linear_method="fp8-rowwise", use_triton=True,
                               fused_ffn1=False).describe()["ffn1"].startswith("fused")
    assert fused.describe()["ffn1"].startswith("fused") and not plain.describe()["ffn1"].startswith("fused")
    x = inputs(6)
    cond = fused.conditioning(torch.tensor([600.0]), batch=1)
    with torch.no_grad():
        got, expect = fused.forward_step(x, cond, 0), plain.forward_step(x, cond, 0)
    assert cos(got, expect) > 0.999 and not torch.equal(got, expect)


def test_fp8_mode_is_close_but_not_identical():
    model = tiny_model(2)
    fast = FastTransformer(model, linear_method="fp8-rowwise", use_triton=False)
    x = inputs(3)
    cond = fast.conditioning(torch.tensor([600.0]), batch=1)
    with torch.no_grad():
        expect = model(x, torch.tensor([600.0]))
        got = fast.forward_step(x, cond, 0)
    assert cos(got, expect) > 0.99
    assert not torch.equal(got, expect)  # identical output would mean the quantized path did not run


@pytest.mark.parametrize("batch", [1, 2])
def test_cudnn_fp8_codes_path_folds_the_v_centre_into_the_o_projection(monkeypatch, batch):
    """The fast transformer's cuDNN-FP8 path centres V (on its first-step sequence mean c), takes the attention output
    as e4m3 codes of (o - c) / sv and adds b_o + W_o c with the O projection (batch 1: as the GEMM's bias; more
    batches: an add per batch after it). With cuDNN's kernel faked by its dequantized math (codes in, codes out) and
    V given a large shared offset (to_v biases + 4), a step matches the fp8 mode's generic path (fp32 attention, then
    the O projection's own row quantization) far closer than the same path with the fold's centre zeroed or (two
    batches) swapped between the batches."""
    from fastremover.fast import transformer_fast

    model = tiny_model(9)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn1.to_v.bias.add_(4.0)
    x, t = inputs(10, shape=(batch, 48, 3, 8, 12)), torch.tensor([500.0, 400.0])
    if batch == 2:
        x[1].add_(10.0)  # the batches' V means then differ: a centre applied to the wrong batch shows

    generic = FastTransformer(model, linear_method="fp8-rowwise", use_triton=False)
    cond = generic.conditioning(t, batch=batch)
    with torch.no_grad():
        expect = [generic.forward_step(x, cond, i) for i in (0, 1)]
    # the cuDNN path, with the kernel faked (the real one needs a Hopper GPU): a backend whose output is fp8 codes
    fake = attention_fakes.registered("test-cudnn-like", codes_call=attention_fakes.fake_cudnn_codes,
                                      output="fp8-codes")
    with fake:
        codes = FastTransformer(model, linear_method="fp8-rowwise", use_triton=False, attention="test-cudnn-like")
    assert codes.fp8_attention_codes and not codes.fp8_attention_requant
    biases = []
    o_proj = codes.fp8_blocks[0]["o"]
    real_forward = o_proj.forward
    monkeypatch.setattr(o_proj, "forward", lambda *a, **k: biases.append(k.get("bias")) or real_forward(*a, **k))
    with pytest.raises(RuntimeError, match="calibration missing"):
        codes.forward_step(x, cond, 1)  # a later step before any first step: no centres to use
    with torch.no_grad():
        got = [codes.forward_step(x, cond, i) for i in (0, 1)]  # step 1 reuses step 0's centres
    assert biases[0] is not None and bool(biases[0].abs().max() > 0) == (batch == 1)  # b_o + W_o c as the bias
    real_bias = transformer_fast.o_projection_bias
    variants = {"zeroed": lambda c, w, b: real_bias(torch.zeros_like(c), w, b)}
    if batch == 2:
        variants["swapped"] = lambda c, w, b: real_bias(c.flip(0), w, b)
    errs = {}
    with torch.no_grad():
        for name, fn in variants.items():
            monkeypatch.setattr(transformer_fast, "o_projection_bias", fn)
            errs[name] = rel_err(codes.forward_step(x, cond, 0), expect[0])
    err = [rel_err(g, e) for g, e in zip(got, expect)]
    print(f"codes path vs generic: rel. error {err}; with the fold's centre " +
          ", ".join(f"{k}: {v:.4f}" for k, v in errs.items()))
    assert max(err) < 0.1 and err[0] < 0.2 * errs["zeroed"], (err, errs)
    if batch == 2:
        assert err[0] < 0.5 * errs["swapped"], (err, errs)


@pytest.mark.parametrize("batch", [1, 2])
def test_static_fp8_bounds_hold_and_are_not_absurd(monkeypatch, batch):
    """The fast mode's static scales: the GELU output's Cauchy-Schwarz bound (Conditioning.ffn_amax) and the 8-bit
    attention output's 1.125 * 448 * sv are never exceeded (no code saturates) over a few steps, and are within 100x
    of the true amax (a looser bound would push typical values toward e4m3's subnormals). FlashAttention-3's kernel
    is faked by its dequantized math (bf16 out), so the requantizing path runs on the CPU."""

    model = tiny_model(13)
    x = inputs(14, shape=(batch, 48, 3, 8, 12))
    with attention_fakes.registered("test-flash3-like", codes_call=attention_fakes.fake_flash3_codes,
                                    output="centred-16bit", row_split_block_m=128):
        fast = FastTransformer(model, linear_method="fp8-rowwise", use_triton=False, attention="test-flash3-like")
    assert fast.fp8_attention_requant
    seen = []
    real = fast.ops.quant_static

    def recording(y, amax, mult=1.0, *, gelu=False, **kw):
        vals = F.gelu(y.float(), approximate="tanh") if gelu else y.float()
        seen.append(("gelu" if gelu else "o", float(vals.abs().max()), float(amax) * mult))
        return real(y, amax, mult, gelu=gelu, **kw)

    monkeypatch.setattr(fast.ops, "quant_static", recording)
    cond = fast.conditioning(torch.tensor([900.0, 500.0, 100.0]), batch=batch)
    with torch.no_grad():
        for step in range(3):
            fast.forward_step(x, cond, step)
    assert {k for k, _, _ in seen} == {"gelu", "o"} and len(seen) == 3 * 2 * len(model.blocks)
    for kind, true_amax, bound in seen:
        assert true_amax <= bound, (kind, true_amax, bound)
        assert bound < 100 * true_amax, (kind, true_amax, bound)
    worst = {k: max(b / a for kk, a, b in seen if kk == k) for k in ("gelu", "o")}
    print(f"bound / true amax, worst: {worst}")


def test_attention_row_split_leaves_the_partial_last_wave():
    from fastremover.fast.transformer_fast import attention_row_split

    # W2 / W1 on an H200 (132 SMs, 12 heads, 128-row tiles): 3072 tiles -> 3036 (23 waves) + 36; 684 -> 660 + 24
    assert attention_row_split(32760, 12, 132) == 253 * 128
    assert attention_row_split(7290, 12, 132) == 55 * 128
    assert attention_row_split(11 * 128 * 2, 12, 132) is None  # 264 tiles: two whole waves
    assert attention_row_split(1000, 12, 132) is None  # 96 tiles: one partial wave, nothing to overlap it with
    assert attention_row_split(777, 3, 10) is None  # 7 block rows: whole waves need 10 of them
    for s, per_row, sms in ((5000, 12, 132), (777, 3, 6), (4096 + 1, 24, 108)):
        rows_a = attention_row_split(s, per_row, sms)
        blocks = -(-s // 128)
        assert rows_a is not None and rows_a % 128 == 0 and 0 < rows_a < s
        assert (rows_a // 128 * per_row) % sms == 0  # whole waves
        assert blocks - rows_a // 128 <= sms // math.gcd(sms, per_row)  # at most one wave's worth left over


def test_attention_tail_split_matches_one_call(monkeypatch):
    """fp8-flash3 with one batch splits the attention's query rows where its tiles would leave a partial last wave
    (faked here with a 16-row tile and 4 SMs): two attention calls, each followed by its rows' O projection and
    residual + adaLN into row slices of shared outputs. Every step of the CPU composition is row-wise, so the result
    equals the unsplit path's."""

    model = tiny_model(15)
    x = inputs(16, shape=(1, 48, 3, 8, 12))  # 72 tokens
    calls = []

    def fake_flash3(q8, k8, v8, sq, sk, sv, out_dtype=None):
        calls.append(q8.shape[1])
        return attention_fakes.fake_flash3_codes(q8, k8, v8, sq, sk, sv)

    outs = {}
    for overlap in (True, False):
        with attention_fakes.registered("test-flash3-like", codes_call=fake_flash3, output="centred-16bit",
                                        row_split_block_m=16):  # a 16-row query tile, 4 SMs (below)
            fast = FastTransformer(model, linear_method="fp8-rowwise", use_triton=False, attention="test-flash3-like",
                                   options=TransformerOptions(tail_overlap=overlap))
        fast.sm_count = 4
        cond = fast.conditioning(torch.tensor([900.0, 500.0]), batch=1)
        calls.clear()
        with torch.no_grad():
            outs[overlap] = [fast.forward_step(x, cond, i) for i in (0, 1)]
        heads = model.config.num_attention_heads
        expect = [64, 8] if overlap else [72]
        assert fast.split_rows(1, 72, heads) == (64 if overlap else None)
        assert calls == expect * 2 * len(model.blocks), calls
    for got, ref in zip(outs[True], outs[False]):
        assert torch.equal(got, ref)


def test_fused_v_statistics_equal_the_three_kernel_chain(monkeypatch):
    """fused_v_stats (the default with Triton): V's statistics kernel does its own final reduction, with a program
    counter per layer kept by the transformer. Under the interpreter the step equals the three-kernel chain's, and
    every counter is back to 0 after it (FlashAttention-3 faked by its dequantized math)."""

    model = tiny_model(19)
    x = inputs(20, shape=(1, 48, 3, 8, 12))

    outs = {}
    for fused in (True, False):
        with attention_fakes.registered("test-flash3-like", codes_call=attention_fakes.fake_flash3_codes,
                                        output="centred-16bit", row_split_block_m=128):
            fast = FastTransformer(model, linear_method="fp8-rowwise", use_triton=True, attention="test-flash3-like",
                                   options=TransformerOptions(fused_v_stats=fused))
        assert fast.fp8_attention_requant
        assert fast.fused_v_stats == fused
        cond = fast.conditioning(torch.tensor([900.0]), batch=1)
        with torch.no_grad():  # one step (the interpreter runs every kernel of it on the CPU)
            outs[fused] = [fast.forward_step(x, cond, 0)]
        assert len(fast._v_counters) == (1 if fused else 0)
        assert all(int(c.abs().sum()) == 0 for c in fast._v_counters.values())
    for got, ref in zip(outs[True], outs[False]):
        assert torch.equal(got, ref)


def test_fp8_linear_matches_dequantized_math():
    lin = torch.nn.Linear(64, 48)
    fp8 = Fp8Linear(lin, torch.float32)
    x = torch.randn(10, 64)
    from fastremover.fast.kernels.quant import quant_fp8_rowwise_reference

    q, s = quant_fp8_rowwise_reference(x)
    y = fp8(q, s)
    expect = (q.float() * s) @ (fp8.codes.float() * fp8.scale.t()).t() + lin.bias
    assert rel_err(y, expect) < 1e-5
    assert cos(y, lin(x)) > 0.999
    # a per-call bias replaces the layer's own one: the same GEMM plus the other vector
    other = torch.randn(48)
    assert rel_err(fp8(q, s, bias=other) - other, fp8(q, s) - fp8.bias) < 1e-6
    with pytest.raises(ValueError, match="bias override"):
        fp8(q, s, bias=torch.zeros(47))


def test_fast_denoiser_cpu_matches_eager_loop():
    model = tiny_model(4)
    noise, masked, mask = (inputs(s, (1, 16, 2, 8, 12)) for s in (5, 6, 7))
    eager = EagerDenoiser(model, DEFAULT_SCHEDULER_CONFIG)(noise, masked, mask, steps=3)
    fast = FastDenoiser(FastTransformer(model, use_triton=False), DEFAULT_SCHEDULER_CONFIG, cuda_graphs=False)
    assert rel_err(fast(noise, masked, mask, steps=3), eager) <= 1e-4


class _FakeGraph:
    """Stands in for a CUDA graph of one step on the CPU: a replay runs the recorded call again into its output."""

    replays = 0

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self):
        _FakeGraph.replays += 1
        self.out.copy_(self.fn())


@pytest.mark.parametrize("fail", [False, True], ids=["recorded", "recording-fails"])
def test_step_graph_loop_equals_the_eager_loop(monkeypatch, fail):
    """FastDenoiser._loop_step_graph's plumbing (the step's input and conditioning rows copied into static buffers,
    the later steps not calibrating again, each replay's output copied before the scheduler keeps it): the same
    latents as the eager loop, bit for bit, on the fast mode's FP8 path (K calibrated at step 0, the FFN's static
    bounds per step) with the graph faked by re-running the call; a recording that fails runs the rest eagerly."""
    from fastremover.engine import denoise
    from fastremover.schedulers import build_scheduler

    def record(fn, device):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = _FakeGraph(fn)
        return graph, graph.out

    monkeypatch.setattr(denoise, "record_one", record)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    with attention_fakes.registered("test-flash3-like", codes_call=attention_fakes.fake_flash3_codes,
                                    output="centred-16bit", row_split_block_m=128):
        fast = FastTransformer(tiny_model(seed), linear_method="fp8-rowwise", use_triton=False,
                               attention="test-flash3-like")
        den = FastDenoiser(fast, DEFAULT_SCHEDULER_CONFIG, cuda_graphs=True)
        noise, masked, mask = (inputs(seed + s, (1, 16, 2, 8, 12)) for s in (1, 2, 3))
        steps = 6
        scheduler = build_scheduler(DEFAULT_SCHEDULER_CONFIG, steps, device=noise.device)
        cond = fast.conditioning(scheduler.timesteps, 1)
        eager = den._loop(scheduler, cond, noise, masked, mask)
        _FakeGraph.replays = 0
        got, why = den._loop_step_graph(scheduler, cond, noise, masked, mask)
    assert torch.equal(got, eager)
    if fail:
        assert "capture failed (RuntimeError: operation not permitted" in why and _FakeGraph.replays == 0
    else:
        assert why is None and _FakeGraph.replays == steps - denoise.STEP_GRAPH_EAGER_STEPS


def test_conditioning_slot_keeps_each_blocks_alignment():
    """A one-step slot has the layouts of the full Conditioning (the FFN bounds' rows padded), and `fill` copies
    step i's rows."""
    with attention_fakes.registered("test-flash3-like", codes_call=attention_fakes.fake_flash3_codes,
                                    output="centred-16bit", row_split_block_m=128):
        fast = FastTransformer(tiny_model(2), linear_method="fp8-rowwise", use_triton=False,
                               attention="test-flash3-like")
    cond = fast.conditioning(torch.tensor([900.0, 500.0, 100.0]), batch=1)
    slot = cond.slot()
    for name in ("block_mods", "final_mods", "ffn_amax"):
        full, one = getattr(cond, name), getattr(slot, name)
        assert one.shape[1:] == full.shape[1:] and one.stride() == full.stride(), name
    slot.fill(cond, 2)
    assert torch.equal(slot.block_mods[0], cond.block_mods[2]) and torch.equal(slot.final_mods[0], cond.final_mods[2])
    assert torch.equal(slot.ffn_amax[0], cond.ffn_amax[2])


def test_modes_fall_back_on_cpu_with_a_note():
    mode, notes = resolve_mode("fast", torch.device("cpu"))
    assert mode == "eager" and "eager" in notes[0]
    assert resolve_mode("eager", torch.device("cpu")) == ("eager", [])
    denoiser, notes = build_denoiser(tiny_model(0), DEFAULT_SCHEDULER_CONFIG, "eager", torch.device("cpu"))
    assert isinstance(denoiser, EagerDenoiser) and notes == []


def test_attention_backend_choice_and_errors_on_cpu():
    from fastremover.errors import FastRemoverError
    from fastremover.engine.build import resolve_attention
    from fastremover.ops.attention import available as available_backends
    from fastremover.ops.attention import unavailable_reason

    cpu = torch.device("cpu")
    import os

    # the sparse backends' Triton kernel runs on the CPU only in Triton's interpreter (as here without a GPU)
    interpreted = ["sparse-sta", "sparse-vsa"] if os.environ.get("TRITON_INTERPRET") == "1" else []
    assert available_backends(cpu) == ["sdpa", *interpreted]
    assert "CUDA" in unavailable_reason("fp8", cpu)
    assert resolve_attention("auto", "eager", cpu) == ("sdpa", [])
    assert resolve_attention("auto", "exact", cpu) == ("sdpa", [])  # the CPU has nothing else: no note
    backend, notes = resolve_attention("auto", "fast", cpu)  # no 8-bit backend here: fp16 SDPA, said in a note
    assert backend == "sdpa" and len(notes) == 1 and "8-bit attention unavailable" in notes[0]
    with pytest.raises(FastRemoverError, match="fp8"):
        resolve_attention("fp8", "exact", cpu)  # asked for fp8 explicitly: an error, never a silent fp16 run
    with pytest.raises(FastRemoverError, match="eager"):
        resolve_attention("fp8", "eager", cpu)
    with pytest.raises(FastRemoverError, match="choose one of"):
        resolve_attention("flash9", "exact", cpu)


@pytest.mark.parametrize("available,mode,expect_backend,expect_note", [
    ({"sdpa", "cudnn-fp8"}, "fast", "cudnn-fp8", None),
    # neither FlashAttention-3 nor cuDNN's FP8: fp16 SDPA (it outranks FlashInfer's kernels in fast), saying why
    ({"sdpa", "flashinfer-fa3", "flashinfer-fa3-fp8"}, "fast", "sdpa", "8-bit attention unavailable"),
    ({"sdpa"}, "fast", "sdpa", "8-bit attention unavailable"),
    ({"sdpa", "cudnn-fp8"}, "exact", "sdpa", "FA3 attention is not used"),  # no FlashInfer: say why
    ({"sdpa"}, "exact", "sdpa", "FA3 attention is not used"),
    ({"sdpa", "flashinfer-fa3", "flashinfer-fa3-fp8", "cudnn-fp8"}, "exact", "flashinfer-fa3", None),
    ({"sdpa", "flashinfer-fa3", "flashinfer-fa3-fp8", "cudnn-fp8"}, "fast", "cudnn-fp8", None),
    ({"sdpa", "flashinfer-fa3", "flashinfer-fa3-fp8", "cudnn-fp8", "flashattn3-fp8"}, "fast",
     "flashattn3-fp8", None),  # FlashAttention-3 built
    ({"sdpa", "flashattn3-fp8"}, "exact", "sdpa", "FA3 attention is not used"),
], ids=["fast-all", "fast-flashinfer-only", "fast-no-8bit", "exact-all", "exact-no-8bit",
        "exact-flashinfer", "fast-flashinfer", "fast-flash3", "exact-flash3"])
def test_auto_backend_policy(monkeypatch, available, mode, expect_backend, expect_note):
    """auto_backend's choice given which backends can run (unavailable_reason faked: nothing CUDA is touched): fast
    takes FlashAttention-3's fp8-flash3 when it is built, else cuDNN's fp8 when it can run, else fp16 sdpa with a
    note naming why each of the two FP8 backends could not run; exact takes FlashInfer's fa3 when it can run, else
    sdpa with a note naming why fa3 could not."""
    from fastremover.ops.attention import registry

    asked = []

    def fake_reason(name, device):
        asked.append((name, device))
        return None if name in available else f"fake: {name} is not available here"

    monkeypatch.setattr(registry, "unavailable_reason", fake_reason)
    dev = torch.device("cuda")
    backend, notes = registry.choose(mode, dev)
    assert backend == expect_backend, (backend, notes)
    if expect_note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and expect_note in notes[0], notes
        if mode == "exact":
            assert "fake: flashinfer-fa3 is not" in notes[0], notes  # the note says why FlashInfer's FA3 is not used
        else:
            # fast has a note only when it ends up in fp16: it says why each preferred (FP8) backend did not run,
            # FlashAttention-3 included (not announced while cuDNN's runs), and what runs instead
            assert expect_backend == "sdpa" and "attention runs in fp16 (sdpa)" in notes[0], notes
            assert "fake: cudnn-fp8 is not" in notes[0], notes  # the note says why cuDNN's FP8 attention is not used
            assert "fake: flashattn3-fp8 is not" in notes[0], notes  # ... and why FlashAttention-3's is not
            assert "flashinfer" not in notes[0], notes  # ranked below sdpa in fast: never tried, never named
    assert all(d == dev for _, d in asked)  # the device is passed through
    if mode == "fast" and expect_backend not in ("cudnn-fp8", "flashattn3-fp8"):
        assert "cudnn-fp8" in [n for n, _ in asked]  # the note comes from asking, not from a guess
    if mode == "fast":
        assert "flashattn3-fp8" in [n for n, _ in asked]


def test_fused_qkv_fp8_linear_equals_three_separate_quantizations():
    from fastremover.fast.transformer_fast import _fused_linear

    lins = [torch.nn.Linear(32, 48) for _ in range(3)]
    for i, lin in enumerate(lins):
        torch.manual_seed(100 + i)
        torch.nn.init.normal_(lin.weight)
    fused = Fp8Linear(_fused_linear(*lins), torch.float32)
    parts = [Fp8Linear(lin, torch.float32) for lin in lins]
    assert torch.equal(fused.codes.view(torch.uint8), torch.cat([p.codes for p in parts]).view(torch.uint8))
    assert torch.equal(fused.scale, torch.cat([p.scale for p in parts], dim=1))
    assert torch.equal(fused.bias, torch.cat([p.bias for p in parts]))


# ----------------------------------------------------------------------------------------------------------------------
# GPU: real config (random weights), real shapes


REAL = RemoverTransformerConfig()


@pytest.fixture(scope="module")
def real_model():
    return tiny_model(11, REAL, "cuda", torch.float16)


@pytest.mark.gpu
def test_gpu_exact_and_fast_vs_eager_at_real_config(real_model):
    x = inputs(12, (1, 48, 21, 60, 104), "cuda", torch.float16)  # W2 latents: 32760 tokens
    t = torch.tensor([937.0], device="cuda")
    with torch.no_grad():
        eager = real_model(x, t)
        exact = FastTransformer(real_model)
        got_exact = exact.forward_step(x, exact.conditioning(t, 1), 0)
        fast = FastTransformer(real_model, linear_method="fp8-rowwise")
        cond = fast.conditioning(t, 1)  # an fp8 transformer's: it carries the FFN's static quantization bounds
        got_fast = fast.forward_step(x, cond, 0)
        got_fast_attn = FastTransformer(real_model, linear_method="fp8-rowwise", attention="fp8").forward_step(x, cond,
                                                                                                               0)
    c_exact, c_fast, c_attn = cos(got_exact, eager), cos(got_fast, eager), cos(got_fast_attn, eager)
    print(f"cos vs eager fp16: exact {c_exact:.6f}, fast(fp8 linears) {c_fast:.6f}, "
          f"fast(fp8 linears + fp8 attention) {c_attn:.6f}")
    assert c_exact > 0.9999
    assert c_fast > 0.99 and not torch.equal(got_fast, eager)
    assert c_attn > 0.99 and not torch.equal(got_fast_attn, got_fast)


@pytest.mark.gpu
def test_gpu_fp8_linear_cosine_at_real_shapes():
    from fastremover.fast.kernels.quant import quant_fp8_rowwise

    for k, n in ((1536, 1536), (1536, 8960), (8960, 1536)):
        lin = torch.nn.Linear(k, n).cuda().half()
        x = torch.randn(32760, k, device="cuda", dtype=torch.float16)
        y = Fp8Linear(lin, torch.float16)(*quant_fp8_rowwise(x))
        c = cos(y, lin(x))
        print(f"fp8 linear {k}->{n}: cos {c:.6f}")
        assert c >= 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("mode,attention,expect", [("exact", "sdpa", "sdpa"), ("fast", "auto", "auto"),
                                                   ("exact", "fa3", "fa3"), ("fast", "fp8-fa3", "fp8-fa3"),
                                                   ("fast", "fp8-flash3", "fp8-flash3")],
                         ids=["exact-sdpa", "fast-auto", "exact-flashinfer-fa3", "fast-flashinfer-fp8-fa3",
                              "fast-flash3-fp8"])
def test_gpu_graph_replay_is_bit_identical(real_model, mode, attention, expect):
    """exact (SDPA, FlashInfer's FA3), fast with its default FP8 attention (FlashAttention-3's where built, else
    cuDNN's; centred K and V) and with FlashInfer's FA3 FP8 kernel inside the captured loop: the graph replays
    bit-identically and reads new inputs."""
    from fastremover.ops.attention import canonical, choose, unavailable_reason

    # flashattn3-fp8 where FlashAttention-3 is built, else cuDNN's fp8; the old names are aliases
    expect = choose(mode, torch.device("cuda"))[0] if expect == "auto" else canonical(expect)
    if attention not in ("auto", "sdpa"):
        why = unavailable_reason(attention, torch.device("cuda"))
        if why is not None:
            pytest.skip(f"attention backend {attention} cannot run here: {why}")
    denoiser, notes = build_denoiser(real_model, DEFAULT_SCHEDULER_CONFIG, mode, torch.device("cuda"),
                                     attention=attention)
    assert isinstance(denoiser, FastDenoiser) and denoiser.cuda_graphs
    assert denoiser.describe()["attention"] == expect, notes
    noise, masked, mask = (inputs(s, (1, 16, 5, 30, 54), "cuda", torch.float16) for s in (1, 2, 3))
    first = denoiser(noise, masked, mask, steps=4)  # eager run on the fast transformer, then capture
    replay = denoiser(noise, masked, mask, steps=4)
    assert torch.equal(first, replay)
    other = denoiser(noise.roll(1, dims=-1), masked, mask, steps=4)  # the graph really reads new inputs
    assert not torch.equal(other, replay)
    eager = EagerDenoiser(real_model, DEFAULT_SCHEDULER_CONFIG)(noise, masked, mask, steps=4)
    print(f"{mode} ({expect} attention): 4-step latents cos vs eager {cos(replay, eager):.6f}")
    assert cos(replay, eager) > (0.9999 if mode == "exact" else 0.99)



@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_step_graph_first_call_equals_the_eager_loop(real_model, mode):
    """A host-bound shape's first call (the measured 320x256 crop's 3520 tokens, 12 steps; no whole-loop recording
    yet) replays its later steps from a graph of one transformer step: torch.equal to the eager loop on the same
    inputs, at the real config, in each fast mode with its default attention."""
    from fastremover.engine import denoise
    from fastremover.schedulers import build_scheduler

    denoiser, _ = build_denoiser(real_model, DEFAULT_SCHEDULER_CONFIG, mode, torch.device("cuda"))
    shape, steps = (1, 16, 11, 32, 40), 12
    assert denoise.step_graph_pays(steps, 11 * 16 * 20) and not denoise.capture_pays(steps, 1, 11 * 16 * 20)
    noise, masked, mask = (inputs(s, shape, "cuda", torch.float16) for s in (4, 5, 6))
    used = []
    real = denoiser._loop_step_graph
    denoiser._loop_step_graph = lambda *a, **k: used.append(1) or real(*a, **k)
    first = denoiser(noise, masked, mask, steps=steps)
    assert used and not denoiser.notes, denoiser.notes
    scheduler = build_scheduler(DEFAULT_SCHEDULER_CONFIG, steps, device="cuda")
    cond = denoiser.fast.conditioning(scheduler.timesteps, 1)
    eager = denoiser._loop(scheduler, cond, noise, masked, mask)
    assert torch.equal(first, eager)
    again, why = real(scheduler, cond, noise.roll(1, dims=-1), masked, mask)  # the graph reads each step's inputs
    assert why is None and torch.equal(again, denoiser._loop(scheduler, cond, noise.roll(1, dims=-1), masked, mask))
    assert not torch.equal(again, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["auto", "fp8"])
def test_gpu_concurrent_branches_equal_the_serial_order(real_model, attention):
    """The 8-bit attention's q / k / V preparation on three streams and the attention's split-off last wave on a
    side stream (the defaults on CUDA) run the same kernels on the same inputs as one stream after another:
    torch.equal at W1's token count, for a calibrating first step and a later one, eagerly and as a captured graph.
    Without the split, close."""
    from fastremover.engine.build import resolve_attention

    backend = resolve_attention(attention, "fast", torch.device("cuda"))[0]
    x = inputs(21, (1, 48, 10, 54, 54), "cuda", torch.float16)  # 7290 tokens
    t = torch.tensor([937.0, 500.0], device="cuda")
    outs = {}
    for concurrent, tail_overlap in ((True, True), (False, True), (False, False)):
        fast = FastTransformer(real_model, linear_method="fp8-rowwise", attention=backend,
                               options=TransformerOptions(concurrent=concurrent, tail_overlap=tail_overlap))
        assert fast.describe()["concurrent_branches"] == concurrent
        if backend == "flashattn3-fp8" and tail_overlap and fast.sm_count == 132:  # H200 / H100 SXM: 684 tiles, rows
            assert fast.split_rows(1, 7290, 12) == 7040  # [7040, 7290) are the last wave's 24
        cond = fast.conditioning(t, 1)
        with torch.no_grad():
            eager = [fast.forward_step(x, cond, i) for i in (0, 1)]
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static = fast.forward_step(x, cond, 1)
            g.replay()
            torch.cuda.synchronize()
        outs[concurrent, tail_overlap] = (*eager, static.clone())
    for got, expect in zip(outs[True, True], outs[False, True]):
        assert torch.equal(got, expect)
    assert torch.equal(outs[True, True][1], outs[True, True][2])  # the captured step is the eager one
    # the attention split into two calls (fp8-flash3): the same per-row attention; the O projection's GEMM at two
    # row counts may pick other cuBLAS kernels, so close rather than equal
    for got, expect in zip(outs[True, True], outs[False, False]):
        c = cos(got, expect)
        print(f"{backend}: tail split vs one call: cos {c:.8f}, equal {torch.equal(got, expect)}")
        assert c > 0.99999


@pytest.mark.gpu
def test_gpu_fast_mode_defaults_to_the_fastest_fp8_attention():
    """On a Hopper GPU the fast mode's `auto` attention is FlashAttention-3's `fp8-flash3` where it is built, else
    cuDNN's `fp8` (both with K and V centred: W2 48.6 dB, docs/performance.md); exact takes FlashInfer's FA3 when it
    can run, else SDPA."""
    from fastremover.engine.build import resolve_attention

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("cuDNN's FP8 attention needs Hopper (sm_90)")
    from fastremover.ops.attention import unavailable_reason

    why = unavailable_reason("cudnn-fp8", dev)
    assert why is None, why  # the GPU image carries cudnn-frontend (bench/gpu_session.sh)
    fast_default = "flashattn3-fp8" if unavailable_reason("flashattn3-fp8", dev) is None else "cudnn-fp8"
    assert resolve_attention("auto", "fast", dev) == (fast_default, [])
    # FlashInfer's FA3 when installed
    exact_default = "flashinfer-fa3" if unavailable_reason("flashinfer-fa3", dev) is None else "sdpa"
    backend, notes = resolve_attention("auto", "exact", dev)
    assert backend == exact_default
    if exact_default == "flashinfer-fa3":
        assert notes == []
    else:  # the faster kernel is not installed: one note says so and how to get it
        assert len(notes) == 1 and "flashinfer-fa3" in notes[0] and "pip install flashinfer-python" in notes[0], notes


@pytest.mark.parametrize("fp8", [False, True])
def test_denoiser_description_fits_the_engine_config(fp8):
    """The pipeline builds its EngineConfig from the denoiser's describe(): every key must be a field (an fp8-only
    key once crashed the GPU bench, bench/results/w2-fast-fusedffn1-crash-*-8dd3c19.txt)."""
    from dataclasses import fields

    from fastremover.config import ResolvedEngine as EngineConfig  # the pipeline's record of what runs

    denoiser = FastDenoiser(FastTransformer(tiny_model(1), linear_method="fp8-rowwise" if fp8 else "dense",
                            use_triton=False), DEFAULT_SCHEDULER_CONFIG,
                            cuda_graphs=False)
    described = denoiser.describe()
    assert set(described) <= {f.name for f in fields(EngineConfig)}, set(described)
    assert EngineConfig(model="m", device="cpu", precision="fp32", **described).fp8_linears == fp8


def test_fused_ffn1_switch_says_when_it_cannot_run(monkeypatch):
    """FASTREMOVER_FUSED_FFN1=1 where the fused GEMM cannot run (no sm_90 GPU / no Triton ops): the two-pass FFN
    runs, with a note; unset (the default: fused where it runs) or 0, no note; any other value is an error."""
    from fastremover.errors import FastRemoverError
    from fastremover.engine.build import build_denoiser

    model = tiny_model(3)
    monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", "1")
    denoiser, notes = build_denoiser(model, DEFAULT_SCHEDULER_CONFIG, "fast", torch.device("cpu"), attention="sdpa")
    assert not denoiser.fast.fused_ffn1 and any("FASTREMOVER_FUSED_FFN1" in n for n in notes), notes
    for value in ("0", None):
        if value is None:
            monkeypatch.delenv("FASTREMOVER_FUSED_FFN1")
        else:
            monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", value)
        denoiser, notes = build_denoiser(model, DEFAULT_SCHEDULER_CONFIG, "fast", torch.device("cpu"),
                                         attention="sdpa")
        assert not denoiser.fast.fused_ffn1 and not any("FFN1" in n for n in notes)
    monkeypatch.setenv("FASTREMOVER_FUSED_FFN1", "yes")
    with pytest.raises(FastRemoverError, match="FASTREMOVER_FUSED_FFN1"):
        build_denoiser(model, DEFAULT_SCHEDULER_CONFIG, "fast", torch.device("cpu"), attention="sdpa")
