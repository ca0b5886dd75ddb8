"""Print the oldest releases pyproject.toml admits for the runtime dependencies, as pip requirements.

    python tools/floor_pins.py [--pyproject pyproject.toml] [--skip torch]

Each `NAME>=X.Y` dependency becomes `NAME==X.Y.*` (the floor's minor series), one per line. CI installs them into a
fresh venv and runs `demo` and a tiny-model `remove`, so a floor that no longer works (a module attribute that an
older release lacks, say) fails CI instead of a user's install. torch is skipped by default: CI takes the CPU build
it has on disk. A dependency without a `>=` floor is an error: every runtime dependency must state one.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

_FLOOR = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9]+(?:\.[0-9]+)?)[0-9.]*\s*(?:,.*)?")


def floor_pins(dependencies: list[str], skip: set[str]) -> list[str]:
    pins = []
    for dep in dependencies:
        spec = dep.split(";")[0]
        m = _FLOOR.fullmatch(spec)
        if m is None:
            raise ValueError(f"dependency {dep!r} states no NAME>=VERSION floor")
        name, version = m.groups()
        if name.lower() not in skip:
            pins.append(f"{name}=={version}.*")
    return pins


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml")
    p.add_argument("--skip", action="append", default=None, help="a dependency to leave out (default: torch)")
    args = p.parse_args(argv)
    with open(args.pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    skip = {s.lower() for s in (args.skip if args.skip is not None else ["torch"])}
    try:
        print("\n".join(floor_pins(deps, skip)))
    except ValueError as e:
        print(f"floor_pins: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
