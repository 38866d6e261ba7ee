"""Tests of ``kpool_pd.kvcache``: specs, layouts, allocators, the node cache."""
