"""Helpers the test modules share (test modules import this, never each other)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"


def load_tool(name: str):
    """A tools/ script as a module (tools/ is not a package; the scripts import each other as siblings)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    module_name = f"tools_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
