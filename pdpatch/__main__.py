from pdpatch.cli import main

raise SystemExit(main())
