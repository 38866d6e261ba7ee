"""Tests of ``kpool_pd.vllm`` (KpoolPdConnector) with vLLM's own objects, engines and servers (marker ``vllm``)."""
