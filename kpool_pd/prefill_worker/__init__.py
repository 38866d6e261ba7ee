"""The prefill daemon: runs prompts into its cache and serves them to decode nodes through the
connector's prefill side (``kpool-pd prefill``, ``python -m kpool_pd.prefill_worker``)."""
