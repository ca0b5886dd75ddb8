"""The package logger. Library code logs notes (fallbacks, warnings about the inputs) to `fastremover`; the CLI
prints them on stderr as ``fastremover: ...`` at the level its ``-v`` / ``-q`` flags set. A library user configures
the `fastremover` logger like any other (nothing is printed unless the application sets up logging)."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("fastremover")


class _CliFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "fastremover: " + ("debug: " if record.levelno < logging.INFO else "")
        return prefix + record.getMessage()


def setup_cli(verbosity: int = 0) -> logging.Handler:
    """One stderr handler on the package logger: -1 (``-q``) errors only, 0 notes and warnings, 1 (``-v``) debug.
    Returns the handler (remove it with `teardown_cli`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CliFormatter())
    logger.addHandler(handler)
    logger.setLevel({-1: logging.ERROR, 0: logging.INFO}.get(verbosity, logging.DEBUG))
    logger.propagate = False
    return handler


def teardown_cli(handler: logging.Handler) -> None:
    logger.removeHandler(handler)
    logger.propagate = True
