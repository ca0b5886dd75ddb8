from fastremover.cli import main

raise SystemExit(main())
