"""``python -m fastremover.batch ARGS`` = ``fastremover batch ARGS`` (same flags, same exit codes, same handling of
SIGTERM and of a user's OSError)."""

import sys

from fastremover.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["batch", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
