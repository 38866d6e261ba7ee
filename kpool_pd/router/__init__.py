"""`kpool-pd router`: an OpenAI-compatible PD router in front of prefill and decode ``vllm serve``
instances running ``kpool_pd.vllm.KpoolPdConnector`` (or any connector that speaks NixlConnector's
``kv_transfer_params`` protocol): completions and chat completions through a prefill and a decode
instance; models, version, tokenize and detokenize passed through to a decode instance; /health and
/metrics (``app`` lists the endpoints). Built on aiohttp (the ``router`` extra; vLLM brings it too): import
``kpool_pd.router.app`` for ``build_app`` and ``run_router``; ``kpool_pd.router.main`` is the command."""
