"""`torchrun --nproc-per-node N -m fastremover.parallel remove ... --parallel ulysses`: the fastremover CLI, run by
each rank (the same as `-m fastremover` where the package has a `__main__`)."""

from fastremover.cli import main

raise SystemExit(main())
