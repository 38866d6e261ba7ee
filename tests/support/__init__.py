"""What the tests share: the in-process connector pair, process launchers built on ``kpool_pd.runtime.launch``, fakes, waits with deadlines."""
