"""The attention backend registry (fastremover/ops/attention): registration, priorities, reasons, aliases."""

import subprocess
import sys

import pytest
import torch

from fastremover.errors import FastRemoverError
from fastremover.engine.build import build_denoiser, resolve_attention
from fastremover.fast.transformer_fast import FastTransformer
from fastremover.models.loading import random_init_
from fastremover.models.transformer import RemoverTransformer, RemoverTransformerConfig
from fastremover.ops import attention as registry
from fastremover.schedulers import DEFAULT_SCHEDULER_CONFIG
from helpers import attention_fakes

TINY = RemoverTransformerConfig(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=1, freq_dim=32)
CPU = torch.device("cpu")


def test_canonical_names_and_aliases():
    expected = {"sdpa": "sdpa", "fa3": "flashinfer-fa3", "fp8-fa3": "flashinfer-fa3-fp8", "fp8": "cudnn-fp8",
                "fp8-flash3": "flashattn3-fp8"}
    for alias, name in expected.items():
        assert registry.canonical(alias) == name and registry.canonical(name) == name
    sparse = {"sparse-sta", "sparse-vsa", "sparse-sta-cudnn", "sparse-vsa-cudnn"}
    assert set(expected.values()) | sparse == set(registry.names())
    with pytest.raises(FastRemoverError, match="choose one of"):
        registry.canonical("flash9")
    for gone in ("triton-fp8", "fp8-triton"):  # our Triton FP8 kernel no longer ships (experiments/attention_fp8.py)
        with pytest.raises(FastRemoverError, match="unknown backend"):
            registry.canonical(gone)


def test_a_registered_backend_is_picked_by_priority_and_runs():
    """A backend defined in one other file (tests/helpers/attention_fakes.py) and registered: `auto` picks it where its
    priority is highest, the engine builds with it, and the transformer calls it."""
    calls = []

    def counting_sdpa(q, k, v):
        calls.append(q.shape)
        return attention_fakes.sdpa(q, k, v)

    with attention_fakes.registered("test-first", call=counting_sdpa, priority={"exact": 1000, "fast": 1000}):
        assert registry.choose("exact", CPU) == ("test-first", [])
        assert resolve_attention("auto", "exact", CPU) == ("test-first", [])
        denoiser, notes = build_denoiser(random_init_(RemoverTransformer(TINY), 0), DEFAULT_SCHEDULER_CONFIG,
                                         "exact", CPU)
        assert denoiser.describe()["attention"] == "test-first" and notes == []
        x = torch.randn(1, 16, 2, 8, 8)
        out = denoiser(x, x.clone(), x.clone(), steps=1)
        assert calls and out.shape == x.shape
    assert "test-first" not in registry.names()
    assert registry.choose("exact", CPU) == ("sdpa", [])  # gone again


def test_an_explicit_backend_that_cannot_run_raises_with_its_reasons():
    with attention_fakes.registered("test-broken", reasons=["needs a flux capacitor", "and 1.21 GW"],
                                    priority={"exact": 5000}):
        with pytest.raises(FastRemoverError, match="needs a flux capacitor; and 1.21 GW"):
            resolve_attention("test-broken", "exact", CPU)
        with pytest.raises(FastRemoverError, match="flux capacitor"):
            FastTransformer(random_init_(RemoverTransformer(TINY), 0), attention="test-broken", use_triton=False)
        # auto passes over it (the CPU gets no note: nothing else would run here anyway)
        assert registry.choose("exact", CPU) == ("sdpa", [])


def test_a_backend_outside_its_modes_is_refused():
    with attention_fakes.registered("test-exact-only", priority={"exact": -5}):
        with pytest.raises(FastRemoverError, match="not available in the fast mode"):
            resolve_attention("test-exact-only", "fast", CPU)
    with pytest.raises(FastRemoverError, match="eager"):
        resolve_attention("cudnn-fp8", "eager", CPU)


def test_names_are_unique():
    with pytest.raises(ValueError, match="taken"):
        registry.register(registry.AttentionBackend(name="fp8", label="x", call=None, validate=lambda d: []))
    with pytest.raises(ValueError, match="codes_call"):
        registry.AttentionBackend(name="y", label="y", call=None, validate=lambda d: [], takes_codes=True)


@pytest.mark.parametrize("module", ["registry", "sdpa", "cudnn_fp8", "flashinfer_fa3", "flashattn3_fp8", "quantize",
                                    "sparse"])
def test_each_backend_module_imports_alone(module):
    """No import cycle: each module imports first in a fresh interpreter, without torch being pulled in."""
    code = (f"import sys; import fastremover.ops.attention.{module}; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_no_backend_name_comparisons_outside_the_registry():
    """The transformer, the engine and the CLI read capabilities; only fastremover/ops/attention knows names."""
    from pathlib import Path

    import fastremover

    root = Path(fastremover.__file__).parent
    names = [*registry.names(), "fp8-flash3", "fp8-fa3"]
    offenders = []
    for path in root.rglob("*.py"):
        if "ops/attention" in path.as_posix():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for name in names:
                if f'== "{name}"' in code or f'"{name}" ==' in code or f'in ("{name}"' in code:
                    offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, offenders
