from gpufeed.convert.cli import main

raise SystemExit(main())
