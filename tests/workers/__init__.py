"""Tests of the prefill and decode daemons (``kpool_pd.prefill_worker``, ``kpool_pd.decode_worker``)."""
