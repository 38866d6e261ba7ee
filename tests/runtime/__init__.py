"""Tests of ``kpool_pd.runtime``: options, transports, logs, the serve skeleton, child processes."""
