"""The kernels' compile keys do not depend on the run shape (issue 45: a new crop size must not recompile them).

tools/triton_variants.py computes each launch's compile key with Triton's own binder for an sm_90 target, driving
the real wrappers (the fast transformer's step, the fast VAE's encode + decode) with meta tensors. Runs in a
subprocess: this process imported the kernels for the interpreter, where there are no compile keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "triton_variants.py"

# what a second run shape may still compile: the fused FFN1 GEMM's two tile configs (chosen by the token count) and
# the sub-pixel conv's tuned patch shapes (chosen by the frame width)
SHAPE_BUCKETED = {"_gemm_gelu_quant_kernel", "_upsample_conv_kernel"}


def test_second_run_shape_compiles_no_new_row_kernels(tmp_path):
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "variants.json"
    # two windows of the cold real-clip benchmark: 6720 tokens (a multiple of 16) and 17820 (not), H/8 = 32 and 60
    r = subprocess.run([sys.executable, str(TOOL), "--shape", "81x256x320", "--shape", "41x480x864",
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    first, second = result["per_shape"]
    assert {"_adaln_kernel", "_qk_norm_rope_kernel", "_vae_norm_kernel", "_add_rows_kernel"} <= set(
        result["per_shape"][first])
    new = {k: v for k, v in result["new_per_shape"][second].items() if k not in SHAPE_BUCKETED}
    assert new == {}, f"kernels compiled again for the second run shape: {new}"
