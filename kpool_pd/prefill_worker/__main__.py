from kpool_pd.prefill_worker.daemon import main

raise SystemExit(main())
