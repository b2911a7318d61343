from tray.cli import main

raise SystemExit(main())
