from kpool_pd.decode_worker.daemon import main

raise SystemExit(main())
