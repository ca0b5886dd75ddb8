"""The lab's own checks, moved out of the kernels' test files with the lab code (tools/): each kernel benchmark's code
path on tiny shapes in the interpreter, the offline sm_90 codegen checks (Triton's bundled ptxas, no GPU), and the
step profiler's JSON provenance. The tests themselves are unchanged; only the entry points moved (module `--bench` /
`--codegen` flags and `fastremover.bench.profile_step` became tools/*.py scripts)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import TOOLS

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BF16 = torch.bfloat16


def tool(name: str):
    """A tools/ script as a module, its kernel names loaded (the scripts import them after argparse)."""
    if str(TOOLS) not in sys.path:  # the scripts import each other (codegen_check) as siblings
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "_load"):
        module._load()
    return module


def interp_rel(cin: int) -> float:
    """= tests/kernels/test_conv3d_fp8.py's interpreter bound (fp32 sums of 27 * cin products + the bias)."""
    return (27 * cin + 8) * 2.0**-24


def test_conv3d_fp8_bench_code_path_runs():
    """The GPU benchmark's code path on tiny shapes (device="cpu" in the interpreter), JSON included."""
    if not INTERPRET:
        pytest.skip("on the GPU run the real benchmark: python tools/bench_conv3d_fp8.py --bench")
    import json
    import tempfile

    c = tool("bench_conv3d_fp8")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b.json")
        rows = c.bench(shapes=[(16, 16, 1, 4, 5)], dtype=BF16, out_path=path, device="cpu")
        data = json.load(open(path))
    assert len(rows) == 1 and data["rows"][0]["cin"] == 16 and set(data["rows"][0]["variants"]) == {
        "fused", "imprecise_acc"}
    r = rows[0]
    assert r["max_err_over_S_frame0"] <= interp_rel(16) and r["cos_vs_fp16"] > 0.99
    assert all("error" not in v for v in r["variants"].values()), r["variants"]


def test_conv3d_fp8_sm90_codegen_fp8_wgmma_no_spills():
    """Compile the default configs for 96 and 384 channels for sm_90 with the bundled ptxas: QGMMA (fp8 wgmma) in
    the SASS, no register spills, the fp32 promotion adds present. Subprocess: this process imports the kernels for
    the interpreter."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend (its bundled ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(TOOLS / "bench_conv3d_fp8.py"), "--codegen", "--quick"],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas available for an offline sm_90 compile")
    assert r.returncode == 0 and "codegen OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def test_upsample_conv_sm90_codegen():
    """Offline sm_90 compile (bundled ptxas) of every candidate config at the W2 shapes: fp16 wgmma, TMA loads and
    stores, no spills, no shared-memory round trip through registers. Subprocess: this process imports the kernel
    for the interpreter."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend (its bundled ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(TOOLS / "bench_upsample_conv.py"), "--codegen"], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas available for an offline sm_90 compile")
    assert r.returncode == 0 and "codegen OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def test_profile_step_compare_json_has_provenance_and_burst_options(tmp_path, monkeypatch, capsys):
    """profile_step's JSON carries what a cited result needs (GPU, commit, the command as run), and --burst asks
    compare_graph_steps for the bench-like rounds (8 rounds of 12 replays after IDLE_S of idle). The GPU work is
    faked: the call's arguments and the written file are what is checked."""
    profile_step = tool("profile_step")

    calls = []

    def fake_compare(model, workload, labels, attention, **kw):
        calls.append((model, workload, labels, attention, kw))
        return {"workload": workload, "attention": "fake", "notes": [], "variants": [
            {"variant": label, "step_ms_graph": 28.5, "step_ms_rounds": [28.5], "equal_to_shipped": True}
            for label in labels]}

    monkeypatch.setattr(profile_step, "real_model", lambda: "model")
    monkeypatch.setattr(profile_step, "compare_graph_steps", fake_compare)
    argv = ["--workload", "w1", "--compare", "shipped", "torch-gemm", "--burst", "1", "--out", str(tmp_path / "c.json")]
    profile_step.main(argv)
    assert calls == [("model", "w1", ["shipped", "torch-gemm"], "auto",
                      {"step": 1, "rounds": 8, "replays": 12, "burst_idle_s": 1.0})]
    payload = json.loads((tmp_path / "c.json").read_text())
    assert payload["command"] == "python tools/profile_step.py " + " ".join(argv)
    assert payload["commit"] and payload["gpu"] and payload["torch"] == torch.__version__
    assert [v["variant"] for v in payload["variants"]] == ["shipped", "torch-gemm"]
    assert "w1 step 1 torch-gemm" in capsys.readouterr().out
    profile_step.main(["--compare", "shipped"])  # without --burst: the hot rounds' defaults
    assert calls[-1][4] == {"step": 1}
