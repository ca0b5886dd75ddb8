"""How to install an optional extra, said the same way by every message that needs one.

Quoted with double quotes, which every common shell (and Windows' cmd) reads as one argument; both forms are given,
since a source checkout installs itself (``-e .``) rather than the published package.
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """``pip install "fastremover[EXTRA]"`` and its source-checkout form."""
    return f'pip install "fastremover[{extra}]" (in a source checkout: pip install -e ".[{extra}]")'
