"""tools/attention_installable.py (the installable-attention evaluation, lab code) on the CPU: its fp32 reference, the
whole flow with the GPU candidates reporting why they cannot run, and the FP8 kernel rows' reconstruction of o."""

import json

import pytest
import torch

from fastremover.ops import attention as registry
from helpers import load_tool

T = load_tool("attention_installable")  # lab code, not shipped

CPU = torch.device("cpu")


def _attention_f64(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.double())


def test_help_runs_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        T.main(["--help"])
    assert exc.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_reference_is_exact_attention_across_query_chunks():
    """The chunked fp32 reference equals float64 attention, with S not a multiple of the chunk and B, H > 1."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 13, 3, 8, generator=g).half() for _ in range(3))
    ref = T.reference_fp32(q, k, v, chunk=5)
    assert ref.dtype == torch.float32 and ref.shape == (2, 13, 3, 8)
    torch.testing.assert_close(ref.double(), _attention_f64(q, k, v), rtol=0, atol=2e-6)


def test_cpu_run_times_sdpa_and_names_why_the_others_cannot_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    T.main(["--device", "cpu", "--seq", "40", "24", "--heads", "2", "--head-dim", "16", "--warmup", "1",
            "--iters", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["candidate"], r["seq"]): r for r in result["rows"]}
    assert set(rows) == {("sdpa", 40), ("sdpa", 24)}  # the only candidate that runs on a CPU
    for r in rows.values():
        assert r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"] and r["iters"] == 2
        assert r["cos"] > 0.99999  # fp16 SDPA against the fp32 reference of the same values
    names = [c.name for c in T.candidates()]
    assert {"sdpa-flash", "cudnn-fp8", "flashinfer-fa3", "flashinfer-fa3-fp8", "flashattn3-fp8",
            "flashattn3-fp8 kernel", "fa4-fp16", "fa4-bf16", "fa4-fp8"} <= set(names)
    assert set(result["unavailable"]) == set(names) - {"sdpa"}
    assert all(isinstance(why, str) and why for why in result["unavailable"].values())
    assert result["shape"] == {"B": 1, "H": 2, "D": 16, "S": [40, 24]} and result["versions"]["torch"]
    printed = capsys.readouterr().out
    assert "fa4-fp16" in printed and "not available" in printed


@pytest.mark.parametrize("output", ["fp8-codes", "centred-16bit"])
def test_kernel_rows_rebuild_o_from_centred_codes(output):
    """A registered FP8 backend's kernel row: codes from quantize_qkv (K and V centred), the backend's codes_call,
    then the tool's reconstruction (times sv for FP8 codes, plus V's mean) must give o. V carries a large shared
    offset, so a reconstruction that dropped the mean (or the scale) would be far off."""
    e4m3 = torch.float8_e4m3fn

    def codes_call(q8, k8, v8, sq, sk, sv, out_dtype=None):
        qf, kf, vf = (t.float() * s.float() for t, s in ((q8, sq), (k8, sk), (v8, sv)))
        o = _attention_f64(qf, kf, vf).float()  # (o - c): V was centred
        return (o / sv.float()).to(e4m3) if output == "fp8-codes" else o.to(out_dtype or torch.float16)

    backend = registry.AttentionBackend(
        name="test-fake-fp8", label="fake", call=lambda q, k, v: None, validate=lambda device, **kw: [],
        precision="8bit", takes_codes=True, codes_call=codes_call, output=output)
    registry.register(backend)
    try:
        g = torch.Generator().manual_seed(1)
        q, k = (torch.randn(1, 32, 2, 16, generator=g) for _ in range(2))
        v = torch.randn(1, 32, 2, 16, generator=g) + 6.0 * torch.randn(2, 16, generator=g)
        q, k, v = q.half(), k.half(), v.half()
        cand = T._registry_kernel("test-fake-fp8")
        assert cand.unavailable(CPU) is None
        fn, to_fp32 = cand.prepare(q, k, v)
        o = to_fp32(fn())
        assert T.cosine(o, T.reference_fp32(q, k, v)) > 0.999
    finally:
        registry.unregister("test-fake-fp8")
