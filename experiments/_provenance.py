"""The experiment scripts' JSON (run as `python experiments/NAME.py ...`, so this folder is on sys.path): their rows
with the provenance the results need (GPU, torch, commit, the command line as run)."""

from __future__ import annotations

import json

from fastremover.bench.harness import script_environment


def save_experiment(path: str | None, rows: list, **fields) -> None:
    """Write {provenance, **fields, "rows": rows} to `path` (nothing without a path)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({**script_environment(), **fields, "rows": rows}, f, indent=1)
