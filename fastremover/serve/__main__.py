"""`python -m fastremover.serve ...` = `fastremover serve ...`."""

import sys

from fastremover.serve.cli import main

sys.exit(main())
