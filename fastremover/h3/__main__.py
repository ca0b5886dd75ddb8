"""``python -m fastremover.h3 ARGS`` = ``fastremover h3-decode ARGS`` (the same command and exit codes)."""

import sys

from fastremover.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["h3-decode", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
