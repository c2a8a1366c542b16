from streamrl.cli.main import main

raise SystemExit(main())
