"""`fastremover batch`: many clips, one model load per worker, on the GPUs of one host or on a Ray cluster.

* ``plan``: the clips of a folder or manifest, their masks and outputs, and the resume records.
* ``driver``: skips what is done, dispatches the rest longest-first, writes records and the report.
* ``local``: worker processes on one host (one per GPU); ``ray_runner``: Ray actors.
* ``execute``: one clip on a `fastremover.worker.RemovalWorker`, the worker the CLI and the HTTP service use.
* ``report``: report lines, progress bars, the summary table; ``cli``: the subcommand.

The names below are imported on first use, so that building the CLI's parser (``batch.cli``) stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Runner": "driver", "run_batch": "driver", "BatchPlan": "plan", "ClipTask": "plan", "plan_batch": "plan"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"fastremover.batch.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'fastremover.batch' has no attribute {name!r}")
