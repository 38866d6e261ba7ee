from prefill_worker.daemon import main

raise SystemExit(main())
