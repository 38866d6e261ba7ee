from decode_worker.daemon import main

raise SystemExit(main())
