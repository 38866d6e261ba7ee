"""Tests of ``kpool_pd.model``: the synthetic model, the batch engine, its graphs, state digests."""
