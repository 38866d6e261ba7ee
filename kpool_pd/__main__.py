from kpool_pd.cli import main

raise SystemExit(main())
