"""kpool-pd, one package: its layers are its subpackages (``kvcache`` <- ``kernels``, ``model`` <- ``connector``
<- ``runtime`` <- ``prefill_worker``, ``decode_worker`` <- ``bench``); its own modules are the command line,
the vLLM connector (``kpool_pd.vllm``) and the router (``kpool_pd.router``). Importing it loads nothing."""
