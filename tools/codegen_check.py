"""Offline codegen check: compile every kernel for sm_90 (H200) WITHOUT a GPU and inspect its PTX/SASS.

Triton ships ptxas/cuobjdump, so `triton.compile(..., target=GPUTarget("cuda", 90, 32))` works on a CPU-only machine.
This verifies the properties the kernels' bit-exactness arguments rest on, which the interpreter cannot show:
    * gate_residual / adaln / qk_norm_rope: no FMA at all (PTX `fma.` / SASS `FFMA`): every product is rounded
      before its add, like the separate eager kernels;
    * gate_residual: the product is the inline `mul.rn.f32`;
    * quantizers: the divisions are IEEE `div.rn.f32` (Triton's `/` on fp32 is the approximate `div.full.f32`);
    * fp8 via `cvt.rn.satfinite.e4m3x2.f32`, bf16 via `cvt.rn.bf16.f32` (or the x2 form), rsqrt non-ftz;
    * gelu: the sigmoid form's exp2 is `ex2.approx` and its one division the fast `div.full.f32` (by design: the
      fp8 quantization after it has 2^-4 relative spacing), no extern call; the quantizer's row divisions stay div.rn.

Must run in a process where TRITON_INTERPRET is not "1" when the kernel modules are imported (tests run it in a
subprocess): `python tools/codegen_check.py` prints a report and exits non-zero on a violation.
"""

from __future__ import annotations

import re
import sys


def _compile(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int | None = None,
             divisible: tuple = ("D", "N", "stride_x")):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastremover.fast.kernels._common import launch_options

    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    # the specialization a real launch gets: 16-byte aligned pointers, and the `divisible` integer arguments (row
    # widths 1536, 8960, 768; channel counts) divisible by 16
    names = list(kernel.arg_names)
    aligned = {names.index(k) for k, t in sig.items() if t.startswith("*") or k in divisible}
    attrs = {(i,): [["tt.divisibility", 16]] for i in sorted(aligned)}
    src = ASTSource(fn=kernel, signature={k: sig[k] for k in names}, constexprs=constexprs, attrs=attrs)
    opts = {"num_warps": num_warps, **launch_options(kernel)}  # exactly what the wrappers launch with
    if num_stages is not None:
        opts["num_stages"] = num_stages
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _opcodes(ptx: str) -> set[str]:
    ops = set()  # instruction names (directives start with '.', comments with '//': neither matches)
    for ln in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", ln)
        if m:
            ops.add(m.group(1))
    return ops


def _sass(compiled) -> str | None:
    try:
        return compiled.asm["sass"]  # disassembled lazily with the bundled cuobjdump/nvdisasm
    except Exception:  # cuobjdump missing or failing: SASS checks are skipped, PTX checks still run
        return None


def resource_usage(compiled) -> str:
    """'REG:40 ... LOCAL:0' line of `cuobjdump --dump-resource-usage` (empty if the tool is unavailable)."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, timeout=60)
        line = next((ln.strip() for ln in out.stdout.splitlines() if "REG:" in ln), "")
        return " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "SHARED", "LOCAL", "STACK"))
    except Exception:
        return ""


def builds() -> list[tuple[str, object, dict, dict, int]]:
    from fastremover.fast.kernels import adaln, qk_norm_rope, quant, residual
    import triton.language as tl

    from fastremover.fast.kernels._common import row_num_warps as nw

    f = False
    out = []
    for xt in ("fp16", "bf16"):
        out.append((f"gate_residual[{xt}]", residual._gate_residual_kernel,
                    {"X": f"*{xt}", "BR": f"*{xt}", "G": "*fp32", "Y": f"*{xt}", "M": "i32", "D": "i32", "S": "i32"},
                    {"BLOCK_M": 8, "BLOCK_D": 512, "INTERPRET": f}, 8))
        ad_sig = {"X": f"*{xt}", "BR": f"*{xt}", "G": "*fp32", "SHIFT": "*fp32", "SCALE": "*fp32", "Y": f"*{xt}",
                  "RS": "*fp32", "D": "i32", "S": "i32", "d_f": "fp32", "eps": "fp32"}
        for name, y_type, fp8, with_add in (("adaln", f"*{xt}", False, False), ("adaln_fp8", "*fp8e4nv", True, False),
                                            ("gate_residual_adaln", f"*{xt}", False, True),
                                            ("gate_residual_adaln_fp8", "*fp8e4nv", True, True)):
            out.append((f"{name}[{xt}]", adaln._adaln_kernel, {**ad_sig, "Y": y_type},
                        {"HEAD": 1024, "TAIL": 512, "FP8": fp8, "RESIDUAL": with_add, "INTERPRET": f}, nw(1536)))
        tdt = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[xt]
        qk_sig = {"X": f"*{xt}", "W": f"*{xt}", "COS": "*fp32", "SIN": "*fp32", "Y": f"*{xt}", "AMAX": "*fp32",
                  "CENTRE": "*fp32", "S": "i32", "stride_x": "i32", "inv_n": "fp32", "eps": "fp32"}
        out.append((f"qk_norm_rope[{xt}]", qk_norm_rope._qk_norm_rope_kernel, qk_sig,
                    {"H": 12, "HALF": 64, "HH": 8, "HT": 4, "HALF_P": 64, "DTYPE": tdt, "FP8": False, "HAS_CENTRE": False,
                     "INTERPRET": f}, nw(1536) // 2))
        out.append((f"qk_norm_rope_fp8[{xt}]", qk_norm_rope._qk_norm_rope_kernel, {**qk_sig, "Y": "*fp8e4nv"},
                    {"H": 12, "HALF": 64, "HH": 8, "HT": 4, "HALF_P": 64, "DTYPE": tdt, "FP8": True, "HAS_CENTRE": True,
                     "INTERPRET": f}, nw(1536) // 2))
        out.append((f"quant_fp8_static_gelu[{xt}]", quant._static_quant_kernel,
                    {"X": f"*{xt}", "AMAX": "*fp32", "Q": "*fp8e4nv", "RS": "*fp32", "M": "i32", "N": "i32",
                     "amax_mult": "fp32"},
                    {"GELU": True, "BLOCK_M": 16, "BLOCK_N": 256, "INTERPRET": f}, 4))
        out.append((f"quant_fp8_static[{xt}]", quant._static_quant_kernel,
                    {"X": f"*{xt}", "AMAX": "*fp32", "Q": "*fp8e4nv", "RS": "*fp32", "M": "i32", "N": "i32",
                     "amax_mult": "fp32"},
                    {"GELU": False, "BLOCK_M": 16, "BLOCK_N": 256, "INTERPRET": f}, 4))
        out.append((f"quant_fp8_rowwise[{xt}]", quant._quant_rows_kernel,
                    {"X": f"*{xt}", "Q": "*fp8e4nv", "RS": "*fp32", "N": "i32"},
                    {"HEAD": 1024, "TAIL": 512, "GELU": False, "QUANT": True, "INTERPRET": f}, nw(1536)))
        out.append((f"quant_fp8_rowwise_8960[{xt}]", quant._quant_rows_kernel,
                    {"X": f"*{xt}", "Q": "*fp8e4nv", "RS": "*fp32", "N": "i32"},
                    {"HEAD": 8192, "TAIL": 1024, "GELU": False, "QUANT": True, "INTERPRET": f}, nw(9216)))
        out.append((f"gelu_tanh_quant_fp8[{xt}]", quant._quant_rows_kernel,
                    {"X": f"*{xt}", "Q": "*fp8e4nv", "RS": "*fp32", "N": "i32"},
                    {"HEAD": 8192, "TAIL": 1024, "GELU": True, "QUANT": True, "INTERPRET": f}, nw(9216)))
        out.append((f"column_stats[{xt}]", quant._column_stats_kernel,
                    {"X": f"*{xt}", "PSUM": "*fp32", "PMAX": "*fp32", "PMIN": "*fp32", "S": "i32", "N": "i32",
                     "stride_x": "i32", "NBLK": "i32", "ROWS_PER_BLK": "i32"},
                    {"BLOCK_M": 64, "BLOCK_N": 128, "INTERPRET": f}, 8))
        out.append((f"column_stats_final[{xt}]", quant._column_stats_final_kernel,
                    {"X": f"*{xt}", "PSUM": "*fp32", "PMAX": "*fp32", "PMIN": "*fp32", "MEAN": "*fp32", "AMAX": "*fp32",
                     "COUNT": "*i32", "S": "i32", "N": "i32", "stride_x": "i32", "NBLK": "i32",
                     "ROWS_PER_BLK": "i32", "s_f": "fp32"},
                    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_B": 32, "INTERPRET": f}, 4))
        out.append((f"quant_fp8_tensorwise[{xt}]", quant._tensor_quant_kernel,
                    {"X": f"*{xt}", "MEAN": "*fp32", "AMAX": "*fp32", "Q": "*fp8e4nv", "SCALE": "*fp32", "M": "i32",
                     "N": "i32", "S": "i32", "stride_x": "i32"},
                    {"HAS_MEAN": True, "BLOCK_M": 16, "BLOCK_N": 256, "INTERPRET": f, "N_AMAX": 12,
                     "AMAX_BLOCK": 16}, 4))
    out.append(("column_finalize", quant._column_finalize_kernel,
                {"PSUM": "*fp32", "PMAX": "*fp32", "PMIN": "*fp32", "MEAN": "*fp32", "AMAX": "*fp32", "N": "i32",
                 "NBLK": "i32", "s_f": "fp32"},
                {"BLOCK_B": 512, "BLOCK_N": 16}, 8))
    return out


def check(verbose: bool = True) -> list[str]:
    """Compile everything for sm_90; return the list of violated properties (empty = all good)."""
    problems = []
    for name, kernel, sig, consts, warps in builds():
        c = _compile(kernel, sig, consts, warps)
        ptx = c.asm["ptx"]
        ops = _opcodes(ptx)
        sass = _sass(c)
        fam = name.split("[")[0]
        bf16 = "[bf16]" in name

        def need(cond: bool, what: str):
            if not cond:
                problems.append(f"{name}: {what}")

        need(re.search(r"^\s*call|\.extern\s+\.func", ptx, re.M) is None, "a function call was left in the PTX")
        if sass is not None:
            need(re.search(r"\b(STL|LDL)\b", sass) is None, "SASS spills registers to local memory (STL/LDL)")
        if fam in ("gelu_tanh_quant_fp8", "quant_fp8_static_gelu"):
            need(any(o.startswith("ex2.approx") for o in ops), "expected ex2.approx for the sigmoid form's exp2")
        else:
            need(not any(o.startswith("div.full") or o.startswith("div.approx") for o in ops),
                 "approximate fp32 division")
        if fam in ("column_finalize", "column_stats_final"):
            need("div.rn.f32" in ops, "expected IEEE div.rn.f32 for the mean")
        if fam == "column_stats_final":
            need(re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx) is not None,
                 "expected an acq_rel gpu-scope atomic add for the last-program count")
            need(re.search(r"ld\.global\.cg", ptx) is not None, "expected .cg loads of the partials")
            need(re.search(r"bar\.sync|barrier\.sync", ptx) is not None, "expected a CTA barrier before the count")
        if fam in ("gate_residual", "adaln", "adaln_fp8", "gate_residual_adaln", "gate_residual_adaln_fp8",
                   "column_stats", "column_finalize", "qk_norm_rope", "qk_norm_rope_fp8", "quant_fp8_rowwise",
                   "quant_fp8_rowwise_8960", "quant_fp8_tensorwise", "quant_fp8_static"):
            fmas = sorted(o for o in ops if o.startswith("fma."))
            need(not fmas, f"PTX contains {fmas}")
            # PTX mul.rn/add.rn (explicit rounding) are never contracted by ptxas; where there is no div.rn (whose
            # IEEE expansion is MUFU.RCP + FFMA Newton steps) the SASS must not contain a single FFMA either
            if sass is not None and "div.rn.f32" not in ops:
                need(re.search(r"\bFFMA\b", sass) is None, "SASS contains FFMA")
        if fam in ("gate_residual", "gate_residual_adaln", "gate_residual_adaln_fp8"):
            need("mul.rn.f32" in ptx, "the inline mul.rn.f32 is missing")
        if fam in ("adaln", "adaln_fp8", "gate_residual_adaln", "gate_residual_adaln_fp8", "qk_norm_rope",
                   "qk_norm_rope_fp8"):
            need(any(o.startswith("rsqrt.approx.f32") for o in ops), f"expected non-ftz rsqrt.approx.f32, got "
                 f"{sorted(o for o in ops if 'rsqrt' in o)}")
        if fam in ("adaln_fp8", "gate_residual_adaln_fp8", "quant_fp8_rowwise", "quant_fp8_rowwise_8960",
                   "gelu_tanh_quant_fp8",
                   "quant_fp8_tensorwise", "qk_norm_rope_fp8", "quant_fp8_static", "quant_fp8_static_gelu"):
            need("div.rn.f32" in ops, "expected IEEE div.rn.f32")
            need(any(o.startswith("cvt.rn.satfinite.e4m3x2.f32") for o in ops), "expected cvt.rn.satfinite.e4m3x2.f32")
        if bf16 and fam in ("gate_residual", "adaln", "gate_residual_adaln", "qk_norm_rope"):
            need(any(o.startswith("cvt.rn.bf16") for o in ops), "expected cvt.rn.bf16(x2).f32")
        if verbose:
            flt = sorted(o for o in ops if re.search(r"\.(f32|bf16|f16|e4m3x2)|^cvt|^div|^rsqrt|^fma|^mul\.rn", o))
            mem = sorted({o for o in ops if o.startswith(("ld.global", "st.global"))})
            res = resource_usage(c)
            need("LOCAL:0" in res or not res, f"uses local memory: {res}")
            print(f"{name:30s} warps={warps} {res}\n{'':30s} {' '.join(flt)}\n{'':30s} memory: {' '.join(mem)}")
    return problems


def report(problems: list[str]) -> int:
    """Print each violation and the verdict ("codegen OK" is what the tests look for); the exit status: 1 if any."""
    for p in problems:
        print("VIOLATION:", p)
    print("codegen OK" if not problems else f"{len(problems)} violation(s)")
    return 1 if problems else 0


def main(argv=None) -> int:
    import argparse
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be imported as compiled @triton.jit functions", file=sys.stderr)
        return 2
    return report(check())


if __name__ == "__main__":
    sys.exit(main())
