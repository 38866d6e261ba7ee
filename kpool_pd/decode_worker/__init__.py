"""The decode daemon: serves the public Generate API, pulls each request's cache from a prefill
node and decodes with drafts (``kpool-pd decode``, ``python -m kpool_pd.decode_worker``)."""
