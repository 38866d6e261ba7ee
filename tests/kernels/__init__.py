"""Tests of ``kpool_pd.kernels``: the kpool and QSA ops against their references, on every backend that runs here."""
