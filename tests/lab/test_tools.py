"""The lab stays out of the package: every script in tools/ starts (`--help`, in a subprocess), and no module under
fastremover/ imports tools/, the profilers or the code-generation checks; only the user-facing `bench` / `verify`
(fastremover/bench/ and the CLI) import the benchmark package."""

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import REPO, TOOLS

PACKAGE = REPO / "fastremover"
# scripts a user runs; a leading underscore marks a module the scripts share (tools/_workload.py), not a script
SCRIPTS = sorted(p for p in TOOLS.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_"))
# modules a library file may never import: lab code that used to live in the package, and tools/ itself
LAB_MODULES = {"tools", "experiments", "fastremover.bench.profile_step", "fastremover.fast.kernels.codegen_check",
               "fastremover.fast.kernels.bench_kernels", "fastremover.fast.kernels.attention_fp8", "attention_fp8",
               *(p.stem for p in TOOLS.glob("*.py"))}
# the benchmark package backs the user-facing `fastremover bench` / `verify`: only it and the CLI may import it
BENCH_USERS = {PACKAGE / "cli.py"}


def _help(script: Path) -> tuple[Path, subprocess.CompletedProcess]:
    cmd = ["bash", str(script), "--help"] if script.suffix == ".sh" else [sys.executable, str(script), "--help"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return script, subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_tools_folder_holds_the_lab():
    names = {p.name for p in SCRIPTS}
    moved_in = {"codegen_check.py", "bench_kernels.py", "profile_step.py", "bench_conv3d_fp8.py",
                "bench_upsample_conv.py", "gpu_session.sh", "build_flash3.sh",
                "build_flashinfer_modules.sh", "flash3_fp8_out_patch.py", "flash3_variant_patch.py"}
    assert moved_in <= names, moved_in - names
    # the retired Triton FP8 attention kernel and its benchmark are experiments, not package or tools code
    assert not (PACKAGE / "fast" / "kernels" / "attention_fp8.py").exists()
    assert {"attention_fp8.py", "bench_attention_fp8.py"} <= {p.name for p in (REPO / "experiments").iterdir()}
    assert not (REPO / "bench" / "experiments").exists() and (REPO / "experiments").is_dir()
    assert {p.name for p in (REPO / "bench").iterdir()} == {"results"}  # bench/ keeps only the committed results
    assert (REPO / "bench" / "results" / "README.md").is_file()


def test_every_tool_starts_with_help():
    """Each script answers --help with exit status 0 and a usage text, without running anything (no GPU here)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(_help, SCRIPTS))
    failed = {s.name: (r.returncode, (r.stdout + r.stderr)[-600:]) for s, r in results
              if r.returncode != 0 or not r.stdout.strip()}
    assert not failed, failed
    for script, r in results:
        if script.suffix == ".py":
            assert "usage:" in r.stdout, (script.name, r.stdout[:300])


def _imports(path: Path, text: str | None = None) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included), absolute names."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _covers(name: str, forbidden: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if "bench" not in p.relative_to(PACKAGE).parts[:1])


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(REPO)))
def test_library_modules_import_no_lab_code(path):
    bad = sorted(n for n in _imports(path) for f in LAB_MODULES if _covers(n, f))
    assert not bad, f"{path.relative_to(REPO)} imports lab code: {bad}"
    if path not in BENCH_USERS:
        bench = sorted(n for n in _imports(path) if _covers(n, "fastremover.bench"))
        assert not bench, f"{path.relative_to(REPO)} imports the benchmark package: {bench}"


def test_the_import_scan_sees_function_level_and_relative_imports():
    """The check above is only as good as its parser: a function-level import and a relative one are both found."""
    probe = PACKAGE / "fast" / "kernels" / "probe.py"
    source = "def f():\n    from fastremover.bench.metrics import cosine\n    from . import codegen_check\n"
    imports = _imports(probe, source)
    assert "fastremover.bench.metrics" in imports and "fastremover.fast.kernels.codegen_check" in imports
    assert any(_covers(n, "fastremover.fast.kernels.codegen_check") for n in imports)


LAB_FLAGS = ('"--bench"', '"--codegen"', '"--sweep"', '"--profile"', '"--gpu-check"', "'--bench'", "'--codegen'")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_benchmark_entry_points_left_in_the_package(path):
    """No module keeps a benchmark / codegen / profiling entry point: a `__main__` block of a library module is a
    user command (the CLI, batch, serve, FlashInfer's --build prebuild step) or it is lab code for tools/."""
    text = path.read_text()
    if '__name__ == "__main__"' not in text:
        return
    flags = [f for f in LAB_FLAGS if f in text]
    assert not flags, f"{path.relative_to(REPO)}: a lab entry point ({flags}) belongs in tools/"


def test_floor_pins_turn_each_runtime_floor_into_its_minor_series():
    """CI installs tools/floor_pins.py's pins to run the package at the oldest releases pyproject admits."""
    sys.path.insert(0, str(TOOLS))
    try:
        from floor_pins import floor_pins
    finally:
        sys.path.remove(str(TOOLS))
    assert floor_pins(["torch>=2.4", "numpy>=1.24", "av>=18", "tqdm>=4.60.1,<5", "x>=1.2; python_version<'3.12'"],
                      skip={"torch"}) == ["numpy==1.24.*", "av==18.*", "tqdm==4.60.*", "x==1.2.*"]
    with pytest.raises(ValueError, match="no NAME>=VERSION floor"):
        floor_pins(["numpy"], skip=set())
    proc = subprocess.run([sys.executable, str(TOOLS / "floor_pins.py")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pins = proc.stdout.split()
    assert "av==18.*" in pins and not any(p.startswith("torch") for p in pins)
